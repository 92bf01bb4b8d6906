"""The paged KV cache (chapter 分页的 KV cache): blocks of ``block_size`` tokens, handed out as a
request grows; the one object the scheduler asks to allocate, free, swap and look prompts up.

The block bookkeeping, block tables included, is the pure-Python
:class:`~minillm.engine.paging.KVCacheManager`; this class adds the tensors (the blocks, the pinned
swap pool beside its bookkeeping) and hands the kernels a step's block tables, the manager's rows
for its requests (a copy, so a step costs the host per request, not per block).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.engine.config import ModelConfig
from minillm.engine.engine_config import EngineConfig
from minillm.engine.kv_cache import KVCache
from minillm.engine.paging import BlockPool, KVCacheManager
from minillm.engine.units import ceil_div


class PagedKVCache(KVCache):
    """``num_blocks`` blocks of ``block_size`` tokens shared by all requests.

    ``max_model_len`` bounds a request's block table (default: the whole pool).
    ``num_cpu_blocks``: the swap pool that preempted requests' blocks are copied into (pinned
    memory on CUDA, so the copies run at the host link's speed); 0: preemption recomputes.
    ``bookkeeping=False``: the tensors only, for a tensor-parallel rank > 0 (rank 0 keeps the
    block tables and sends each step's, :meth:`swap` and ``step_builder`` still work).
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", *,
                 enable_prefix_caching: bool = False, prefix_index: str = "hash",
                 max_model_len: int | None = None, num_cpu_blocks: int = 0, bookkeeping: bool = True):
        super().__init__(config, num_blocks, block_size, dtype, device)
        on_cuda = self.device.type == "cuda"
        # Block-major, [num_cpu_blocks, L, 2, block_size, n_kv, d]: each block is one contiguous
        # piece of (pinned) host memory that a copy reaches directly, with no staging buffer.
        self.swap_kv = (torch.zeros((num_cpu_blocks, *self.kv.shape[:2], *self.kv.shape[3:]), dtype=dtype,
                                    pin_memory=on_cuda) if num_cpu_blocks else None)
        if not bookkeeping:
            return
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, prefix_index, max_model_len)
        self.swap_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        self._swapped: dict[str, list[int]] = {}  # request id -> its blocks in the swap pool

    @classmethod
    def from_config(cls, model_config: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                    device: torch.device | str, bookkeeping: bool = True) -> "PagedKVCache":
        """The engine's pool as its resolved settings say (every rank builds it here)."""
        return cls(model_config, config.num_kv_blocks, config.block_size, dtype, device,
                   enable_prefix_caching=config.enable_prefix_caching, prefix_index=config.prefix_index,
                   max_model_len=config.max_model_len, num_cpu_blocks=config.num_cpu_blocks,
                   bookkeeping=bookkeeping)

    # -- room: the KVCache interface and the prefix cache -------------------------------------------
    def cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached blocks a prompt starts with, to pass to its first :meth:`allocate`."""
        return self.manager.cached_prefix(token_ids)

    def allocate(self, request_id: str, num_tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Room for ``num_tokens`` tokens in total (a new request may start with ``prefix``);
        False, changing nothing, when the pool is short."""
        return self.manager.allocate(request_id, num_tokens, prefix)

    def commit(self, request_id: str, token_ids: Sequence[int]) -> None:
        """The request's KV is computed for ``token_ids``: its new full blocks join the prefix cache."""
        self.manager.commit(request_id, token_ids)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` slots: the blocks past them go back (rejected proposals)."""
        self.manager.truncate(request_id, num_tokens)

    def free(self, request_id: str) -> None:
        """Whatever the request holds goes back: its blocks and table row, its swapped-out blocks."""
        if request_id in self.manager:
            self.manager.free(request_id)
        self._free_swapped(request_id)

    def num_tokens(self, request_id: str) -> int:
        return self.manager.num_tokens(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.manager

    @property
    def request_ids(self) -> list[str]:
        return self.manager.request_ids

    # -- swap preemption --------------------------------------------------------------------------
    def swap_out(self, request_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Preempt: the request's blocks go back to the pool. If the swap pool has room for the
        blocks of its first ``num_tokens`` tokens, they move there: the (gpu_block, cpu_block)
        pairs to copy are returned. ``[]``: nothing is kept, the request recomputes."""
        gpu_blocks = self.manager.block_table(request_id)[:ceil_div(num_tokens, self.block_size)]
        self.free(request_id)
        if self.swap_pool is None or not 0 < len(gpu_blocks) <= self.swap_pool.num_free:
            return []
        cpu_blocks = self._swapped[request_id] = [self.swap_pool.allocate() for _ in gpu_blocks]
        return list(zip(gpu_blocks, cpu_blocks))

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """After a swapped-out request is allocated again: the (cpu_block, gpu_block) pairs to copy
        back; its swap pool blocks are free again."""
        cpu_blocks = self._free_swapped(request_id)
        return list(zip(cpu_blocks, self.manager.block_table(request_id)[:len(cpu_blocks)]))

    def _free_swapped(self, request_id: str) -> list[int]:
        cpu_blocks = self._swapped.pop(request_id, [])
        for block in cpu_blocks:
            self.swap_pool.decref(block)
            self.swap_pool.free(block)
        return cpu_blocks

    def swap(self, blocks_out: list[tuple[int, int]], blocks_in: list[tuple[int, int]]) -> None:
        """Copy (gpu_block, cpu_block) pairs to the swap pool, then (cpu_block, gpu_block) pairs back.

        The GPU side is gathered into (or scattered from) one block-major buffer on the device;
        each block then travels in one copy between it and its slot of the host pool."""
        if blocks_out:
            gpu, cpu = zip(*blocks_out)
            staged = self.kv[:, :, list(gpu)].movedim(2, 0).contiguous()
            for i, block in enumerate(cpu):
                self.swap_kv[block].copy_(staged[i], non_blocking=True)
        if blocks_in:
            cpu, gpu = zip(*blocks_in)
            staged = torch.empty((len(gpu), *self.swap_kv.shape[1:]), dtype=self.kv.dtype, device=self.device)
            for i, block in enumerate(cpu):
                staged[i].copy_(self.swap_kv[block], non_blocking=True)
            self.kv[:, :, list(gpu)] = staged.movedim(0, 2)

    # -- block tables -----------------------------------------------------------------------------
    def block_tables(self, request_ids: list[str]) -> torch.Tensor:
        """The requests' block tables (the manager's rows, copied), cut to the widest of them."""
        rows, width = self.manager.table_rows(request_ids)
        tables = torch.frombuffer(self.manager.tables, dtype=torch.int32).view(-1, self.manager.table_width)
        return tables[rows, :width]
