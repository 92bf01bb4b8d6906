"""SGLang's RadixAttention cache at block granularity (chapter 分页的 KV cache)."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from minillm.engine.paging.prefix_index import PrefixIndex, full_blocks


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

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], start: int = 0) -> list[int]:
        """The walk always starts at the root (a node may have been split since); ``start`` only
        cuts the answer."""
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
        return cached[start:]

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
