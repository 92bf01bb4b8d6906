"""The ranks 1..N-1 of a tensor-parallel engine (chapter 一张卡放不下): processes that rank 0
spawns (:class:`Workers`), each loading its shard and following rank 0's orders (plan, build the
cache, step) over a pipe; ``minillm.engine.parallel`` holds what every rank's forward shares.

A worker waits for the next step on a pipe from rank 0, not in a collective, so an idle engine
never times out; the pipe closing (rank 0 gone) ends the worker. A worker that dies between steps
is found before the next one; one that dies inside a step fails rank 0's collective: gloo sees the
socket close and rank 0 reports which rank died, while NCCL's watchdog gives up only after
``COLLECTIVE_TIMEOUT`` and, under PyTorch's default NCCL error handling, ends rank 0's process too.
"""
from __future__ import annotations

import os
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.engine.loader import load_model
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.parallel import COLLECTIVE_TIMEOUT, TensorParallel, collective
from minillm.engine.planner import plan

STOP_TIMEOUT_S = 5.0  # a worker told to stop gets this long before it is killed
_ACTIVE: list = []  # the Workers of the one tensor-parallel engine this process may run


class TensorParallelError(RuntimeError):
    """A rank died, a collective failed, or the engine was closed: the engine cannot step."""


def _pack_step(input_ids, attn, last_rows, slices, swap_out, swap_in) -> tuple[list[int], torch.Tensor]:
    """One step's inputs as a header (sizes) and one int64 tensor on the step's device: the token
    ids, each sequence's computed and new token counts and its block-table row (what rank 0's
    ``StepBuilder`` built the step from), the rows to compute logits for and how many rows each
    logits computation takes, the blocks to swap."""
    batch, width = attn.block_tables.shape
    flat_pairs = [b for pair in (*swap_out, *swap_in) for b in pair]
    header = [len(input_ids), batch, width, len(last_rows), len(slices), len(swap_out), len(swap_in)]
    num_new = attn.cu_seqlens_q.diff()
    extra = torch.tensor([*last_rows, *slices, *flat_pairs], dtype=torch.int64, device=input_ids.device)
    payload = torch.cat([input_ids.long(), (attn.seq_lens - num_new).long(), num_new.long(),
                         attn.block_tables.reshape(-1).long(), extra])
    return header, payload


def _payload_sizes(header: list[int]) -> list[int]:
    tokens, batch, width, rows, num_slices, num_out, num_in = header
    return [tokens, batch, batch, batch * width, rows, num_slices, 2 * num_out, 2 * num_in]


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
                kv = PagedKVCache.from_config(net.config, args[0], args[1], device, bookkeeping=False)
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
    ids, computed, new, tables, last, slices, out, back = payload.cpu().split(_payload_sizes(header))
    pairs = lambda t: [tuple(p) for p in t.view(-1, 2).tolist()]  # noqa: E731
    kv.swap(pairs(out), pairs(back))
    input_ids, positions, attn = kv.step_builder.build(tables.view(header[1], header[2]).int(), computed.tolist(),
                                                       new.tolist(), kv.block_size, ids.tolist())
    hidden = net(input_ids, positions, attn, kv.layer_caches)
    if len(last):
        for rows in hidden[last.to(device)].split(slices.tolist()):  # rank 0's logits computations
            net.compute_logits(rows)


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

    def broadcast_step(self, input_ids, attn, last_rows, slices, swap_out, swap_in) -> None:
        """Tell the workers a step is coming and broadcast its inputs."""
        self.check()
        header, payload = _pack_step(input_ids, attn, last_rows, slices, swap_out, swap_in)
        self.order("step", header)
        collective(dist.broadcast, payload, 0)

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
