"""Paged KV cache bookkeeping (chapter 分页的 KV cache).

The KV cache is cut into fixed-size blocks of ``block_size`` token slots. A request holds a block
table (the ids of its blocks, in order) that grows as its tokens are appended, so it never wastes
more than one partly filled block. Token position ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size`` of the flat cache.

Three parts, top to bottom:

* :class:`BlockPool`: the blocks, a ref count for each, and a free queue with O(1) allocate/free.
* A prefix index remembers which full blocks hold which tokens, so a new request whose prompt
  starts the same way reuses them instead of computing them again. Two interchangeable versions:
  :class:`HashPrefixIndex` (vLLM: a chain of block hashes) and :class:`RadixPrefixIndex`
  (SGLang: a radix tree over blocks of tokens). A cached block that no request holds stays in the
  index (it keeps its key) until the index evicts it, least recently used first.
* :class:`KVCacheManager`: per-request block tables, slot mappings and the counters the chapter
  measures (free, cached and used blocks, utilization, prefix-cache hits and lookup time).
"""
from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PREFIX_INDEXES = ("hash", "radix")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def full_blocks(token_ids: Sequence[int], block_size: int) -> list[tuple[int, ...]]:
    """The tokens of each full block, in order (a partly filled last block is left out)."""
    return [tuple(token_ids[start:start + block_size])
            for start in range(0, len(token_ids) - block_size + 1, block_size)]


# -- the block pool ----------------------------------------------------------------------------
class BlockPool:
    """``num_blocks`` blocks, a ref count per block (how many requests hold it) and a free queue.

    The free queue is an ``OrderedDict`` keyed by block id, used as a doubly linked list:
    allocate pops the head, free appends at the tail, both O(1). It holds only blocks with
    nothing worth keeping; a cached block that no request holds waits in the prefix index instead.
    """

    def __init__(self, num_blocks: int):
        _check_positive_int("num_blocks", num_blocks)
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


# -- prefix indexes ----------------------------------------------------------------------------
class PrefixIndex(ABC):
    """Which full blocks hold which tokens, and which cached block to give back when memory runs out.

    The manager keeps the protocol: ``lock(block)`` when a cached block goes from no holder to one
    holder (a prefix hit), ``unlock(block)`` when its last holder lets go, blocks of a request in
    order (root first) when locking and in reverse order (tail first) when unlocking. Blocks that
    ``insert`` registers are locked on arrival: the inserting request holds them.
    """

    def __init__(self, block_size: int):
        _check_positive_int("block_size", block_size)
        self.block_size = block_size

    @abstractmethod
    def match(self, token_ids: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached run of full blocks at the start of ``token_ids``."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        """Register the full blocks ``block_ids`` of a sequence whose tokens are ``token_ids``.

        Returns the cached block for each position: the one passed in, or an existing block with
        the same tokens (the caller should switch to it), or the one passed in left uncached.
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

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        chunks = full_blocks(token_ids, self.block_size)
        if len(chunks) != len(block_ids):
            raise ValueError(f"insert got {len(block_ids)} blocks for {len(chunks)} full blocks of tokens")
        cached: list[int] = []
        parent_key = ROOT_KEY
        for position, (tokens, block) in enumerate(zip(chunks, block_ids)):
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


@dataclass(eq=False)
class RadixNode:
    """A run of cached blocks; its children continue it, keyed by their first block's tokens.

    ``lock_ref`` counts the node's blocks that requests hold. Held blocks always form a path from
    the root, so they are the first ``lock_ref`` blocks of the node.
    """

    parent: RadixNode | None
    block_tokens: list[tuple[int, ...]] = field(default_factory=list)  # one tuple per block
    blocks: list[int] = field(default_factory=list)
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0


class RadixPrefixIndex(PrefixIndex):
    """SGLang's RadixAttention cache at block granularity: a radix tree over blocks of tokens.

    Lookup walks the tree from the root, comparing whole blocks; a node is split where a new
    sequence branches off inside it. Eviction takes the tail blocks of the least recently used
    leaf that no request holds; a leaf emptied this way is removed and its parent may become the
    next candidate.
    """

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.root = RadixNode(parent=None)
        self._node_of: dict[int, RadixNode] = {}  # cached block -> its node
        self._num_locked = 0
        self._clock = itertools.count(1)  # access times: a counter, so eviction order is exact

    def match(self, token_ids: Sequence[int]) -> list[int]:
        chunks = full_blocks(token_ids, self.block_size)
        now = next(self._clock)
        path: list[int] = []
        node = self.root
        while len(path) < len(chunks) and (child := node.children.get(chunks[len(path)])):
            matched = _common_length(child.block_tokens, chunks, len(path))
            path += child.blocks[:matched]
            child.last_access = now
            if matched < len(child.blocks):
                break
            node = child
        return path

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> list[int]:
        chunks = full_blocks(token_ids, self.block_size)
        if len(chunks) != len(block_ids):
            raise ValueError(f"insert got {len(block_ids)} blocks for {len(chunks)} full blocks of tokens")
        now = next(self._clock)
        cached: list[int] = []
        node = self.root
        while len(cached) < len(chunks):
            child = node.children.get(chunks[len(cached)])
            if child is None:
                self._add_leaf(node, chunks[len(cached):], block_ids[len(cached):], now)
                cached += block_ids[len(cached):]
                break
            matched = _common_length(child.block_tokens, chunks, len(cached))
            cached += child.blocks[:matched]
            child.last_access = now
            if matched < len(child.blocks) and len(cached) < len(chunks):
                child = self._split(child, matched)  # the new sequence branches off inside child
            node = child
        return cached

    def _add_leaf(self, parent: RadixNode, block_tokens: list[tuple[int, ...]],
                  blocks: Sequence[int], now: int) -> None:
        if any(block in self._node_of for block in blocks):
            raise ValueError(f"blocks {list(blocks)} include blocks that are already cached")
        leaf = RadixNode(parent, list(block_tokens), list(blocks),
                         lock_ref=len(blocks), last_access=now)  # the inserting request holds them
        parent.children[block_tokens[0]] = leaf
        self._node_of.update((block, leaf) for block in blocks)
        self._num_locked += len(blocks)

    def _split(self, node: RadixNode, length: int) -> RadixNode:
        """Cut ``node`` after its first ``length`` blocks; return the new upper node."""
        upper = RadixNode(node.parent, node.block_tokens[:length], node.blocks[:length],
                          lock_ref=min(node.lock_ref, length), last_access=node.last_access)
        upper.parent.children[upper.block_tokens[0]] = upper
        node.parent = upper
        node.block_tokens, node.blocks = node.block_tokens[length:], node.blocks[length:]
        node.lock_ref = max(node.lock_ref - length, 0)
        upper.children[node.block_tokens[0]] = node
        self._node_of.update((block, upper) for block in upper.blocks)
        return upper

    def lock(self, block: int) -> None:
        node = self._cached_node(block)
        if node.lock_ref == len(node.blocks) or node.blocks[node.lock_ref] != block:
            raise ValueError(f"block {block}: lock a request's blocks from the root down")
        node.lock_ref += 1
        self._num_locked += 1

    def unlock(self, block: int) -> None:
        node = self._cached_node(block)
        if node.lock_ref == 0 or node.blocks[node.lock_ref - 1] != block:
            raise ValueError(f"block {block}: unlock a request's blocks from the tail up")
        if node.lock_ref == len(node.blocks) and any(c.lock_ref for c in node.children.values()):
            raise ValueError(f"block {block}: a block below it is still locked")
        node.lock_ref -= 1
        self._num_locked -= 1

    def _cached_node(self, block: int) -> RadixNode:
        if block not in self._node_of:
            raise KeyError(f"block {block!r} is not cached")
        return self._node_of[block]

    def evict(self, num_blocks: int) -> list[int]:
        self._check_evict(num_blocks)
        tie = itertools.count()  # heap entries never compare nodes
        heap = [(node.last_access, next(tie), node) for node in self._nodes()
                if not node.children and node.lock_ref < len(node.blocks)]
        heapq.heapify(heap)
        evicted: list[int] = []
        while len(evicted) < num_blocks:
            _, _, leaf = heapq.heappop(heap)
            key = leaf.block_tokens[0]
            while len(evicted) < num_blocks and leaf.lock_ref < len(leaf.blocks):
                block = leaf.blocks.pop()  # tail first
                leaf.block_tokens.pop()
                del self._node_of[block]
                evicted.append(block)
            if leaf.blocks:
                continue
            parent = leaf.parent
            del parent.children[key]
            if parent is not self.root and not parent.children and parent.lock_ref < len(parent.blocks):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return evicted

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node of the tree, the root excluded."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def __contains__(self, block: int) -> bool:
        return block in self._node_of

    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._node_of) - self._num_locked

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root excluded."""
        return sum(1 for _ in self._nodes())


def _common_length(block_tokens: list[tuple[int, ...]], chunks: list[tuple[int, ...]],
                   start: int) -> int:
    """How many leading blocks of a node match ``chunks`` from index ``start`` on."""
    length = 0
    while (length < len(block_tokens) and start + length < len(chunks)
           and block_tokens[length] == chunks[start + length]):
        length += 1
    return length


# -- the manager -------------------------------------------------------------------------------
@dataclass
class _RequestBlocks:
    blocks: list[int] = field(default_factory=list)  # the block table
    num_tokens: int = 0  # token slots the request holds
    num_committed_blocks: int = 0  # leading full blocks already offered to the prefix index


class KVCacheManager:
    """Block tables for requests over one :class:`BlockPool`, with optional prefix caching.

    ``prefix_index`` picks the prefix cache: ``"hash"`` (chained block hashes, vLLM) or
    ``"radix"`` (radix tree, SGLang); both give the same answers while nothing is evicted, and
    the same counters, so the chapter can compare hit rate and lookup time on one workload.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 prefix_index: str = "hash"):
        _check_positive_int("block_size", block_size)
        if prefix_index not in PREFIX_INDEXES:
            raise ValueError(f"prefix_index must be one of {PREFIX_INDEXES}, got {prefix_index!r}")
        self.pool = BlockPool(num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        index_class = HashPrefixIndex if prefix_index == "hash" else RadixPrefixIndex
        self.index: PrefixIndex | None = index_class(block_size) if enable_prefix_caching else None
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_query_tokens = 0  # prompt tokens looked up in the prefix cache (cumulative)
        self.prefix_hit_tokens = 0  # of which found cached: prefill tokens skipped (cumulative)
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

    @property
    def prefix_hit_rate(self) -> float:
        """Hit tokens / looked-up tokens (0.0 before the first lookup)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` holds a block table (matched or allocated, not yet freed)."""
        return request_id in self._requests

    # -- a request's life ---------------------------------------------------------------------------
    def match_prefix(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Before a request's first allocate: hold the cached full blocks its prompt starts with.

        Returns how many tokens are already there: a multiple of ``block_size``, always less than
        ``len(token_ids)`` so at least one token is computed (its logits are needed).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks: match_prefix comes first")
        if len(token_ids) == 0:
            raise ValueError(f"request {request_id!r}: token_ids is empty")
        request = self._requests[request_id] = _RequestBlocks()
        if self.index is None:
            return 0
        start = time.perf_counter()
        path = self.index.match(token_ids[:-1])
        self.prefix_lookup_seconds += time.perf_counter() - start
        for block in path:
            if self.pool.incref(block) == 1:
                self.index.lock(block)
        request.blocks = list(path)
        request.num_tokens = len(path) * self.block_size
        request.num_committed_blocks = len(path)
        self.prefix_query_tokens += len(token_ids)
        self.prefix_hit_tokens += request.num_tokens
        return request.num_tokens

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request hold slots for ``num_tokens`` tokens in total.

        Returns False, changing nothing, when too few blocks are free: a normal answer the
        scheduler acts on (wait, or preempt someone).
        """
        request = self._requests.get(request_id)
        held = request.num_tokens if request else 0
        if not isinstance(num_tokens, int) or num_tokens < held:
            raise ValueError(f"request {request_id!r}: num_tokens must be an int >= the {held} "
                             f"tokens it holds, got {num_tokens!r}")
        num_new_blocks = -(-num_tokens // self.block_size) - (len(request.blocks) if request else 0)
        if num_new_blocks > self.num_free_blocks:
            return False
        if request is None:
            request = self._requests[request_id] = _RequestBlocks()
        shortfall = num_new_blocks - self.pool.num_free
        if shortfall > 0:  # reuse cached blocks nobody holds, least recently used first
            for block in self.index.evict(shortfall):
                self.pool.free(block)
        request.blocks += [self.pool.allocate() for _ in range(num_new_blocks)]
        request.num_tokens = num_tokens
        return True

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """``token_ids``: all tokens of the request whose KV is computed. Caches its new full blocks.

        A block that another request computed meanwhile with the same tokens is already cached:
        the request switches to that copy and its own block goes back to the pool.
        """
        request = self._request(request_id)
        if len(token_ids) > request.num_tokens:
            raise ValueError(f"request {request_id!r}: commit of {len(token_ids)} tokens, "
                             f"but it holds slots for {request.num_tokens}")
        num_full = len(token_ids) // self.block_size
        if self.index is None or num_full <= request.num_committed_blocks:
            return
        cached = self.index.insert(token_ids[:num_full * self.block_size], request.blocks[:num_full])
        for position in range(request.num_committed_blocks, num_full):
            own, shared = request.blocks[position], cached[position]
            if shared != own:
                if self.pool.incref(shared) == 1:
                    self.index.lock(shared)
                self.pool.decref(own)
                self.pool.free(own)
                request.blocks[position] = shared
        request.num_committed_blocks = num_full

    def free(self, request_id: str) -> None:
        """Give back all blocks of a request, tail first; cached ones keep their key."""
        request = self._request(request_id)
        del self._requests[request_id]
        for block in reversed(request.blocks):
            if self.pool.decref(block) == 0:
                if self.index is not None and block in self.index:
                    self.index.unlock(block)
                else:
                    self.pool.free(block)

    def block_table(self, request_id: str) -> list[int]:
        return list(self._request(request_id).blocks)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Flat cache slots of the request's token positions ``[start, end)``."""
        request = self._request(request_id)
        if not 0 <= start <= end <= request.num_tokens:
            raise ValueError(f"request {request_id!r}: positions [{start}, {end}) are outside the "
                             f"{request.num_tokens} slots it holds")
        size = self.block_size
        return [request.blocks[p // size] * size + p % size for p in range(start, end)]

    def _request(self, request_id: str) -> _RequestBlocks:
        if request_id not in self._requests:
            raise KeyError(f"unknown request {request_id!r} (never allocated, or already freed)")
        return self._requests[request_id]
