"""The latency-throughput Pareto frontier of one or more result files, as a PNG.

Two panels: output tokens/s (x) against TTFT p99 and against TPOT p99 (y, ms). Every run is a
point labelled with its load; the line joins a series' Pareto-optimal points (no other point of the
series has both more throughput and less latency); a star marks the highest load that met the
run's SLOs; the SLO thresholds are dashed lines. A `bench serve` file is a series of one point.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill.bench.benchmark import RESULT_KIND, SWEEP_KIND, BenchError

PANELS = (("ttft_ms", "ttft", "TTFT"), ("tpot_ms", "tpot", "TPOT"))


def load_results(paths: list[str | Path]) -> list[dict]:
    results = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BenchError(f"{path}: cannot read a result file: {e}") from None
        if not isinstance(data, dict) or data.get("kind") not in (RESULT_KIND, SWEEP_KIND):
            raise BenchError(f"{path}: not a `tokenmill bench serve` or `sweep` result (no matching 'kind')")
        results.append(data)
    return results


def series(result: dict) -> dict:
    """A result file as one series: its label, load kind and per-run points."""
    runs = result["runs"] if result["kind"] == SWEEP_KIND else [result]
    points = []
    for run in runs:
        s = run["summary"]
        point = {"load": run.get("load_value"), "throughput": s["output_throughput"], "met": s["slo"]["met"]}
        for key, _, _ in PANELS:
            d = s[key]
            point[key] = d.get("p99", d.get("max"))
        points.append(point)
    met = [p for p in points if p["met"] and p["load"] is not None]
    best = max(met, key=lambda p: p["load"]) if met else None
    return {"label": result["label"], "load_kind": runs[0].get("load_kind"), "points": points, "best": best,
            "slo": runs[0]["summary"]["slo"], "config": runs[0]["config"]}


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (more x and less y), by x."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(x2 >= x and y2 <= y and (x2 > x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_results(results: list[dict], path: str | Path, title: str | None = None,
                 labels: list[str] | None = None) -> Path:
    try:
        import matplotlib
    except ImportError:
        raise BenchError("plots need matplotlib: pip install 'tokenmill[bench]'") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    all_series = [series(r) for r in results]
    if labels:
        if len(labels) != len(all_series):
            raise BenchError(f"labels: {len(labels)} given for {len(all_series)} result files")
        for s, label in zip(all_series, labels):
            s["label"] = label
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, metric, name) in zip(axes, PANELS):
        values = []
        thresholds: dict[float, str] = {}  # one dashed line per distinct SLO threshold on this metric
        starred = False
        for n, s in enumerate(all_series):
            color = colors[n % len(colors)]
            pts = [(p["throughput"], p[key]) for p in s["points"] if p[key] is not None]
            loads = [p["load"] for p in s["points"] if p[key] is not None]
            if not pts:
                continue
            values += [y for _, y in pts]
            ax.scatter(*zip(*pts), color=color, s=22, zorder=3)
            front = pareto_front(pts)
            ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], color=color, lw=1.6, label=s["label"])
            for (x, y), load in zip(pts, loads):
                if load is not None:
                    ax.annotate(_load_label(load, s["load_kind"]), (x, y), textcoords="offset points", xytext=(4, 4),
                                fontsize=7, color=color)
            best = s["best"]
            if best is not None and best[key] is not None:
                ax.scatter([best["throughput"]], [best[key]], marker="*", s=220, color=color, edgecolor="black",
                           zorder=4)
                starred = True
            for check in s["slo"]["checks"]:
                if check["slo"].split("_p")[0] == metric:
                    thresholds.setdefault(check["threshold_ms"], check["slo"])
        if starred:  # one legend entry for the stars of every series
            ax.scatter([], [], marker="*", s=220, color="white", edgecolor="black", label="highest load meeting the SLOs")
        for threshold, slo in thresholds.items():
            ax.axhline(threshold, color="gray", ls="--", lw=1, label=f"SLO {slo} <= {threshold:g} ms")
        if values and min(values) > 0 and max(values) / min(values) > 30:
            ax.set_yscale("log")
        ax.margins(x=0.08, y=0.08)
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{name} p99 (ms)")
        ax.set_title(f"throughput vs {name} p99")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    first = all_series[0]["config"]
    fig.suptitle(title or "latency-throughput frontier", fontsize=12)
    fig.text(0.5, 0.005, _workload(first), ha="center", va="bottom", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 0.96))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _load_label(load: float, load_kind: str | None) -> str:
    return f"c={load:g}" if load_kind == "concurrency" else f"{load:g} req/s"


def _workload(config: dict) -> str:
    if config["dataset"] == "random":
        data = f"random, input {config['input_len']} tok, output {config['output_len']} tok"
    elif config["dataset"] == "shared-prefix":
        data = (f"shared-prefix, {config['num_groups']} groups x {config['system_prompt_len']}-token system prompt, "
                f"question {config['question_len']} tok, output {config['output_len']} tok")
    else:
        data = f"{config['dataset']}, max_tokens {config['output_len']}"
    return f"workload: {data}; {config['num_requests']} requests per point; {config['api']} API, streaming"


def main_plot(args) -> int:
    results = load_results(args.files)
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    print(f"plot: {plot_results(results, args.output, title=args.title, labels=labels)}")
    return 0
