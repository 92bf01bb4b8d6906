"""vLLM's prefix cache: a chain of block hashes (chapter 分页的 KV cache)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from minillm.engine.paging.prefix_index import PrefixIndex, full_blocks

ROOT_KEY = 0  # the parent key of a sequence's first block


@dataclass(frozen=True)
class _HashEntry:
    key: int
    parent_key: int
    tokens: tuple[int, ...]


class HashPrefixIndex(PrefixIndex):
    """vLLM's prefix cache: block key = hash((parent block's key, this block's token ids)).

    A key names the whole prefix up to and including its block, so lookup is one dict probe per
    block. Each hit is checked against the stored parent key and token ids, so a hash collision
    is a miss, never wrong KV. Unlocked blocks wait in an LRU queue in the order they were
    unlocked: a finished request is unlocked tail first, so its last block goes first.
    """

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self._block_by_key: dict[int, int] = {}
        self._entries: dict[int, _HashEntry] = {}  # cached block -> what it holds
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unlocked, least recent first

    @staticmethod
    def block_key(parent_key: int, tokens: tuple[int, ...]) -> int:
        return hash((parent_key, tokens))

    def match(self, token_ids: Sequence[int]) -> list[int]:
        path: list[int] = []
        parent_key = ROOT_KEY
        for tokens in full_blocks(token_ids, self.block_size):
            key = self.block_key(parent_key, tokens)
            block = self._block_by_key.get(key)
            if block is None or self._entries[block] != _HashEntry(key, parent_key, tokens):
                break
            path.append(block)
            parent_key = key
        return path

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], start: int = 0) -> list[int]:
        chunks = full_blocks(token_ids[start * self.block_size:], self.block_size)
        if len(chunks) != len(block_ids) - start:
            raise ValueError(f"insert got {len(block_ids)} blocks for {start + len(chunks)} full blocks "
                             f"of tokens")
        parent_key = ROOT_KEY
        if start:  # the chain goes on from the key of the block before; none: it broke at a collision
            parent = self._entries.get(block_ids[start - 1])
            if parent is None:
                return list(block_ids[start:])
            parent_key = parent.key
        cached: list[int] = []
        for position, (tokens, block) in enumerate(zip(chunks, block_ids[start:]), start):
            if block in self._entries:  # registered earlier (a hit or an earlier commit)
                cached.append(block)
                parent_key = self._entries[block].key
                continue
            entry = _HashEntry(self.block_key(parent_key, tokens), parent_key, tokens)
            existing = self._block_by_key.get(entry.key)
            if existing is None:
                self._block_by_key[entry.key] = block
                self._entries[block] = entry
                cached.append(block)
            elif self._entries[existing] == entry:  # computed twice: keep the cached copy
                cached.append(existing)
            else:  # a hash collision: leave this block and the rest uncached
                return cached + list(block_ids[position:])
            parent_key = entry.key
        return cached

    def lock(self, block: int) -> None:
        if block not in self._evictable:
            raise ValueError(f"block {block} is not an unlocked cached block")
        del self._evictable[block]

    def unlock(self, block: int) -> None:
        if block not in self._entries or block in self._evictable:
            raise ValueError(f"block {block} is not a locked cached block")
        self._evictable[block] = None

    def evict(self, num_blocks: int) -> list[int]:
        self._check_evict(num_blocks)
        evicted = []
        for _ in range(num_blocks):
            block, _ = self._evictable.popitem(last=False)
            del self._block_by_key[self._entries.pop(block).key]
            evicted.append(block)
        return evicted

    def __contains__(self, block: int) -> bool:
        return block in self._entries

    @property
    def num_cached_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)
