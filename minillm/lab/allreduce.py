"""What one all-reduce costs between two processes on this machine (chapter 一张卡放不下).

Two spawned processes (gloo on the CPU; NCCL between two GPUs) do nothing but all-reduce messages of
a few sizes; :func:`fit_link` fits α and β of the ledger's ``AllReduceCost`` to what they measured.
The processes are spawned, so their function lives here, in an importable module, not in the lab.
"""
from __future__ import annotations

import socket
import time

import torch

from minillm.lab.estimate import AllReduceCost, ring_bytes_per_card


def two_ranks(device: str = "cpu") -> torch.device:
    """Where two ranks run: ``"cpu"`` (gloo processes) or ``"cuda"`` (one GPU each, NCCL), refused
    with a clear error when this machine has fewer than two GPUs."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError(f"the NCCL runs need two GPUs, this machine has {torch.cuda.device_count()}; use device='cpu'")
    return torch.device("cuda", 0) if device.type == "cuda" else device


WARMUP = 5  # untimed all-reduces of each size, before the first timed one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, sizes: tuple[int, ...], repeats: int, device_type: str, results) -> None:
    """One of the two processes: all-reduce float32 messages of each size ``repeats`` times, the
    sizes in turn, each after a barrier (every size first ``WARMUP`` times untimed); rank 0 puts
    each size's fastest seconds on ``results`` (what the link does; on a busy machine most tries
    of one size can stall)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    try:
        messages = [torch.ones(nbytes // 4, device=device) for nbytes in sizes]
        for x in messages * WARMUP:  # the connection and every size's buffers settle before any is timed
            dist.all_reduce(x)
        samples = [[] for _ in sizes]
        for _ in range(repeats):  # the sizes take turns
            for x, seconds in zip(messages, samples):
                dist.barrier()
                sync()
                start = time.perf_counter()
                dist.all_reduce(x)
                sync()
                seconds.append(time.perf_counter() - start)
        if rank == 0:
            results.put([min(seconds) for seconds in samples])
    finally:
        dist.destroy_process_group()


def allreduce_sweep(sizes: tuple[int, ...], repeats: int = 30, device: str = "cpu") -> dict[int, float]:
    """Seconds of one all-reduce of each message size (bytes) between two processes, the fastest try."""
    import torch.multiprocessing as mp

    if len(sizes) < 2 or any(n < 4 or n % 4 for n in sizes):
        raise ValueError(f"need two or more sizes, each a positive multiple of 4 bytes; got {sizes}")
    device_type = two_ranks(device).type
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    ranks = [ctx.Process(target=_rank, args=(rank, port, sizes, repeats, device_type, results)) for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        fastest = results.get(timeout=120)
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return dict(zip(sizes, fastest, strict=True))


def fit_link(points: dict[int, float], tp: int = 2) -> AllReduceCost:
    """α and β of ``latency + ring bytes / bandwidth`` fitted to measured all-reduces, each point's
    error relative to its own time (least squares weighted by 1/t², so the small messages count as
    much as the large ones)."""
    xs, ts = [ring_bytes_per_card(n, tp) for n in points], list(points.values())
    w = [1 / t**2 for t in ts]
    sw, sx, sxx = sum(w), sum(a * x for a, x in zip(w, xs)), sum(a * x * x for a, x in zip(w, xs))
    st, sxt = sum(a * t for a, t in zip(w, ts)), sum(a * x * t for a, x, t in zip(w, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    if slope <= 0:
        raise ValueError(f"all-reduce time does not grow with the message: {points}")
    return AllReduceCost(latency=max((st - slope * sx) / sw, 0.0), bandwidth=1 / slope)
