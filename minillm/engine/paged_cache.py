"""The paged KV cache (chapter 分页的 KV cache): blocks of ``block_size`` tokens, handed out as a
request grows.

The bookkeeping (which blocks a request holds, the prefix cache) is the pure-Python
:class:`~minillm.engine.paging.KVCacheManager`, which the scheduler drives. This class adds the
tensors: the blocks themselves, an optional CPU pool that preempted requests swap into, and the
block tables the kernels read. Those tables are kept in one persistent host buffer, a row per
request, and each step writes only the entries that changed since the last (usually none, or the
one block a decode just opened), so building a step costs the host per request, not per token or
per block.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minillm.engine.config import ModelConfig
from minillm.engine.kv_cache import KVCache
from minillm.engine.paging import KVCacheManager
from minillm.engine.paging.kv_cache_manager import RequestBlocks
from minillm.engine.units import ceil_div

MIN_TABLE_ROWS = 64


@dataclass(eq=False)
class _TableRow:
    owner: RequestBlocks  # the manager's record this row mirrors
    row: int
    written: int = 0  # leading entries written
    stable: int = 0  # leading entries that cannot change any more (committed blocks)


class PagedKVCache(KVCache):
    """``num_blocks`` blocks of ``block_size`` tokens shared by all requests.

    ``max_model_len`` bounds a request's block table (default: the whole pool).
    ``num_cpu_blocks``: the host pool that ``swap`` copies preempted requests' blocks into (pinned
    memory on CUDA, so the copies run at the host link's speed).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 enable_prefix_caching: bool = False, prefix_index: str = "hash",
                 max_model_len: int | None = None, num_cpu_blocks: int = 0):
        super().__init__(config, num_blocks, block_size, dtype, device)
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, prefix_index)
        on_cuda = self.device.type == "cuda"
        # Block-major, [num_cpu_blocks, L, 2, block_size, n_kv, d]: each block is one contiguous
        # piece of (pinned) host memory that a copy reaches directly, with no staging buffer.
        self.cpu_kv = (torch.zeros((num_cpu_blocks, *self.kv.shape[:2], *self.kv.shape[3:]), dtype=dtype,
                                   pin_memory=on_cuda) if num_cpu_blocks else None)
        self.table_width = ceil_div(max_model_len, block_size) if max_model_len else num_blocks
        self._table = torch.zeros(MIN_TABLE_ROWS, self.table_width, dtype=torch.int32, pin_memory=on_cuda)
        self._table_entries = self._table.numpy()  # the same memory, for cheap element writes
        self._rows: dict[str, _TableRow] = {}
        self._free_rows = list(range(MIN_TABLE_ROWS - 1, -1, -1))

    # -- the KVCache interface, on the manager --------------------------------------------------
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.manager.allocate(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        self.manager.free(request_id)

    def num_tokens(self, request_id: str) -> int:
        return self.manager.num_tokens(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.manager

    @property
    def request_ids(self) -> list[str]:
        return self.manager.request_ids

    def block_tables(self, request_ids: list[str]) -> torch.Tensor:
        """Rows of the persistent table for these requests, cut to the widest of them."""
        rows, width = [], 1
        for request_id in request_ids:
            owner, entry = self.manager.request_blocks(request_id), self._rows.get(request_id)
            if (entry is None or entry.owner is not owner or len(owner.blocks) != entry.written
                    or owner.num_committed_blocks != entry.stable):  # else: nothing changed (most steps)
                entry = self._synced_row(request_id, owner, entry)
            rows.append(entry.row)
            if entry.written > width:
                width = entry.written
        return self._table[:, :width].index_select(0, torch.tensor(rows))

    def _synced_row(self, request_id: str, owner: RequestBlocks, entry: _TableRow | None) -> _TableRow:
        """The request's table row, with the entries written that changed since the last step."""
        if entry is None or entry.owner is not owner:  # new, or freed and holding blocks afresh
            if entry is not None:
                self._free_rows.append(entry.row)
            entry = self._rows[request_id] = _TableRow(owner, self._take_row())
        blocks = owner.blocks
        if len(blocks) > self.table_width:
            raise ValueError(f"request {request_id!r} holds {len(blocks)} blocks, more than the "
                             f"{self.table_width} its table row has (max_model_len)")
        start = min(entry.written, entry.stable)
        self._table_entries[entry.row, start:len(blocks)] = blocks[start:]
        entry.written, entry.stable = len(blocks), owner.num_committed_blocks
        return entry

    def _take_row(self) -> int:
        if not self._free_rows:  # give back the rows of requests that no longer hold blocks
            for request_id, entry in list(self._rows.items()):
                if (request_id not in self.manager
                        or self.manager.request_blocks(request_id) is not entry.owner):
                    self._free_rows.append(self._rows.pop(request_id).row)
        if not self._free_rows:  # more requests hold blocks than there are rows: double the rows
            rows = self._table.shape[0]
            grown = torch.zeros(2 * rows, self.table_width, dtype=torch.int32,
                                pin_memory=self._table.is_pinned())
            grown[:rows] = self._table
            self._table, self._table_entries = grown, grown.numpy()
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()

    # -- swap preemption --------------------------------------------------------------------------
    def swap(self, blocks_out: list[tuple[int, int]], blocks_in: list[tuple[int, int]]) -> None:
        """Copy (gpu_block, cpu_block) pairs to the CPU pool, then (cpu_block, gpu_block) pairs back.

        The GPU side is gathered into (or scattered from) one block-major buffer on the device;
        each block then travels in one copy between it and its slot of the host pool."""
        if blocks_out:
            gpu, cpu = zip(*blocks_out)
            staged = self.kv[:, :, list(gpu)].movedim(2, 0).contiguous()
            for i, block in enumerate(cpu):
                self.cpu_kv[block].copy_(staged[i], non_blocking=True)
        if blocks_in:
            cpu, gpu = zip(*blocks_in)
            staged = torch.empty((len(gpu), *self.cpu_kv.shape[1:]), dtype=self.kv.dtype, device=self.device)
            for i, block in enumerate(cpu):
                staged[i].copy_(self.cpu_kv[block], non_blocking=True)
            self.kv[:, :, list(gpu)] = staged.movedim(0, 2)
