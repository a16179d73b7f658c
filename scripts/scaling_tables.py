"""The tables of docs/scaling.md, computed from the formulas the page states: model sizes, the
bytes tensor and pipeline parallelism move per token, and how long those transfers take per step
on each link against the step's own memory (decode) or compute (prefill) time.

    python scripts/scaling_tables.py            # print every table (Markdown)
    python scripts/scaling_tables.py --write    # put them into docs/scaling.md (make docs)
    python scripts/scaling_tables.py --check    # exit 1 if docs/scaling.md is out of date

Each table sits in the page between `<!-- scaling-table: NAME -->` and `<!-- /scaling-table -->`.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
BYTES = 2  # bf16
DEGREES = (2, 4, 8)
DECODE_BATCHES = (1, 64)
PREFILL_CHUNK = 512


@dataclass(frozen=True)
class Model:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int

    @property
    def params(self) -> int:
        """q, o: h x h; k, v: h x kv_heads * head_dim; gate, up, down: h x intermediate; two norms
        per layer; untied input and output embeddings; the final norm."""
        kv_dim = self.num_kv_heads * self.hidden // self.num_heads
        layer = 2 * self.hidden**2 + 2 * self.hidden * kv_dim + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.num_layers * layer + 2 * self.vocab * self.hidden + self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * BYTES

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.hidden // self.num_heads) * BYTES

    @property
    def tp_bytes_per_token(self) -> int:
        """The all-reduce payload per token: 2 all-reduces (after attention, after the MLP) of
        hidden x bf16 per layer."""
        return 2 * self.num_layers * self.hidden * BYTES

    @property
    def pp_bytes_per_boundary(self) -> int:
        """One hidden state per token crosses each stage boundary."""
        return self.hidden * BYTES


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth: float  # bytes/s, per direction per device, effective
    latency: float  # seconds per all-reduce or send

    def allreduce_seconds(self, payload: int, degree: int) -> float:
        """Ring all-reduce: each rank sends (and receives) 2(N-1)/N of the payload."""
        return self.latency + 2 * (degree - 1) / degree * payload / self.bandwidth

    def send_seconds(self, payload: int) -> float:
        return self.latency + payload / self.bandwidth


LLAMA2_7B = Model("Llama-2-7B", 32, 4096, 32, 32, 11008, 32000)
LLAMA3_8B = Model("Llama-3-8B", 32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = Model("Llama-3-70B", 80, 8192, 64, 8, 28672, 128256)
SMOLLM2_135M = Model("SmolLM2-135M", 30, 576, 9, 3, 1536, 49152)  # the default model (only its L and h are used)
MODELS = (LLAMA2_7B, LLAMA3_8B, LLAMA3_70B)

LINKS = (
    Link("NVLink 4 (H100 SXM)", 450e9, 5e-6),  # 18 links x 25 GB/s per direction
    Link("PCIe Gen4 x16", 25e9, 15e-6),  # 31.5 GB/s raw per direction
    Link("PCIe Gen5 x16", 50e9, 15e-6),  # 63 GB/s raw per direction
    Link("100 GbE, TCP", 0.9 * 100e9 / 8, 30e-6),  # 90% of the line rate
    Link("25 GbE, TCP", 0.9 * 25e9 / 8, 30e-6),
)
HBM_BANDWIDTH = 3.35e12  # H100 SXM, bytes/s
BF16_FLOPS = 989e12  # H100 SXM, dense bf16 tensor FLOP/s
LOOPBACK_LATENCIES = (20e-6, 50e-6)  # a gloo all-reduce between two ranks over TCP on one host


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} µs"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def models_table() -> str:
    rows = [[m.name, str(m.num_layers), f"{m.hidden:,}", f"{m.num_heads} / {m.num_kv_heads}", f"{m.intermediate:,}",
             f"{m.params / 1e9:.2f} B", fmt_bytes(m.weight_bytes), f"{m.kv_bytes_per_token:,} B"] for m in MODELS]
    return table(["model", "layers L", "hidden h", "heads / KV heads", "intermediate", "parameters P",
                  "weights, bf16 (2P)", "KV cache per token, bf16"], rows)


def volume_table() -> str:
    rows = []
    for m in MODELS:
        payload = m.tp_bytes_per_token
        rows.append([m.name, f"{payload:,} B"]
                    + [f"{2 * (n - 1) / n * payload:,.0f} B" for n in DEGREES]
                    + [f"{(n - 1) * m.pp_bytes_per_boundary:,} B" for n in DEGREES])
    return table(["model", "TP payload 2·L·h·2"] + [f"TP={n}: sent per rank" for n in DEGREES]
                 + [f"PP={n}: (PP−1)·h·2" for n in DEGREES], rows)


def decode_table(m: Model) -> str:
    """All-reduce seconds per decode step (2L all-reduces of B·h·2 bytes), with their share of
    the step's weight-reading time (weights / N / HBM bandwidth)."""
    header = ["link"] + [f"TP={n}, batch {b}" for b in DECODE_BATCHES for n in DEGREES]
    rows = []
    for link in LINKS:
        row = [link.name]
        for b in DECODE_BATCHES:
            for n in DEGREES:
                comm = 2 * m.num_layers * link.allreduce_seconds(b * m.hidden * BYTES, n)
                row.append(f"{fmt_seconds(comm)} ({comm / (m.weight_bytes / n / HBM_BANDWIDTH):.0%})")
        rows.append(row)
    rows.append(["weights / (N · 3.35 TB/s)"] + [fmt_seconds(m.weight_bytes / n / HBM_BANDWIDTH)
                                                  for _ in DECODE_BATCHES for n in DEGREES])
    return table(header, rows)


def prefill_table() -> str:
    """All-reduce seconds per 512-token prefill chunk, with their share of the chunk's compute
    time at peak (2·P·512 FLOP / N / 989 TFLOP/s)."""
    header = ["link"] + [f"{m.name}, TP={n}" for m in (LLAMA3_8B, LLAMA3_70B) for n in DEGREES]
    rows = []
    for link in LINKS:
        row = [link.name]
        for m in (LLAMA3_8B, LLAMA3_70B):
            for n in DEGREES:
                comm = 2 * m.num_layers * link.allreduce_seconds(PREFILL_CHUNK * m.hidden * BYTES, n)
                row.append(f"{fmt_seconds(comm)} ({comm / prefill_compute_seconds(m, n):.0%})")
        rows.append(row)
    rows.append(["2·P·512 / (N · 989 TFLOP/s)"] + [fmt_seconds(prefill_compute_seconds(m, n))
                                                    for m in (LLAMA3_8B, LLAMA3_70B) for n in DEGREES])
    return table(header, rows)


def prefill_compute_seconds(m: Model, degree: int) -> float:
    return 2 * m.params * PREFILL_CHUNK / degree / BF16_FLOPS


def pipeline_table() -> str:
    """Seconds of one stage-boundary send (B·h·2 bytes) per step; a token crosses PP−1 of them."""
    shapes = [("decode, batch 1", 1), ("decode, batch 64", 64), (f"prefill, {PREFILL_CHUNK} tokens", PREFILL_CHUNK)]
    header = ["link"] + [f"{m.name}, {label}" for m in (LLAMA3_8B, LLAMA3_70B) for label, _ in shapes]
    rows = [[link.name] + [fmt_seconds(link.send_seconds(tokens * m.hidden * BYTES))
                           for m in (LLAMA3_8B, LLAMA3_70B) for _, tokens in shapes] for link in LINKS]
    return table(header, rows)


def cpu_table() -> str:
    """TP=2 on one CPU host: bandwidth is no issue on loopback, the 2·L latencies are."""
    m = SMOLLM2_135M
    rows = [[m.name, str(m.num_layers), str(m.hidden), f"{m.tp_bytes_per_token:,} B", f"{m.tp_bytes_per_token * 2:,} B",
             str(2 * m.num_layers)] + [fmt_seconds(2 * m.num_layers * alpha) for alpha in LOOPBACK_LATENCIES]]
    return table(["model", "layers L", "hidden h", "payload per token, bf16", "fp32", "all-reduces per step (2·L)"]
                 + [f"2·L·α at α = {fmt_seconds(alpha)}" for alpha in LOOPBACK_LATENCIES], rows)


TABLES = {
    "models": models_table,
    "volume": volume_table,
    "decode-8b": lambda: decode_table(LLAMA3_8B),
    "decode-70b": lambda: decode_table(LLAMA3_70B),
    "prefill": prefill_table,
    "pipeline": pipeline_table,
    "cpu": cpu_table,
}
BLOCK = re.compile(r"(<!-- scaling-table: ([a-z0-9-]+) -->\n)(.*?)(<!-- /scaling-table -->)", re.S)


def regenerate(text: str) -> str:
    def fill(m: re.Match) -> str:
        if m.group(2) not in TABLES:
            raise KeyError(f"docs/scaling.md names an unknown table {m.group(2)!r} (known: {', '.join(TABLES)})")
        return m.group(1) + TABLES[m.group(2)]() + "\n" + m.group(4)

    return BLOCK.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="rewrite the tables in docs/scaling.md")
    action.add_argument("--check", action="store_true", help="exit 1 if docs/scaling.md differs from the formulas")
    args = parser.parse_args(argv)
    if not (args.write or args.check):
        for name, render in TABLES.items():
            print(f"{name}:\n{render()}\n")
        return 0
    text = DOC.read_text()
    new = regenerate(text)
    if new == text:
        print("docs/scaling.md up to date")
        return 0
    if args.check:
        print("docs/scaling.md is out of date (run `make docs`)")
        return 1
    DOC.write_text(new)
    print("updated docs/scaling.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
