"""The plumbing of the lab 为什么服务大模型难 (chapter 2, ``notebooks/ch02-ledger.ipynb``), and the
ledger of its page.

:func:`page_numbers` is the page's arithmetic for Llama-3.1-8B in bf16, every figure formatted
once. The lab's helpers print the ledger of the lab's own model, set it beside the parameters a
meta-device model really has, show this machine's two ceilings and which side of the ridge each
prefill and decode lands on here, and glue what the page quotes from the lab.
"""
from __future__ import annotations

import functools
import json

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.claims import choose, claim
from minillm.lab.estimate import GB, GiB, KiB, fmt_int
from minillm.lab.gpus import gpu_specs, lookup_gpu
from minillm.lab.report import BOUND_WORDS, floor_words, show_table

MODEL = "llama-3.1-8b"
UTIL, CARD = 0.92, "24GiB"
CONTEXTS = (1024, 4096, 8192, 131072)
DECODE_BATCHES, DECODE_CTX = (1, 16, 48), 1024
PREFILL_LENGTHS = (512, 2048)
HYPOTHETICAL_BANDWIDTH = 1e12  # the page's decode table: a made-up card of 1 TB/s
REAL_CARDS = ("RTX 4090", "RTX 3090", "A10")
CHECKED_MODELS = ("llama-3.1-8b", "llama-2-7b", "qwen2.5-0.5b", "qwen3-0.6b", "smollm2-135m")


@functools.cache
def _cfg():
    return load_config(MODEL)


@functools.cache
def _reported() -> dict[str, dict]:
    """What real "24 GB" cards reported to PyTorch in public logs (``data/vllm_startup_logs.json``)."""
    from minillm.lab.vllm_logs import LOGS_JSON

    return {card["gpu"]: card for card in json.loads(LOGS_JSON.read_text(encoding="utf-8"))["reported_memory"]}


def hypothetical_card() -> tuple[float, float]:
    """(P, W) of the page's made-up card: W = 1 TB/s, and the lowest ridge point of the spec table,
    so that what is bandwidth-bound there is bandwidth-bound on every card in the table."""
    ridge = min(s.ridge_point for s in gpu_specs())
    return ridge * HYPOTHETICAL_BANDWIDTH, HYPOTHETICAL_BANDWIDTH


def decode_floors(cfg, batches=DECODE_BATCHES, ctx=DECODE_CTX) -> dict[int, tuple[L.DecodeEstimate, L.Floor]]:
    """Each batch's decode step at ``ctx`` on the made-up card: the ledger and its floor."""
    P, W = hypothetical_card()
    steps = {b: L.decode_step(cfg, b, ctx, W) for b in batches}
    return {b: (s, s.floor(P)) for b, s in steps.items()}


def rule_of_thumb_intensity(cfg, n: int) -> float:
    """The prefill intensity "≈ n": every matmul weight for every one of the ``n`` tokens (2 FLOPs
    each, the output layer included) over the weights read once."""
    return n * L.matmul_flops_per_token(cfg) / L.weight_bytes(cfg)


def attention_crossover(cfg) -> float:
    """The context at which a token's attention FLOPs equal its linear layers' (4·L·c·n_h·d = 2·N)."""
    return L.matmul_flops_per_token(cfg) / L.attention_flops_per_token(cfg, 1)


def page_numbers() -> dict[str, str]:
    """Every number of the chapter page, formatted once."""
    from minillm.lab.vllm_logs import reported_memory

    cfg = _cfg()
    parts = L.param_breakdown(cfg)
    w = L.weight_bytes(cfg)
    v = {"layers": str(cfg.num_layers), "n_h": str(cfg.num_heads), "n_kv": str(cfg.num_kv_heads),
         "head_dim": str(cfg.head_dim), "attn_per_layer": fmt_int(parts["attention"] // cfg.num_layers),
         "mlp_per_layer": fmt_int(parts["mlp"] // cfg.num_layers), "embedding": fmt_int(parts["embedding"]),
         "params": fmt_int(L.param_count(cfg)), "params_b": f"{L.param_count(cfg) / 1e9:.3f}",
         "w_gb": f"{w / GB:.2f} GB", "w_gib": f"{w / GiB:.2f} GiB", "gb_gib_gap": f"{1 - GB / GiB:.1%}",
         "matmul_params_b": f"{L.matmul_param_count(cfg) / 1e9:.3f}",
         "matmul_gflop": f"{L.matmul_flops_per_token(cfg) / 1e9:.2f}",
         "lm_head_gflop": f"{L.output_layer_flops(cfg) / 1e9:.2f}",
         "attn_cross": fmt_int(attention_crossover(cfg))}
    for c in (1024, 4096, 8192, 32768):
        attn = L.attention_flops_per_token(cfg, c)
        v[f"attn_gflop_{c}"] = f"{attn / 1e9:.3f}"
        v[f"attn_share_{c}"] = f"{attn / (attn + L.matmul_flops_per_token(cfg)):.1%}"
    claim(L.attention_flops_per_token(cfg, 32768) > L.matmul_flops_per_token(cfg),
          "32K 的上下文里，注意力的运算超过了线性层", context=32768)
    # Prefill: the rule of thumb, and the ledger as the engine computes it
    for n in PREFILL_LENGTHS:
        p = L.prefill(cfg, n)
        v.update({f"prefill_tflop_{n}": f"{n * L.matmul_flops_per_token(cfg) / 1e12:.2f}",
                  f"prefill_int_{n}": fmt_int(rule_of_thumb_intensity(cfg, n)),
                  f"engine_tflop_{n}": f"{p.flops / 1e12:.2f}", f"engine_gb_{n}": f"{p.bytes / GB:.2f} GB",
                  f"engine_int_{n}": fmt_int(p.intensity), f"engine_attn_gflop_{n}": f"{p.attention_flops / 1e9:,.{1 if p.attention_flops < 1e11 else 0}f}"})
    # Decode on the made-up card
    P, W = hypothetical_card()
    floors = decode_floors(cfg)
    for b, (s, f) in floors.items():
        claim(f.bound == "memory", "假想卡上这几个批大小的解码都受带宽限制", batch=b, intensity=f.intensity)
        v.update({f"dec_gb_{b}": f"{s.bytes / GB:.2f} GB", f"dec_gflop_{b}": f"{s.flops / 1e9:,.1f}",
                  f"dec_int_{b}": f"{f.intensity:.1f}", f"dec_ms_{b}": f"{f.seconds * 1e3:.2f} ms",
                  f"dec_tok_{b}": fmt_int(b / f.seconds)})
    h100 = lookup_gpu("H100 SXM")
    claim(decode_crossover(cfg, DECODE_CTX, "bf16", h100.bf16_flops, h100.bandwidth) is None,
          "上下文 1024 时，8B 的解码在 H100 上批再大也受带宽限制", ctx=DECODE_CTX)
    lowest = min(gpu_specs(), key=lambda s: s.ridge_point)
    highest = max(gpu_specs(), key=lambda s: s.ridge_point)
    claim(all(L.prefill(cfg, n).intensity > highest.ridge_point for n in PREFILL_LENGTHS),
          "这两个长度的预填充在规格表里每一张卡上都受算力限制", ridge=highest.ridge_point)
    cross_all = max(L.prefill_crossover(cfg, s.bf16_flops, s.bandwidth) for s in gpu_specs())
    v.update({"cross_all": fmt_int(cross_all), "max_ridge": f"{highest.ridge_point:,.0f}", "max_ridge_card": highest.name,
              "hyp_tflops": f"{P / 1e12:.0f}", "hyp_ridge": f"{P / W:.0f}", "hyp_card": lowest.name,
              "kv_intensity": f"{floors[1][0].kv_intensity:.0f}", "gqa_ratio": str(cfg.gqa_ratio),
              "kv_share_48": f"{floors[48][0].kv_read_bytes / floors[48][0].bytes:.0%}"})
    # KV cache
    kvt = L.kv_bytes_per_token(cfg)
    mha = cfg.replace(num_kv_heads=cfg.num_heads)
    v.update({"kv_per_token": fmt_int(kvt), "kv_per_token_kib": f"{kvt / KiB:.0f} KiB",
              "kv_per_token_mha_kib": f"{L.kv_bytes_per_token(mha) / KiB:.0f} KiB"})
    for c in CONTEXTS:
        v[f"kv_req_{c}"] = f"{L.kv_bytes(cfg, c) / GiB:.3f} GiB"
    # A 24 GiB card
    budget = L.memory_budget(cfg, CARD, UTIL)
    whole = budget.concurrent_requests(1024)
    v.update({"usable_gib": f"{budget.budget_bytes / GiB:.2f} GiB", "left_gib": f"{budget.kv_budget_bytes / GiB:.2f} GiB",
              "rest_gib": f"{(budget.total_bytes - budget.budget_bytes) / GiB:.2f} GiB",
              "tokens_fit": fmt_int(budget.tokens), "whole_1024": str(whole), "next_1024": str(whole + 1),
              "last_share_1024": f"{budget.requests_at(1024) - whole:.0%}",
              "waste": f"{L.preallocation_waste(8192, 1024):.1%}",
              "fit_prealloc": str(int(budget.kv_budget_bytes // L.kv_bytes(cfg, 8192))),
              "fit_actual": str(int(budget.tokens // 1024))})
    for c in (1024, 4096, 8192):
        v[f"conc_{c}"] = f"{budget.requests_at(c):.1f}"
    # Exercise 1: no GQA, two ways (the same weights with MHA's KV; a real MHA model's bigger K/V projections)
    mha_same = L.memory_budget(cfg, CARD, UTIL, kv_config=mha)
    mha_real = L.memory_budget(mha, CARD, UTIL)
    v.update({"mha_kv_tokens": fmt_int(mha_same.token_capacity), "mha_real_tokens": fmt_int(mha_real.token_capacity),
              "mha_real_weights": f"{(L.weight_bytes(mha) - w) / GiB:.2f} GiB",
              "mha_conc_1024": f"{mha_same.requests_at(1024):.1f}",
              "mha_intensity": f"{L.decode_step(mha, 1, 1024, W).kv_intensity:.1f}"})
    # Exercise 2: an H100
    b80 = L.memory_budget(cfg, h100.memory_bytes, UTIL)
    f80 = L.decode_step(cfg, 1, 1024, h100.bandwidth).floor(h100.bf16_flops)
    v.update({"ex2_tokens": fmt_int(b80.tokens), "ex2_floor": floor_words(f80), "ex2_floor_ms": f"{f80.seconds * 1e3:.2f} ms",
              "ex2_tok": fmt_int(1 / f80.seconds), "ex2_compute": f"{f80.compute_seconds * 1e3:.3f} ms",
              "ex2_conc_8192": f"{b80.requests_at(8192):.1f}"})
    # Exercise 3: Qwen2.5-7B beside Llama-3.1-8B
    for name, key in (("qwen2.5-7b", "qwen"), (MODEL, "llama")):
        c = load_config(name)
        b = L.memory_budget(c, CARD, UTIL)
        v.update({f"ex3_{key}_w": f"{L.weight_bytes(c) / GiB:.2f} GiB", f"ex3_{key}_kv": f"{L.kv_bytes_per_token(c) / KiB:.0f} KiB",
                  f"ex3_{key}_layers": str(c.num_layers), f"ex3_{key}_kv_heads": str(c.num_kv_heads),
                  f"ex3_{key}_left": f"{b.kv_budget_bytes / GiB:.2f} GiB", f"ex3_{key}_8k": f"{b.requests_at(8192):.1f}"})
    # Real "24 GB" cards as PyTorch reports them (public logs)
    reported = _reported()
    for name in REAL_CARDS:
        b = L.memory_budget(cfg, reported_memory(name), UTIL)
        key = name.replace(" ", "").lower()
        v.update({f"{key}_reported": f"{reported[name]['total_gib']:g} GiB", f"{key}_tokens": fmt_int(b.token_capacity),
                  f"{key}_loss": f"{1 - b.token_capacity / budget.token_capacity:.0%}", f"sources_{key}": reported[name]["url"]})
        claim(b.token_capacity < budget.token_capacity, "真实的 24 GB 卡按 0.92 算，能给 KV 的比 24 GiB 的账少",
              card=name, tokens=b.token_capacity)
    return v


def real_card_rows() -> list[list]:
    """The 24 GiB ledger beside what real "24 GB" cards report to PyTorch (public logs)."""
    from minillm.lab.vllm_logs import reported_memory

    cfg = _cfg()
    reported = _reported()
    rows = [("账本：24 GiB", L.memory_budget(cfg, CARD, UTIL))] + [
        (f"{name}：PyTorch 报告 {reported[name]['total_gib']:g} GiB", L.memory_budget(cfg, reported_memory(name), UTIL))
        for name in REAL_CARDS]
    return [[name, f"{b.budget_bytes / GiB:.2f} GiB", f"{b.kv_budget_bytes / GiB:.2f} GiB", fmt_int(b.token_capacity),
             f"{b.requests_at(1024):.1f}", f"{b.requests_at(8192):.1f}"] for name, b in rows]


def decode_rows() -> list[list]:
    """The page's decode table on the made-up card."""
    return [[b, f"{s.bytes / GB:.2f} GB", f"{s.flops / 1e9:,.1f} GFLOP", f"{f.intensity:.1f}", floor_words(f),
             f"{fmt_int(b / f.seconds)} token/s"] for b, (s, f) in decode_floors(_cfg()).items()]


# --- The lab --------------------------------------------------------------------------------------

def show_model_ledger(cfg, dtype) -> None:
    """The ledger of one model: its parameters by part, weights, FLOPs and KV per token."""
    parts = L.param_breakdown(cfg)
    names = {"embedding": "输入嵌入", "attention": "注意力投影", "mlp": "MLP", "router": "MoE 路由器",
             "norms": "RMSNorm", "lm_head": "输出层（不共享时）"}
    show_table(["项", "值"], [
        ["参数量（公式）", fmt_int(L.param_count(cfg))],
        *[[f"　其中{' ' if names[k][0].isascii() else ''}{names[k]}", fmt_int(n)] for k, n in parts.items()],
        [f"权重（{dtype}）", L.fmt_bytes(L.weight_bytes(cfg, dtype))],
        ["每 token 的线性层运算 2N", f"{L.matmul_flops_per_token(cfg) / 1e9:.4f} GFLOP"],
        [f"每 token 的 KV（{dtype}）", L.fmt_bytes(L.kv_bytes_per_token(cfg, dtype))],
        ["输入输出嵌入共享", "是" if cfg.tie_word_embeddings else "否"],
    ])


def show_param_check(counted: dict[str, int]) -> None:
    """The formula against the parameters a meta-device model really has; raises if one differs."""
    rows = [[name, fmt_int(L.param_count(load_config(name))), fmt_int(n),
             "一致" if n == L.param_count(load_config(name)) else "不一致"] for name, n in counted.items()]
    show_table(["模型", "公式", "实例化后逐个张量数", "对账"], rows)
    wrong = [row[0] for row in rows if row[3] != "一致"]
    if wrong:
        raise AssertionError(f"the parameter formula is wrong for {wrong}")


def show_profile(profile, spec) -> None:
    """This build's machine profile beside the device's spec row (a GPU's), if it has one."""
    from minillm.lab.notebook import profile_words

    words = profile_words(profile)
    show_table(["", "本机（机器画像）", f"规格表（{spec.name}）" if spec else "规格表"], [
        ["拷贝带宽 W", words["bw"], f"{spec.bandwidth_gb_s:,.0f} GB/s" if spec else "CPU 没有规格行"],
        [f"矩阵乘速率 P（{profile.matmul_dtype.removeprefix('torch.')}）", words["flops"],
         f"{spec.bf16_dense_tflops:g} TFLOP/s" if spec else "—"],
        ["脊点 P/W", f"{words['ridge']} FLOP/字节", f"{spec.ridge_point:,.0f} FLOP/字节" if spec else "—"],
        ["线程", words["threads"], "—"],
        ["探测时间", profile.date, "—"],
    ])


PREFILL_HERE, DECODE_HERE = (1, 16, 128, 1024), (1, 4, 8, 16, 64)


def sides(cfg, dtype, P, W, ctx: int) -> list[tuple[str, L.Floor]]:
    """The floors of the lab's model on this machine: prefills of ``PREFILL_HERE`` tokens and
    decode steps of ``DECODE_HERE`` requests at context ``ctx``."""
    rows = [(f"预填充 n = {fmt_int(n)}", L.prefill(cfg, n, dtype).floor(P, W)) for n in PREFILL_HERE]
    rows += [(f"解码一步 B = {b}（上下文 {fmt_int(ctx)}）", L.decode_step(cfg, b, ctx, W, dtype).floor(P))
             for b in DECODE_HERE]
    return rows


def show_sides(cfg, dtype, P, W, ctx) -> None:
    show_table(["这一步", "运算 F", "字节 M", "强度 F/M", "F/P", "M/W", "下界"], [
        [what, f"{f.flops / 1e9:,.2f} GFLOP", L.fmt_bytes(f.bytes), f"{f.intensity:,.2f}",
         f"{f.compute_seconds * 1e3:,.2f} ms", f"{f.memory_seconds * 1e3:,.2f} ms", floor_words(f)]
        for what, f in sides(cfg, dtype, P, W, ctx)])


def decode_crossover(cfg, ctx: int, dtype, P, W, limit: int = 4096) -> int | None:
    """The smallest batch whose decode step at ``ctx`` is compute-bound (F/P ≥ M/W); None when no
    batch up to ``limit`` is (the KV reads keep the intensity below the ridge)."""
    return next((b for b in range(1, limit + 1)
                 if L.decode_step(cfg, b, ctx, W, dtype).floor(P).bound == "compute"), None)


def plot_here(cfg, dtype, profile, ctx) -> None:
    """The roofline of this machine (and two GPUs' for scale), with the lab's model on it."""
    import matplotlib.pyplot as plt

    from minillm.lab.hardware import DeviceProbe
    from minillm.lab.plotting import plot_roofline

    probe = DeviceProbe(profile.device_name, profile.copy_bandwidth, profile.matmul_flops, profile.matmul_dtype)
    P, W = profile.matmul_flops, profile.copy_bandwidth
    fig, ax = plt.subplots(figsize=(7.4, 4.6))
    plot_roofline(ax, [lookup_gpu("RTX 4090"), lookup_gpu("H100 SXM")], probe,
                  prefill_points=[(f"n={n}", L.prefill(cfg, n, dtype).intensity) for n in PREFILL_HERE],
                  decode_points=[(f"B={b}", L.decode_step(cfg, b, ctx, W, dtype).intensity) for b in DECODE_HERE],
                  on=probe)
    ax.set_xlim(0.1, 3e4)


def calculator(model: str, gpu: str, utilization: float, ctx: int) -> None:
    """The capacity calculator of the lab's widget: KV room, concurrency and the decode floor."""
    c, s = load_config(model), lookup_gpu(gpu)
    b = L.memory_budget(c, s.memory_bytes, utilization)
    if not b.weights_fit:
        print(f"{model} 的 bf16 权重 {L.weight_bytes(c) / GiB:.2f} GiB 放不进 {s.name} × {utilization}")
        return
    f = L.decode_step(c, 1, ctx, s.bandwidth).floor(s.bf16_flops)
    print(f"KV 可放 {fmt_int(b.tokens)} 个 token；上下文 {ctx:,} 时能同时放 {b.requests_at(ctx):.1f} 个请求；"
          f"单个请求解码一步 {floor_words(f)}，每秒至多 {1 / f.seconds:,.0f} 个 token")


def calculator_controls() -> dict:
    """The calculator's controls, labelled in Chinese: model, GPU, utilization, context."""
    import ipywidgets as widgets

    from minillm.engine.config import preset_names

    return {"model": widgets.Dropdown(options=preset_names(), value=MODEL, description="模型"),
            "gpu": widgets.Dropdown(options=[s.name for s in gpu_specs()], value="RTX 4090", description="GPU"),
            "utilization": widgets.FloatSlider(value=UTIL, min=0.5, max=1.0, step=0.01, description="利用率"),
            "ctx": widgets.IntSlider(value=8192, min=1024, max=131072, step=1024, description="上下文")}


CAPACITY_MODELS = ("llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "llama-2-7b")


def plot_capacity(models=CAPACITY_MODELS, ctx: int = 8192) -> None:
    """How many requests of ``ctx`` tokens each card's KV room holds, per model (bf16, 0.92)."""
    import matplotlib.pyplot as plt
    import numpy as np

    specs = gpu_specs()
    fig, ax = plt.subplots(figsize=(7.6, 4.0))
    width = 0.8 / len(models)
    for k, m in enumerate(models):
        c = load_config(m)
        ax.bar(np.arange(len(specs)) + k * width,
               [L.memory_budget(c, s.memory_bytes, UTIL).requests_at(ctx) for s in specs], width, label=m)
    ax.set_xticks(np.arange(len(specs)) + 0.4 - width / 2, [s.name for s in specs], rotation=35, ha="right")
    ax.set_ylabel(f"{ctx // 1024}K 请求数（上界）")
    ax.set_yscale("symlog", linthresh=1)
    ax.legend(ncols=2)


def show_comparison(lab, counted: dict[str, int]) -> None:
    """The lab's closing table: estimate | measured here | recorded on GPU."""
    from minillm.lab import records
    from minillm.lab.hardware import describe_device
    from minillm.lab.notebook import profile_words, recorded
    from minillm.lab.report import comparison_table

    spec, words = describe_device(lab.device).spec, profile_words(lab.profile)
    probed = max(records.find("prefill") + records.find("decode"), key=lambda r: r.environment["date"], default=None)
    probe = lambda key, scale, unit: recorded(probed, lambda r: f"{r.results['probe'][key] / scale:,.1f} {unit}")
    comparison_table([
        (f"{lab.config.name} 的参数量", fmt_int(L.param_count(lab.config)), fmt_int(counted[lab.config.name]), None),
        ("拷贝带宽 W", f"{spec.bandwidth_gb_s:,.0f} GB/s（规格）" if spec else "CPU 没有规格", words["bw"],
         probe("copy_bandwidth", 1e9, "GB/s")),
        ("矩阵乘速率 P", f"{spec.bf16_dense_tflops:g} TFLOP/s（规格）" if spec else "CPU 没有规格", words["flops"],
         probe("matmul_flops", 1e12, "TFLOP/s")),
        ("脊点 P/W", f"{spec.ridge_point:,.0f} FLOP/字节" if spec else "—", f"{words['ridge']} FLOP/字节",
         recorded(probed, lambda r: f"{r.results['probe']['ridge_point']:,.1f} FLOP/字节")),
    ])


def cross_words(model: str, dtype: str, cross_b: int | None) -> str:
    """Whether decode stays bandwidth-bound on this machine, in a whole sentence: ``cross_b`` is
    the first compute-bound batch (None: none is)."""
    return choose(
        cross_b is not None,
        f"在这台机器上，“解码受带宽限制”并不总成立：{model}（{dtype}）的解码从 B = {cross_b} 起就落到算力一侧，"
        "批再大，一步的时间就由 F/P 决定，不再由读了多少字节决定。",
        f"在这台机器上，“解码受带宽限制”一直成立：{model}（{dtype}）的解码无论批多大都落在带宽一侧，"
        "KV 的读取让强度停在脊点之下。")


def ridge_words(ridge: float, lowest: float) -> str:
    """This machine's ridge against ``lowest``, the lowest of the spec table, in a whole sentence:
    an order of magnitude below it, below it, or not below it."""
    card = f"规格表里脊点最低的卡（{lowest:,.0f}）"
    return choose(ridge < lowest / 10,
                  f"这比{card}还低一个数量级以上：同样的强度，在这台机器上早得多就落到算力一侧。",
                  choose(ridge < lowest, f"这比{card}还低：同样的强度，在这台机器上更早落到算力一侧。",
                         f"这不低于{card}：同样的强度，在这台机器上不会比在那张卡上更早落到算力一侧。"))


def glue_chapter(lab, counted: dict[str, int], ctx: int) -> dict[str, str]:
    """What the chapter page quotes from this lab, glued (and returned)."""
    from minillm.lab.notebook import g_all, profile_words

    cfg, dtype, profile = lab.config, lab.dtype_name, lab.profile
    P, W = profile.matmul_flops, profile.copy_bandwidth
    words = profile_words(profile)
    claim(all(n == L.param_count(load_config(name)) for name, n in counted.items()),
          "公式数出的参数量和实例化后逐个张量数的一样", **counted)
    cross_b = decode_crossover(cfg, ctx, dtype, P, W)
    cross_n = L.prefill_crossover(cfg, P, W, dtype)
    min_gpu = min(s.ridge_point for s in gpu_specs())
    v = {"model": cfg.name, "dtype": dtype, "ctx": fmt_int(ctx), "checked": str(len(counted)),
         **{f"profile_{k}": words[k] for k in ("device", "threads", "bw", "flops", "ridge", "policy")},
         "cross_prefill": fmt_int(cross_n), "min_gpu_ridge": f"{min_gpu:,.0f}",
         "decode_1": floor_words(L.decode_step(cfg, 1, ctx, W, dtype).floor(P)),
         "decode_1_intensity": f"{L.decode_step(cfg, 1, ctx, W, dtype).floor(P).intensity:.2f}"}
    v["cross_cell"] = choose(cross_b is not None, f"{cfg.name} 的解码从 B = {cross_b} 起就受算力限制",
                             f"{cfg.name} 的解码不论批多大都受带宽限制")
    v["cross_words"] = cross_words(cfg.name, dtype, cross_b)
    v["ridge_words"] = ridge_words(profile.ridge_point, min_gpu)
    return g_all(v)
