"""Where the engine thread's time goes during a measured prefill: on a CPU, runnable but waiting for one,
or off CPU (blocked: the GIL, a lock, a wait for the GPU, a sleep).

A 1K prefill on Flash-Next's preset launches thousands of kernels from one Python thread, so its time to
first token is host time. On the H200 it took 725 ms with the disk tier's writer threads busy against 292
ms with the host tier alone (session 19), and a CPU probe could not tell whether the engine thread then
waits for a CPU (too many busy threads), for the GIL, or runs slower on its CPU (caches and memory
bandwidth taken by the writers). The kernel's per-thread scheduler statistics tell the three apart:
/proc/thread-self/schedstat holds the thread's time on a CPU and its time runnable in a run queue, in
nanoseconds (Linux; elsewhere nothing is recorded); the time on a CPU is read from the thread's CPU clock,
which is exact to the moment (`read_thread_times`).

The engine reads them on the thread that steps it, at a request's first admission and at its first
token (`FirstTokenTimes.prefill_on_cpu_s` / `prefill_runqueue_s`): a server's engine process exports the
split in /metrics, which `morion bench --url` and `morion validate perf` read; the offline bench reads
the engine's outputs."""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


class ThreadTimes(NamedTuple):
    """A thread's cumulative seconds on a CPU and runnable but waiting for one."""

    on_cpu_s: float
    runqueue_s: float


def read_thread_times() -> ThreadTimes | None:
    """The calling thread's times so far; None where the kernel does not keep them. The time on a CPU is
    the thread's CPU clock (`time.thread_time`), which counts the running slice to the moment it is read:
    schedstat's first field is brought up to date only at a tick or a switch, so two readings a few
    milliseconds apart on a busy thread could differ by nothing. The run-queue wait is schedstat's."""
    try:
        fields = _SCHEDSTAT.read_text().split()
    except OSError:
        return None
    return ThreadTimes(time.thread_time(), int(fields[1]) / 1e9)


def split_wall(
    before: ThreadTimes | None, after: ThreadTimes | None, wall_s: float
) -> dict[str, float] | None:
    """`wall_s` of the thread as on-CPU, run-queue and off-CPU (the rest) seconds between two readings;
    None without them."""
    if before is None or after is None:
        return None
    on_cpu = after.on_cpu_s - before.on_cpu_s
    runqueue = after.runqueue_s - before.runqueue_s
    return {"on_cpu_s": on_cpu, "runqueue_s": runqueue, "off_cpu_s": max(0.0, wall_s - on_cpu - runqueue)}
