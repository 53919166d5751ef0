"""Where an engine's time goes, step by step: the wall time of `Engine.step` by kind of step, and (in the
server's engine process) the busy loop around it.

A decode step is one in which every scheduled request is generating, one token each (plain decode, or a
speculative verify that starts from that token); every other step (any prompt work) is `other`. The
counters only grow; a reader takes two snapshots and divides the differences (`StepTimes.since`), which is
how `morion bench` and `morion validate perf` put the engine's own milliseconds per decode step beside the
rate a client measured (the gap between them is the serving path: IPC, the front end, HTTP, the client).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StepTimes:
    decode_steps: int = 0
    decode_seconds: float = 0.0
    other_steps: int = 0
    other_seconds: float = 0.0
    # The server's engine loop: seconds between leaving the idle wait and the step's outputs being sent
    # (inbox handling, the step, stats and the send). 0 where no loop runs around the engine (offline).
    busy_seconds: float = 0.0

    def record(self, decode: bool, seconds: float) -> None:
        if decode:
            self.decode_steps += 1
            self.decode_seconds += seconds
        else:
            self.other_steps += 1
            self.other_seconds += seconds

    def snapshot(self) -> StepTimes:
        return dataclasses.replace(self)

    def since(self, earlier: StepTimes) -> dict[str, float | int | None]:
        """The figures of the steps between `earlier` and this snapshot: counts, the mean decode step in
        milliseconds and, where a loop ran, its overhead per step beyond the steps themselves."""
        decode_steps = self.decode_steps - earlier.decode_steps
        steps = decode_steps + self.other_steps - earlier.other_steps
        step_seconds = (
            self.decode_seconds - earlier.decode_seconds + self.other_seconds - earlier.other_seconds
        )
        busy = self.busy_seconds - earlier.busy_seconds
        return {
            "decode_steps": decode_steps,
            "other_steps": steps - decode_steps,
            "decode_step_ms": (self.decode_seconds - earlier.decode_seconds) / decode_steps * 1e3
            if decode_steps
            else None,
            "loop_overhead_ms_per_step": (busy - step_seconds) / steps * 1e3 if busy > 0 and steps else None,
        }
