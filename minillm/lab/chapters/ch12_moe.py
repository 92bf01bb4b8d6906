"""The MoE chapter's plumbing (``book/ch12-moe.md``, ``notebooks/ch12-moe.ipynb``, chapter 混合专家).

Two halves. The page's: the ledger of Mixtral-8x7B and Qwen3-30B-A3B from their shipped configs
(total and active parameters, the experts a batch touches, the bytes a decode step reads and its
floor ``max(F/P, M/W)`` on a datasheet's ceilings, MBU, what the experts take of a card). The lab's:
a scaled-down MoE with random weights timed one decode step per batch size, the distinct experts
each layer ran counted from ``MoE.expert_tokens``, beside a dense model of the same active size and
a router biased towards a few hot experts; its tables, figure and :func:`glue_chapter`.

One convention on the bytes a step reads, everywhere in the chapter: every weight the step's tokens
are routed through, the output layer included, but not the embedding table, which a step only looks
``B`` rows up in (``minillm.lab.estimate.decode_read_bytes``), and not the experts no token picked.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from minillm.engine.config import ModelConfig, load_config
from minillm.lab import estimate as L
from minillm.lab.estimate import decode_read_bytes
from minillm.lab.estimate import GB, GiB, Floor, fmt_int, roofline_floor

MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
PAGE_GPU, CTX = "H100 SXM", 1024
PAGE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CARDS = (24, 80)  # GiB
UTILIZATION = 0.92
FORMATS = (None, "int8", "int4")  # chapter 10's weight formats (int4 in groups of 32)


# --- The page: the ledger of two real MoE models ----------------------------------------------------

def models() -> dict[str, ModelConfig]:
    return {name: load_config(name) for name in MODELS}


def all_experts_bytes(cfg: ModelConfig, dtype="bf16", quantization: str | None = None) -> int:
    """Every expert of every layer, as stored: they all live on the card."""
    return cfg.num_layers * L.experts_per_layer(cfg) * L.expert_bytes(cfg, dtype, quantization)


def weights_read(cfg: ModelConfig, batch: int, dtype="bf16", quantization: str | None = None) -> float:
    """Weight bytes a decode step of ``batch`` tokens reads, uniform routing (the module's
    convention): the ledger's ``weight_bytes_read`` less the embedding table."""
    table = L.weight_bytes(cfg, dtype, quantization) - decode_read_bytes(cfg, dtype, quantization)
    return L.weight_bytes_read(cfg, batch, dtype, quantization) - table


def weights_read_counted(cfg: ModelConfig, touched: list[int], dtype="bf16") -> float:
    """The same bytes for the experts a step really ran, ``touched[l]`` of them in layer ``l``."""
    if len(touched) != cfg.num_layers or not all(0 <= n <= cfg.num_experts for n in touched):
        raise ValueError(f"need one count in [0, {cfg.num_experts}] per layer ({cfg.num_layers}), got {touched}")
    idle = sum(cfg.num_experts - n for n in touched)
    return decode_read_bytes(cfg, dtype) - idle * L.expert_bytes(cfg, dtype)


def step(cfg: ModelConfig, batch: int, peak_flops: float, bandwidth: float, ctx: int = CTX,
         dtype="bf16", read: float | None = None) -> Floor:
    """The floor of a decode step of ``batch`` requests at ``ctx``: each token's FLOPs through its k
    experts; the weights it reads (``read``, default :func:`weights_read`) and every request's KV."""
    ledger = L.decode_step(cfg, batch, ctx, bandwidth, dtype)
    nbytes = (weights_read(cfg, batch, dtype) if read is None else read) + ledger.kv_read_bytes
    return roofline_floor(ledger.flops, nbytes, peak_flops, bandwidth)


def mbu_three_ways(cfg: ModelConfig, batch: int, measured_seconds: float, bandwidth: float,
                   ctx: int = CTX) -> dict[str, float]:
    """MBU of a step measured at ``measured_seconds`` with three numerators: the bytes it really
    reads (``read``), every weight (``total``), one token's active weights (``active``); KV in each."""
    kv = batch * L.kv_bytes(cfg, ctx)
    table = L.param_breakdown(cfg)["embedding"] * 2
    numerators = {"read": weights_read(cfg, batch) + kv,
                  "total": L.weight_bytes(cfg) - table + kv,
                  "active": 2 * L.active_param_count(cfg) - table + kv}
    return {key: n / measured_seconds / bandwidth for key, n in numerators.items()}


def ledger_rows(cfgs: dict[str, ModelConfig]) -> list[list[str]]:
    """Experts, k, total and active parameters, and the experts' share of the total."""
    rows = []
    for cfg in cfgs.values():
        experts = cfg.num_layers * cfg.num_experts * L.expert_params(cfg)
        rows.append([cfg.name, f"{cfg.num_experts} 选 {cfg.num_experts_per_tok}", f"{cfg.num_layers}",
                     f"{L.expert_params(cfg) / 1e6:,.1f}M", f"{L.param_count(cfg) / 1e9:.1f}B",
                     f"{L.active_param_count(cfg) / 1e9:.1f}B", f"{experts / L.param_count(cfg):.0%}"])
    return rows


def touched_rows(cfgs: dict[str, ModelConfig], batches=PAGE_BATCHES) -> list[list[str]]:
    """Expected distinct experts per layer, per batch size (uniform routing)."""
    return [[str(b), *[f"{L.experts_touched(cfg, b):.1f}" for cfg in cfgs.values()]] for b in batches]


def floor_rows(cfgs: dict[str, ModelConfig], peak_flops: float, bandwidth: float,
               batches=PAGE_BATCHES) -> list[list[str]]:
    """Per batch size, for each model: the weights a step reads and its floor (the ceiling named)."""
    from minillm.lab.report import floor_words

    return [[str(b), *[cell for cfg in cfgs.values() for cell in
                       (f"{weights_read(cfg, b) / GB:.1f} GB", floor_words(step(cfg, b, peak_flops, bandwidth)))]]
            for b in batches]


def fits(nbytes: float, card_gib: int) -> bool:
    return nbytes <= UTILIZATION * card_gib * GiB


def card_rows(cfgs: dict[str, ModelConfig]) -> list[list[str]]:
    """Per model and weight format: all weights, the experts among them, their share of a 24 GiB and
    an 80 GiB card's budget (``UTILIZATION``), and whether the weights fit."""
    rows = []
    for cfg in cfgs.values():
        for q in FORMATS:
            weights, experts = L.weight_bytes(cfg, "bf16", q), all_experts_bytes(cfg, "bf16", q)
            rows.append([cfg.name, q or "bf16", f"{weights / GiB:.1f} GiB", f"{experts / GiB:.1f} GiB",
                         *[f"{experts / (UTILIZATION * c * GiB):.0%}（{'放得下' if fits(weights, c) else '放不下'}）"
                           for c in CARDS]])
    return rows


def plot_read(ax, cfgs: dict[str, ModelConfig], batches=range(1, 257)) -> None:
    """Weights a step reads over batch size, as a share of all (non-embedding) weights."""
    from minillm.lab.plotting import PALETTE

    for color, cfg in zip(PALETTE, cfgs.values()):
        whole = weights_read(cfg, 10**6)
        ax.plot(list(batches), [weights_read(cfg, b) / whole for b in batches], color=color, label=cfg.name)
        ax.axhline(weights_read(cfg, 1) / whole, color=color, linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks([1, 4, 16, 64, 256], ["1", "4", "16", "64", "256"])
    ax.minorticks_off()
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("解码批大小 B")
    ax.set_ylabel("一步读的权重 ÷ 全部权重")
    ax.legend(loc="lower right")


# --- The lab: a scaled-down MoE, timed ----------------------------------------------------------

# Qwen3-MoE's architecture at a size a laptop times in seconds: 32 experts, top-2, two layers.
LAB_MOE = ModelConfig(name="moe-lab（32 选 2，2 层）", model_type="qwen3_moe", vocab_size=2048, hidden_size=512,
                      intermediate_size=768, num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64,
                      max_position_embeddings=2048, qk_norm=True, torch_dtype="float32",
                      num_experts=32, num_experts_per_tok=2, norm_topk_prob=True)
LAB_BATCHES = (1, 2, 4, 8, 16, 32, 64)
LAB_CTX, LAB_STEPS, LAB_ROUNDS = 64, 3, 4
HOT_EXPERTS, HOT_SCALE = 4, 3.0  # the skewed router: these experts' router rows scaled up


def dense_twin(cfg: ModelConfig) -> ModelConfig:
    """A dense model whose every token runs as many weights as the MoE's: one MLP k experts wide."""
    return replace(cfg, name=f"dense-lab（一个 {cfg.num_experts_per_tok} 倍宽的 MLP）", model_type="qwen3",
                   intermediate_size=cfg.num_experts_per_tok * cfg.intermediate_size,
                   num_experts=0, num_experts_per_tok=0, norm_topk_prob=False)


def load(lab, cfg: ModelConfig):
    """``cfg`` with random weights on the lab's device and dtype."""
    from minillm.engine.loader import load_model

    return load_model(cfg, device=lab.device, dtype=lab.dtype, weights="random")


def moe_layers(model) -> list:
    from minillm.engine.model import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def heat(model, experts: int = HOT_EXPERTS, scale: float = HOT_SCALE) -> None:
    """Bias every router towards its first ``experts`` experts: their rows of the router's weight
    times ``scale`` spread their logits wider, so top-k picks them far more often."""
    import torch

    with torch.no_grad():
        for layer in moe_layers(model):
            layer.gate.weight[:experts] *= scale


@dataclass(frozen=True)
class Point:
    """One batch size: the step's median seconds and, per MoE layer, each expert's tokens."""

    batch: int
    seconds: float
    expert_tokens: tuple[tuple[int, ...], ...] = ()  # empty for a dense model

    @property
    def touched(self) -> list[int]:
        """Distinct experts each layer ran."""
        return [sum(1 for n in layer if n) for layer in self.expert_tokens]

    @property
    def mean_touched(self) -> float:
        return statistics.fmean(self.touched)

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean per expert (B·k/E), averaged over layers."""
        return statistics.fmean(max(layer) * len(layer) / sum(layer) for layer in self.expert_tokens)


def sweep(model, batches=LAB_BATCHES, ctx: int = LAB_CTX, steps: int = LAB_STEPS, rounds: int = LAB_ROUNDS) -> list[Point]:
    """Time one decode step per batch size (``bench.time_decode_step``: the same step ``steps``
    times) in ``rounds`` passes over all the batch sizes, so that a busy spell of a shared machine
    falls on all of them; each point the median of its samples, with what each MoE layer's router
    did in that step (the same input every time)."""
    from minillm.lab.bench import time_decode_step

    samples, tokens = {b: [] for b in batches}, {}
    for _ in range(rounds):
        for b in batches:
            samples[b] += time_decode_step(model, b, ctx, steps)
            tokens[b] = tuple(tuple(layer.expert_tokens) for layer in moe_layers(model))
    return [Point(b, statistics.median(samples[b]), tokens[b]) for b in batches]


def lab_floor(cfg: ModelConfig, point: Point, profile, dtype: str) -> Floor:
    """The floor of a lab step on this machine's probed ceilings, with the experts it really ran."""
    read = weights_read_counted(cfg, point.touched, dtype) if point.expert_tokens else decode_read_bytes(cfg, dtype)
    return step(cfg, point.batch, profile.matmul_flops, profile.copy_bandwidth, LAB_CTX, dtype, read)


SWEEP_HEADER = ["B", "一步（实测）", "每层触到的专家（实测）", "公式 E·(1−(1−k/E)^B)", "时间之比 t(B)/t(1)",
                "专家数之比 n(B)/n(1)", "两者之比", "读的权重", "下界 max(F/P, M/W)", "稠密模型一步"]


def sweep_rows(cfg: ModelConfig, moe: list[Point], dense: list[Point], profile, dtype: str) -> list[list[str]]:
    from minillm.lab.notebook import ms
    from minillm.lab.report import floor_words

    rows = []
    for p, d in zip(moe, dense):
        t, n = p.seconds / moe[0].seconds, p.mean_touched / moe[0].mean_touched
        read = weights_read_counted(cfg, p.touched, dtype)
        rows.append([str(p.batch), ms(p.seconds), f"{p.mean_touched:.1f}", f"{L.experts_touched(cfg, p.batch):.1f}",
                     f"{t:.2f}", f"{n:.2f}", f"{t / n:.2f}", f"{read / 1e6:,.0f} MB",
                     floor_words(lab_floor(cfg, p, profile, dtype)), ms(d.seconds)])
    return rows


SKEW_HEADER = ["B", "每层触到的专家（均匀）", "每层触到的专家（偏向）", "公式（均匀）", "最忙专家 ÷ 平均（偏向）",
               "一步（均匀）", "一步（偏向）"]


def skew_rows(cfg: ModelConfig, uniform: list[Point], skewed: list[Point]) -> list[list[str]]:
    from minillm.lab.notebook import ms

    return [[str(u.batch), f"{u.mean_touched:.1f}", f"{s.mean_touched:.1f}", f"{L.experts_touched(cfg, u.batch):.1f}",
             f"{s.imbalance:.1f}", ms(u.seconds), ms(s.seconds)] for u, s in zip(uniform, skewed)]


def plot_sweep(ax, cfg: ModelConfig, moe: list[Point], dense: list[Point], skewed: list[Point]) -> None:
    """Each curve over batch size, as a multiple of its value at B = 1."""
    from minillm.lab.plotting import PALETTE

    b = [p.batch for p in moe]
    formula = [L.experts_touched(cfg, x) / L.experts_touched(cfg, 1) for x in b]
    ax.plot(b, [p.seconds / moe[0].seconds for p in moe], "o-", color=PALETTE[0], label="MoE 一步的时间（实测）")
    ax.plot(b, [p.mean_touched / moe[0].mean_touched for p in moe], "s--", color=PALETTE[1], label="触到的专家（实测）")
    ax.plot(b, formula, ":", color=PALETTE[1], label="触到的专家（公式）")
    ax.plot(b, [p.seconds / skewed[0].seconds for p in skewed], "^-", color=PALETTE[3], label="偏向路由：一步的时间")
    ax.plot(b, [p.seconds / dense[0].seconds for p in dense], "d-", color=PALETTE[2], label="稠密模型一步的时间")
    ax.set_xscale("log", base=2)
    ax.set_xticks(b, [str(x) for x in b])
    ax.minorticks_off()
    ax.set_xlabel("解码批大小 B")
    ax.set_ylabel("相对 B = 1 的倍数")
    ax.legend(fontsize=8)


def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.notebook import ms
    from minillm.lab.report import comparison_table, floor_words

    cfg, moe, lab = r["cfg"], r["moe"], r["lab"]
    first, last = moe[0], moe[-1]
    floor = lab_floor(cfg, last, lab.profile, lab.dtype_name)
    comparison_table([
        (f"B = {last.batch} 时每层触到的专家", f"{L.experts_touched(cfg, last.batch):.1f}（均匀路由）",
         f"{last.mean_touched:.1f}", None),
        (f"B = {last.batch} 比 B = 1 慢几倍", f"{L.experts_touched(cfg, last.batch) / L.experts_touched(cfg, 1):.1f}（专家数之比）",
         f"{last.seconds / first.seconds:.1f}", None),
        (f"B = {last.batch} 的一步", floor_words(floor), ms(last.seconds), None),
    ])


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab (``r``: the lab's results)."""
    from minillm.lab.claims import above_floor, choose, claim
    from minillm.lab.notebook import g, last_level_cache_bytes, ms
    from minillm.lab.report import floor_words

    lab, cfg, moe, dense, skewed = r["lab"], r["cfg"], r["moe"], r["dense"], r["skewed"]
    profile, dtype = lab.profile, lab.dtype_name
    g("lab_device", lab.device_name)
    g("lab_threads", lab.threads)
    g("lab_dtype", dtype)
    g("lab_model", cfg.name)
    g("lab_experts", str(cfg.num_experts))
    g("lab_topk", str(cfg.num_experts_per_tok))
    g("lab_layers", str(cfg.num_layers))
    g("lab_ctx", fmt_int(LAB_CTX))
    g("lab_expert_mb", f"{L.expert_bytes(cfg, dtype) / 1e6:.1f} MB")
    g("lab_all_experts_mb", f"{all_experts_bytes(cfg, dtype) / 1e6:,.0f} MB")
    g("lab_rest_mb", f"{(decode_read_bytes(cfg, dtype) - all_experts_bytes(cfg, dtype)) / 1e6:.1f} MB")
    g("lab_total_m", f"{L.param_count(cfg) / 1e6:.0f}M")
    g("lab_active_m", f"{L.active_param_count(cfg) / 1e6:.0f}M")
    g("lab_dense_m", f"{L.param_count(r['dense_cfg']) / 1e6:.0f}M")
    g("lab_max_b", str(moe[-1].batch))
    first, last = moe[0], moe[-1]
    for p in (first, last):
        g(f"lab_b{p.batch}_ms", ms(p.seconds))
        g(f"lab_b{p.batch}_touched", f"{p.mean_touched:.1f}")
        g(f"lab_b{p.batch}_formula", f"{L.experts_touched(cfg, p.batch):.1f}")
    time_x, touched_x = last.seconds / first.seconds, last.mean_touched / first.mean_touched
    g("lab_time_x", f"{time_x:.1f}")
    g("lab_touched_x", f"{touched_x:.1f}")
    g("lab_dense_x", f"{dense[-1].seconds / dense[0].seconds:.1f}")
    g("lab_dense_b1_ms", ms(dense[0].seconds))
    g(f"lab_dense_b{dense[-1].batch}_ms", ms(dense[-1].seconds))
    claim(last.seconds > 2 * first.seconds, "the MoE's step is much slower at the largest batch than at one token",
          b1=first.seconds, last=last.seconds)
    claim(time_x > dense[-1].seconds / dense[0].seconds, "the MoE's step time grows faster with B than the dense twin's")
    claim(dense[-1].seconds > dense[0].seconds, "the dense twin's step is slower at the largest batch than at one token",
          b1=dense[0].seconds, last=dense[-1].seconds)
    ratios = [(p.seconds / first.seconds) / (p.mean_touched / first.mean_touched) for p in moe]
    g("lab_ratio_lo", f"{min(ratios):.2f}")
    g("lab_ratio_hi", f"{max(ratios):.2f}")
    g("lab_follows", choose(
        max(ratios) / min(ratios) < 1.6,
        "时间之比和专家数之比一路同涨：两者之比在整个扫描里变化不到 1.6 倍，一步的时间几乎就是“触到几个专家”的函数。",
        "时间之比和专家数之比同向上涨，但两者之比在扫描里变化超过了 1.6 倍：除了触到几个专家，还有别的东西随 B 变了，下一节逐条说。"))
    claim(min(ratios[1:-1]) < 1, "the time ratio over the experts ratio falls below 1 at the middle batches",
          ratios=ratios)
    gap = statistics.fmean(abs(p.mean_touched - L.experts_touched(cfg, p.batch)) for p in moe)
    claim(gap <= 0.05 * cfg.num_experts, "random routers touch about as many experts as uniform routing", gap=gap)
    g("lab_formula_gap", f"{gap:.1f}")
    # bytes, floor and MBU of the largest batch
    read = weights_read_counted(cfg, last.touched, dtype)
    floor = lab_floor(cfg, last, profile, dtype)
    llc = last_level_cache_bytes(lab.device)
    cached = llc is not None and read < llc
    above_floor(last.seconds, floor, f"这一步读的权重 {read / 1e6:,.0f} MB 放得进本机最大一级缓存（{llc / 1e6 if llc else 0:,.0f} MB），"
                                     "重复计时的同一步有一部分从缓存里读" if cached else None)
    g("lab_last_read_mb", f"{read / 1e6:,.0f} MB")
    g("lab_last_floor", floor_words(floor))
    g("lab_bw", f"{profile.copy_bandwidth / 1e9:,.1f} GB/s")
    g("lab_flops", f"{profile.matmul_flops / 1e9:,.1f} GFLOP/s")
    g("lab_ridge", f"{profile.ridge_point:,.1f}")
    share = last.batch * cfg.num_experts_per_tok / cfg.num_experts
    g("lab_big_bound", choose(
        floor.bound == "compute",
        f"批 {last.batch} 时每个专家分到约 {share:.0f} 个 token，这一步的下界已经由算力决定。",
        f"批 {last.batch} 时每个专家分到约 {share:.0f} 个 token，这一步的下界仍由带宽决定，但每个字节要做的运算已经是批 1 时的好几倍。"))
    g("lab_rebound", rebound_note(ratios, floor.bound))
    dense_floor = lab_floor(r["dense_cfg"], dense[-1], profile, dtype)
    g("lab_dense_why", choose(
        dense_floor.bound == "compute",
        f"稠密模型也慢了：本机的脊点只有 {profile.ridge_point:,.1f} FLOP/字节，批 {last.batch} 时它的一步已经由算力决定，"
        "运算随批线性增长。",
        f"稠密模型也慢了：它的一步虽仍由带宽决定（本机的脊点是 {profile.ridge_point:,.1f} FLOP/字节），"
        "注意力、KV 和每一步的固定开销都随批增长。"))
    kv = last.batch * L.kv_bytes(cfg, LAB_CTX, dtype)
    g("lab_mbu", f"{(read + kv) / last.seconds / profile.copy_bandwidth:.0%}")
    one_read = weights_read_counted(cfg, first.touched, dtype)
    one_bytes = one_read + L.kv_bytes(cfg, LAB_CTX, dtype)
    g("lab_b1_read_mb", f"{one_read / 1e6:,.0f} MB")
    g("lab_b1_mbu", f"{one_bytes / first.seconds / profile.copy_bandwidth:.0%}")
    every = decode_read_bytes(cfg, dtype) + L.kv_bytes(cfg, LAB_CTX, dtype)
    g("lab_b1_mbu_total", f"{every / first.seconds / profile.copy_bandwidth:.0%}")
    g("lab_b1_cached", b1_cached_note(one_bytes, llc))
    # the skewed router
    mid = next(i for i, p in enumerate(moe) if p.batch == 16)
    g("skew_hot", str(HOT_EXPERTS))
    g("skew_scale", f"{HOT_SCALE:g}")
    g("skew_b16_uniform", f"{moe[mid].mean_touched:.1f}")
    g("skew_b16_skewed", f"{skewed[mid].mean_touched:.1f}")
    g("skew_last_imbalance", f"{skewed[-1].imbalance:.1f}")
    g("skew_last_uniform_imbalance", f"{last.imbalance:.1f}")
    g("skew_b16_uniform_imbalance", f"{moe[mid].imbalance:.1f}")
    g("skew_b16_mean", f"{16 * cfg.num_experts_per_tok / cfg.num_experts:g}")
    claim(skewed[mid].mean_touched < moe[mid].mean_touched, "at batch 16 the skewed router touches fewer experts",
          uniform=moe[mid].mean_touched, skewed=skewed[mid].mean_touched)
    claim(moe[mid].imbalance > 1.5, "at batch 16 even the uniform router loads its busiest expert well above the mean",
          imbalance=moe[mid].imbalance)
    fewer = sum(s.mean_touched < u.mean_touched for u, s in zip(moe[1:], skewed[1:]))
    g("skew_fewer", choose(
        fewer >= len(moe[1:]) - 1,
        "偏向的路由器在几乎每个批上都触到更少的专家：热门专家被反复选中，冷门的那些更久才轮到一次。",
        "偏向的路由器并没有在每个批上都触到更少的专家：这一次随机的 token 里，热门专家的优势没有大到处处压过均匀的情形。"))
    g("skew_heavier", choose(
        skewed[-1].imbalance > last.imbalance,
        "热门专家的负担也确实更重了。",
        "这一次偏向的路由器在最大的批上反而没有更不均：热门专家不止一个，token 在它们之间又分开了。"))


def rebound_note(ratios: list[float], bound: str) -> str:
    """Whether the time over the experts ratio rises again at the largest batch (``ratios``, by
    batch), as one whole sentence that fits what bounds that step's floor (``bound``)."""
    if ratios[-1] <= ratios[-2]:
        return "这一次“两者之比”在最大的批上没有回升：运算多出来的那一份没有在时间里显出来。"
    if bound == "compute":
        return "“两者之比”在最大的批上回升：时间比专家数涨得更快，多出来的是运算。"
    return ("“两者之比”在最大的批上回升：时间比专家数涨得更快；可这一步的下界仍由带宽决定，"
            "多出来的那份不能全算在运算头上。")


def b1_cached_note(step_bytes: float, llc: int | None) -> str:
    """Whether batch 1's step (``step_bytes``, weights and KV) fits this machine's last-level cache
    (``llc`` bytes; None: unknown), as one whole sentence."""
    if llc is None:
        return "本机最大一级缓存有多大，这次没查到：批 1 的一步有没有一部分从缓存里读、MBU 有没有因此偏高，说不准。"
    if step_bytes < llc:
        return (f"批 1 的一步读的字节比本机最大一级缓存（{llc / 1e6:,.0f} MB）还少，同一步重复计时，后几遍有一部分是从缓存里读的，"
                "它的 MBU 因此可能偏高。")
    return "批 1 的一步也比本机最大一级缓存大，重复计时的每一遍都要从内存里读。"
