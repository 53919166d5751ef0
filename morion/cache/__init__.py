"""The memory model: what a model caches (CacheSpec), where it lives on the device (PagePool, StateSlots),
and which prefixes are kept for reuse (RadixCache); behind it, host-RAM and disk tiers (`tiers.CacheTiers`,
`host_store`, `disk_store`, `copy_engine`) and the operators' commands on a disk cache (`disk_admin`)."""

from morion.cache.page_pool import PagePool
from morion.cache.prefix_cache import CacheIntegrityError, InsertResult, PrefixCache, PrefixMatch
from morion.cache.radix_cache import RadixCache, RadixNode
from morion.cache.spec import CacheSpec, StateComponent, TokenComponent
from morion.cache.state_slots import StateSlots

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
