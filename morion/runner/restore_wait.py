"""Copy rule 4 (design §3) as the backend's hook: while host/disk restores of this step are still copying
in, every read or write of cache memory waits (on the GPU, never the CPU) for the copies it depends on."""

from __future__ import annotations

from collections.abc import Sequence

from morion.cache.copy_engine import Transfer


class RestoreWaits:
    """The step's load-backs, waited for by layer: attention for each token component at its index (K/V,
    and any side cache paged with it), a side cache for its own (component, layer) copies, a linear layer
    for the state component it reads or writes, whichever way it reaches it (whole states or the pool in
    place). `PagedAttentionBackend` calls these before it touches the memory."""

    def __init__(self, restores: Sequence[Transfer], token_components: Sequence[str]) -> None:
        self._restores = restores
        self._token_components = token_components

    def tokens(self, layer_index: int) -> None:
        """Every token component's copies at `layer_index`: what attention and K/V access read."""
        for restore in self._restores:
            for name in self._token_components:
                restore.wait(name, layer_index)

    def component(self, component: str, ordinal: int) -> None:
        """The copies of one (component, layer): a side cache, or a linear layer's state."""
        for restore in self._restores:
            restore.wait(component, ordinal)
