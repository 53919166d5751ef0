"""PNGs beside the report, when matplotlib is importable: soak latency over time, and perf's tok/s against
concurrency (drawn by bench's own plot from a bench-shaped view of the perf suite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from morion.bench.plot import matplotlib_available
from morion.bench.plot import write_png as write_bench_png


def write_pngs(result: dict[str, Any], stem: Path) -> dict[str, str]:
    """suite -> PNG file name written beside `stem` (none without matplotlib)."""
    if not matplotlib_available():
        return {}
    written = {}
    suites = result["suites"]
    soak = suites.get("soak")
    if soak and soak.get("requests") and _soak_png(soak, result, stem.with_name(stem.name + "-soak.png")):
        written["soak"] = stem.name + "-soak.png"
    perf = suites.get("perf")
    if perf and perf.get("decode"):
        view = {"label": result["label"], "date": result["date"], "settings": perf["settings"], **perf}
        if write_bench_png(view, stem.with_name(stem.name + "-perf.png")):
            written["perf"] = stem.name + "-perf.png"
    return written


def _soak_png(soak: dict[str, Any], result: dict[str, Any], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    requests = [r for r in soak["requests"] if r.get("ttft_s") is not None]
    figure, (ttft_axes, itl_axes) = plt.subplots(2, 1, figsize=(8, 6), dpi=120, sharex=True)
    ttft_axes.plot([r["t_s"] for r in requests], [r["ttft_s"] * 1e3 for r in requests], ".", alpha=0.4)
    windows = soak["figures"]["windows"]
    middles = [(w["start_s"] + w["end_s"]) / 2 for w in windows]
    for axes, key in ((ttft_axes, "ttft"), (itl_axes, "itl")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            values = [None if w[f"{key}_{q}_s"] is None else w[f"{key}_{q}_s"] * 1e3 for w in windows]
            axes.plot(middles, values, style, label=f"{key.upper()} {q} per window")
        axes.set_ylabel(f"{key.upper()} ms")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    itl_axes.set_xlabel("seconds since the soak started")
    ttft_axes.set_title(f"{result['label']} ({result['date']}): soak latency over time")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True
