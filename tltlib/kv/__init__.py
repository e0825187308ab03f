"""The KV cache: the paged cache the engine runs on (a pool of pages read through block tables; ``KVConfig`` sizes
its memory), the dense per-row cache it is checked against, the pages' bookkeeping and attention through block
tables."""
from .dense import KVCache
from .paged import KVCacheFull, KVConfig, PagedKVCache, kv_stats, make_cache

__all__ = ["KVCache", "KVCacheFull", "KVConfig", "PagedKVCache", "kv_stats", "make_cache"]
