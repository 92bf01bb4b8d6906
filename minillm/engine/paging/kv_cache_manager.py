"""Paged KV cache bookkeeping (chapter 分页的 KV cache).

A request holds a block table (the ids of its blocks, in order) that grows as its tokens are
appended, so it never wastes more than one partly filled block. Token position ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size`` of the flat cache.
:class:`KVCacheManager` keeps the block tables over one :class:`BlockPool`, looks prompts up in a
prefix index and caches their full blocks. Each request's table is a list and, written in the same
statements, a row of one flat int32 array (:attr:`KVCacheManager.tables`), the layout an attention
kernel reads: a step takes its requests' rows as they are. It is pure bookkeeping: the tensors live in
:class:`~minillm.engine.paged_cache.PagedKVCache`, the one object the scheduler asks.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from minillm.engine.engine_config import PREFIX_INDEXES, check_choice
from minillm.engine.paging.block_pool import BlockPool
from minillm.engine.paging.hash_index import HashPrefixIndex
from minillm.engine.paging.radix_index import RadixPrefixIndex
from minillm.engine.paging.prefix_index import PrefixIndex
from minillm.engine.units import ceil_div

MIN_TABLE_ROWS = 64  # rows of the block-table array at first; it doubles when more requests hold blocks


@dataclass(eq=False)
class RequestBlocks:
    """One request's block table; a new record each time the request gets blocks afresh."""

    row: int  # its row of the manager's ``tables``
    blocks: list[int] = field(default_factory=list)  # the block table
    num_tokens: int = 0  # token slots the request holds
    num_committed_blocks: int = 0  # leading full blocks already offered to the prefix index


class KVCacheManager:
    """Block tables for requests over one :class:`BlockPool`, with optional prefix caching.

    ``prefix_index`` picks the prefix cache: ``"hash"`` (chained block hashes, vLLM) or
    ``"radix"`` (radix tree, SGLang); both give the same answers while nothing is evicted, so the
    chapter can compare hit rate and lookup time on one workload. ``max_model_len`` bounds a
    request's block table (default: the whole pool).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_index: str = "hash", max_model_len: int | None = None):
        check_choice("prefix_index", prefix_index, PREFIX_INDEXES)
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.table_width = ceil_div(max_model_len, block_size) if max_model_len else num_blocks
        self.tables = array("i", bytes(4 * MIN_TABLE_ROWS * self.table_width))  # rows of table_width int32
        self._free_rows = list(range(MIN_TABLE_ROWS - 1, -1, -1))
        index_class = HashPrefixIndex if prefix_index == "hash" else RadixPrefixIndex
        self.index: PrefixIndex | None = index_class(block_size) if enable_prefix_caching else None
        self._requests: dict[str, RequestBlocks] = {}
        self.prefix_lookup_seconds = 0.0  # time spent in prefix lookups (cumulative)

    # -- counters ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus cached ones no request holds."""
        return self.pool.num_free + (self.index.num_evictable_blocks if self.index else 0)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache, held or not."""
        return self.index.num_cached_blocks if self.index else 0

    @property
    def num_live_tokens(self) -> int:
        """Token slots the requests hold, a shared block counted once."""
        filled: dict[int, int] = {}
        for request in self._requests.values():
            for position, block in enumerate(request.blocks):
                tokens = min(self.block_size, request.num_tokens - position * self.block_size)
                filled[block] = max(filled.get(block, 0), tokens)
        return sum(filled.values())

    def utilization(self) -> float:
        """Live tokens / allocated slots (0.0 when no block is in use)."""
        slots = self.num_used_blocks * self.block_size
        return self.num_live_tokens / slots if slots else 0.0

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table (allocated, not yet freed)."""
        return request_id in self._requests

    # -- a request's life ---------------------------------------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached full blocks a prompt starts with, for its first :meth:`allocate` (a lookup:
        nothing is held). They cover fewer tokens than ``token_ids`` has, so at least one token is
        computed (its logits are needed)."""
        if len(token_ids) == 0:
            raise ValueError("token_ids is empty")
        if self.index is None:
            return []
        start = time.perf_counter()
        path = self.index.match(token_ids[:-1])
        self.prefix_lookup_seconds += time.perf_counter() - start
        return list(path)

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Make the request hold slots for ``num_tokens`` tokens in total; a request that holds
        nothing yet may start with ``prefix``, the blocks :meth:`cached_prefix` found for it.

        Returns False, changing nothing, when too few blocks are free: a normal answer the
        scheduler acts on (wait, or preempt someone).
        """
        request = self._requests.get(request_id)
        if request is not None and prefix:
            raise ValueError(f"request {request_id!r} already holds blocks: a prefix comes with the first allocate")
        held = request.num_tokens if request else len(prefix) * self.block_size
        if not isinstance(num_tokens, int) or num_tokens < held:
            raise ValueError(f"request {request_id!r}: num_tokens must be an int >= the {held} "
                             f"tokens it holds, got {num_tokens!r}")
        if request is not None and num_tokens <= len(request.blocks) * self.block_size:
            request.num_tokens = num_tokens  # room in its last block: the common decode step
            return True
        num_blocks = ceil_div(num_tokens, self.block_size)
        num_new_blocks = num_blocks - (len(request.blocks) if request else len(prefix))
        revived = sum(1 for block in prefix if self.pool.ref_counts[block] == 0)  # leave the evictable ones
        if num_new_blocks + revived > self.num_free_blocks:
            return False
        if num_blocks > self.table_width:
            raise ValueError(f"request {request_id!r}: {num_tokens} tokens need more than the "
                             f"{self.table_width} blocks a block table holds (max_model_len)")
        if request is None:
            request = self._requests[request_id] = RequestBlocks(self._take_row(), list(prefix),
                                                                 num_committed_blocks=len(prefix))
            self._write(request, 0, prefix)
            for block in prefix:
                if self.pool.incref(block) == 1:
                    self.index.lock(block)
        shortfall = num_new_blocks - self.pool.num_free
        if shortfall > 0:  # reuse cached blocks nobody holds, least recently used first
            for block in self.index.evict(shortfall):
                self.pool.free(block)
        new_blocks = [self.pool.allocate() for _ in range(num_new_blocks)]
        self._write(request, len(request.blocks), new_blocks)
        request.blocks += new_blocks
        request.num_tokens = num_tokens
        return True

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """``token_ids``: all tokens of the request whose KV is computed. Caches its new full blocks.

        A block that another request computed meanwhile with the same tokens is already cached:
        the request switches to that copy and lets go of its own (back to the pool unless a request
        made ``prompt_of`` it shares it).
        """
        request = self.request_blocks(request_id)
        if len(token_ids) > request.num_tokens:
            raise ValueError(f"request {request_id!r}: commit of {len(token_ids)} tokens, "
                             f"but it holds slots for {request.num_tokens}")
        num_full = len(token_ids) // self.block_size
        if self.index is None or num_full <= request.num_committed_blocks:
            return
        start = request.num_committed_blocks
        cached = self.index.insert(token_ids[:num_full * self.block_size], request.blocks[:num_full], start)
        for position, shared in enumerate(cached, start):
            own = request.blocks[position]
            if shared != own:
                if self.pool.incref(shared) == 1:
                    self.index.lock(shared)
                self._release([own])
                request.blocks[position] = shared
                self._write(request, position, [shared])
        request.num_committed_blocks = num_full

    def free(self, request_id: str) -> None:
        """Give back all blocks of a request, tail first; cached ones keep their key."""
        request = self.request_blocks(request_id)
        del self._requests[request_id]
        self._release(request.blocks)
        self._free_rows.append(request.row)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Hold only the first ``num_tokens`` token slots (the rest held rejected speculative
        tokens): the blocks past them go back to the pool. Committed blocks stay."""
        request = self.request_blocks(request_id)
        if not request.num_committed_blocks * self.block_size <= num_tokens <= request.num_tokens:
            raise ValueError(f"request {request_id!r}: truncate to {num_tokens} tokens, outside "
                             f"[{request.num_committed_blocks * self.block_size}, {request.num_tokens}]")
        keep = ceil_div(num_tokens, self.block_size)
        self._release(request.blocks[keep:])
        del request.blocks[keep:]
        request.num_tokens = num_tokens

    def _release(self, blocks: list[int]) -> None:
        """Drop a reference to each block, last first; a block nobody holds is freed, or stays in
        the prefix cache (evictable) if it is cached."""
        for block in reversed(blocks):
            if self.pool.decref(block) == 0:
                if self.index is not None and block in self.index:
                    self.index.unlock(block)
                else:
                    self.pool.free(block)

    def block_table(self, request_id: str) -> list[int]:
        return list(self.request_blocks(request_id).blocks)

    def table_rows(self, request_ids: Sequence[str]) -> tuple[list[int], int]:
        """The requests' rows of :attr:`tables` and the length of the longest of their tables (at
        least 1); a shorter row's entries past its blocks are stale, no kernel reads them."""
        held = [self.request_blocks(request_id) for request_id in request_ids]
        return [request.row for request in held], max([len(request.blocks) for request in held] + [1])

    def _write(self, request: RequestBlocks, position: int, blocks: Sequence[int]) -> None:
        start = request.row * self.table_width + position
        self.tables[start:start + len(blocks)] = array("i", blocks)

    def _take_row(self) -> int:
        if not self._free_rows:  # more requests hold blocks than there are rows: double the rows
            rows = len(self.tables) // self.table_width
            self.tables.frombytes(bytes(4 * len(self.tables)))
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    def num_tokens(self, request_id: str) -> int:
        """Token slots the request holds."""
        return self.request_blocks(request_id).num_tokens

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def request_blocks(self, request_id: str) -> RequestBlocks:
        """The request's live record (its block table is ``.blocks``; not a copy)."""
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r} (never allocated, or already freed)") from None
