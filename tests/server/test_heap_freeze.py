"""The serving processes freeze their startup heap (server/heap_freeze.py): what is alive then leaves the
collector's passes, what is allocated later is collected as before."""

from __future__ import annotations

import gc

from morion.server.heap_freeze import freeze_startup_heap


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_the_startup_heap_leaves_the_collector_and_later_garbage_is_still_collected():
    startup = _Cycle()
    try:
        assert freeze_startup_heap() > 0  # (frozen objects freed since by reference counting leave it)
        assert id(startup) not in {id(o) for o in gc.get_objects()}  # frozen: no pass walks it
        later = _Cycle()
        assert id(later) in {id(o) for o in gc.get_objects()}
        del later
        assert gc.collect() >= 1  # a cycle made after the freeze is found and freed
    finally:
        gc.unfreeze()
    assert id(startup) in {id(o) for o in gc.get_objects()}
