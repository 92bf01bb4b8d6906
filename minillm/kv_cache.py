"""The contiguous KV cache (chapter KV cache): every request gets room for ``max_len`` tokens up front.

This is the naive design the paging chapter improves on. One tensor
``[num_layers, 2, num_requests, max_len, n_kv, d]`` is allocated at the start; request ``r`` owns
row ``r``. Seen by the attention kernels it is a paged cache whose blocks are ``max_len`` tokens
long and request ``r``'s block table is ``[r]``, so contiguous and paged caches share one code path.
Whatever a request does not fill is reserved but unused: the waste the chapter measures.
"""
from __future__ import annotations

import torch

from minillm.config import ModelConfig
from minillm.model import AttentionMetadata


class ContiguousKVCache:
    """Keys and values for ``num_requests`` requests of up to ``max_len`` tokens each."""

    def __init__(self, config: ModelConfig, num_requests: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value in (("num_requests", num_requests), ("max_len", max_len)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.config = config
        self.max_len = max_len
        self.kv = torch.zeros(config.num_layers, 2, num_requests, max_len, config.num_kv_heads,
                              config.head_dim, dtype=dtype, device=device)
        self.lengths = [0] * num_requests  # tokens written so far, per request
        self._layer_caches = [(layer[0], layer[1]) for layer in self.kv]

    @property
    def num_requests(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer: 2 * L * n_kv * d * element size."""
        cfg = self.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv.element_size()

    @property
    def reserved_bytes(self) -> int:
        return self.kv.nbytes

    @property
    def used_bytes(self) -> int:
        return sum(self.lengths) * self.bytes_per_token

    @property
    def waste(self) -> float:
        """Fraction of the reserved bytes that hold no token."""
        return 1 - self.used_bytes / self.reserved_bytes

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, ``(k_cache, v_cache)`` views of shape ``[num_requests, max_len, n_kv, d]``."""
        return self._layer_caches

    def prepare_step(self, rows: list[int], num_new_tokens: list[int]
                     ) -> tuple[torch.Tensor, AttentionMetadata]:
        """Claim the next ``num_new_tokens[i]`` positions of request ``rows[i]`` for one forward.

        Returns the new tokens' positions ``[T]`` and the attention metadata of the step.
        """
        if len(rows) != len(num_new_tokens) or not rows or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct, non-empty and as many as num_new_tokens, "
                             f"got rows={rows} and num_new_tokens={num_new_tokens}")
        for row, new in zip(rows, num_new_tokens):
            if not 0 <= row < self.num_requests:
                raise ValueError(f"row {row} is not a request of this cache (0..{self.num_requests - 1})")
            if new < 1 or self.lengths[row] + new > self.max_len:
                raise ValueError(f"request {row}: {self.lengths[row]} cached + {new} new tokens "
                                 f"does not fit max_len={self.max_len}")
        positions, slots, cu_seqlens, seq_lens = [], [], [0], []
        for row, new in zip(rows, num_new_tokens):
            start = self.lengths[row]
            positions.extend(range(start, start + new))
            slots.extend(range(row * self.max_len + start, row * self.max_len + start + new))
            cu_seqlens.append(cu_seqlens[-1] + new)
            seq_lens.append(start + new)
            self.lengths[row] = start + new
        device = self.kv.device
        attn = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(rows, dtype=torch.int32, device=device)[:, None],
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(num_new_tokens),
        )
        return torch.tensor(positions, dtype=torch.int64, device=device), attn

    def free(self, row: int) -> None:
        """Forget request ``row``'s tokens; its room stays reserved (that is this design's cost)."""
        self.lengths[row] = 0
