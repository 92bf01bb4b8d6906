"""What a prefix index promises (chapter 分页的 KV cache).

A prefix index remembers which full blocks hold which tokens, so a new request whose prompt starts
the same way reuses them instead of computing them again. Two interchangeable versions implement
:class:`PrefixIndex`: :class:`~minillm.engine.paging.hash_index.HashPrefixIndex` (vLLM: a chain of
block hashes) and :class:`~minillm.engine.paging.radix_index.RadixPrefixIndex` (SGLang: a radix tree
over blocks of tokens). A cached block that no request holds stays in the index (it keeps its key)
until the index evicts it, least recently used first.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence


def full_blocks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """The tokens of each full block, in order (a partly filled last block is left out)."""
    return [tuple(token_ids[start:start + block_size])
            for start in range(0, len(token_ids) - block_size + 1, block_size)]


class PrefixIndex(ABC):
    """Which full blocks hold which tokens, and which cached block to give back when memory runs out.

    The manager keeps the protocol: ``lock(block)`` when a cached block goes from no holder to one
    holder (a prefix hit), ``unlock(block)`` when its last holder lets go, blocks of a request in
    order (root first) when locking and in reverse order (tail first) when unlocking. Blocks that
    ``insert`` registers are locked on arrival: the inserting request holds them.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of full blocks at the start of ``token_ids``."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], start: int = 0) -> list[int]:
        """Register the full blocks ``block_ids`` of a sequence whose tokens are ``token_ids``; the
        first ``start`` blocks were inserted before (a request commits as its blocks fill up).

        Returns the cached block for each position from ``start`` on: the one passed in, or an
        existing block with the same tokens (the caller should switch to it), or the one passed
        in left uncached.
        """

    @abstractmethod
    def lock(self, block: int) -> None:
        """A request holds the cached ``block`` now: it cannot be evicted."""

    @abstractmethod
    def unlock(self, block: int) -> None:
        """No request holds the cached ``block`` any more: it may be evicted (keeping its key)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Forget ``num_blocks`` unlocked blocks, least recently used first, and return them."""

    @abstractmethod
    def __contains__(self, block: int) -> bool:
        """Whether ``block`` is cached (locked or evictable)."""

    @property
    @abstractmethod
    def num_cached_blocks(self) -> int:
        """Blocks in the index, held by requests or not."""

    @property
    @abstractmethod
    def num_evictable_blocks(self) -> int:
        """Cached blocks that no request holds: free for reuse, kept while memory lasts."""

    def _check_evict(self, num_blocks: int) -> None:
        if not 0 <= num_blocks <= self.num_evictable_blocks:
            raise ValueError(f"cannot evict {num_blocks} blocks: "
                             f"{self.num_evictable_blocks} are evictable")
