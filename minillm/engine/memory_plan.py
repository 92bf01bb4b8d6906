"""Where one card's memory goes (chapter 一张 24 GiB 的卡放 8B 模型). Pure Python.

One :class:`MemoryPlan` describes every budget the book draws: the ledger's bound (weights only,
``source="ledger"``), the planner's dry run for a card you do not have (``"estimated"``) and the
plan profiled on the device (``"profiled"``). The card's budget is ``total × utilization``; from it
go the weights, the activation peak of the largest step and the memory outside PyTorch; what is
left is cut into KV blocks of ``block_size`` tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minillm.engine.units import ceil_div, fmt_bytes, fmt_int

SOURCES = ("ledger", "estimated", "profiled")


class MemoryPlanError(ValueError):
    """The model or the requested length does not fit; ``plan`` holds the breakdown and
    ``max_model_len_that_fits`` the longest request that would (0 when nothing fits)."""

    def __init__(self, message: str, plan: "MemoryPlan", max_model_len_that_fits: int):
        super().__init__(message)
        self.plan = plan
        self.max_model_len_that_fits = max_model_len_that_fits


@dataclass(frozen=True)
class MemoryPlan:
    """Where the memory of one card goes: weights, activations, other overhead, KV blocks."""

    model: str
    device: str
    dtype: str
    total_bytes: int  # the card (or the emulated card)
    utilization: float  # gpu_memory_utilization
    weight_bytes: int
    activation_peak_bytes: int  # peak of the largest step, above the weights (0 in the ledger)
    other_bytes: int  # outside PyTorch: CUDA context, cuBLAS workspace, other processes
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    max_position_embeddings: int
    max_num_batched_tokens: int  # the step whose activations were counted (0 in the ledger)
    source: str  # one of SOURCES
    quantization: str = "none"  # the linears' weight format: "none", "int8", "int4 (groups of 32)"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8"

    @classmethod
    def cut(cls, *, total_bytes: int, utilization: float, weight_bytes: int,
            activation_peak_bytes: int, other_bytes: int, block_size: int, bytes_per_block: int,
            max_model_len: int | None, max_position_embeddings: int, **labels) -> "MemoryPlan":
        """The plan whose KV pool is every whole block the budget leaves (``max_model_len=None``:
        the model's max positions)."""
        kv_budget = int(total_bytes * utilization) - weight_bytes - activation_peak_bytes - other_bytes
        return cls(total_bytes=total_bytes, utilization=utilization, weight_bytes=weight_bytes,
                   activation_peak_bytes=activation_peak_bytes, other_bytes=other_bytes,
                   block_size=block_size, bytes_per_block=bytes_per_block,
                   num_blocks=max(kv_budget, 0) // bytes_per_block,
                   max_model_len=max_model_len or max_position_embeddings,
                   max_position_embeddings=max_position_embeddings, **labels)

    @property
    def profiled(self) -> bool:
        return self.source == "profiled"

    @property
    def budget_bytes(self) -> int:
        """What the engine may use: total × utilization."""
        return int(self.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        """The budget minus weights, activation peak and other overhead (negative: nothing fits)."""
        return self.budget_bytes - self.weight_bytes - self.activation_peak_bytes - self.other_bytes

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes <= self.budget_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        """What the KV blocks take: whole blocks only."""
        return self.num_blocks * self.bytes_per_block

    @property
    def unused_bytes(self) -> int:
        """The rest of the card: outside the budget, and the last partial block."""
        used = self.weight_bytes + self.activation_peak_bytes + self.other_bytes + self.kv_cache_bytes
        return self.total_bytes - used

    @property
    def tokens(self) -> int:
        """KV slots in the block pool."""
        return self.num_blocks * self.block_size

    def blocks_for(self, context: int) -> int:
        """Blocks one request of ``context`` tokens holds."""
        return ceil_div(context, self.block_size)

    def fits(self, context: int) -> bool:
        """Whether one request of ``context`` tokens fits in the block pool."""
        return self.blocks_for(context) <= self.num_blocks

    @property
    def token_capacity(self) -> float:
        """KV budget / KV bytes per token, before it is cut into whole blocks (the ledger's bound)."""
        return max(self.kv_budget_bytes, 0) / self.kv_bytes_per_token

    def requests_at(self, context: int) -> float:
        """The KV room counted in requests of ``context`` tokens (fractional: the ledger's 57.0)."""
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return self.token_capacity / context

    def concurrent_requests(self, context: int) -> int:
        """How many whole requests of ``context`` tokens the pool holds at once."""
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return self.num_blocks // self.blocks_for(context)

    def longest_fitting_len(self) -> int:
        """The largest max_model_len that fits (0 when not even one token fits), as vLLM answers
        ``max_model_len=-1``."""
        return min(self.tokens, self.max_position_embeddings)

    def checked(self, max_model_len: int | None) -> "MemoryPlan":
        """This plan if the weights, one block and one request of ``max_model_len`` fit (-1: the
        longest that fits, which the returned plan then holds); else ``MemoryPlanError``."""
        if not self.weights_fit:
            raise MemoryPlanError(
                f"the weights alone ({fmt_bytes(self.weight_bytes)}) do not fit in the budget of "
                f"{fmt_bytes(self.budget_bytes)} ({fmt_bytes(self.total_bytes)} x {self.utilization}): "
                f"use a bigger card or a smaller dtype", self, 0)
        longest = self.longest_fitting_len()
        if longest == 0:
            raise MemoryPlanError(
                f"no room for one KV block: weights {fmt_bytes(self.weight_bytes)} + activation peak "
                f"{fmt_bytes(self.activation_peak_bytes)} + other {fmt_bytes(self.other_bytes)} leave "
                f"{fmt_bytes(self.kv_budget_bytes)} of the {fmt_bytes(self.budget_bytes)} budget, a block "
                f"needs {fmt_bytes(self.bytes_per_block)}; lower max_num_batched_tokens or raise "
                f"gpu_memory_utilization", self, 0)
        if max_model_len == -1:
            return dataclasses.replace(self, max_model_len=longest)
        if not self.fits(self.max_model_len):
            needed = self.blocks_for(self.max_model_len) * self.bytes_per_block
            raise MemoryPlanError(
                f"one request of max_model_len {self.max_model_len:,} needs {fmt_bytes(needed)} of KV "
                f"but the KV blocks hold {fmt_bytes(self.kv_cache_bytes)} ({self.tokens:,} tokens); "
                f"the longest max_model_len that fits is {longest:,} (or pass -1 to use it)", self, longest)
        return self

    @classmethod
    def from_dict(cls, fields: dict) -> "MemoryPlan":
        """The plan from its ``as_dict()`` (derived numbers ignored), e.g. read from a record."""
        return cls(**{f.name: fields[f.name] for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict:
        """Fields and derived numbers, for JSON records."""
        derived = {name: getattr(self, name) for name in
                   ("profiled", "budget_bytes", "kv_budget_bytes", "kv_cache_bytes", "unused_bytes",
                    "tokens")}
        return {**dataclasses.asdict(self), **derived}

    def rows(self, contexts=(1024, 4096, 8192)) -> list[tuple[str, str]]:
        """The breakdown as (label, value) rows, integers with thousands separators."""

        def size(n: int) -> str:
            return f"{fmt_int(n)} B ({fmt_bytes(n)})"

        rows = [("model", self.model), ("device", self.device), ("dtype", self.dtype),
                ("weight format", self.quantization), ("KV cache dtype", self.kv_cache_dtype),
                ("source", self.source),
                ("total", size(self.total_bytes)),
                (f"budget (x {self.utilization})", size(self.budget_bytes)),
                ("weights", size(self.weight_bytes)),
                (f"activation peak ({fmt_int(self.max_num_batched_tokens)} tokens)",
                 size(self.activation_peak_bytes)),
                ("other overhead", size(self.other_bytes)),
                ("KV budget", size(self.kv_budget_bytes)),
                (f"bytes per block ({self.block_size} tokens)", fmt_int(self.bytes_per_block)),
                ("KV blocks", fmt_int(self.num_blocks)),
                ("KV tokens", fmt_int(self.tokens)),
                ("max_model_len", fmt_int(self.max_model_len))]
        rows += [(f"concurrent requests @ctx {fmt_int(c)}", fmt_int(self.concurrent_requests(c)))
                 for c in contexts]
        return rows
