"""The plumbing of the lab KV cache 省了什么、花了什么 (chapter 5, ``notebooks/ch05-kvcache.ipynb``),
and the ledger of its page.

:func:`page_numbers` is the page's arithmetic for Llama-3.1-8B in bf16. The lab's helpers time the
step that makes the next token with the cache and without it (a prefill of the whole sequence),
run the real model's generation both ways, measure the KV bytes a cache really allocates, count
the positions a contiguous cache leaves empty, set GQA beside MHA, and glue what the page quotes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.claims import choose, claim, floors_beaten
from minillm.lab.estimate import GB, GiB, KiB, fmt_int
from minillm.lab.gpus import lookup_gpu
from minillm.lab.notebook import ms
from minillm.lab.report import beaten_words, floor_words, linear_beat_words, show_table

MODEL, CARD, UTIL = "llama-3.1-8b", "H100 SXM", 0.92
STEP_TS = (1024, 4096, 8192)
CONTEXTS = (1024, 4096, 8192, 131072)
T_LONG, BATCH = 8192, 16
PROMPT, NEW = 1024, 1024
MAX_LEN, USED = 8192, 1024
ID_BYTES = 8  # an int64 token id
TS_CPU, TS_GPU = (24, 96, 384), (384, 1536, 6144)  # lengths chapters 3 and 4 do not time
STEPS = 2  # timed steps per point and round
QUESTION = "Explain in two sentences why a language model keeps a KV cache."


@functools.cache
def _cfg():
    return load_config(MODEL)


def step_floor(cfg, t: int, use_cache: bool, P: float, W: float, dtype="bf16") -> L.Floor:
    """The step that leaves one sequence at ``t`` tokens: one new token against the cache (a
    decode step at context ``t``), or all ``t`` again (a prefill of ``t``)."""
    if use_cache:
        return L.decode_step(cfg, 1, t, W, dtype).floor(P)
    return L.prefill(cfg, t, dtype).floor(P, W)


def generation_floors(cfg, prompt: int, new: int, use_cache: bool, P: float, W: float) -> tuple[float, float]:
    """(FLOPs, seconds) of generating ``new`` tokens after a ``prompt``: its prefill, then one step
    per further token, each step's floor summed."""
    steps = [step_floor(cfg, prompt, False, P, W)] + [step_floor(cfg, prompt + k, use_cache, P, W) for k in range(1, new)]
    return sum(f.flops for f in steps), sum(f.seconds for f in steps)


def page_numbers() -> dict[str, str]:
    """Every number of the chapter page, formatted once."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    P, W = h100.bf16_flops, h100.bandwidth
    mha = cfg.replace(num_kv_heads=cfg.num_heads)
    v = {"layers": str(cfg.num_layers), "n_h": str(cfg.num_heads), "n_kv": str(cfg.num_kv_heads),
         "head_dim": str(cfg.head_dim), "card": h100.name, "card_ridge": fmt_int(h100.ridge_point),
         "layer_gflop": f"{(L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)) / 1e9:.2f}",
         "attn_crossover": fmt_int(2 * (L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg))
                                   / L.attention_flops_per_token(cfg, 1))}
    for t in STEP_TS:
        cached, again = step_floor(cfg, t, True, P, W), step_floor(cfg, t, False, P, W)
        v.update({f"cached_gflop_{t}": f"{cached.flops / 1e9:.2f} GFLOP", f"recompute_tflop_{t}": f"{again.flops / 1e12:.2f} TFLOP",
                  f"flop_ratio_{t}": fmt_int(again.flops / cached.flops)})
    # A whole generation
    (f_c, t_c), (f_r, t_r) = (generation_floors(cfg, PROMPT, NEW, u, P, W) for u in (True, False))
    v.update({"gen_prompt": fmt_int(PROMPT), "gen_new": fmt_int(NEW), "gen_cached": f"{f_c / 1e12:.1f} TFLOP",
              "gen_recompute": f"{f_r / 1e15:.1f} PFLOP", "gen_ratio": fmt_int(f_r / f_c),
              "ex2_cached": f"{t_c:.2f} s", "ex2_recompute": f"{t_r:.2f} s", "ex2_ratio": f"{t_r / t_c:.0f}"})
    # The same steps in time on the H100
    cached, again = step_floor(cfg, T_LONG, True, P, W), step_floor(cfg, T_LONG, False, P, W)
    claim(cached.bound == "memory" and again.bound == "compute", "带 cache 的一步受带宽限制，重算的一步受算力限制")
    batch_cached = L.decode_step(cfg, BATCH, T_LONG, W).floor(P)
    v.update({"t_long": fmt_int(T_LONG), "h100_cached": floor_words(cached), "h100_recompute": floor_words(again),
              "h100_time_ratio": f"{again.seconds / cached.seconds:.0f}",
              "h100_t_over_ridge": f"{T_LONG / h100.ridge_point:.0f}", "batch": str(BATCH),
              "h100_batch_cached": floor_words(batch_cached),
              "h100_batch_ratio": f"{BATCH * again.seconds / batch_cached.seconds:.0f}"})
    # What is stored
    kvt = L.kv_bytes_per_token(cfg)
    v.update({"kv_per_token": fmt_int(kvt), "kv_per_token_kib": f"{kvt / KiB:.0f} KiB", "max_pos": fmt_int(cfg.max_position_embeddings),
              "kv_mha_kib": f"{L.kv_bytes_per_token(mha) / KiB:.0f} KiB", "gqa_ratio": f"{cfg.gqa_ratio:g}",
              "kv_mha_req_8192": f"{L.kv_bytes(mha, 8192) / GiB:g} GiB",
              "mha_extra_weights": f"{(L.weight_bytes(mha) - L.weight_bytes(cfg)) / GB:.2f} GB"})
    for c in CONTEXTS:
        v[f"kv_req_{c}"] = f"{L.kv_bytes(cfg, c) / GiB:g} GiB"
    for b in (1, 16):
        g_f, m_f = (L.decode_step(x, b, 4096, W).floor(P) for x in (cfg, mha))
        claim(g_f.bound == m_f.bound == "memory", "GQA 和 MHA 的这一步都受带宽限制", batch=b)
        v.update({f"gqa_floor_{b}": floor_words(g_f), f"mha_floor_{b}": floor_words(m_f),
                  f"mha_ratio_{b}": f"{m_f.seconds / g_f.seconds:.2f}"})
    # A 24 GiB card
    budget, budget_mha = L.memory_budget(cfg, "24GiB", UTIL), L.memory_budget(mha, "24GiB", UTIL)
    v.update({"tokens_fit": fmt_int(budget.token_capacity), "tokens_fit_mha": fmt_int(budget_mha.token_capacity),
              "tokens_fit_mha_same": fmt_int(L.memory_budget(cfg, "24GiB", UTIL, kv_config=mha).token_capacity),
              "mha_fit_ratio": f"{budget.token_capacity / budget_mha.token_capacity:.1f}",
              "left_gib": f"{budget.kv_budget_bytes / GiB:.2f} GiB",
              "fit_8k": str(budget.kv_budget_bytes // L.kv_bytes(cfg, 8192)), "id_ratio": fmt_int(kvt / ID_BYTES),
              "max_len": fmt_int(MAX_LEN), "used": fmt_int(USED), "waste": f"{L.preallocation_waste(MAX_LEN, USED):.1%}",
              "fit_prealloc": str(budget.kv_budget_bytes // L.kv_bytes(cfg, MAX_LEN)),
              "fit_actual": str(budget.concurrent_requests(USED)), "conc_used": f"{budget.requests_at(USED):.1f}"})
    # Exercises 1 and 3
    for name, key in (("qwen2.5-7b", "qwen"), (MODEL, "llama")):
        c = load_config(name)
        v.update({f"ex1_{key}_layers": str(c.num_layers), f"ex1_{key}_kv_heads": str(c.num_kv_heads),
                  f"ex1_{key}_kib": f"{L.kv_bytes_per_token(c) / KiB:.0f} KiB",
                  f"ex1_{key}_32k": f"{L.kv_bytes(c, 32768) / GiB:.2f} GiB"})
    for kv_dtype in ("bf16", "fp8"):
        b = L.memory_budget(cfg, "24GiB", UTIL, kv_dtype=kv_dtype)
        v.update({f"ex3_{kv_dtype}_tokens": fmt_int(b.tokens), f"ex3_{kv_dtype}_8k": f"{b.requests_at(8192):.1f}",
                  f"ex3_{kv_dtype}_kib": f"{L.kv_bytes_per_token(cfg, kv_dtype) / KiB:.0f} KiB"})
    return v


def step_rows() -> list[list]:
    """The page's table: the next token at length t, with the cache and without it."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    rows = []
    for t in STEP_TS:
        c, r = (step_floor(cfg, t, u, h100.bf16_flops, h100.bandwidth) for u in (True, False))
        rows.append([fmt_int(t), f"{c.flops / 1e9:.2f} GFLOP", floor_words(c), f"{r.flops / 1e12:.2f} TFLOP",
                     floor_words(r), fmt_int(r.flops / c.flops), f"{r.seconds / c.seconds:.0f}"])
    return rows


def context_rows() -> list[list]:
    cfg = _cfg()
    return [[fmt_int(c), f"{L.kv_bytes(cfg, c) / GiB:g} GiB"] for c in CONTEXTS]


def mha_rows() -> list[list]:
    """GQA beside MHA on the H100 at context 4096, B = 1 and 16."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    mha = cfg.replace(num_kv_heads=cfg.num_heads)
    rows = []
    for b in (1, 16):
        g_s, m_s = (L.decode_step(x, b, 4096, h100.bandwidth) for x in (cfg, mha))
        g_f, m_f = g_s.floor(h100.bf16_flops), m_s.floor(h100.bf16_flops)
        rows.append([b, f"{g_s.bytes / GB:.2f} GB", floor_words(g_f), f"{m_s.bytes / GB:.2f} GB", floor_words(m_f),
                     f"{m_f.seconds / g_f.seconds:.2f}"])
    return rows


def plot_trade(ax1, ax2) -> None:
    """The trade in two panels: FLOPs of the next token both ways (left), a request's KV (right)."""
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    cfg, h100 = _cfg(), lookup_gpu(CARD)
    mha = cfg.replace(num_kv_heads=cfg.num_heads)
    color = ROLE_COLORS["estimate"]
    ts = np.unique(np.logspace(4, 17, 60, base=2).astype(int))
    for use_cache, style, label in ((False, ":", "重算"), (True, "--", "带 cache")):
        ax1.plot(ts, [step_floor(cfg, int(t), use_cache, h100.bf16_flops, h100.bandwidth).flops / 1e9 for t in ts],
                 style, color=color, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("序列长度 t（token）")
    ax1.set_ylabel("生成下一个 token（GFLOP）")
    ax1.legend()
    ctx = np.linspace(0, cfg.max_position_embeddings, 200)
    ax2.plot(ctx, ctx * L.kv_bytes_per_token(cfg) / GiB, "--", color=color, label=f"GQA（{cfg.num_kv_heads} 个 KV 头）")
    ax2.plot(ctx, ctx * L.kv_bytes_per_token(mha) / GiB, ":", color=color, label=f"MHA（{cfg.num_heads} 个 KV 头）")
    left = L.memory_budget(cfg, "24GiB", UTIL).kv_budget_bytes / GiB
    ax2.axhline(left, color="#777777", lw=1)
    ax2.annotate("24 GiB 卡扣掉权重后的余量", (cfg.max_position_embeddings, left), xytext=(0, 6),
                 textcoords="offset points", ha="right", fontsize=10, color="#555555")
    ax2.set_ylim(0, 40)
    ax2.set_xlabel("一个请求的上下文（token）")
    ax2.set_ylabel("这个请求的 KV（GiB）")
    ax2.legend(loc="upper left")


# --- The lab --------------------------------------------------------------------------------------

def lengths(lab) -> tuple[int, ...]:
    return TS_GPU if lab.on_gpu else TS_CPU


@dataclass
class Steps:
    """The next token at each length ``t``, with the cache (a decode step) and without it (a
    prefill of ``t``): the fastest sample of each, with the ledger; ``linear``, the fastest of the
    model's linear layers alone on as many rows as each step runs (1 with the cache, ``t`` without)."""

    cfg: object
    dtype: str
    peak_flops: float
    bandwidth: float
    cached: dict[int, float] = field(default_factory=dict)
    recompute: dict[int, float] = field(default_factory=dict)
    linear: dict[int, float] = field(default_factory=dict)

    def floor(self, t: int, use_cache: bool) -> L.Floor:
        return step_floor(self.cfg, t, use_cache, self.peak_flops, self.bandwidth, self.dtype)

    def measured(self, t: int, use_cache: bool) -> float:
        return (self.cached if use_cache else self.recompute)[t]

    def linear_rates(self, t: int, use_cache: bool) -> tuple[float, float]:
        """FLOP/s and weight-read bytes/s of the linear layers timed alone at the step's rows."""
        rows = 1 if use_cache else t
        seconds = self.linear[rows]
        return (L.prefill(self.cfg, rows, self.dtype).linear_flops / seconds,
                L.matmul_weight_bytes(self.cfg, rows, self.dtype) / seconds)

    def why(self, t: int, use_cache: bool) -> str | None:
        """Why the step at ``t`` beat its floor, from the linear layers timed beside it
        (``linear_rates``); None when it did not, or nothing explains it."""
        return linear_beat_words(self.measured(t, use_cache), self.floor(t, use_cache), *self.linear_rates(t, use_cache),
                                 f"带 cache、t = {fmt_int(t)} 时" if use_cache else f"重算 t = {fmt_int(t)} 个 token 时")

    @property
    def ts(self) -> list[int]:
        return sorted(self.cached)


def time_steps(model, ts, P: float, W: float, steps: int = STEPS, rounds: int = 2) -> Steps:
    """Time both ways of making the next token at each ``t`` (``bench.time_decode_step`` and
    ``bench.time_prefill``) and the linear layers alone at their rows (``bench.time_linear_layers``),
    taking turns point by point, ``rounds`` passes over all of them; the fastest sample of each is kept."""
    from minillm.lab.bench import time_decode_step, time_linear_layers, time_prefill

    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    cached, again, linear = {t: [] for t in ts}, {t: [] for t in ts}, {rows: [] for rows in (1, *ts)}
    for _ in range(rounds):
        linear[1] += time_linear_layers(model, 1, steps)
        for t in ts:
            cached[t] += time_decode_step(model, 1, t, steps)
            again[t] += time_prefill(model, t, steps)
            linear[t] += time_linear_layers(model, t, steps)
    fastest = lambda samples: {key: min(x) for key, x in samples.items()}
    return Steps(model.config, dtype, P, W, fastest(cached), fastest(again), fastest(linear))


def show_steps(s: Steps) -> None:
    show_table(["t", "带 cache：实测", "带 cache：下界", "重算：实测", "重算：下界", "重算 ÷ 带 cache（实测）"], [
        [fmt_int(t), ms(s.cached[t]), floor_words(s.floor(t, True)), ms(s.recompute[t]), floor_words(s.floor(t, False)),
         f"{s.recompute[t] / s.cached[t]:,.1f}"] for t in s.ts])


def plot_steps(ax, s: Steps) -> None:
    from minillm.lab.plotting import ROLE_COLORS

    est, meas = ROLE_COLORS["estimate"], ROLE_COLORS["measured"]
    ax.plot(s.ts, [s.floor(t, False).seconds * 1e3 for t in s.ts], ":", color=est, label="重算：下界")
    ax.plot(s.ts, [s.floor(t, True).seconds * 1e3 for t in s.ts], "--", color=est, label="带 cache：下界")
    ax.plot(s.ts, [s.recompute[t] * 1e3 for t in s.ts], "s-", color=meas, label="重算：实测")
    ax.plot(s.ts, [s.cached[t] * 1e3 for t in s.ts], "o-", color=meas, label="带 cache：实测")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("序列长度 t（token）")
    ax.set_ylabel("生成下一个 token（ms）")
    ax.legend()


@dataclass
class Generation:
    """The real model's greedy answer to one question, generated with the cache and without."""

    prompt: list[int]
    tokens: dict[bool, list[int]]
    seconds: dict[bool, float]
    text: str


def generate_both_ways(model, new_tokens: int, question: str = QUESTION) -> Generation:
    """``generate`` one chat prompt greedily, ``use_cache`` True and False, each timed once."""
    import time

    from minillm import LLM, generate
    from minillm.engine.sampling import SamplingParams

    prompt = LLM(model, num_kv_blocks=64).chat_prompt_ids([{"role": "user", "content": question}])
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    generate(model, [prompt], SamplingParams(temperature=0.0, max_tokens=2))  # the first call pays one-time costs
    tokens, seconds = {}, {}
    for use_cache in (True, False):
        start = time.perf_counter()
        tokens[use_cache] = generate(model, [prompt], params, use_cache=use_cache)[0]
        seconds[use_cache] = time.perf_counter() - start
    return Generation(prompt, tokens, seconds, model.tokenizer.decode(tokens[True]))


def show_generation(gen: Generation) -> None:
    show_table(["", "带 cache", "重算（`use_cache=False`）"], [
        ["生成的 token 数", len(gen.tokens[True]), len(gen.tokens[False])],
        ["总耗时", f"{gen.seconds[True]:.2f} s", f"{gen.seconds[False]:.2f} s"],
        ["两次生成的 token 一样", "是" if gen.tokens[True] == gen.tokens[False] else "否", ""]])


def measured_kv_per_token(cfg, dtype, device, tokens: int = 64) -> int:
    """Bytes per token of a contiguous cache really allocated for one request of ``tokens``."""
    from minillm.engine.contiguous_cache import ContiguousKVCache

    cache = ContiguousKVCache(cfg, 1, tokens, dtype, device)
    return cache.kv.nbytes // tokens


def show_kv(rows: list[tuple[str, int, int]]) -> None:
    """(model, ledger bytes, measured bytes) per token."""
    show_table(["缓存", "账本：2·L·n_kv·d·字节数", "分配出来的张量 ÷ token 数", "对账"], [
        [name, L.fmt_bytes(ledger), L.fmt_bytes(measured), "一致" if ledger == measured else "不一致"]
        for name, ledger, measured in rows])
    wrong = [name for name, ledger, measured in rows if ledger != measured]
    if wrong:
        raise AssertionError(f"the KV formula is wrong for {wrong}")


@dataclass
class Waste:
    lengths: list[int]
    max_len: int
    written: list[int]
    reserved_bytes: int
    bytes_per_token: int

    @property
    def used_bytes(self) -> int:
        return sum(self.written) * self.bytes_per_token

    @property
    def measured(self) -> float:
        return 1 - self.used_bytes / self.reserved_bytes

    @property
    def estimate(self) -> float:
        return L.preallocation_waste(len(self.lengths) * self.max_len, sum(self.lengths))


def waste_max_len(lab, requests: int) -> int:
    """The contiguous cache's longest request here: 512 on the CPU; 4,096 on a GPU whose free
    memory holds that cache twice over, else 1,024."""
    from minillm.lab.notebook import enough_gpu_memory

    if not lab.on_gpu:
        return 512
    return 4096 if enough_gpu_memory(lab.device, 2 * L.kv_bytes(lab.config, requests * 4096, lab.dtype_name)) else 1024


def contiguous_waste(model, requests: int, max_len: int, seed: int = 3) -> Waste:
    """Prefill a batch of lognormal prompt lengths into a contiguous cache that reserves
    ``max_len`` for each, then count the positions layer 0's K really holds."""
    from minillm.engine.contiguous_cache import ContiguousKVCache
    from minillm.lab.workload import lognormal_lengths, random_prompts

    cfg, device = model.config, model.lm_head.weight.device
    lens = lognormal_lengths(requests, median=max_len / 8, sigma=0.8, low=16, high=max_len, seed=seed)
    prompts = random_prompts(lens, cfg.vocab_size, seed=seed + 1)
    cache = ContiguousKVCache(cfg, requests, max_len, model.lm_head.weight.dtype, device)
    positions, attn = cache.append(list(range(requests)), lens)
    with torch.inference_mode():
        model(torch.tensor([t for p in prompts for t in p], device=device), positions, attn, cache.layer_caches)
    written = (cache.kv[0, 0].abs().amax(dim=(-1, -2)) > 0).sum(dim=1).tolist()
    return Waste(lens, max_len, written, cache.reserved_bytes, cache.bytes_per_token)


def plot_waste(ax, w: Waste) -> None:
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    rows = np.arange(len(w.lengths))
    ax.barh(rows, [w.max_len] * len(rows), color="#DDDDDD", label=f"预留：每个 {fmt_int(w.max_len)} token")
    ax.barh(rows, w.written, color=ROLE_COLORS["measured"], label="用了：写过的位置（实测）")
    ax.set_yticks(rows, [f"请求 {i}" for i in rows])
    ax.invert_yaxis()
    ax.set_xlabel("token")
    ax.legend(loc="lower right")
    ax.grid(axis="y", visible=False)


def mha_variant(cfg):
    """The same shape with a KV head for every query head (its K/V projections grow too)."""
    return cfg.replace(num_kv_heads=cfg.num_heads, name=f"{cfg.name}-mha")


GQA_POINTS_CPU, GQA_POINTS_GPU = ((2, 256), (2, 1024)), ((8, 1024), (8, 4096))


@dataclass
class GqaMha:
    """Decode steps of a model and of its MHA variant at a few (batch, context) points; ``linear``,
    each one's linear layers alone at each batch (logits on every row)."""

    cfg: object
    dtype: str
    peak_flops: float
    bandwidth: float
    times: dict[str, dict[tuple[int, int], float]]
    linear: dict[str, dict[int, float]]

    def config(self, name: str):
        return self.cfg if name == "GQA" else mha_variant(self.cfg)

    def floor(self, name: str, point) -> L.Floor:
        return L.decode_step(self.config(name), point[0], point[1], self.bandwidth, self.dtype).floor(self.peak_flops)

    def why(self, name: str, point) -> str | None:
        """Why ``name``'s step at ``point`` beat its floor, from its linear layers timed at that
        batch; None when it did not, or nothing explains it."""
        return linear_beat_words(self.times[name][point], self.floor(name, point), *self.linear_rates(name, point[0]),
                                 f"{name} 在 B = {point[0]}、c = {fmt_int(point[1])} 时")

    def linear_rates(self, name: str, batch: int) -> tuple[float, float]:
        """FLOP/s and weight-read bytes/s of ``name``'s linear layers timed alone at ``batch`` rows."""
        c, seconds = self.config(name), self.linear[name][batch]
        return batch * L.matmul_flops_per_token(c) / seconds, L.matmul_weight_bytes(c, batch, self.dtype) / seconds

    @property
    def points(self) -> list[tuple[int, int]]:
        return sorted(self.times["GQA"])


def time_gqa_mha(gqa_model, points, P: float, W: float, steps: int = STEPS) -> GqaMha:
    """The fastest decode step of the model and of its MHA variant (random weights) at each
    (batch, context) point, the two taking turns point by point, each step followed by the same
    model's linear layers alone at that batch (the fastest of those kept per batch)."""
    from minillm.engine.loader import load_model
    from minillm.lab.bench import time_decode_step, time_linear_layers

    weight = gqa_model.lm_head.weight
    mha = load_model(mha_variant(gqa_model.config), device=weight.device, dtype=weight.dtype, weights="random")
    times, linear = {"GQA": {}, "MHA": {}}, {"GQA": {}, "MHA": {}}
    for point in points:
        for name, model in (("GQA", gqa_model), ("MHA", mha)):
            times[name][point] = min(time_decode_step(model, *point, steps))
            alone = min(time_linear_layers(model, point[0], steps, every_row_logits=True))
            linear[name][point[0]] = min(alone, linear[name].get(point[0], alone))
    return GqaMha(gqa_model.config, str(weight.dtype).removeprefix("torch."), P, W, times, linear)


def show_gqa_mha(g: GqaMha) -> None:
    rows = []
    for point in g.points:
        fg, fm = g.floor("GQA", point), g.floor("MHA", point)
        tg, tm = g.times["GQA"][point], g.times["MHA"][point]
        rows.append([f"B = {point[0]}，c = {fmt_int(point[1])}", floor_words(fg), ms(tg), floor_words(fm), ms(tm),
                     f"{fm.seconds / fg.seconds:.2f}", f"{tm / tg:.2f}"])
    show_table(["点", "GQA：下界", "GQA：实测", "MHA：下界", "MHA：实测", "MHA ÷ GQA（下界）", "MHA ÷ GQA（实测）"], rows)


def show_comparison(s: Steps, waste: Waste, kv_rows, g: GqaMha) -> None:
    """The lab's closing table: estimate | measured here | recorded on GPU (sizes need no GPU)."""
    from minillm.lab.report import comparison_table

    t = s.ts[-1]
    c, r = s.floor(t, True), s.floor(t, False)
    point = g.points[-1]
    same = "与设备无关"
    comparison_table([
        (f"每 token 的 KV（{kv_rows[0][0]}）", L.fmt_bytes(kv_rows[0][1]), L.fmt_bytes(kv_rows[0][2]), same),
        (f"重算 ÷ 带 cache（t = {fmt_int(t)}）", f"下界之比 {r.seconds / c.seconds:,.1f}",
         f"{s.recompute[t] / s.cached[t]:,.1f}", None),
        ("连续缓存的浪费", f"{waste.estimate:.1%}", f"{waste.measured:.1%}", same),
        (f"MHA ÷ GQA（B = {point[0]}，c = {fmt_int(point[1])}）",
         f"{g.floor('MHA', point).seconds / g.floor('GQA', point).seconds:.2f}",
         f"{g.times['MHA'][point] / g.times['GQA'][point]:.2f}", None),
    ])


def gqa_points(lab):
    return GQA_POINTS_GPU if lab.on_gpu else GQA_POINTS_CPU


def floor_checks(s: Steps, g: GqaMha) -> list[tuple]:
    """Every timed step of the lab with its floor and its ``why`` (for ``claims.floors_beaten``)."""
    checks = [(s.measured(t, u), s.floor(t, u), s.why(t, u)) for t in s.ts for u in (True, False)]
    return checks + [(g.times[name][p], g.floor(name, p), g.why(name, p)) for name in ("GQA", "MHA") for p in g.points]


def ratio_words(measured: float, floor: float, read_slow: bool) -> str:
    """Recompute over cached, ``measured`` against the ratio of their floors; ``read_slow`` when the
    cached step's linear layers read their weights slower than the probed copy."""
    return choose(measured < floor, choose(
        read_slow, "实测之比小于下界之比：带 cache 的一步离下界更远，固定开销和读权重的低效把它垫高了。",
        "实测之比小于下界之比：带 cache 的一步离下界更远，每步的固定开销把它垫高了。"),
        "实测之比不小于下界之比：重算的一步离下界更远，下面“为什么对不上”的第 3 条量了它差在哪里。")


def mha_words(measured: float, floor: float, read_slow: bool, on_gpu: bool) -> str:
    """MHA over GQA, ``measured`` against the ratio of their floors; ``read_slow`` when the linear
    layers of both read their weights slower than the probed copy."""
    return choose(measured < floor, choose(
        read_slow, "实测之比小于下界之比：两者共有的固定开销和读权重的低效把倍数往 1 拉。",
        "实测之比小于下界之比：两者共有的每步固定开销把倍数往 1 拉。"), choose(
        on_gpu, "实测之比不小于下界之比：KV 越多，注意力 kernel 读 KV 的效率在一步里越要紧。",
        "实测之比不小于下界之比：CPU 的参考实现先把 K、V 收集成一份连续的拷贝再算，KV 字节被搬了不止一遍，"
        "KV 越多，这份额外的搬运越多。"))


def glue_chapter(lab, s: Steps, gen: Generation, kv_rows, waste: Waste, g: GqaMha) -> dict[str, str]:
    """What the chapter page quotes from this lab, glued (and returned)."""
    from minillm.lab.notebook import g_all, profile_words

    cfg, dtype, words = s.cfg, s.dtype, profile_words(lab.profile)
    t_min, t_max = s.ts[0], s.ts[-1]
    c_max, r_max = s.floor(t_max, True), s.floor(t_max, False)
    v = {"device": f"{words['device']}（{words['threads']}）", "model": f"{cfg.name}（{dtype}，{'真实权重' if lab.real_weights else '随机权重'}）", "ridge": words["ridge"],
         "t_min": fmt_int(t_min), "t_max": fmt_int(t_max),
         "cached_min": ms(s.cached[t_min]), "cached_max": ms(s.cached[t_max]), "recompute_max": ms(s.recompute[t_max]),
         "cached_floor_max": floor_words(c_max), "recompute_floor_max": floor_words(r_max),
         "step_ratio": f"{s.recompute[t_max] / s.cached[t_max]:,.1f}",
         "flop_ratio": fmt_int(r_max.flops / c_max.flops), "floor_ratio": f"{r_max.seconds / c_max.seconds:,.1f}",
         "cached_share": f"{c_max.share_of(s.cached[t_max]):.0%}", "recompute_share": f"{r_max.share_of(s.recompute[t_max]):.0%}"}
    claim(c_max.bound == "memory", "带 cache 的一步在本机上受带宽限制", t=t_max, bound=c_max.bound)
    claim(r_max.bound == "compute", "重算的一步在本机上受算力限制", t=t_max, bound=r_max.bound)
    claim(s.recompute[t_max] > s.cached[t_max], "最长的 t 上重算比带 cache 慢")
    v["floors"] = beaten_words(floors_beaten(floor_checks(s, g)),
                               "带 cache 的一步、重算的一步、GQA 和 MHA 的解码步，每一个计时都不低于它的下界 max(F/P, M/W)。",
                               "探测用的方阵乘法和拷贝不是这些运算的上限，按探测值算出的下界对它们并不成立。")
    _, read = s.linear_rates(t_max, True)
    v["cached_why"] = choose(
        read < s.bandwidth,
        f"单独计时的线性层读权重只有 {read / 1e9:,.1f} GB/s，比拷贝探测的 {s.bandwidth / 1e9:,.1f} GB/s 慢；这一步还要付每步的固定开销。",
        f"单独计时的线性层读权重有 {read / 1e9:,.1f} GB/s，不比拷贝探测的 {s.bandwidth / 1e9:,.1f} GB/s 慢，差距主要是每步的固定开销。")
    linear_share = s.linear[t_max] / s.recompute[t_max]
    claim(linear_share < 1, "重算一步里单独计时的线性层比整步短", share=linear_share)
    rate, _ = s.linear_rates(t_max, False)
    v["recompute_why"] = choose(
        rate < s.peak_flops,
        f"单独计时的线性层只占这一步的 {linear_share:.0%}，其余是注意力和账本外的逐元素运算；线性层自己也只跑出 "
        f"{rate / 1e9:,.1f} GFLOP/s，低于方阵探测的 {s.peak_flops / 1e9:,.1f} GFLOP/s。",
        f"单独计时的线性层只占这一步的 {linear_share:.0%}，其余是注意力和账本外的逐元素运算；线性层自己跑出 "
        f"{rate / 1e9:,.1f} GFLOP/s，已不低于方阵探测的 {s.peak_flops / 1e9:,.1f} GFLOP/s。")
    v["sides"] = (f"这台机器的脊点是 {words['ridge']} FLOP/字节；带 cache 的一步强度只有 {c_max.intensity:.2f}，落在带宽一侧，"
                  f"重算的一步强度 {r_max.intensity:,.0f}，落在算力一侧。")
    v["ratio_words"] = ratio_words(s.recompute[t_max] / s.cached[t_max], r_max.seconds / c_max.seconds, read < s.bandwidth)
    # The real model's generation
    same = gen.tokens[True] == gen.tokens[False]
    claim(same, "带 cache 和重算，贪心生成的 token 一字不差")
    v.update({"gen_new": fmt_int(len(gen.tokens[True])), "gen_prompt": fmt_int(len(gen.prompt)),
              "gen_cached_s": f"{gen.seconds[True]:.2f} s", "gen_recompute_s": f"{gen.seconds[False]:.2f} s",
              "gen_ratio": f"{gen.seconds[False] / gen.seconds[True]:.1f}"})
    v["gen_words"] = choose(
        gen.seconds[False] / gen.seconds[True] < s.recompute[t_max] / s.cached[t_max],
        "总耗时之比比第 1 项里最长的 t 上单步之比小：prompt 短、生成也短，大部分步里序列都不长，差距还没拉开；生成得越长，"
        "重算每一步的预填充越长。",
        "总耗时之比不比第 1 项里最长的 t 上单步之比小：这段生成里，重算每一步的预填充已经够长。")
    # What is stored
    (_, ledger, measured), *_ = kv_rows
    meta = kv_rows[-1]
    v.update({"kv_ledger": L.fmt_bytes(ledger), "kv_measured": L.fmt_bytes(measured), "kv_8b_meta": L.fmt_bytes(meta[2]),
              "kv_8b_full": L.fmt_bytes(meta[2] * load_config(MODEL).max_position_embeddings),
              "held_cached": L.fmt_bytes(measured * t_max), "held_ids": L.fmt_bytes(ID_BYTES * t_max),
              "held_ratio": fmt_int(measured / ID_BYTES)})
    # The contiguous cache's waste
    claim(waste.written == waste.lengths, "每个请求写过的位置正好是它的 prompt 长度")
    v.update({"waste_requests": str(len(waste.lengths)), "waste_max_len": fmt_int(waste.max_len),
              "waste_lens": "、".join(fmt_int(n) for n in waste.lengths),
              "waste_reserved": L.fmt_bytes(waste.reserved_bytes), "waste_used": L.fmt_bytes(waste.used_bytes),
              "waste_est": f"{waste.estimate:.1%}", "waste_measured": f"{waste.measured:.1%}",
              "paged_waste": f"{L.paged_waste_tokens(waste.lengths, 16) / (sum(waste.lengths) + L.paged_waste_tokens(waste.lengths, 16)):.1%}",
              "paged_slots": fmt_int(L.paged_waste_tokens(waste.lengths, 16))})
    # GQA beside MHA
    point = g.points[-1]
    fg, fm = g.floor("GQA", point), g.floor("MHA", point)
    claim(fg.bound == fm.bound == "memory", "GQA 和 MHA 的这一步在本机上都受带宽限制", point=point)
    v.update({"mha_point": f"B = {point[0]}、c = {fmt_int(point[1])}", "mha_model": g.cfg.name,
              "mha_kv_gqa": L.fmt_bytes(L.kv_bytes_per_token(g.cfg, g.dtype)),
              "mha_kv": L.fmt_bytes(L.kv_bytes_per_token(mha_variant(g.cfg), g.dtype)),
              "mha_floor_ratio": f"{fm.seconds / fg.seconds:.2f}",
              "mha_ratio": f"{g.times['MHA'][point] / g.times['GQA'][point]:.2f}"})
    reads_slow = all(g.linear_rates(name, point[0])[1] < g.bandwidth for name in ("GQA", "MHA"))
    v["mha_words"] = mha_words(g.times["MHA"][point] / g.times["GQA"][point], fm.seconds / fg.seconds, reads_slow, lab.on_gpu)
    return g_all(v)
