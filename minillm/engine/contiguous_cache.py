"""The contiguous KV cache (chapter KV cache): every request gets room for ``max_len`` tokens up front.

This is the naive design the paging chapter improves on. The cache tensor is allocated at the
start with one block of ``max_len`` tokens per request; a request takes a free block when it
first asks for room and keeps it until it is freed. Whatever it does not fill is reserved but
unused: the waste the chapter measures.
"""
from __future__ import annotations

import torch

from minillm.engine.config import ModelConfig
from minillm.engine.engine_config import check_positive_int
from minillm.engine.kv_cache import KVCache


class ContiguousKVCache(KVCache):
    """Keys and values for ``num_requests`` requests of up to ``max_len`` tokens each."""

    def __init__(self, config: ModelConfig, num_requests: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_positive_int("num_requests", num_requests)
        check_positive_int("max_len", max_len)
        super().__init__(config, num_requests, max_len, dtype, device)
        self.max_len = max_len
        self._row_of: dict = {}  # request id -> its block (row)
        self._tokens: dict = {}  # request id -> token slots it holds
        self._free_rows = list(range(num_requests - 1, -1, -1))  # pop() gives the lowest row

    @property
    def num_requests(self) -> int:
        return self.num_blocks

    @property
    def request_ids(self) -> list:
        return list(self._row_of)

    @property
    def waste(self) -> float:
        """Fraction of the reserved bytes that hold no token."""
        return 1 - self.used_bytes / self.reserved_bytes

    def allocate(self, request_id, num_tokens: int) -> bool:
        held = self._tokens.get(request_id, 0)
        if not isinstance(num_tokens, int) or num_tokens < held:
            raise ValueError(f"request {request_id!r}: num_tokens must be an int >= the {held} "
                             f"tokens it holds, got {num_tokens!r}")
        if num_tokens > self.max_len or (request_id not in self._row_of and not self._free_rows):
            return False
        if request_id not in self._row_of:
            self._row_of[request_id] = self._free_rows.pop()
        self._tokens[request_id] = num_tokens
        return True

    def free(self, request_id) -> None:
        """Forget the request's tokens; its block stays reserved for the next request (that is this
        design's cost)."""
        self._free_rows.append(self._row_of.pop(request_id))
        del self._tokens[request_id]

    def num_tokens(self, request_id) -> int:
        if request_id not in self._tokens:
            raise KeyError(f"unknown request {request_id!r} (never allocated, or already freed)")
        return self._tokens[request_id]

    def __contains__(self, request_id) -> bool:
        return request_id in self._row_of

    def block_tables(self, request_ids: list) -> torch.Tensor:
        return torch.tensor([[self._row_of[r]] for r in request_ids], dtype=torch.int32)
