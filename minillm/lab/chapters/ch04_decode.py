"""The plumbing of the lab 解码一步要多久 (chapter 4, ``notebooks/ch04-decode.ipynb``), and the
ledger of its page.

:func:`page_numbers` is the page's arithmetic for Llama-3.1-8B in bf16 on the spec cards. The lab's
helpers time decode steps of the lab's model over batch sizes (and contexts) on this machine, time
its linear layers alone at the same rows, set every step against the one floor max(F/P, M/W) with
the ceiling that binds, time the sampler, and glue what the page quotes from the lab.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass, field

import torch

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.claims import choose, claim, floors_beaten
from minillm.lab.estimate import GB, GiB, KiB, MiB, fmt_int
from minillm.lab.gpus import lookup_gpu
from minillm.lab.report import beaten_words, floor_words, linear_beat_words, show_table

MODEL, CARD, CTX, UTIL = "llama-3.1-8b", "H100 SXM", 1024, 0.92
CARDS = ("A100 80GB SXM", "H100 SXM", "H200", "RTX 4090", "A10", "L4")
BATCHES_CPU, BATCHES_GPU = (1, 2, 4, 8, 16, 32), (1, 8, 32, 64, 128)
CTX_CPU, CTX_GPU = 128, 1024
CONTEXTS_CPU, CONTEXTS_GPU = (128, 512, 2048), (1024, 4096, 8192)
STEPS, ROUNDS = 3, 2  # timed steps per round; rounds over the sweep, so a busy machine slows every point alike


@functools.cache
def _cfg():
    return load_config(MODEL)


def ms(seconds: float) -> str:
    """``12.34 ms``: decode steps are short, two decimals."""
    return f"{seconds * 1e3:,.2f} ms"


def card_step(cfg, batch: int, ctx: int, spec, **kw) -> L.Floor:
    """A decode step on a spec card (datasheet bf16 rate and bandwidth)."""
    return L.decode_step(cfg, batch, ctx, spec.bandwidth, **kw).floor(spec.bf16_flops)


def intensity_limit(cfg, ctx: int) -> float:
    """The step's intensity as the batch grows without bound at context ``ctx``: the weights no
    longer count, every request's FLOPs over its own KV bytes."""
    return (L.matmul_flops_per_token(cfg) + L.attention_flops_per_token(cfg, ctx)) / L.kv_bytes(cfg, ctx)


def always_bandwidth_bound_from(cfg, ridge: float) -> float:
    """The context above which no batch makes the step compute-bound on a card of ``ridge``."""
    kv = L.kv_bytes_per_token(cfg)
    return L.matmul_flops_per_token(cfg) / kv / (ridge - L.attention_flops_per_token(cfg, 1) / kv)


def max_batch(cfg, spec, ctx: int = CTX) -> int:
    """Whole requests of ``ctx`` tokens whose KV fits the card at ``UTIL`` (chapter 2's budget)."""
    return L.memory_budget(cfg, spec.memory_bytes, UTIL).concurrent_requests(ctx)


def page_numbers() -> dict[str, str]:
    """Every number of the chapter page, formatted once."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    one = card_step(cfg, 1, CTX, h100)
    claim(one.bound == "memory", "H100 上 8B 的 B=1 解码受带宽限制", bound=one.bound)
    w = L.weight_bytes(cfg)
    v = {"card": h100.name, "card_pflops": f"{h100.bf16_flops / 1e15:.2f}", "card_bw": f"{h100.bandwidth_gb_s:,.0f} GB/s",
         "card_ridge": f"{h100.ridge_point:.0f}", "ctx": fmt_int(CTX),
         "step_gflop": f"{one.flops / 1e9:.1f}", "step_compute": f"{one.compute_seconds * 1e6:.1f} µs",
         "step_gb": f"{one.bytes / GB:.2f} GB", "step_floor": floor_words(one),
         "step_ratio": fmt_int(one.memory_seconds / one.compute_seconds),
         "step_tok": fmt_int(1 / one.seconds), "l4_floor": floor_words(card_step(cfg, 1, CTX, lookup_gpu("L4"))),
         "a100_floor": floor_words(card_step(cfg, 1, CTX, lookup_gpu("A100 80GB SXM"))),
         "w_gb": f"{w / GB:.2f} GB", "layers": str(cfg.num_layers), "vocab": fmt_int(cfg.vocab_size),
         "matmul_gflop": f"{L.matmul_flops_per_token(cfg) / 1e9:.2f}",
         "kv_per_token_kib": f"{L.kv_bytes_per_token(cfg) / KiB:.0f} KiB",
         "kv_req_mib": f"{L.kv_bytes(cfg, CTX) / MiB:.0f} MiB",
         "weight_intensity": f"{L.matmul_flops_per_token(cfg) / w:.2f}",
         "kv_intensity": f"{L.decode_step(cfg, 1, CTX, h100.bandwidth).kv_intensity:.0f}",
         "n_h": str(cfg.num_heads), "n_kv": str(cfg.num_kv_heads), "gqa_ratio": str(cfg.gqa_ratio),
         "c_cross": fmt_int(always_bandwidth_bound_from(cfg, h100.ridge_point))}
    for c in (1024, 8192):
        v[f"int_limit_{c}"] = f"{intensity_limit(cfg, c):.0f}"
        claim(intensity_limit(cfg, c) < h100.ridge_point, "8B 的解码在 H100 上批再大也受带宽限制", ctx=c)
    # Chapter 2's made-up card of 1 TB/s: the step grows little with the batch, the throughput a lot
    from minillm.lab.chapters.ch02_ledger import decode_floors

    for b, (est, f) in decode_floors(cfg).items():
        v[f"tb_floor_{b}"], v[f"tb_gb_{b}"], v[f"tb_tok_{b}"] = floor_words(f), f"{est.bytes / GB:.2f} GB", fmt_int(b / f.seconds)
    # The 24 GiB and 80 GiB cards at their largest batch
    rtx = lookup_gpu("RTX 4090")
    b24, b80 = max_batch(cfg, rtx), max_batch(cfg, h100)
    full24, full80 = card_step(cfg, b24, CTX, rtx), card_step(cfg, b80, CTX, h100)
    s24, s80 = L.decode_step(cfg, b24, CTX, rtx.bandwidth), L.decode_step(cfg, b80, CTX, h100.bandwidth)
    v.update({"b24": str(b24), "b24_next": str(b24 + 1),
              "conc24": f"{L.memory_budget(cfg, '24GiB', UTIL).requests_at(CTX):.1f}",
              "rtx_floor_1": floor_words(card_step(cfg, 1, CTX, rtx)), "rtx_floor_max": floor_words(full24),
              "rtx_growth": f"{full24.seconds / card_step(cfg, 1, CTX, rtx).seconds:.2f}",
              "rtx_agg_max": fmt_int(b24 / full24.seconds), "rtx_kv_share": f"{s24.kv_read_bytes / s24.bytes:.0%}",
              "b80": str(b80), "h100_kv_share": f"{s80.kv_read_bytes / s80.bytes:.0%}",
              "h100_int_max": f"{full80.intensity:.0f}", "h100_floor_max": floor_words(full80)})
    claim(all(card_step(cfg, b, CTX, lookup_gpu(n)).bound == "memory" for n in CARDS
              for b in (1, max_batch(cfg, lookup_gpu(n)))), "表里每张卡上，B=1 和最大批的解码都受带宽限制")
    # Exercise 1: a 30 ms TPOT at 4K on the H100
    C, TPOT = 4096, 0.030
    b_bw = int((TPOT * h100.bandwidth - w) // L.kv_bytes(cfg, C))
    b_mem = L.memory_budget(cfg, h100.memory_bytes, UTIL).concurrent_requests(C)
    claim(card_step(cfg, b_bw, C, h100).bound == "memory", "30 ms 的那一批仍受带宽限制", batch=b_bw)
    ex1 = card_step(cfg, min(b_bw, b_mem), C, h100)
    v.update({"ex1_kv_gib": f"{L.kv_bytes(cfg, C) / GiB:.1f} GiB", "ex1_b_bw": str(b_bw), "ex1_b_mem": str(b_mem),
              "ex1_floor": floor_words(ex1), "ex1_agg": fmt_int(min(b_bw, b_mem) / ex1.seconds)})
    v["ex1_wall"] = choose(b_mem < b_bw, "先撞上的是容量墙，而不是延迟要求",
                           "先卡住的是延迟要求：显存还放得下更多，带宽先不够了")
    # Exercise 2: no GQA at B = 32, c = 4096
    mha = cfg.replace(num_kv_heads=cfg.num_heads)
    gqa_s, mha_s = (L.decode_step(c, 32, 4096, h100.bandwidth) for c in (cfg, mha))
    gqa_f, mha_f = (s.floor(h100.bf16_flops) for s in (gqa_s, mha_s))
    v.update({"ex2_gqa": floor_words(gqa_f), "ex2_mha": floor_words(mha_f), "ex2_ratio": f"{mha_f.seconds / gqa_f.seconds:.1f}",
              "ex2_kv_gqa": f"{gqa_s.kv_read_bytes / gqa_s.bytes:.0%}", "ex2_kv_mha": f"{mha_s.kv_read_bytes / mha_s.bytes:.0%}",
              "ex2_int_mha": f"{mha_s.kv_intensity:.0f}"})
    # Exercise 3: fp8 weights, bf16 KV
    for b in (1, 64):
        bf16, fp8 = card_step(cfg, b, 4096, h100), card_step(cfg, b, 4096, h100, dtype="fp8", kv_dtype="bf16")
        claim(bf16.bound == fp8.bound == "memory", "fp8 权重的解码仍受带宽限制", batch=b)
        v[f"ex3_bf16_{b}"], v[f"ex3_fp8_{b}"] = floor_words(bf16), floor_words(fp8)
        v[f"ex3_speedup_{b}"] = f"{bf16.seconds / fp8.seconds:.2f}"
    return v


def card_rows() -> list[list]:
    """Llama-3.1-8B at context ``CTX`` on each card: B = 1 and the largest batch that fits."""
    cfg, rows = _cfg(), []
    for name in CARDS:
        spec = lookup_gpu(name)
        one, b = card_step(cfg, 1, CTX, spec), max_batch(cfg, spec)
        full = card_step(cfg, b, CTX, spec)
        rows.append([spec.name, f"{spec.memory_gib:g} GiB", f"{spec.bandwidth_gb_s:,.0f} GB/s", floor_words(one),
                     fmt_int(1 / one.seconds), b, floor_words(full), fmt_int(b / full.seconds), f"{1 / full.seconds:.1f}"])
    return rows


def plot_batches(ax_t, ax_q) -> None:
    """The H100 decode floor against the batch at three contexts, and the tok/s bounds."""
    import numpy as np

    from minillm.lab.plotting import PALETTE

    cfg, h100 = _cfg(), lookup_gpu(CARD)
    batches = 2 ** np.arange(0, 10)
    budget = L.memory_budget(cfg, h100.memory_bytes, UTIL)
    for c, color in zip((1024, 4096, 8192), (PALETTE[0], PALETTE[2], PALETTE[5])):
        floors = [card_step(cfg, int(b), c, h100) for b in batches]
        ax_t.plot(batches, [f.seconds * 1e3 for f in floors], "o-", ms=3, color=color, label=f"c = {c:,}")
        ax_q.plot(batches, [b / f.seconds for b, f in zip(batches, floors)], "o-", ms=3, color=color, label=f"总吞吐，c = {c:,}")
        ax_q.plot(batches, [1 / f.seconds for f in floors], ":", color=color)
        for ax in (ax_t, ax_q):
            ax.axvline(budget.requests_at(c), color=color, lw=0.8, ls="--")
    for ax in (ax_t, ax_q):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("批大小 B")
    ax_t.set_ylabel("每步的下界（ms）")
    ax_t.legend()
    ax_q.set_ylabel("tok/s 上界（实线总吞吐，点线单请求）")
    ax_q.legend()


def toy_sampling_rows(draws: int = 4000) -> tuple[list[list], dict[str, str]]:
    """A six-word toy distribution drawn ``draws`` times under five settings: the share of each
    token, and the words of the page about top-p."""
    from minillm.engine.sampling import SamplingParams, sample

    toy = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    settings = [("贪心", SamplingParams(temperature=0.0)), ("T=1", SamplingParams()),
                ("T=0.5", SamplingParams(temperature=0.5)), ("T=1，top_k=2", SamplingParams(top_k=2)),
                ("T=1，top_p=0.8", SamplingParams(top_p=0.8))]
    generator = torch.Generator().manual_seed(0)
    shares = {name: torch.bincount(sample(toy.expand(draws, -1).clone(), [p] * draws, [generator] * draws),
                                   minlength=toy.shape[1]) / draws for name, p in settings}
    probs = toy.softmax(-1)[0]
    kept = int((shares["T=1，top_p=0.8"] > 0).sum())
    rows = [[i, f"{toy[0, i]:g}", f"{probs[i]:.3f}", *[f"{shares[n][i]:.3f}" for n, _ in settings]]
            for i in range(toy.shape[1])]
    header = ["token", "打分", "概率（T=1）", *[f"抽中比例：{n}" for n, _ in settings]]
    return [header, *rows], {"draws": fmt_int(draws), "top_p_kept": str(kept),
                             "top_p_mass": f"{probs[:kept].sum():.2f}", "top_p_mass_before": f"{probs[:kept - 1].sum():.2f}"}


# --- The lab --------------------------------------------------------------------------------------

def sweep_points(lab) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """(batches, context, contexts) the lab runs here: on a GPU only those whose KV fits the free
    memory with room to spare (the guard says so in Chinese when it drops a point)."""
    from minillm.lab.notebook import enough_gpu_memory

    if not lab.on_gpu:
        return BATCHES_CPU, CTX_CPU, CONTEXTS_CPU
    kv = lambda b, c: 1.5 * L.kv_bytes(lab.config, b * c, lab.dtype_name)
    batches = tuple(b for b in BATCHES_GPU if enough_gpu_memory(lab.device, kv(b, CTX_GPU)))
    contexts = tuple(c for c in CONTEXTS_GPU if enough_gpu_memory(lab.device, kv(context_batch(batches), c)))
    return batches, CTX_GPU, contexts


def context_batch(batches) -> int:
    """The batch of the context sweep: one below the middle of the batch sweep."""
    return batches[max(0, len(batches) // 2 - 1)]


def linear_seconds(model, rows: int, steps: int = STEPS) -> list[float]:
    """Seconds of the model's linear layers alone on ``rows`` random rows, the output layer on
    every row (in a decode step every request needs its logits)."""
    from minillm.lab.bench import time_linear_layers

    return time_linear_layers(model, rows, steps, every_row_logits=True)


@dataclass
class DecodeSweep:
    """Decode steps on this machine, the fastest sample per (batch, context), with the ledger:
    ``step`` the whole step, ``linear`` the linear layers alone (batch sweep only)."""

    cfg: object
    dtype: str
    peak_flops: float
    bandwidth: float
    step: dict[tuple[int, int], float] = field(default_factory=dict)
    linear: dict[int, float] = field(default_factory=dict)

    def estimate(self, batch: int, ctx: int) -> L.DecodeEstimate:
        return L.decode_step(self.cfg, batch, ctx, self.bandwidth, self.dtype)

    def floor(self, batch: int, ctx: int) -> L.Floor:
        return self.estimate(batch, ctx).floor(self.peak_flops)

    def mbu(self, batch: int, ctx: int) -> float:
        """Bytes the ledger says the step moves, per measured second, over the probed bandwidth."""
        return self.estimate(batch, ctx).bytes / self.step[batch, ctx] / self.bandwidth

    def mfu(self, batch: int, ctx: int) -> float:
        return self.estimate(batch, ctx).flops / self.step[batch, ctx] / self.peak_flops

    def linear_rate(self, batch: int) -> float:
        """FLOP/s of the linear layers alone at ``batch`` rows."""
        return batch * L.matmul_flops_per_token(self.cfg) / self.linear[batch]

    def linear_read(self, batch: int) -> float:
        """Bytes/s at which the linear layers alone read their weights at ``batch`` rows."""
        return L.matmul_param_count(self.cfg) * L.dtype_bytes(self.dtype) / self.linear[batch]

    def why(self, batch: int, ctx: int) -> str | None:
        """Why the step at (``batch``, ``ctx``) beat its floor, from the linear layers timed alone
        at ``batch`` rows; None when it did not, or nothing explains it."""
        return linear_beat_words(self.step[batch, ctx], self.floor(batch, ctx), self.linear_rate(batch),
                                 self.linear_read(batch), f"B = {batch}、c = {fmt_int(ctx)} 时")

    def points(self, ctx: int) -> list[int]:
        return sorted(b for b, c in self.step if c == ctx)


def decode_sweep(model, batches, ctx: int, contexts, peak_flops: float, bandwidth: float,
                 steps: int = STEPS, rounds: int = ROUNDS) -> DecodeSweep:
    """Time a decode step (``bench.time_decode_step``, the benchmark's function) of each batch at
    ``ctx`` beside the linear layers alone at as many rows, and of the middle batch at each of
    ``contexts``; ``rounds`` passes over all points, the fastest sample kept."""
    from minillm.lab.bench import time_decode_step

    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    points = [(b, ctx) for b in batches] + [(context_batch(batches), c) for c in contexts if c != ctx]
    step, linear = {p: [] for p in points}, {b: [] for b in batches}
    for _ in range(rounds):
        for b, c in points:
            step[b, c] += time_decode_step(model, b, c, steps)
            if c == ctx:
                linear[b] += linear_seconds(model, b, steps)
    return DecodeSweep(model.config, dtype, peak_flops, bandwidth, {p: min(t) for p, t in step.items()},
                       {b: min(t) for b, t in linear.items()})


def show_sides(cfg, dtype, P, W, batches, ctx) -> None:
    """The ledger of each batch's step on this machine, and the ceiling that binds."""
    show_table(["B", "运算 F", "字节 M", "强度 F/M", "F/P", "M/W", "下界"], [
        [b, f"{f.flops / 1e9:,.2f} GFLOP", L.fmt_bytes(f.bytes), f"{f.intensity:,.2f}",
         ms(f.compute_seconds), ms(f.memory_seconds), floor_words(f)]
        for b in batches for f in [L.decode_step(cfg, b, ctx, W, dtype).floor(P)]])


def show_steps(s: DecodeSweep, ctx: int) -> None:
    """Each batch's measured step against its floor: the share, MBU and MFU, and the tok/s."""
    show_table(["B", "实测每步", "下界", "下界 ÷ 实测", "MBU（带宽利用）", "MFU（算力利用）", "总吞吐", "单请求"], [
        [b, ms(t), floor_words(s.floor(b, ctx)), f"{s.floor(b, ctx).share_of(t):.0%}", f"{s.mbu(b, ctx):.0%}",
         f"{s.mfu(b, ctx):.0%}", f"{b / t:,.1f} tok/s", f"{1 / t:,.1f} tok/s"]
        for b in s.points(ctx) for t in [s.step[b, ctx]]])


def show_linear(s: DecodeSweep, ctx: int) -> None:
    """The linear layers alone at each batch: the rest of the step, and on the side that binds,
    their weight-read speed (bandwidth) or their FLOP/s (compute) against the probe."""
    from minillm.lab.notebook import remainder

    rows = []
    for b in sorted(s.linear):
        f = s.floor(b, ctx)
        side = ([f"读权重 {s.linear_read(b) / GB:,.1f} GB/s", f"{s.linear_read(b) / s.bandwidth:.0%}（÷ W）"]
                if f.bound == "memory" else
                [f"{s.linear_rate(b) / 1e9:,.1f} GFLOP/s", f"{s.linear_rate(b) / s.peak_flops:.0%}（÷ P）"])
        rows.append([b, BOUND_SIDE[f.bound], ms(s.step[b, ctx]), ms(s.linear[b]),
                     remainder(s.step[b, ctx], s.linear[b], 2), *side])
    show_table(["B", "这一侧", "整步", "线性层单独跑", "其余（注意力、归一化、Python）", "线性层的速度", "占探测值"], rows)


BOUND_SIDE = {"memory": "带宽", "compute": "算力"}


def show_contexts(s: DecodeSweep, batch: int) -> None:
    """The middle batch at each context: the KV bytes, the floor and the measured step."""
    show_table(["上下文 c", "KV 占字节", "下界", "实测每步", "下界 ÷ 实测"], [
        [fmt_int(c), f"{e.kv_read_bytes / e.bytes:.0%}", floor_words(s.floor(batch, c)), ms(s.step[batch, c]),
         f"{s.floor(batch, c).share_of(s.step[batch, c]):.0%}"]
        for (b, c) in sorted(s.step) if b == batch for e in [s.estimate(b, c)]])


def plot_steps(ax_t, ax_q, s: DecodeSweep, ctx: int) -> None:
    """Measured step times against the floor and its two terms (left), tok/s (right)."""
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    batches = s.points(ctx)
    grid = np.unique(np.geomspace(batches[0], batches[-1], 60).round().astype(int))
    floors = [s.floor(int(b), ctx) for b in grid]
    est, meas = ROLE_COLORS["estimate"], ROLE_COLORS["measured"]
    ax_t.plot(grid, [f.seconds * 1e3 for f in floors], color=est, lw=2, label="下界 max(F/P, M/W)")
    ax_t.plot(grid, [f.memory_seconds * 1e3 for f in floors], ":", color=est, label="M / W")
    ax_t.plot(grid, [f.compute_seconds * 1e3 for f in floors], "--", color=est, label="F / P")
    ax_t.plot(batches, [s.step[b, ctx] * 1e3 for b in batches], "o-", color=meas, label="实测")
    ax_t.set_ylabel("一个解码步（ms）")
    ax_q.plot(grid, [b / f.seconds for b, f in zip(grid, floors)], color=est, lw=2, label="总吞吐上界")
    ax_q.plot(batches, [b / s.step[b, ctx] for b in batches], "o-", color=meas, label="总吞吐实测")
    ax_q.plot(batches, [1 / s.step[b, ctx] for b in batches], "s:", color=meas, label="单请求实测")
    ax_q.set_ylabel("tok/s")
    for ax in (ax_t, ax_q):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("批大小 B")
        ax.legend()


def sample_topk_first(logits, params_list, generators):
    """``sample`` for rows that all set top_k: sort only the k best of each row. Every kept token,
    the top-p cut and the inverse-CDF draw match ``sample``'s, which sorts the whole vocabulary."""
    from minillm.engine.sampling import sample

    if not all(p.temperature > 0 and p.top_k for p in params_list):
        return sample(logits, params_list, generators)
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params_list], device=device)
    scaled = logits.float() / temperature[:, None]
    k = max(p.top_k for p in params_list)
    values, order = scaled.topk(k, dim=-1)  # sorted, best first
    probs = (values - scaled.logsumexp(dim=-1, keepdim=True)).exp()  # k entries of the full softmax
    top_k = torch.tensor([p.top_k for p in params_list], device=device)
    top_p = torch.tensor([p.top_p for p in params_list], device=device)
    keep = (torch.arange(k, device=device) < top_k[:, None]) & (probs.cumsum(dim=-1) - probs < top_p[:, None])
    probs = probs * keep
    u = torch.cat([torch.rand(1, device=device, generator=g) for g in generators])
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    picks = torch.minimum(picks, keep.sum(dim=-1, keepdim=True) - 1)
    return order.gather(1, picks)[:, 0]


def time_samplers(device, rows: int, vocab: int, repeats: int = 5) -> dict[str, float | bool]:
    """Fastest seconds of greedy, of ``sample`` (whole-vocabulary sort) and of
    :func:`sample_topk_first` on ``rows`` rows of ``vocab`` logits; and whether the two samplers
    drew the same tokens from the same seeds."""
    from minillm.engine.sampling import SamplingParams, make_generator, sample
    from minillm.lab.hardware import measure_seconds

    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(device) * 3
    drawn = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(rows)]
    greedy = [SamplingParams(temperature=0.0)] * rows
    gens = lambda: [make_generator(i, device) for i in range(rows)]
    best = lambda fn: min(measure_seconds(fn, device, repeats))
    return {"greedy": best(lambda: sample(logits, greedy, [None] * rows)),
            "sort": best(lambda: sample(logits, drawn, gens())),
            "topk": best(lambda: sample_topk_first(logits, drawn, gens())),
            "same": torch.equal(sample(logits, drawn, gens()), sample_topk_first(logits, drawn, gens()))}


def show_samplers(t: dict, rows: int, vocab: int) -> None:
    show_table(["采样（{} 行 × {} 个词）".format(rows, fmt_int(vocab)), "耗时"], [
        ["贪心（argmax）", ms(t["greedy"])], ["top-k 50、top-p 0.9：整表排序（`sample`）", ms(t["sort"])],
        ["同样的设置：先取 top-k（`sample_topk_first`）", ms(t["topk"])],
        ["两者抽到的 token 一样", "是" if t["same"] else "否"]])


HOST_BATCH, HOST_CTX = 256, 1000


def time_host(device, steps: int = 20) -> dict:
    """``python -m minillm bench host`` at B = 256: the engine's own Python per decode step, the
    model's forward swapped for a no-op (no attention, no matmul), logits and sampling taken off."""
    from minillm.lab.bench_host import bench_host

    return bench_host(device, batch=HOST_BATCH, ctx=HOST_CTX, steps=steps)


def show_host(host: dict) -> None:
    launches = host["launches"]
    show_table([f"主机一侧（B = {host['batch']}，上下文约 {fmt_int(host['ctx'])}）", "每步"], [
        ["引擎自己的 Python（中位数）", ms(host["engine_median_s"])],
        ["logits 和采样（替身模型的输出上，中位数）", ms(statistics.median(host["model_seconds"]))],
        [f"{launches['model']} 的一步 eager 前向发出的 aten 算子", fmt_int(launches["per_step"])]])


def host_words(host: dict) -> dict[str, str]:
    """The host's share of an 8B decode step on an H100 at the same batch and context, if the two
    ran one after the other (as ``minillm``'s steps do)."""
    engine, floor = host["engine_median_s"], card_step(_cfg(), host["batch"], host["ctx"], lookup_gpu(CARD))
    return {"host_batch": str(host["batch"]), "host_ctx": fmt_int(host["ctx"]), "host_engine": ms(engine),
            "host_card": CARD, "host_floor": floor_words(floor), "host_share": f"{engine / (engine + floor.seconds):.0%}",
            "host_ops": fmt_int(host["launches"]["per_step"]), "host_model": host["launches"]["model"]}


def _gpu_record():
    from minillm.lab import records

    return next((r for r in records.find("decode", model=MODEL) if r.points()), None)


def show_comparison(s: DecodeSweep, ctx: int) -> None:
    """The lab's closing table: estimate | measured here | recorded on GPU."""
    from minillm.lab.notebook import recorded
    from minillm.lab.report import comparison_table

    record = _gpu_record()
    lo, hi = s.points(ctx)[0], s.points(ctx)[-1]

    def rec(batch_index):
        def text(r):
            pts = r.points()
            p = pts[0] if batch_index == 0 else pts[-1]
            return f"{min(p['seconds']) * 1e3:,.2f} ms（B = {p['batch']}，c = {fmt_int(p['ctx'])}）"
        return recorded(record, text)

    comparison_table([
        (f"B = {lo} 的一步", floor_words(s.floor(lo, ctx)), ms(s.step[lo, ctx]), rec(0)),
        (f"B = {hi} 的一步", floor_words(s.floor(hi, ctx)), ms(s.step[hi, ctx]), rec(-1)),
        (f"B = {hi} 的总吞吐", f"≤ {hi / s.floor(hi, ctx).seconds:,.1f} tok/s", f"{hi / s.step[hi, ctx]:,.1f} tok/s", None),
    ])


def sides_words(ridge: str, dtype: str, ctx: str, batches, bw, cp) -> str:
    """Which side of this machine's ridge the swept batches ``bw`` (bandwidth) and ``cp``
    (compute) fall on at context ``ctx``."""
    join = lambda bs: "、".join(map(str, bs))
    head = f"这台机器的脊点只有 {ridge} FLOP/字节，{dtype} 的权重每个参数 {L.dtype_bytes(dtype)} 字节，"
    return choose(bool(cp), choose(
        bool(bw),
        f"{head}上下文 {ctx} 时 B = {join(bw)} 的一步落在带宽一侧，B = {join(cp)} 已经落到算力一侧。",
        f"{head}上下文 {ctx} 时扫到的每个 B（{join(batches)}）都落在算力一侧，连 B = 1 也不例外。"),
        f"上下文 {ctx} 时扫到的每个 B（{join(batches)}）都落在带宽一侧。")


def growth_verdict(h_floor: float, h_meas: float) -> str:
    """How the measured step grew past the ridge (``h_meas`` times) against its floor (``h_floor``
    times): slower than 0.9 of it, within a tenth, or faster than 1.1 of it."""
    r = h_meas / h_floor
    return choose(r < 0.9, "实测涨得比下界慢：批大了，实测离下界更近，矩阵乘的效率上来了。", choose(
        r <= 1.1, "实测涨得和下界差不多（相差不到一成）：批大了，实测离下界的比例几乎不变。",
        "实测涨得比下界快：批大了，实测离下界反而更远。"))


def read_words(batch: int, weights: str, seconds: str, read: float, bandwidth: float, on_gpu: bool, threads: str) -> str:
    """The linear layers alone at ``batch`` rows reading their ``weights`` in ``seconds`` at
    ``read`` bytes/s, against the probed copy ``bandwidth``."""
    head = f"B = {batch} 时线性层单独跑，读 {weights} 的权重用了 {seconds}，读速度 {read / GB:,.1f} GB/s，"
    frac = f"{read / bandwidth:.0%}"
    return choose(read < bandwidth, choose(
        on_gpu,
        f"{head}是拷贝探测的 {frac}：几行的矩阵乘边读边算，矩阵-向量乘的 kernel 跑不满显存带宽。",
        f"{head}是拷贝探测的 {frac}：几行的矩阵乘边读边算，{threads}喂不满内存总线。"),
        f"{head}不比拷贝探测慢（{frac}）：只读不写，探测的拷贝带宽不是它的上限。")


def gap_words(read: float, bandwidth: float, rate: float, peak_flops: float, has_compute_side: bool) -> str:
    """The summary's two sentences on the linear layers: their weight ``read`` against the copy
    ``bandwidth``, and their FLOP ``rate`` on the compute side against the probed ``peak_flops``."""
    return choose(read < bandwidth, "这台机器上，带宽一侧的线性层读权重比拷贝慢。",
                  "这台机器上，带宽一侧的线性层读权重不比拷贝慢。") + choose(
        has_compute_side, choose(
            rate < peak_flops, f"算力一侧的窄矩阵只跑到方阵探测的 {rate / peak_flops:.0%}。",
            "算力一侧的窄矩阵也跑到了方阵探测的速率。"),
        "扫到的批都没有越过脊点，窄矩阵的速率不在差距里。")


def topk_words(sort: float, topk: float) -> str:
    """The top-k-first sampler's ``topk`` seconds against the whole-vocabulary sort's ``sort``."""
    return choose(topk < sort, f"先取 top-k 只要 {ms(topk)}，快了 {sort / topk:.1f} 倍。",
                  f"先取 top-k 要 {ms(topk)}，反而比整表排序慢，是它的 {topk / sort:.1f} 倍。")


def glue_chapter(lab, s: DecodeSweep, ctx: int, samplers: dict, sampler_rows: int, host: dict) -> dict[str, str]:
    """What the chapter page quotes from this lab, glued (and returned); ``samplers`` timed on
    ``sampler_rows`` rows, the sweep's largest batch; ``host`` from :func:`time_host`."""
    if sampler_rows != s.points(ctx)[-1]:
        raise ValueError(f"time the samplers on the largest batch ({s.points(ctx)[-1]}), not {sampler_rows}")
    from minillm.lab.notebook import g_all, profile_words

    cfg, dtype, words = s.cfg, s.dtype, profile_words(lab.profile)
    batches = s.points(ctx)
    beaten = floors_beaten((t, s.floor(*point), s.why(*point)) for point, t in s.step.items())
    bw = [b for b in batches if s.floor(b, ctx).bound == "memory"]
    cp = [b for b in batches if s.floor(b, ctx).bound == "compute"]
    claim(bool(bw) and bw[0] == 1, "B = 1 的解码在本机上受带宽限制", batches=batches)
    lo, mid, hi = 1, (bw or [1])[-1], batches[-1]  # a reader's machine may have no bandwidth side
    v = {"device": f"{words['device']}（{words['threads']}）", "model": f"{cfg.name}（{dtype}，{'真实权重' if lab.real_weights else '随机权重'}）",
         "params": fmt_int(L.param_count(cfg)), "weights": f"{L.weight_bytes(cfg, dtype) / MiB:,.0f} MiB",
         "probe_bw": words["bw"], "probe_flops": words["flops"], "ridge": words["ridge"], "ctx": fmt_int(ctx),
         "batches": "、".join(str(b) for b in batches), "b_mid": str(mid), "b_hi": str(hi)}
    for key, b in (("lo", lo), ("mid", mid), ("hi", hi)):
        f, t = s.floor(b, ctx), s.step[b, ctx]
        v.update({f"step_{key}": ms(t), f"floor_{key}": floor_words(f), f"share_{key}": f"{f.share_of(t):.0%}",
                  f"mbu_{key}": f"{s.mbu(b, ctx):.0%}", f"mfu_{key}": f"{s.mfu(b, ctx):.0%}",
                  f"agg_{key}": f"{b / t:,.1f}", f"per_{key}": f"{1 / t:,.1f}"})
    v["sides"] = sides_words(words["ridge"], dtype, v["ctx"], batches, bw, cp)
    # Growth from B = 1 along the bandwidth side, then into the compute side
    g_floor, g_meas = s.floor(mid, ctx).seconds / s.floor(lo, ctx).seconds, s.step[mid, ctx] / s.step[lo, ctx]
    if mid > lo:
        v["growth_bw"] = (f"在带宽一侧，B 从 1 加到 {mid}，token 多了 {mid} 倍，下界只变成 {g_floor:.2f} 倍，实测变成 "
                          f"{g_meas:.2f} 倍，总吞吐从 {v['agg_lo']} 涨到 {v['agg_mid']} tok/s。") + choose(
            g_meas < mid / 2, "多出来的请求搭上了同一遍权重的读取。",
            "实测涨得比下界多：一行的矩阵-向量乘和几行的矩阵乘走的是矩阵乘库里不同的实现。")
    else:
        v["growth_bw"] = choose(bool(bw), "扫到的 B 里只有 B = 1 落在带宽一侧。", "扫到的 B 里没有一个落在带宽一侧。")
    if cp:
        h_floor, h_meas = s.floor(hi, ctx).seconds / s.floor(mid, ctx).seconds, s.step[hi, ctx] / s.step[mid, ctx]
        v["growth_cp"] = (f"过了脊点，下界由 F/P 决定，随 B 成正比：B 从 {mid} 到 {hi}，下界变成 {h_floor:.2f} 倍，"
                          f"实测变成 {h_meas:.2f} 倍，总吞吐从 {v['agg_mid']} 到 {v['agg_hi']} tok/s。") + growth_verdict(h_floor, h_meas)
    else:
        v["growth_cp"] = "扫到的批都没有越过脊点：批越大，总吞吐越高。"
    v["floors"] = beaten_words(beaten, "扫到的每一步都不低于它的下界。", "探测的方阵乘法和拷贝不是这些线性层的上限。")
    # Item by item: the linear layers alone, on each side
    lin_side = mid
    read, rate = s.linear_read(lin_side), s.linear_rate(hi)
    rest = s.step[lin_side, ctx] - s.linear[lin_side]
    v["rest_words"] = choose(
        rest > 0,
        f"B = {lin_side} 时整步比线性层单独跑多出 {ms(rest)}，占 {rest / s.step[lin_side, ctx]:.0%}：注意力读 KV、归一化、"
        "RoPE、写 KV，以及几百个算子在 Python 里逐个发出的固定开销。",
        f"B = {lin_side} 时整步并不比线性层单独跑慢：这一次的计时噪声盖过了其余各项。")
    v["read_words"] = read_words(lin_side, f"{L.matmul_param_count(cfg) * L.dtype_bytes(dtype) / MiB:,.0f} MiB",
                                 ms(s.linear[lin_side]), read, s.bandwidth, lab.on_gpu, words["threads"])
    if not cp:
        v["compute_words"] = (f"扫到的批都在带宽一侧，线性层在 B = {hi} 时单独跑出 {rate / 1e9:,.1f} GFLOP/s，"
                              f"离方阵探测的 {words['flops']} 还远，用不着它。")
    else:
        v["compute_words"] = choose(
            rate < s.peak_flops,
            f"算力一侧的差距不在带宽：B = {hi} 时下界是实测的 {v['share_hi']}，卡住它的是 F/P；"
            f"线性层单独跑出 {rate / 1e9:,.1f} GFLOP/s，是方阵探测 {words['flops']} 的 {rate / s.peak_flops:.0%}。"
            f"只有 {hi} 行的矩阵乘又窄又扁，矩阵乘库喂不满计算单元。",
            f"算力一侧，B = {hi} 时线性层单独跑出 {rate / 1e9:,.1f} GFLOP/s，不低于方阵探测的 {words['flops']}："
            f"只有 {hi} 行的矩阵乘也跑到了探测值，那个方阵不是它的上限。")
    v["gap_words"] = gap_words(read, s.bandwidth, rate, s.peak_flops, bool(cp))
    # Contexts: the KV reads that no batch shares
    cb = context_batch(batches)
    ctxs = sorted(c for b, c in s.step if b == cb)
    e_long = s.estimate(cb, ctxs[-1])
    v.update({"c_batch": str(cb), "c_short": fmt_int(ctxs[0]), "c_long": fmt_int(ctxs[-1]),
              "c_kv_share": f"{e_long.kv_read_bytes / e_long.bytes:.0%}",
              "c_floor_short": floor_words(s.floor(cb, ctxs[0])), "c_floor_long": floor_words(s.floor(cb, ctxs[-1])),
              "c_step_short": ms(s.step[cb, ctxs[0]]), "c_step_long": ms(s.step[cb, ctxs[-1]])})
    # The sampler (exercise 4)
    claim(samplers["same"], "先取 top-k 再抽样，抽到的 token 和整表排序时一样")
    v.update({"ex4_rows": str(sampler_rows), "ex4_greedy": ms(samplers["greedy"]), "ex4_sort": ms(samplers["sort"]),
              "ex4_share": f"{samplers['sort'] / s.step[hi, ctx]:.0%}"})
    v["ex4_speed"] = topk_words(samplers["sort"], samplers["topk"])
    v |= host_words(host)
    v["record_note"] = _record_note()
    return g_all(v)


def _record_note() -> str:
    from minillm.lab.report import NOT_RECORDED

    record = _gpu_record()
    if record is None:
        return f"{NOT_RECORDED}（在 GPU 上运行 `scripts/gpu_record.sh` 就会写下它）"
    p = record.points()[0]
    return (f"{record.device} 上 B = {p['batch']}、c = {fmt_int(p['ctx'])} 的一步是 {min(p['seconds']) * 1e3:,.2f} ms"
            f"（{record.environment['date']}）")
