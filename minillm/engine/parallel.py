"""Tensor parallelism over ``torch.distributed`` (chapter 一张卡放不下).

``tensor_parallel_size=N`` splits every layer across N ranks, Megatron's way: the attention's
query heads and KV heads (a KV head is replicated when N exceeds them), the MLP's gate and up
projections by output rows ("column parallel"), the output and down projections by input columns
("row parallel"), the embedding and the LM head by vocabulary rows. Each row-parallel projection
leaves every rank a partial sum of the full hidden state, so a layer ends each of its two halves
with an all-reduce; the embedding adds one more per step and the logits one all-gather.

Rank 0 is the engine's own process: it schedules, keeps the block tables and samples. Ranks
1..N-1 are processes it spawns (``minillm.engine.workers.Workers``); each loads only its shard of
the weights, holds its shard of the paged KV pool and runs the same forward on each step's inputs,
which rank 0 broadcasts. Between GPUs the collectives run on NCCL, between CPU processes on gloo:
the same code.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from minillm.engine.config import ModelConfig, tensor_parallel_shard

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # longest wait of one collective for a peer


@dataclass
class CollectiveClock:
    """What this process's collectives took while :func:`timed_collectives` was on: calls and
    seconds of each kind ("all_reduce", "all_gather", "broadcast"); on CUDA each call is
    synchronized before and after, so its seconds are its own."""

    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


_CLOCK: list[CollectiveClock] = []  # the clock running now, if any


@contextlib.contextmanager
def timed_collectives() -> Iterator[CollectiveClock]:
    """Count and time this process's collectives inside the ``with`` block: the forward's
    all-reduces and all-gather, and on rank 0 the broadcast of each step's inputs."""
    clock = CollectiveClock()
    _CLOCK.append(clock)
    try:
        yield clock
    finally:
        _CLOCK.remove(clock)


def collective(op, *args) -> None:
    """``op(*args)``, timed when a clock runs (``args``: a tensor first, or a list then a tensor)."""
    if not _CLOCK:
        op(*args)
        return
    tensor = args[1] if isinstance(args[0], list) else args[0]
    on_cuda = tensor.is_cuda
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    op(*args)
    if on_cuda:
        torch.cuda.synchronize()
    clock, name = _CLOCK[-1], op.__name__
    clock.calls[name] = clock.calls.get(name, 0) + 1
    clock.seconds[name] = clock.seconds.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class TensorParallel:
    """Which shard this process holds: rank ``rank`` of ``size`` (1: the whole model, no
    collectives), and the one rule that cuts a full tensor into that shard (:meth:`shard`)."""

    rank: int = 0
    size: int = 1

    def shard_config(self, config: ModelConfig) -> ModelConfig:
        """The shape this rank holds: heads, KV heads and MLP width per rank (vocabulary, hidden
        size and layers as the model's). The KV cache, the kernels and the planner read it."""
        return tensor_parallel_shard(config, self.size)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """This rank's first vocabulary row and every rank's row count (the vocabulary padded to a
        multiple of ``size``; padded rows hold zeros)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def _kv_first_head(self, config: ModelConfig) -> int:
        kv = config.num_kv_heads
        return self.rank * kv // self.size if self.size <= kv else self.rank // (self.size // kv)

    def shard(self, name: str, full: torch.Tensor, config: ModelConfig) -> torch.Tensor:
        """This rank's piece of the full tensor ``name`` (Hugging Face names): q/k/v, gate and up
        by output rows, o and down by input columns (their bias on rank 0 only, zeros elsewhere,
        so that the all-reduce adds it once), embedding and LM head by vocabulary rows, norms whole."""
        if self.size == 1:
            return full
        local = self.shard_config(config)
        d, module, kind = config.head_dim, *name.rsplit(".", 2)[-2:]
        if module in ("embed_tokens", "lm_head"):
            start, rows = self.vocab_rows(config.vocab_size)
            piece = full.new_zeros(rows, *full.shape[1:])
            taken = full[start:start + rows]
            piece[:len(taken)] = taken
            return piece
        if module == "q_proj":
            size = local.num_heads * d
            return full[self.rank * size:(self.rank + 1) * size]
        if module in ("k_proj", "v_proj"):
            first = self._kv_first_head(config) * d
            return full[first:first + local.num_kv_heads * d]
        if module in ("gate_proj", "up_proj"):
            size = local.intermediate_size
            return full[self.rank * size:(self.rank + 1) * size]
        if module in ("o_proj", "down_proj"):
            if kind == "bias":
                return full if self.rank == 0 else torch.zeros_like(full)
            size = full.shape[1] // self.size
            return full[:, self.rank * size:(self.rank + 1) * size]
        return full  # RMSNorm weights: every rank holds them whole

    # -- the collectives the forward calls (no-ops on one rank) -----------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of each rank's partial ``x`` (in place)."""
        if self.size > 1:
            collective(dist.all_reduce, x)
        return x

    def embed(self, embedding: torch.nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: each rank looks up the ids in its rows, zeros elsewhere,
        and the all-reduce gathers the rows."""
        if self.size == 1:
            return embedding(input_ids)
        start, rows = self.vocab_rows(embedding.num_embeddings * self.size)
        local = input_ids - start
        outside = (local < 0) | (local >= rows)
        x = embedding(local.masked_fill(outside, 0))
        return self.all_reduce(x.masked_fill(outside[:, None], 0))

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The full ``[N, vocab]`` logits from each rank's ``[N, vocab / size]`` (every rank gets them)."""
        if self.size == 1:
            return logits
        pieces = [torch.empty_like(logits) for _ in range(self.size)]
        collective(dist.all_gather, pieces, logits.contiguous())
        return torch.cat(pieces, dim=-1)[:, :vocab_size]
