"""Keep the garbage collector's full passes off the serving path: freeze the startup heap once ready.

CPython's oldest-generation collection walks every tracked object that is alive, and a serving process's
live objects are mostly what startup made and keeps to the end: torch's and the model's modules, the
tokenizer, fastapi's routes, the pool's page lists. Each such pass stops the process for a time that
grows with that heap, at moments set by allocation counts: in the middle of a request's parsing or of a
decode step. `gc.freeze()` moves every object alive at the call into a permanent generation that no pass
walks; what is allocated later is collected as before (reference counting frees the acyclic garbage at
once, as always). Measured on the CPU: a 33K-token prompt's body parsed in 2.0 ms with the front end's
heap frozen against 4.2 ms without (its 33K new objects set off collections that walked the whole heap).
vLLM freezes its API server and engine core the same way after start-up, SGLang after its warm-up.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collects what startup left unreachable, then freezes everything alive; returns the number frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
