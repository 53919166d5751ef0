"""The memory model: what a model caches (CacheSpec), where it lives on the device (PagePool, StateSlots),
and which prefixes are kept for reuse (RadixCache); behind it, host-RAM and disk tiers (`tiers.CacheTiers`,
`host_store`, `disk_store`, `copy_engine`) and the operators' commands on a disk cache (`disk_admin`).

The names below are imported on first use: the server's front end reads the cache statistics
(`tier_stats`) without importing torch.
"""

from __future__ import annotations

from morion.lazy import lazy_attributes

__all__ = [
    "CacheIntegrityError",
    "CacheSpec",
    "InsertResult",
    "PagePool",
    "PrefixCache",
    "PrefixMatch",
    "RadixCache",
    "RadixNode",
    "StateComponent",
    "StateSlots",
    "TokenComponent",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        "CacheIntegrityError": "morion.cache.prefix_cache",
        "CacheSpec": "morion.cache.spec",
        "InsertResult": "morion.cache.prefix_cache",
        "PagePool": "morion.cache.page_pool",
        "PrefixCache": "morion.cache.prefix_cache",
        "PrefixMatch": "morion.cache.prefix_cache",
        "RadixCache": "morion.cache.radix_cache",
        "RadixNode": "morion.cache.radix_cache",
        "StateComponent": "morion.cache.spec",
        "StateSlots": "morion.cache.state_slots",
        "TokenComponent": "morion.cache.spec",
    },
)
