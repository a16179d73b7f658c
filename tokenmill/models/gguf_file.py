"""A GGUF file's metadata and tensor index, read lazily from a memory map.

gguf-py's `GGUFReader` turns every element of every metadata array into numpy views: a 150k-token
vocabulary with its merges becomes about a million small objects (half a gigabyte and tens of
seconds on 2 cores for Qwen2.5's tokenizer). Loading needs the scalars, the tensor index and one
or two strings; so here numeric arrays stay one numpy view each and string arrays are only
skipped over (their lengths read) until asked for. Tensors are numpy views of the map in the
layout gguf-py gives them (`gguf.quants.dequantize` takes them as they are).

Every count, length and offset is checked against the file's size before anything is allocated
for it, so a truncated or corrupt file fails with `GgufFormatError` at once, in bounded memory.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS

# value type -> (struct format, numpy dtype) of the scalar types
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
    5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9
# Tensor types whose data is a plain numpy array (gguf-py's choice); the others are raw bytes.
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GgufFormatError(ValueError):
    """The file is not a well-formed GGUF file (the message says where)."""


@dataclass
class GgufField:
    """One metadata value: a scalar, a string, or an array (numeric: one numpy view; of strings:
    decoded when `contents()` is called)."""

    _file: GgufFile
    value_type: int
    offset: int  # of the value (an array's: of its first element)
    count: int = 1  # an array's length
    element_type: int | None = None

    def __len__(self) -> int:
        return self.count

    def contents(self) -> Any:
        f = self._file
        if self.value_type == _STRING:
            return f.string_at(self.offset)[0]
        if self.value_type != _ARRAY:
            return struct.unpack_from(_SCALARS[self.value_type][0], f.map, self.offset)[0]
        if self.element_type == _STRING:
            out, offset = [], self.offset
            for _ in range(self.count):
                text, offset = f.string_at(offset)
                out.append(text)
            return out
        return np.frombuffer(f.map, dtype=_SCALARS[self.element_type][1], count=self.count, offset=self.offset).tolist()


@dataclass
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as the file lists them
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a read-only view of the map: [outer..., inner] elements, or bytes per row for block types


class GgufFile:
    """`fields` (key -> GgufField) and `tensors` (in file order) of a GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as handle:
            size = self.path.stat().st_size
            if size < 24:
                raise GgufFormatError(f"{size} bytes: too short for a GGUF header")
            self.map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self.map)
        if self.map[:4] != MAGIC:
            raise GgufFormatError(f"does not start with {MAGIC!r} (found {bytes(self.map[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", self.map, 4)
        if version not in VERSIONS:
            raise GgufFormatError(f"GGUF version {version} (big-endian, or not one of {VERSIONS})")
        # Each metadata entry takes at least 13 bytes and each tensor entry at least 28.
        self._check(n_kv * 13 + n_tensors * 28 <= self.size - 24, f"{n_kv} metadata entries and {n_tensors} tensors")
        offset = 24
        self.fields: dict[str, GgufField] = {}
        for _ in range(n_kv):
            key, offset = self.string_at(offset)
            value_type = self._unpack("<I", offset)
            field, offset = self._field(value_type, offset + 4, key)
            self.fields[key] = field
        infos = []
        for _ in range(n_tensors):
            name, offset = self.string_at(offset)
            n_dims = self._unpack("<I", offset)
            self._check(1 <= n_dims <= MAX_DIMS, f"tensor {name!r} has {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", self.map, offset + 4) if offset + 4 + 8 * n_dims <= self.size else None
            self._check(dims is not None, f"tensor {name!r}: truncated index")
            raw_type, data_offset = self._unpack("<IQ", offset + 4 + 8 * n_dims)
            offset += 4 + 8 * n_dims + 12
            infos.append((name, dims, raw_type, data_offset))
        alignment = self.fields["general.alignment"].contents() if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        self._check(isinstance(alignment, int) and alignment > 0 and alignment & (alignment - 1) == 0,
                    f"general.alignment {alignment!r}")
        start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def string_at(self, offset: int) -> tuple[str, int]:
        """The string at `offset` and the offset after it."""
        length = self._unpack("<Q", offset)
        end = offset + 8 + length
        self._check(end <= self.size, f"a string of {length} bytes at offset {offset}")
        try:
            return self.map[offset + 8 : end].decode("utf-8"), end
        except UnicodeDecodeError as exc:
            raise GgufFormatError(f"the string at offset {offset} is not UTF-8 ({exc.reason})") from None

    def close(self) -> None:
        self.map.close()

    def _field(self, value_type: int, offset: int, key: str) -> tuple[GgufField, int]:
        if value_type in _SCALARS:
            return GgufField(self, value_type, offset), offset + struct.calcsize(_SCALARS[value_type][0])
        if value_type == _STRING:
            return GgufField(self, value_type, offset), self.string_at(offset)[1]
        self._check(value_type == _ARRAY, f"metadata {key!r} has value type {value_type}")
        element_type, count = self._unpack("<IQ", offset)
        first = offset + 12
        if element_type == _STRING:
            self._check(count * 8 <= self.size - first, f"metadata {key!r} holds {count} strings")
            end = first
            for _ in range(count):
                end = self.string_at(end)[1]
        else:
            self._check(element_type in _SCALARS, f"metadata {key!r} is an array of value type {element_type}")
            end = first + count * np.dtype(_SCALARS[element_type][1]).itemsize
            self._check(end <= self.size, f"metadata {key!r} holds {count} values")
        return GgufField(self, value_type, first, count, element_type), end

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], raw_type: int, data_offset: int) -> GgufTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[tensor_type]
        except (ValueError, KeyError):
            raise GgufFormatError(f"tensor {name!r} has an unknown type {raw_type}") from None
        elements = int(np.prod(dims, dtype=object))
        self._check(elements > 0 and dims[0] % block == 0, f"tensor {name!r} has shape {list(dims)} for {tensor_type.name}")
        n_bytes = elements // block * type_size
        begin = start + data_offset
        self._check(begin + n_bytes <= self.size, f"tensor {name!r} ({n_bytes} bytes at offset {begin}) runs past the "
                                                  f"end of the file ({self.size} bytes): truncated?")
        shape = tuple(int(d) for d in reversed(dims))
        dtype = _PLAIN_TENSOR_DTYPES.get(tensor_type)
        if dtype is None:  # block data (and bf16): bytes, one row of blocks per innermost row
            dtype, shape = np.uint8, (*shape[:-1], shape[-1] // block * type_size)
        data = np.frombuffer(self.map, dtype=dtype, count=n_bytes // np.dtype(dtype).itemsize, offset=begin)
        return GgufTensor(name, tensor_type, tuple(int(d) for d in dims), n_bytes, begin, data.reshape(shape))

    def _unpack(self, fmt: str, offset: int):
        end = offset + struct.calcsize(fmt)
        self._check(end <= self.size, f"truncated at offset {offset}")
        values = struct.unpack_from(fmt, self.map, offset)
        return values[0] if len(values) == 1 else values

    @staticmethod
    def _check(ok: bool, what: str) -> None:
        if not ok:
            raise GgufFormatError(what)
