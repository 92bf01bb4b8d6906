"""The KV cache's one interface (chapters KV cache and 分页的 KV cache).

A cache holds the keys and values of every layer in one tensor
``[num_layers, 2 (K, V), num_blocks, block_size, n_kv, d]`` and knows which blocks each request
holds. Whoever runs the model asks it for room (:meth:`KVCache.allocate`), hands it the step's
requests and token counts (:meth:`KVCache.prepare_step`) and gets back the positions and the
:class:`~minillm.engine.attention_metadata.AttentionMetadata` the model needs. Two classes implement
it: :class:`~minillm.engine.contiguous_cache.ContiguousKVCache` (chapter KV cache: one block of
``max_len`` tokens per request, reserved up front) and
:class:`~minillm.engine.paged_cache.PagedKVCache` (chapter 分页: small blocks handed out as a request
grows). Going from one chapter to the other is swapping the class.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np
import torch

from minillm.engine.attention_metadata import AttentionMetadata, StepBuilder
from minillm.engine.config import ModelConfig
from minillm.engine.engine_config import check_positive_int


FP8 = torch.float8_e4m3fn  # kv_cache_dtype="fp8": vLLM's default fp8 format for the KV cache


def kv_storage_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the cache stores keys and values in: the model's for ``"auto"``, e4m3 for
    ``"fp8"`` (one byte each; the attention reads them back in the model's dtype)."""
    return FP8 if setting == "fp8" else model_dtype


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer: 2 * L * n_kv * d * element size."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.zeros``; on the CPU taken from ``calloc`` (numpy's zeros), whose pages the OS maps
    as zeros on first touch: a pool of gigabytes is ready at once and costs memory as it fills."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8)).view(dtype).view(shape)


class KVCache(ABC):
    """Keys and values of every layer in ``num_blocks`` blocks of ``block_size`` token slots."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        check_positive_int("num_blocks", num_blocks)
        self.config = config
        self.block_size = block_size
        self.kv = zeros((config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim),
                        dtype, device)
        self.layer_caches = [(layer[0], layer[1]) for layer in self.kv]  # (k, v) per layer
        self.step_builder = StepBuilder(self.kv.device)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config, self.kv.dtype)

    @property
    def reserved_bytes(self) -> int:
        return self.kv.nbytes

    @abstractmethod
    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make the request hold room for ``num_tokens`` tokens in total; False (nothing changed)
        when there is no room."""

    @abstractmethod
    def free(self, request_id: str) -> None:
        """The request is done: its room goes back."""

    @abstractmethod
    def num_tokens(self, request_id: str) -> int:
        """Token slots the request holds."""

    @abstractmethod
    def __contains__(self, request_id: str) -> bool:
        """Whether the request holds room now."""

    @abstractmethod
    def block_tables(self, request_ids: list[str]) -> torch.Tensor:
        """The requests' block ids, one row each, ``int32 [B, W]`` on the host."""

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots requests hold."""
        return sum(self.num_tokens(r) for r in self.request_ids) * self.bytes_per_token

    @property
    @abstractmethod
    def request_ids(self) -> list[str]:
        """The requests that hold room now."""

    def append(self, request_ids: list, num_new: list[int]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Room for ``num_new[i]`` more tokens of each request after the ones it holds, and the step
        that computes them (what a plain generation loop does every step)."""
        if len(request_ids) != len(num_new) or not request_ids or len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids must be distinct, non-empty and as many as num_new, got "
                             f"{request_ids} and {num_new}")
        batch = [(r, self.num_tokens(r) if r in self else 0, n) for r, n in zip(request_ids, num_new)]
        for request_id, done, new in batch:
            if not isinstance(new, int) or new < 1:
                raise ValueError(f"request {request_id!r}: num_new must be an int >= 1, got {new!r}")
            if not self.allocate(request_id, done + new):
                raise ValueError(f"request {request_id!r}: no room for {done} + {new} tokens in this cache")
        return self.prepare_step(batch)

    def prepare_step(self, batch: list[tuple[str, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """For ``(request_id, num_computed, num_new)`` triples: positions ``[T]`` of the new tokens and
        the step's attention metadata. Each request must hold room for ``num_computed + num_new``."""
        for request_id, done, new in batch:
            if new < 1 or done < 0 or done + new > self.num_tokens(request_id):
                raise ValueError(f"request {request_id!r}: {done} computed + {new} new tokens, but it "
                                 f"holds room for {self.num_tokens(request_id)} (allocate first)")
        _, positions, attn = self.prepare_inputs(batch)
        return positions, attn

    def prepare_inputs(self, batch: list[tuple[str, int, int]], token_ids: list[int] = ()
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """:meth:`prepare_step` plus the new tokens' ids on the device, in one host-to-device copy,
        without checking the batch again (the model runner's batch comes from the scheduler)."""
        return self.step_builder.build(self.block_tables([r for r, _, _ in batch]),
                                       [done for _, done, _ in batch], [new for _, _, new in batch],
                                       self.block_size, token_ids)
