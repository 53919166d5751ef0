"""Start-up times of the default model on this machine: `morion serve` until /health answers 200, and
`morion generate` until the first byte of its answer, each a fresh process (model already pulled).

Runs alternate between the trees given (e.g. a checkout of the base commit, then this one), so that a
busy neighbour on a shared machine slows both alike; each run records the load average it started at.
Writes results/<date>-cpu-startup.json and .md.

    python scripts/measure_startup.py --tree before=/tmp/base,/tmp/venv/bin/python --tree after=. --runs 5

A tree is LABEL=PATH[,PYTHON]: the checkout to run from (its directory is the working directory and the
first entry of PYTHONPATH) and the interpreter to run it with (default: this one). An editable install
of another checkout in that interpreter would win over PYTHONPATH: give such a tree its own interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

PROMPT = "What is the capital of France?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH[,PYTHON] of a checkout")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="results")
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args()
    trees = {}
    for item in args.tree:
        label, _, spec = item.partition("=")
        path, _, python = spec.partition(",")
        trees[label] = (Path(path).resolve(), python or sys.executable)
    runs: dict[str, dict[str, list[dict]]] = {label: {"serve": [], "generate": []} for label in trees}
    for index in range(args.runs):
        for label, (path, python) in trees.items():
            for kind, measure in (("serve", _serve_ready), ("generate", _first_token)):
                load = os.getloadavg()[0]
                seconds, log = measure(path, python, args.timeout)
                runs[label][kind].append({"seconds": seconds, "load_average_1m": load, "stderr": log})
                print(f"run {index + 1} {label} {kind}: {seconds:.2f} s (load {load:.2f})", file=sys.stderr)
    result = {
        "schema": "morion-startup/1",
        "date": time.strftime("%Y-%m-%d"),
        "provenance": _provenance(trees),
        "method": {
            "serve": "fresh `python -m morion serve --port P` (default model, default flags); seconds from "
            "the process start until GET /health answers 200, polled every 50 ms",
            "generate": f"fresh `python -m morion generate --prompt {PROMPT!r} --max-tokens 8`; seconds from "
            "the process start until the first byte on stdout (the first token's text)",
            "order": "runs alternate between the trees, serve then generate, so a busy machine slows both",
        },
        "medians": {
            label: {kind: statistics.median(r["seconds"] for r in entries) for kind, entries in kinds.items()}
            for label, kinds in runs.items()
        },
        "runs": runs,
    }
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    stem = out / f"{result['date']}-cpu-startup"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(result))
    print(stem.with_suffix(".md"))


def _environment(tree: Path) -> dict[str, str]:
    # The tree's package first on the path; the rest of the environment (threads, MORION_HOME) as given.
    return {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}


def _serve_ready(tree: Path, python: str, timeout: float) -> tuple[float, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [python, "-m", "morion", "serve", "--port", str(port)]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=tree, env=_environment(tree), stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(_timed_lines(process.stderr, started)), daemon=True)
    reader.start()
    ready = None
    with httpx.Client(timeout=1, trust_env=False) as client:
        while ready is None and time.perf_counter() - started < timeout and process.poll() is None:
            try:
                if client.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    ready = time.perf_counter() - started
            except httpx.TransportError:
                pass
            time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    process.wait(60)
    reader.join(5)
    if ready is None:
        raise RuntimeError("morion serve was not ready:\n" + "\n".join(lines))
    return ready, "\n".join(lines)


def _first_token(tree: Path, python: str, timeout: float) -> tuple[float, str]:
    command = [python, "-m", "morion", "generate", "--prompt", PROMPT, "--max-tokens", "8"]
    started = time.perf_counter()
    process = subprocess.Popen(
        command, cwd=tree, env=_environment(tree), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(_timed_lines(process.stderr, started)), daemon=True)
    reader.start()
    first = process.stdout.read(1)
    seconds = time.perf_counter() - started
    process.communicate(timeout=timeout)
    reader.join(5)
    if not first or process.returncode != 0:
        raise RuntimeError("morion generate failed:\n" + "\n".join(lines))
    return seconds, "\n".join(lines)


def _timed_lines(stream, started: float):
    for line in stream:
        yield f"{time.perf_counter() - started:6.2f}s {line.rstrip()}"


def _provenance(trees: dict[str, tuple[Path, str]]) -> dict:
    import torch

    commits = {}
    for label, (path, _) in trees.items():
        git = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain"], capture_output=True, text=True)
        commits[label] = (git.stdout.strip() or "not a git checkout") + (" (dirty)" if dirty.stdout else "")
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commits": commits,
        "machine": f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def _markdown(result: dict) -> str:
    prov = result["provenance"]
    labels = list(result["medians"])
    lines = [
        f"# Start-up of the default model on the CPU ({result['date']})",
        "",
        f"Machine: {prov['machine']}; Python {prov['python']}, torch {prov['torch']}. "
        + "; ".join(f"{label}: `{commit}`" for label, commit in prov["commits"].items())
        + ". Raw runs, with each run's stderr and load average, in the JSON beside this file.",
        "",
        f"- serve: {result['method']['serve']}.",
        f"- generate: {result['method']['generate']}.",
        f"- {result['method']['order']}.",
        "",
        "| | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for kind in ("serve", "generate"):
        cells = [
            f"{result['medians'][label][kind]:.2f} s ("
            + ", ".join(f"{r['seconds']:.1f}" for r in result["runs"][label][kind])
            + ")"
            for label in labels
        ]
        what = "`morion serve` ready (median; runs)" if kind == "serve" else "`morion generate` first token"
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    loads = [r["load_average_1m"] for kinds in result["runs"].values() for rs in kinds.values() for r in rs]
    lines += ["", f"1-minute load average at the runs' starts: {min(loads):.2f} to {max(loads):.2f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
