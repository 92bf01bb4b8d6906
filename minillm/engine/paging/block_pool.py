"""The block pool (chapter 分页的 KV cache): the blocks, a ref count for each, and a free queue.

The KV cache is cut into fixed-size blocks of ``block_size`` token slots. The pool hands them out
and takes them back in O(1); a block shared by several requests (a prefix-cache hit) counts its
holders, and goes back to the pool only when the last one lets go.
"""
from __future__ import annotations

from collections import OrderedDict

from minillm.engine.engine_config import check_positive_int


class BlockPool:
    """``num_blocks`` blocks, a ref count per block (how many requests hold it) and a free queue.

    The free queue is an ``OrderedDict`` keyed by block id, used as a doubly linked list:
    allocate pops the head, free appends at the tail, both O(1). It holds only blocks with
    nothing worth keeping; a cached block that no request holds waits in the prefix index instead.
    """

    def __init__(self, num_blocks: int):
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free_queue)

    def is_free(self, block: int) -> bool:
        return block in self._free_queue

    def allocate(self) -> int:
        """Take the block at the head of the free queue; it starts with one reference."""
        if not self._free_queue:
            raise RuntimeError("no free block (check num_free before allocating)")
        block, _ = self._free_queue.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    def free(self, block: int) -> None:
        """Put an unreferenced block at the tail of the free queue."""
        self._check_block(block)
        if block in self._free_queue:
            raise ValueError(f"block {block} is already free (double free)")
        if self.ref_counts[block]:
            raise ValueError(f"block {block} is still held by {self.ref_counts[block]} request(s)")
        self._free_queue[block] = None

    def incref(self, block: int) -> int:
        """One more request holds ``block``; returns its new ref count."""
        self._check_block(block)
        if block in self._free_queue:
            raise ValueError(f"block {block} is free: allocate it instead of sharing it")
        self.ref_counts[block] += 1
        return self.ref_counts[block]

    def decref(self, block: int) -> int:
        """One request lets go of ``block``; returns its new ref count."""
        self._check_block(block)
        if self.ref_counts[block] == 0:
            raise ValueError(f"block {block} is not held by any request (double free)")
        self.ref_counts[block] -= 1
        return self.ref_counts[block]

    def _check_block(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise KeyError(f"unknown block {block!r} (the pool has blocks 0..{self.num_blocks - 1})")
