"""The tensor-parallelism chapter's plumbing (``book/ch13-parallel.md``, ``notebooks/ch13-parallel.ipynb``,
chapter 一张卡放不下).

Two halves. The page's: the ledger of Llama-3.1-8B and 70B cut across 1/2/4/8 cards
(``minillm.lab.estimate``'s tensor-parallel section: weights and KV per card, the all-reduces a token
makes and their bytes, the α–β cost of one, each card count's decode floor plus its all-reduces) for
two example links. The lab's: a small Llama with random weights run by the engine at
``tensor_parallel_size`` 1 and 2 (gloo processes on the CPU; NCCL when the machine has two GPUs), the step time and the all-reduces'
share of it from ``timed_collectives``; and α, β of this machine's own all-reduce, fitted from a
sweep of message sizes between two processes; its tables, figure and :func:`glue_chapter`.
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass

import torch

from minillm.engine.config import ModelConfig, load_config
from minillm.lab import estimate as L
from minillm.lab.estimate import GiB, KiB, AllReduceCost, fmt_int

MODELS = ("llama-3.1-8b", "llama-3.1-70b")
CARD_COUNTS = (1, 2, 4, 8)
CARDS = (24, 80)  # GiB
UTILIZATION = 0.92
PAGE_GPU, CTX, BATCH = "H100 SXM", 4096, 1
# Example links, not measurements: α of the NVLink-like one is the order of a custom all-reduce's
# published small-message latency on H100 (sglang PR #2904); β is of the order of NVLink's per-direction
# bandwidth. The PCIe-like one: α of an NCCL ring through the host, β of a PCIe 4.0 x16 link.
LINKS = {"NVLink 类": AllReduceCost(latency=10e-6, bandwidth=300e9),
         "PCIe 类": AllReduceCost(latency=40e-6, bandwidth=20e9)}


# Published, not measured here: gpt-fast's README (github.com/pytorch-labs/gpt-fast), batch 1 on
# A100-80GB, tokens/s by GPU count.
GPT_FAST = {"Llama-2-7B": {1: 104.9, 2: 168.8, 4: 254.0, 8: 328.4}, "Llama-2-70B": {2: 21.3, 4: 38.0, 8: 62.5}}
GPT_FAST_GPU, GPT_FAST_CTX = "A100 80GB SXM", 256
# Published, not measured here: a user's table in text-generation-inference issue #1315
# (github.com/huggingface/text-generation-inference/issues/1315): CodeLlama-34B-Instruct, one request
# at a time, mean milliseconds per generated token by GPU count.
TGI_1315 = {"A100-80G": {1: 46.79, 2: 29.39, 4: 32.06}, "H100": {1: 27.98, 2: 28.02, 4: 31.77}}


# --- The page: the ledger of two real models on several cards --------------------------------------

def models() -> dict[str, ModelConfig]:
    return {name: load_config(name) for name in MODELS}


def fits(nbytes: float, card_gib: int) -> bool:
    """Whether ``nbytes`` fit a card's budget (``UTILIZATION`` of it)."""
    return nbytes <= UTILIZATION * card_gib * GiB


def kv_tokens_left(cfg: ModelConfig, tp: int, card_gib: int) -> int:
    """Tokens of KV each card holds once its weights are in (0 when they do not fit)."""
    left = UTILIZATION * card_gib * GiB - L.weight_bytes_per_card(cfg, tp)
    return max(0, int(left // L.kv_bytes_per_token_per_card(cfg, tp)))


def card_rows(cfgs: dict[str, ModelConfig]) -> list[list[str]]:
    """Per model and card count: weights and one token's KV per card, and what a 24 / 80 GiB card holds."""
    rows = []
    for cfg in cfgs.values():
        for tp in CARD_COUNTS:
            held = [f"{fmt_int(kv_tokens_left(cfg, tp, gib))} token" if fits(L.weight_bytes_per_card(cfg, tp), gib)
                    else "放不下" for gib in CARDS]
            rows.append([cfg.name, tp, f"{L.weight_bytes_per_card(cfg, tp) / GiB:.1f} GiB",
                         f"{L.kv_bytes_per_token_per_card(cfg, tp) / KiB:.0f} KiB", *held])
    return rows


def allreduce_rows(cfgs: dict[str, ModelConfig], batch: int = BATCH) -> list[list[str]]:
    """Per model: all-reduces per token, one message's bytes, each card's ring bytes and the α–β time
    of one all-reduce on each example link, at 2 and 8 cards."""
    rows = []
    for cfg in cfgs.values():
        nbytes = L.allreduce_message_bytes(cfg, batch)
        for tp in (2, 8):
            rows.append([cfg.name, tp, L.allreduces_per_token(cfg), f"{nbytes / KiB:.0f} KiB",
                         f"{L.ring_bytes_per_card(nbytes, tp) / KiB:.1f} KiB",
                         *[f"{link.seconds(nbytes, tp) * 1e6:.1f} µs（α 占 {link.latency_share(nbytes, tp):.0%}）"
                           for link in LINKS.values()]])
    return rows


def decode(cfg: ModelConfig, tp: int, link: AllReduceCost, gpu, batch: int = BATCH, ctx: int = CTX):
    """``estimate.tensor_parallel_decode`` on ``gpu``'s bf16 ceilings."""
    return L.tensor_parallel_decode(cfg, tp, batch, ctx, gpu.bf16_flops, gpu.bandwidth, link)


def decode_rows(cfg: ModelConfig, gpu, batch: int = BATCH, ctx: int = CTX) -> list[list[str]]:
    """Per card count: each card's floor, then per link the all-reduces' time and the step's tok/s."""
    from minillm.lab.report import floor_words

    rows = []
    for tp in CARD_COUNTS:
        steps = [decode(cfg, tp, link, gpu, batch, ctx) for link in LINKS.values()]
        rows.append([tp, floor_words(steps[0].floor),
                     *[x for s in steps for x in (f"{s.allreduce_seconds * 1e3:.2f} ms", f"{s.tokens_per_s:,.0f}")]])
    return rows


def last_paying(cfg: ModelConfig, link: AllReduceCost, gpu, batch: int = BATCH, ctx: int = CTX) -> int:
    """The largest card count of ``CARD_COUNTS`` up to which every doubling still shortens the step."""
    best = CARD_COUNTS[0]
    for tp in CARD_COUNTS[1:]:
        if decode(cfg, tp, link, gpu, batch, ctx).seconds >= decode(cfg, best, link, gpu, batch, ctx).seconds:
            break
        best = tp
    return best


def plot_speedup(ax, cfgs: dict[str, ModelConfig], gpu, batch: int = BATCH, ctx: int = CTX) -> None:
    """Tokens per second of one request against the card count, per model and example link."""
    for (name, cfg), color in zip(cfgs.items(), ("C0", "C1"), strict=True):
        for (link_name, link), style in zip(LINKS.items(), ("-", "--"), strict=True):
            ax.plot(CARD_COUNTS, [decode(cfg, tp, link, gpu, batch, ctx).tokens_per_s for tp in CARD_COUNTS],
                    style, marker="o", color=color, label=f"{name}，{link_name}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(CARD_COUNTS, [str(n) for n in CARD_COUNTS])
    ax.set_xlabel("卡数")
    ax.set_ylabel("每秒 token（批 1，估算）")
    ax.legend(fontsize=8)


# --- The lab: tp=1 against tp=2 on this machine -----------------------------------------------------

LAB_MODEL = ModelConfig(name="tp-lab（4 层，H=512）", model_type="llama", vocab_size=4096, hidden_size=512,
                        intermediate_size=1536, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64,
                        max_position_embeddings=2048,
                        torch_dtype="float32")
LAB_BATCH, LAB_PROMPT, LAB_TOKENS = 4, 16, 32
SWEEP_BYTES = (2 * KiB, 16 * KiB, 128 * KiB, 1024 * KiB)
SWEEP_REPEATS = 30


@dataclass(frozen=True)
class EngineRun:
    """One timed run of the engine: ``steps`` steps of ``batch`` requests, their mean time, and what
    rank 0's all-reduces took of it (``timed_collectives``)."""

    tp: int
    batch: int
    steps: int
    step_seconds: float  # mean over the run's steps
    allreduce_calls: int
    allreduce_seconds: float  # all of the run's

    @property
    def allreduces_per_step(self) -> float:
        return self.allreduce_calls / self.steps

    @property
    def allreduce_per_step(self) -> float:
        return self.allreduce_seconds / self.steps

    @property
    def allreduce_share(self) -> float:
        return self.allreduce_per_step / self.step_seconds


def lab_device(device: str = "cpu") -> torch.device:
    """Where the lab's ranks run: ``"cpu"`` (gloo processes) or ``"cuda"`` (one GPU per rank, NCCL),
    refused with a clear error when this machine has fewer than two GPUs."""
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        raise ValueError(f"the NCCL runs need two GPUs, this machine has {torch.cuda.device_count()}; use device='cpu'")
    return torch.device("cuda", 0) if device.type == "cuda" else device


def run_engine(tp: int, cfg: ModelConfig = LAB_MODEL, batch: int = LAB_BATCH, prompt: int = LAB_PROMPT,
               tokens: int = LAB_TOKENS, device: str = "cpu") -> EngineRun:
    """Run ``batch`` requests of ``prompt`` tokens for ``tokens`` tokens each on ``tp`` ranks in float32
    (gloo processes on the CPU, one GPU each on ``"cuda"``), once to warm up and once timed."""
    from minillm import LLM, SamplingParams
    from minillm.engine.parallel import timed_collectives

    device = lab_device(device)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(prompt)] for i in range(batch)]
    with LLM(cfg, weights="random", device=device, dtype=torch.float32, tensor_parallel_size=tp,
             num_kv_blocks=64, block_size=16) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        with timed_collectives() as clock:
            llm.generate(prompts, params, use_tqdm=False)
        steps = llm.stats()["steps"]
    busy = sum(s["end"] - s["start"] for s in steps)
    return EngineRun(tp, batch, len(steps), busy / len(steps), clock.calls.get("all_reduce", 0),
                     clock.seconds.get("all_reduce", 0.0))


def model_rows(cfg: ModelConfig = LAB_MODEL) -> list[list[str]]:
    """The lab model's shape and what each of one or two ranks holds (float32)."""
    return [[tp, cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp), cfg.intermediate_size // tp,
             f"{L.weight_bytes_per_card(cfg, tp, 'float32') / 2**20:.1f} MiB"] for tp in (1, 2)]


MODEL_HEADER = ["进程数 tp", "每个进程的注意力头", "KV 头", "MLP 宽度", "每个进程的权重"]
ENGINE_HEADER = ["tp", "步数", "平均一步", "每步 all-reduce 次数", "每次的消息", "每步 all-reduce 的时间（rank 0）", "占一步"]
SWEEP_HEADER = ["消息大小", "一次 all-reduce（实测中位数）", "α + 字节 / β（拟合）"]


def engine_rows(runs: dict[int, EngineRun], cfg: ModelConfig = LAB_MODEL) -> list[list[str]]:
    """One row per run, its times formatted as the page quotes them."""
    from minillm.lab.notebook import ms

    return [[r.tp, r.steps, ms(r.step_seconds), f"{r.allreduces_per_step:.0f}",
             f"{L.allreduce_message_bytes(cfg, r.batch, 'float32') / KiB:.0f} KiB" if r.tp > 1 else "—",
             ms(r.allreduce_per_step) if r.tp > 1 else "—", f"{r.allreduce_share:.0%}"]
            for r in runs.values()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sweep_rank(rank: int, port: int, sizes: tuple[int, ...], repeats: int, device_type: str, results) -> None:
    """One of two processes (gloo on the CPU, NCCL on GPU ``rank``): all-reduce float32 messages of each
    size ``repeats`` times; rank 0 puts each size's median seconds on ``results``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    try:
        medians = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, device=device)
            dist.all_reduce(x)  # warm up this size's buffers
            samples = []
            for _ in range(repeats):
                dist.barrier()
                sync()
                start = time.perf_counter()
                dist.all_reduce(x)
                sync()
                samples.append(time.perf_counter() - start)
            medians.append(statistics.median(samples))
        if rank == 0:
            results.put(medians)
    finally:
        dist.destroy_process_group()


def allreduce_sweep(sizes: tuple[int, ...] = SWEEP_BYTES, repeats: int = SWEEP_REPEATS,
                    device: str = "cpu") -> dict[int, float]:
    """Median seconds of one all-reduce of each message size (bytes) between two processes: gloo on
    the CPU, NCCL between two GPUs on ``"cuda"``."""
    import torch.multiprocessing as mp

    if len(sizes) < 2 or any(n < 4 or n % 4 for n in sizes):
        raise ValueError(f"need two or more sizes, each a positive multiple of 4 bytes; got {sizes}")
    device_type = lab_device(device).type
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_sweep_rank, args=(rank, port, sizes, repeats, device_type, results))
             for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        medians = results.get(timeout=120)
    finally:
        for p in ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return dict(zip(sizes, medians, strict=True))


def fit_link(points: dict[int, float], tp: int = 2) -> AllReduceCost:
    """α and β of ``latency + ring bytes / bandwidth`` fitted to measured all-reduces, each point's
    error relative to its own time (least squares weighted by 1/t², so the small messages count as
    much as the large ones)."""
    xs, ts = [L.ring_bytes_per_card(n, tp) for n in points], list(points.values())
    w = [1 / t**2 for t in ts]
    sw, sx, sxx = sum(w), sum(a * x for a, x in zip(w, xs)), sum(a * x * x for a, x in zip(w, xs))
    st, sxt = sum(a * t for a, t in zip(w, ts)), sum(a * x * t for a, x, t in zip(w, xs, ts))
    slope = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    if slope <= 0:
        raise ValueError(f"all-reduce time does not grow with the message: {points}")
    return AllReduceCost(latency=max((st - slope * sx) / sw, 0.0), bandwidth=1 / slope)


def sweep_rows(points: dict[int, float], link: AllReduceCost) -> list[list[str]]:
    return [[f"{n / KiB:,.0f} KiB", f"{t * 1e6:,.0f} µs", f"{link.seconds(n, 2) * 1e6:,.0f} µs"]
            for n, t in points.items()]


def plot_sweep(ax, points: dict[int, float], link: AllReduceCost) -> None:
    """Measured all-reduce times against the message size, and the fitted α + bytes/β."""
    sizes = list(points)
    ax.plot([n / KiB for n in sizes], [t * 1e6 for t in points.values()], "o", label="实测（中位数）")
    grid = [sizes[0] * (sizes[-1] / sizes[0]) ** (i / 40) for i in range(41)]
    ax.plot([n / KiB for n in grid], [link.seconds(n, 2) * 1e6 for n in grid], "-",
            label=f"拟合：α = {link.latency * 1e6:.0f} µs，β = {link.bandwidth / 1e9:.2f} GB/s")
    ax.axhline(link.latency * 1e6, ls=":", color="gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("消息大小（KiB）")
    ax.set_ylabel("一次 all-reduce（µs）")
    ax.legend(fontsize=8)


def estimated_allreduce_per_step(run: EngineRun, link: AllReduceCost, cfg: ModelConfig = LAB_MODEL) -> float:
    """The α–β time of a step's all-reduces (as many as the run made per step, of its decode message)."""
    return run.allreduces_per_step * link.seconds(L.allreduce_message_bytes(cfg, run.batch, "float32"), run.tp)


def comparison(r: dict):
    """The lab's closing table: the α–β estimate beside what the engine measured."""
    from minillm.lab.notebook import ms
    from minillm.lab.report import comparison_table

    one, two, link = r["runs"][1], r["runs"][2], r["link"]
    estimate = estimated_allreduce_per_step(two, link)
    comparison_table([  # formatted as the page quotes them (glue_chapter)
        ("tp=2 一步里 all-reduce 的时间", f"{ms(estimate)}（α–β）", ms(two.allreduce_per_step), None),
        ("tp=2 一步里 all-reduce 的占比", f"{estimate / two.step_seconds:.0%}", f"{two.allreduce_share:.0%}", None),
        ("tp=2 ÷ tp=1 的一步", "—", f"{two.step_seconds / one.step_seconds:.2f}", None),
    ])


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab (``r``: the lab's results)."""
    from minillm.lab.claims import choose, claim
    from minillm.lab.hardware import describe_device
    from minillm.lab.notebook import g, ms

    lab, runs, points, link = r["lab"], r["runs"], r["points"], r["link"]
    one, two = runs[1], runs[2]
    cfg = LAB_MODEL
    g("lab_device", describe_device(torch.device("cpu")).name)  # the runs glued are the CPU's (gloo)
    g("lab_layers", str(cfg.num_layers))
    g("lab_hidden", str(cfg.hidden_size))
    g("lab_batch", str(LAB_BATCH))
    g("lab_tokens", str(LAB_TOKENS))
    g("lab_message", f"{L.allreduce_message_bytes(cfg, LAB_BATCH, 'float32') / KiB:.0f} KiB")
    g("lab_calls", f"{two.allreduces_per_step:.0f}")
    claim(two.allreduces_per_step == 2 * cfg.num_layers + 1, "a step makes two all-reduces per layer and one for the embedding",
          per_step=two.allreduces_per_step)
    g("lab_tp1_ms", ms(one.step_seconds))
    g("lab_tp2_ms", ms(two.step_seconds))
    ratio = two.step_seconds / one.step_seconds
    g("lab_ratio", f"{ratio:.2f}")
    g("lab_share", f"{two.allreduce_share:.0%}")
    g("lab_ar_step_ms", ms(two.allreduce_per_step))
    g("lab_ar_call_us", f"{two.allreduce_seconds / two.allreduce_calls * 1e6:,.0f} µs")
    g("lab_faster", choose(ratio < 1,
                           "在这台机器上，两个进程的一步比一个进程的快：每个进程只算一半的矩阵乘，省下的时间多于 all-reduce 花掉的。",
                           "在这台机器上，两个进程的一步反而比一个进程的慢：每个进程省下的一半矩阵乘，不够抵 all-reduce 花掉的时间。"))
    g("lab_cpus", str(os.cpu_count()))
    claim(L.allreduce_message_bytes(cfg, LAB_BATCH, "float32") == L.allreduce_message_bytes(load_config(MODELS[0])),
          "the lab's message is as large as Llama-3.1-8B's at batch 1 in bf16")
    g("lab_alpha", f"{link.latency * 1e6:,.0f} µs")
    nvlink = LINKS["NVLink 类"].latency
    claim(link.latency > 5 * nvlink, "gloo's alpha here is far above the NVLink-like example's", alpha=link.latency)
    g("lab_alpha_x", f"{link.latency / nvlink:,.0f}")
    g("lab_beta", f"{link.bandwidth / 1e9:,.2f} GB/s")
    g("lab_sweep_lo", f"{min(points) / KiB:,.0f} KiB")
    g("lab_sweep_hi", f"{max(points) / KiB:,.0f} KiB")
    small = min(points)
    g("lab_small_alpha_share", f"{link.latency_share(small, 2):.1%}")
    estimate = estimated_allreduce_per_step(two, link)
    g("lab_est_step_ms", ms(estimate))
    g("lab_est_share", f"{estimate / two.step_seconds:.0%}")
    g("lab_est_x", f"{two.allreduce_per_step / estimate:.1f}")
    g("lab_est_vs_measured", est_vs_measured(two.allreduce_per_step, estimate))
    g("lab_latency_bound", choose(
        link.latency_share(L.allreduce_message_bytes(cfg, LAB_BATCH, "float32"), 2) > 0.5,
        "按这次拟合的 α 和 β，实验里那种大小的消息，一次 all-reduce 的一大半是 α：和 GPU 上一样，卡住它的是每次调用的固定开销，不是带宽。",
        "按这次拟合的 α 和 β，实验里那种大小的消息，一次 all-reduce 的时间已经主要花在搬字节上。"))


def est_vs_measured(measured: float, estimate: float) -> str:
    """The engine's all-reduce time per step against the α–β estimate, as one whole sentence: far
    longer, far shorter (over 1.5 times either way), or close."""
    if measured > 1.5 * estimate:
        return ("引擎里量到的 all-reduce 时间比 α–β 估算的长得多：估算只算消息本身；引擎里 rank 0 每次还要等 rank 1 "
                "算完它那一半才能开始交换，两个进程又在抢同几颗核。")
    if measured < estimate / 1.5:
        return ("引擎里量到的 all-reduce 时间比 α–β 估算的还短得多：α 和 β 是从单独计时的扫描里拟合的，"
                "引擎里一次接一次的调用，每次付的开销比扫描量到的小，估算在这台机器上偏保守。")
    return "引擎里量到的 all-reduce 时间和 α–β 估算相差不到一半：在这台机器上，一次 all-reduce 的时间几乎就是消息本身的时间。"
