"""Paged KV cache bookkeeping (chapter 分页的 KV cache): the block pool, two prefix indexes and the
manager that keeps every request's block table. Pure Python."""
from minillm.engine.paging.block_pool import BlockPool
from minillm.engine.paging.hash_index import HashPrefixIndex
from minillm.engine.paging.kv_cache_manager import KVCacheManager
from minillm.engine.paging.prefix_index import PrefixIndex, full_blocks
from minillm.engine.paging.radix_index import RadixNode, RadixPrefixIndex

__all__ = ["BlockPool", "HashPrefixIndex", "KVCacheManager", "PrefixIndex", "RadixNode",
           "RadixPrefixIndex", "full_blocks"]
