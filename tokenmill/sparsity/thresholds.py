"""The activation-sparsity thresholds file: what `tokenmill calibrate-sparsity` writes and the
engine reads when `activation_sparsity` > 0.

One small JSON file per model:

    {"format": "tokenmill-activation-sparsity", "version": 1,
     "model": {"name": ..., "path": ..., "architecture": ..., "hidden_size": ..., "intermediate_size": ...,
               "num_layers": ..., "vocab_size": ..., "fingerprint": "<sha256 hex>"},
     "calibration": {"source": ..., "sequences": ..., "seq_len": ..., "tokens": ..., "dtype": ...},
     "sparsities": [0.0, 0.05, ..., 0.95],
     "layers": [{"qkv": [...], "o": [...], "gate_up": [...], "down": [...]}, ...]}

Layer i's list under an input holds, for each entry of `sparsities`, the magnitude below which
that share of the input's entries fell during calibration (non-decreasing, 0 at sparsity 0); a
target between two entries is interpolated linearly. The model's identity is its shape plus a
fingerprint of its files (sizes and their first and last MiB), so a file calibrated for another
model, or for other weights of the same shape, is refused; the name and path only inform.

Where the engine looks, unless given a file: beside the model (`X.gguf.sparsity.json` for a
file, `DIR/activation_sparsity.json` for a directory), then `CACHE_DIR/<name>-<fingerprint>.json`,
where `calibrate-sparsity` writes by default.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from tokenmill.config import ConfigError
from tokenmill.layers.sparsity import LINEAR_INPUTS

FORMAT = "tokenmill-activation-sparsity"
VERSION = 1
SPARSITY_GRID = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 .. 0.95
MAX_SPARSITY = SPARSITY_GRID[-1]
CACHE_DIR = Path.home() / ".cache" / "tokenmill" / "sparsity"
_IDENTITY_FIELDS = ("architecture", "hidden_size", "intermediate_size", "num_layers", "vocab_size", "fingerprint")
_SAMPLE_BYTES = 1 << 20


class ThresholdFileError(ValueError):
    """A thresholds file that cannot be used: the message names the file, and the layer where one is at fault."""

    def __init__(self, path: Path, message: str, layer: int | None = None):
        where = f"{path}" if layer is None else f"{path}: layer {layer}"
        super().__init__(f"activation-sparsity thresholds {where}: {message}")
        self.path, self.layer = path, layer


def model_files(source: Path) -> list[Path]:
    """The files whose bytes identify a checkpoint: a GGUF file itself, or a directory's
    safetensors files (and its config.json)."""
    if source.is_file():
        return [source]
    return sorted(source.glob("*.safetensors")) + [p for p in (source / "config.json",) if p.is_file()]


def model_identity(source: Path, arch) -> dict:
    """The `model` record of a thresholds file for the checkpoint at `source` with shape `arch`
    (a `ModelArchConfig`)."""
    digest = hashlib.sha256()
    for path in model_files(source):
        size = path.stat().st_size
        digest.update(f"{size}\n".encode())
        with path.open("rb") as f:
            digest.update(f.read(_SAMPLE_BYTES))
            if size > 2 * _SAMPLE_BYTES:
                f.seek(size - _SAMPLE_BYTES)
                digest.update(f.read(_SAMPLE_BYTES))
    return {"name": source.name, "path": str(source), "architecture": arch.architecture, "hidden_size": arch.hidden_size,
            "intermediate_size": arch.intermediate_size, "num_layers": arch.num_hidden_layers,
            "vocab_size": arch.vocab_size, "fingerprint": digest.hexdigest()}


def search_paths(source: Path, identity: dict) -> list[Path]:
    """Where the engine looks for a model's thresholds, in order: beside the model, then the cache."""
    beside = source / "activation_sparsity.json" if source.is_dir() else source.with_name(source.name + ".sparsity.json")
    return [beside, default_path(identity)]


def default_path(identity: dict) -> Path:
    """Where `calibrate-sparsity` writes a model's thresholds unless told otherwise."""
    stem = Path(identity["name"]).stem if identity["name"].endswith(".gguf") else identity["name"]
    return CACHE_DIR / f"{stem}-{identity['fingerprint'][:16]}.json"


@dataclass
class ThresholdTable:
    """A validated thresholds file."""

    path: Path
    model: dict
    sparsities: list[float]
    layers: list[dict[str, list[float]]]  # per layer, per LINEAR_INPUTS name, one threshold per sparsity

    def at(self, sparsity: float) -> list[list[float]]:
        """The thresholds [num_layers][4] (LINEAR_INPUTS order) for a target `sparsity`,
        interpolated linearly between the file's grid points."""
        grid = self.sparsities
        if not grid[0] <= sparsity <= grid[-1]:
            raise ThresholdFileError(self.path, f"calibrated for sparsities {grid[0]:g}..{grid[-1]:g}, not {sparsity:g}")
        hi = next(i for i, s in enumerate(grid) if s >= sparsity)
        lo = max(hi - 1, 0)
        w = 0.0 if hi == lo else (sparsity - grid[lo]) / (grid[hi] - grid[lo])
        return [[(1 - w) * layer[name][lo] + w * layer[name][hi] for name in LINEAR_INPUTS] for layer in self.layers]


def write_thresholds(path: Path, model: dict, calibration: dict, sparsities: list[float],
                     layers: list[dict[str, list[float]]]) -> None:
    data = {"format": FORMAT, "version": VERSION, "model": model, "calibration": calibration,
            "sparsities": list(sparsities), "layers": layers}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def load_thresholds(path: Path, identity: dict) -> ThresholdTable:
    """Read and check the thresholds file at `path` for the model whose `model_identity` is
    `identity`. Raises ThresholdFileError naming the file (and the layer) when it is not valid
    JSON of this format, was calibrated for another model, or holds a malformed layer."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ThresholdFileError(path, f"cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ThresholdFileError(path, f"not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ThresholdFileError(path, f"not a {FORMAT} file (its 'format' must be {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ThresholdFileError(path, f"version {data.get('version')!r}, this tokenmill reads version {VERSION}")
    model = data.get("model")
    if not isinstance(model, dict) or any(key not in model for key in _IDENTITY_FIELDS):
        raise ThresholdFileError(path, f"'model' must name {', '.join(_IDENTITY_FIELDS)}")
    differ = [key for key in _IDENTITY_FIELDS if model[key] != identity[key]]
    if differ:
        def shape(m: dict) -> str:
            return (f"{m.get('name')} ({m['architecture']}, {m['num_layers']} layers, hidden {m['hidden_size']}, "
                    f"fingerprint {str(m['fingerprint'])[:16]})")

        raise ThresholdFileError(path, f"calibrated for {shape(model)}, not for this model {shape(identity)} "
                                 f"({', '.join(differ)} differ); run `tokenmill calibrate-sparsity` for it")
    grid = data.get("sparsities")
    if (not isinstance(grid, list) or not grid or not all(_is_number(s) and 0 <= s < 1 for s in grid)
            or grid[0] != 0 or any(b <= a for a, b in zip(grid, grid[1:]))):
        raise ThresholdFileError(path, "'sparsities' must be increasing numbers in [0, 1), from 0")
    layers = data.get("layers")
    if not isinstance(layers, list):
        raise ThresholdFileError(path, "'layers' must be a list, one entry per decoder layer")
    if len(layers) != identity["num_layers"]:
        missing = len(layers) if len(layers) < identity["num_layers"] else identity["num_layers"]
        raise ThresholdFileError(path, f"{len(layers)} layers of thresholds, the model has {identity['num_layers']}",
                                 layer=missing)
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or set(layer) != set(LINEAR_INPUTS):
            keys = sorted(layer) if isinstance(layer, dict) else type(layer).__name__
            raise ThresholdFileError(path, f"must map exactly {', '.join(LINEAR_INPUTS)} to thresholds, got {keys}", layer=i)
        for name in LINEAR_INPUTS:
            values = layer[name]
            if not isinstance(values, list) or len(values) != len(grid):
                raise ThresholdFileError(path, f"{name!r} must list {len(grid)} thresholds, one per sparsity", layer=i)
            if not all(_is_number(v) and math.isfinite(v) and v >= 0 for v in values):
                raise ThresholdFileError(path, f"{name!r} holds a threshold that is not a finite number >= 0", layer=i)
            if any(b < a for a, b in zip(values, values[1:])):
                raise ThresholdFileError(path, f"{name!r} thresholds decrease as the sparsity grows", layer=i)
    return ThresholdTable(path, model, [float(s) for s in grid], layers)


def find_thresholds(source: Path, identity: dict, path: str | Path | None = None) -> Path:
    """The thresholds file the engine reads: `path` when given, else the first of `search_paths`
    that exists. Raises ConfigError saying where it looked and how to make one."""
    if path is not None:
        path = Path(path).expanduser()
        if not path.is_file():
            raise ConfigError("activation_sparsity_file", f"{path}: no such file")
        return path
    candidates = search_paths(source, identity)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError("activation_sparsity", f"no thresholds for {source.name} (looked for "
                      f"{' and '.join(map(str, candidates))}); make them with `tokenmill calibrate-sparsity {source}`")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
