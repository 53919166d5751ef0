"""What launching a CUDA graph costs the host, without a profiler attached: graphs of N one-kernel nodes
(an in-place add on 1,024 floats), `CUDAGraph.replay()` timed on the host with the device idle and with a
long matmul still running ahead of it, and the graph's own time on the device. A speculative step's
verify graph has about 3,000 nodes; under the torch profiler (CUPTI) its launch shows as milliseconds of
device idle (`scripts/profile_spec_timeline.py`), which this tells apart from what an unprofiled step pays.
Usage: python scripts/graph_launch_cost.py [NODES ...] (default 300 3000)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

_SAMPLES = 30


def _captured(nodes: int, target: torch.Tensor) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm the kernel up off the capture
        target.add_(1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            target.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    return graph


def measure(nodes: int) -> str:
    target = torch.zeros(1024, device="cuda")
    graph = _captured(nodes, target)
    idle_host, on_device, busy_host = [], [], []
    for _ in range(_SAMPLES):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        graph.replay()
        idle_host.append((time.perf_counter() - began) * 1e6)
        end.record()
        torch.cuda.synchronize()
        on_device.append(start.elapsed_time(end) * 1e3)
    square = torch.randn(8192, 8192, device="cuda")
    for _ in range(_SAMPLES):
        torch.cuda.synchronize()
        square @ square  # ~1 ms of device work queued ahead of the launch
        began = time.perf_counter()
        graph.replay()
        busy_host.append((time.perf_counter() - began) * 1e6)
    torch.cuda.synchronize()
    return (
        f"{nodes:6d} nodes: replay() on the host {statistics.median(idle_host):6.0f} us (device idle), "
        f"{statistics.median(busy_host):6.0f} us (device busy); the graph on the device "
        f"{statistics.median(on_device):7.0f} us"
    )


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("graph_launch_cost.py needs a CUDA device")
    for nodes in [int(arg) for arg in sys.argv[1:]] or [300, 3000]:
        print(measure(nodes), flush=True)


if __name__ == "__main__":
    main()
