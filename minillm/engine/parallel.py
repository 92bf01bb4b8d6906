"""Tensor parallelism over ``torch.distributed`` (chapter 一张卡放不下).

``tensor_parallel_size=N`` splits every layer across N ranks, Megatron's way: the attention's
query heads and KV heads (a KV head is replicated when N exceeds them), the MLP's gate and up
projections by output rows ("column parallel"), the output and down projections by input columns
("row parallel"), the embedding and the LM head by vocabulary rows. Each row-parallel projection
leaves every rank a partial sum of the full hidden state, so a layer ends each of its two halves
with an all-reduce; the embedding adds one more per step and the logits one all-gather.

Rank 0 is the engine's own process: it schedules, keeps the block tables and samples. Ranks
1..N-1 are processes it spawns (:class:`Workers`); each loads only its shard of the weights, holds
its shard of the paged KV pool and runs the same forward on each step's inputs, which rank 0
broadcasts. Between GPUs the collectives run on NCCL, between CPU processes on gloo: the same code.

A worker waits for the next step on a pipe from rank 0, not in a collective, so an idle engine
never times out; the pipe closing (rank 0 gone) ends the worker. A worker that dies between steps
is found before the next one; one that dies inside a step fails rank 0's collective: gloo sees the
socket close and rank 0 reports which rank died, while NCCL's watchdog gives up only after
``COLLECTIVE_TIMEOUT`` and, under PyTorch's default NCCL error handling, ends rank 0's process too.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.engine.config import ModelConfig, tensor_parallel_shard

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # longest wait of one collective for a peer
STOP_TIMEOUT_S = 5.0  # a worker told to stop gets this long before it is killed
_ACTIVE: list = []  # the Workers of the one tensor-parallel engine this process may run


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


def _collective(op, *args) -> None:
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


class TensorParallelError(RuntimeError):
    """A rank died, a collective failed, or the engine was closed: the engine cannot step."""


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
            _collective(dist.all_reduce, x)
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
        _collective(dist.all_gather, pieces, logits.contiguous())
        return torch.cat(pieces, dim=-1)[:, :vocab_size]


# --- the processes ------------------------------------------------------------------------------

def _pack_step(input_ids, attn, last_rows, swap_out, swap_in) -> tuple[list[int], torch.Tensor]:
    """One step's inputs as a header (sizes) and one int64 tensor on the step's device: the token
    ids, each sequence's computed and new token counts and its block-table row (what rank 0's
    ``StepBuilder`` built the step from), the rows to compute logits for, the blocks to swap."""
    batch, width = attn.block_tables.shape
    flat_pairs = [b for pair in (*swap_out, *swap_in) for b in pair]
    header = [len(input_ids), batch, width, len(last_rows), len(swap_out), len(swap_in)]
    num_new = attn.cu_seqlens_q.diff()
    extra = torch.tensor([*last_rows, *flat_pairs], dtype=torch.int64, device=input_ids.device)
    payload = torch.cat([input_ids.long(), (attn.seq_lens - num_new).long(), num_new.long(),
                         attn.block_tables.reshape(-1).long(), extra])
    return header, payload


def _payload_sizes(header: list[int]) -> list[int]:
    tokens, batch, width, rows, num_out, num_in = header
    return [tokens, batch, batch, batch * width, rows, 2 * num_out, 2 * num_in]


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def _init_group(rank: int, size: int, port: int, device: torch.device):
    """Join the process group (NCCL on CUDA, gloo on the CPU) through rank 0's TCP store."""
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)


def _worker(rank: int, size: int, port: int, conn, model, device: torch.device, dtype, weights: str,
            threads: int) -> None:
    """A rank > 0: join the group, load the shard, then follow rank 0's orders until told to stop
    or until rank 0 is gone."""
    from minillm.engine.loader import load_model
    from minillm.engine.paged_cache import PagedKVCache
    from minillm.engine.planner import plan

    try:
        torch.set_num_threads(threads)
        device = _rank_device(device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        conn.send(("joining",))
        _init_group(rank, size, port, device)
        tp = TensorParallel(rank, size)
        net = load_model(model, device=device, dtype=dtype, weights=weights, tensor_parallel=tp, tokenizer=False)
        conn.send(("loaded",))
        kv = None
        while True:
            order, *args = conn.recv()
            if order == "stop":
                break
            if order == "plan":
                plan(net, engine_config=args[0])
            elif order == "cache":
                config = args[0]
                kv = PagedKVCache(net.config, config.num_kv_blocks, config.block_size, args[1], device,
                                  max_model_len=config.max_model_len, num_cpu_blocks=config.num_cpu_blocks)
            elif order == "step":
                _worker_step(net, kv, args[0], device)
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.inference_mode()
def _worker_step(net, kv, header: list[int], device: torch.device) -> None:
    """Receive the step rank 0 runs, build its inputs the way rank 0 did, run the shard's forward."""
    payload = torch.empty(sum(_payload_sizes(header)), dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    ids, computed, new, tables, last, out, back = payload.cpu().split(_payload_sizes(header))
    pairs = lambda t: [tuple(p) for p in t.view(-1, 2).tolist()]  # noqa: E731
    kv.swap(pairs(out), pairs(back))
    input_ids, positions, attn = kv.step_builder.build(tables.view(header[1], header[2]).int(), computed.tolist(),
                                                       new.tolist(), kv.block_size, ids.tolist())
    hidden = net(input_ids, positions, attn, kv.layer_caches)
    if len(last):
        net.compute_logits(hidden[last.to(device)])


class Workers:
    """Rank 0's side of a tensor-parallel engine: ranks 1..N-1 as spawned processes, their pipes
    and the process group. ``close`` (also run at exit and when the engine is collected) stops
    them; :meth:`check` turns a dead one into a ``TensorParallelError`` that names it."""

    def __init__(self, model, device: torch.device, dtype, weights: str, size: int):
        if _ACTIVE:
            raise ValueError("a tensor-parallel engine is already running in this process; close() it first")
        self.size, self.device = size, device
        self.tp = TensorParallel(0, size)
        threads = max(1, torch.get_num_threads() // size) if device.type == "cpu" else 1
        self._threads_before = torch.get_num_threads()
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                              wait_for_workers=False)
        context = mp.get_context("spawn")
        self.processes, self.conns = [], []
        for rank in range(1, size):
            parent, child = context.Pipe()
            process = context.Process(target=_worker, name=f"minillm-tp-rank{rank}", daemon=True,
                                      args=(rank, size, store.port, child, model, device, dtype, weights, threads))
            process.start()
            child.close()
            self.processes.append(process)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.processes, self.conns)
        _ACTIVE.append(self)
        try:
            for rank, conn in enumerate(self.conns, start=1):
                self._receive(rank, conn, "joining")  # a worker that dies starting up raises here
            if device.type == "cpu":
                torch.set_num_threads(threads)
            else:
                torch.cuda.set_device(device)
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, store=store, rank=0, world_size=size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (ranks 1..N-1)."""
        return [p.pid for p in self.processes]

    def wait_loaded(self) -> None:
        """Block until every worker has loaded its shard; a failed one raises here."""
        for rank, conn in enumerate(self.conns, start=1):
            self._receive(rank, conn, "loaded")

    def _receive(self, rank: int, conn, expected: str) -> None:
        while not conn.poll(0.1):
            self.check()
        try:
            message = conn.recv()
        except EOFError:
            message = ("error", "the process ended")
        if message[0] != expected:
            self.close()
            raise TensorParallelError(f"tensor-parallel rank {rank} failed:\n{message[1]}")

    def order(self, *message) -> None:
        """Send every worker the same order (a step, a plan, building the cache, stop)."""
        for conn in self.conns:
            conn.send(message)

    def broadcast_step(self, input_ids, attn, last_rows, swap_out, swap_in) -> None:
        """Tell the workers a step is coming and broadcast its inputs."""
        self.check()
        header, payload = _pack_step(input_ids, attn, last_rows, swap_out, swap_in)
        self.order("step", header)
        _collective(dist.broadcast, payload, 0)

    def check(self) -> None:
        """``TensorParallelError`` naming the first worker that is no longer running (the others are
        stopped), or saying the engine is closed."""
        if self not in _ACTIVE:
            raise TensorParallelError("the tensor-parallel engine is closed")
        for rank, (process, conn) in enumerate(zip(self.processes, self.conns), start=1):
            if not process.is_alive():
                code, said = process.exitcode, _last_words(conn)
                self.close()
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {process.pid}) died "
                                          f"(exit code {code}); the engine is closed{said}")

    def failed(self, err: BaseException) -> TensorParallelError:
        """The error to raise when a step failed: which rank died, if one did."""
        if isinstance(err, TensorParallelError):
            return err
        for _ in range(20):  # the process may take a moment to be reaped after its socket closed
            try:
                self.check()
            except TensorParallelError as dead:
                return dead
            if not any(p.is_alive() for p in self.processes):
                break
            self.processes[0].join(0.05)
        self.close()
        return TensorParallelError(f"a tensor-parallel step failed ({err}); the engine is closed")

    def close(self) -> None:
        """Stop the workers (asked, then killed), leave the process group, restore the thread count."""
        if self not in _ACTIVE:
            return
        _ACTIVE.remove(self)
        self._finalizer()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.device.type == "cpu":
            torch.set_num_threads(self._threads_before)


def _last_words(conn) -> str:
    """The traceback a worker sent before it exited, if it had time to send one."""
    try:
        while conn.poll():
            message = conn.recv()
            if message[0] == "error":
                return f". Its error:\n{message[1]}"
    except (EOFError, OSError):
        pass
    return ""


def _stop(processes, conns) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for process in processes:
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)
    for conn in conns:
        conn.close()
