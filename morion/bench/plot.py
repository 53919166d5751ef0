"""Decode tok/s against concurrency, one colour per context, with the roofline: a PNG beside the JSON.

matplotlib is no dependency of morion: where it is missing the PNG is skipped with one line, and
`morion bench --plot FILE.json` makes it later on a machine that has it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_png(result: dict[str, Any], path: Path) -> bool:
    """Draws the decode sweep; False (and nothing written) without matplotlib or decode points."""
    points = result.get("decode") or []
    if not points or not matplotlib_available():
        return False
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU server
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5), dpi=120)
    contexts = sorted({p["context"] for p in points})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, context in enumerate(contexts):
        colour = colours[index % len(colours)]
        row = sorted((p for p in points if p["context"] == context), key=lambda p: p["concurrency"])
        c = [p["concurrency"] for p in row]
        axes.plot(
            c,
            [p["median"]["aggregate_tok_s"] for p in row],
            "o-",
            color=colour,
            label=f"ctx {context:,}: aggregate (tokens / makespan)",
        )
        axes.plot(
            c,
            [p["median"]["per_request_tok_s"] for p in row],
            "s--",
            color=colour,
            label=f"ctx {context:,}: per request, post-first-token",
        )
        if all(p.get("roofline") for p in row):
            axes.plot(
                c,
                [p["roofline"]["aggregate_tok_s"] for p in row],
                ":",
                color=colour,
                linewidth=2,
                label=f"ctx {context:,}: roofline aggregate bound",
            )
    baseline = (result.get("baseline") or {}).get("decode") or []
    for p in baseline:
        axes.plot(
            [p["concurrency"]],
            [p["median"]["per_request_tok_s"]],
            "x",
            color="black",
            markersize=9,
            label=f"transformers, ctx {p['context']:,}, per request",
        )
    axes.set_xscale("log", base=2)
    concurrency = sorted({p["concurrency"] for p in points})
    axes.set_xticks(concurrency, [str(c) for c in concurrency])
    axes.set_yscale("log")
    axes.set_xlabel("concurrent requests")
    axes.set_ylabel("output tokens / s")
    axes.set_title(
        f"{result['label']} ({result['date']}): decode, {result['settings']['output_tokens']} tokens"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True
