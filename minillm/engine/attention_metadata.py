"""What the attention kernels need to know about one step (chapters 预填充 and 分页的 KV cache).

The model runs over a flat batch: the new tokens of every sequence, concatenated. For each
sequence, :class:`AttentionMetadata` says where its new tokens sit in that batch, how long its
context is after the step, and which cache blocks hold its keys and values. Every caller (the KV
caches, hence the model runner, the planner's dummy step and the benchmarks) gets it from
:meth:`StepBuilder.build`: the host packs the step's numbers (token ids, one count pair and one
block-table row per sequence) into one buffer, copies it to the device once, and the device
computes everything that has one entry per token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens are in the flat batch and where its KV lives in the cache."""

    cu_seqlens_q: torch.Tensor  # int32 [B+1]; new tokens of sequence i are q[cu[i]:cu[i+1]]
    seq_lens: torch.Tensor  # int32 [B]; tokens in the cache for sequence i after this step
    block_tables: torch.Tensor  # int32 [B, max_blocks]; physical block ids, padded with 0
    slot_mapping: torch.Tensor  # int64 [T]; flat cache slot of each new token's K/V; -1 = skip
    max_query_len: int  # 1 for a pure decode step
    max_seq_len: int  # the largest of seq_lens, known on the host


class StepBuilder:
    """Builds a step's input ids, positions and attention metadata on ``device`` with one copy.

    On CUDA the host side goes through one pinned staging buffer and one non-blocking copy; the
    buffer is reused once the previous copy has finished (an event says when)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._pinned = self.device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int32)
        self._copied = torch.cuda.Event() if self._pinned else None

    def build(self, block_tables: torch.Tensor, num_computed: list[int], num_new: list[int],
              block_size: int, token_ids: list[int] = ()
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids [T], positions [T], metadata)`` of one step.

        ``block_tables`` ``[B, W]`` (int32, on the host): sequence i's blocks. Sequence i holds
        ``num_computed[i]`` tokens in the cache and computes ``num_new[i]`` more, at positions
        ``num_computed[i] ..``; token position p lives in slot ``table[p // block_size] *
        block_size + p % block_size``. ``token_ids``: the new tokens, all sequences' in order
        (empty: the caller feeds the model itself; ``input_ids`` is then empty).
        """
        batch = len(num_new)
        if not len(num_computed) == batch == block_tables.shape[0] or not batch:
            raise ValueError(f"need one row of block_tables and one count each per sequence, got "
                             f"{block_tables.shape[0]} rows, {len(num_computed)} and {batch} counts")
        num_tokens, width = sum(num_new), block_tables.shape[1]
        host = self._host_buffer(len(token_ids) + 2 * batch + batch * width)
        sections = [len(token_ids), batch, batch, batch * width]
        ids, starts, lens, tables = host.split(sections)
        ids.copy_(torch.tensor(token_ids, dtype=torch.int32))
        starts.copy_(torch.tensor(num_computed, dtype=torch.int32))
        lens.copy_(torch.tensor(num_new, dtype=torch.int32))
        tables.view(batch, width).copy_(block_tables)
        packed = host
        if self._pinned:
            packed = host.to(self.device, non_blocking=True)
            self._copied.record()
        ids, starts, lens, tables = packed.split(sections)
        tables = tables.view(batch, width)
        cu_seqlens = torch.nn.functional.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
        sequence = torch.repeat_interleave(torch.arange(batch, device=self.device), lens,
                                           output_size=num_tokens)
        positions = (starts[sequence] + torch.arange(num_tokens, dtype=torch.int32, device=self.device)
                     - cu_seqlens[sequence]).long()
        blocks = tables[sequence, positions // block_size].long()
        attn = AttentionMetadata(cu_seqlens_q=cu_seqlens, seq_lens=starts + lens, block_tables=tables,
                                 slot_mapping=blocks * block_size + positions % block_size,
                                 max_query_len=max(num_new),
                                 max_seq_len=max(map(sum, zip(num_computed, num_new))))
        return ids.long(), positions, attn

    def _host_buffer(self, size: int) -> torch.Tensor:
        """``size`` int32 slots to pack into: a fresh tensor on the CPU (it is the step's input
        itself), else the staging buffer, once the last copy out of it has finished."""
        if not self._pinned:
            return torch.empty(size, dtype=torch.int32)
        self._copied.synchronize()
        if self._staging.numel() < size:
            self._staging = torch.empty(max(size, 2 * self._staging.numel()), dtype=torch.int32,
                                        pin_memory=self._pinned)
        return self._staging[:size]
