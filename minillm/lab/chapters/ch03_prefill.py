"""The plumbing of the lab 预填充要多久 (chapter 3, ``notebooks/ch03-prefill.ipynb``), and the
ledger of its page.

:func:`page_numbers` is the page's arithmetic for Llama-3.1-8B in bf16 on the spec cards, every
figure formatted once. The lab's helpers time prefills of the lab's model over a sweep of prompt
lengths, time its linear layers alone at the same shapes (the matmul rate of the shapes the model
really runs, and the speed at which they read their weights), set every point against the one
floor max(F/P, M/W) and glue what the page quotes from the lab.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.claims import choose, claim, floors_beaten
from minillm.lab.estimate import GB, GiB, KiB, MiB, fmt_int
from minillm.lab.gpus import gpu_specs, lookup_gpu
from minillm.lab.notebook import ms
from minillm.lab.report import beaten_words, floor_words, linear_beat_words, show_table

MODEL, CARD = "llama-3.1-8b", "H100 SXM"
SHORT, LONG = 16, 8192  # the page's question: a short question, an 8K contract
TABLE_LENGTHS = (1, 16, 128, 512, 2048, 8192, 32768)
CHUNKS = (64, 128, 512, 2048, 8192)
SWEEP_CPU = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWEEP_GPU = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
PROBE_SHAPES = {"cpu": "1024 × 1024 的 fp32", "cuda": "8192 × 8192 的 bf16"}  # hardware.probe_matmul_flops
REPEATS = 4  # timed samples per point, in two rounds over the sweep (a busy machine slows every point alike)
ROUNDS = 2


@functools.cache
def _cfg():
    return load_config(MODEL)


def card_floor(cfg, n: int, spec, dtype="bf16") -> L.Floor:
    """The prefill of ``n`` tokens on a spec card (datasheet bf16 rate and bandwidth)."""
    return L.prefill(cfg, n, dtype).floor(spec.bf16_flops, spec.bandwidth)


def chunked_floor(cfg, n: int, chunk: int, spec) -> float:
    """Sum of the floors of a prefill of ``n`` tokens cut into chunks of ``chunk``: each chunk
    reads the weights and the KV of the chunks before it, computes its own tokens (attending to
    the whole prefix) and writes its KV; the output layer only for the last chunk's last token."""
    if chunk < 1 or n < 1:
        raise ValueError(f"need n >= 1 and chunk >= 1, got n={n}, chunk={chunk}")
    per_token = L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)
    attn = L.attention_flops_per_token(cfg, 1)
    total = 0.0
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        flops = size * per_token + attn * (size * start + size * (size + 1) // 2)
        flops += L.output_layer_flops(cfg) if start + size == n else 0
        nbytes = L.weight_bytes(cfg) + L.kv_bytes(cfg, start) + L.kv_bytes(cfg, size)
        total += L.roofline_floor(flops, nbytes, spec.bf16_flops, spec.bandwidth).seconds
    return total


def crossovers(cfg=None, dtype="bf16") -> dict[str, int]:
    """Each spec card's crossover: the shortest prompt whose prefill is compute-bound there."""
    cfg = cfg or _cfg()
    return {s.name: L.prefill_crossover(cfg, s.bf16_flops, s.bandwidth, dtype) for s in gpu_specs()}


def page_numbers() -> dict[str, str]:
    """Every number of the chapter page, formatted once."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    P, W = h100.bf16_flops, h100.bandwidth
    short, long = card_floor(cfg, SHORT, h100), card_floor(cfg, LONG, h100)
    claim(short.bound == "memory" and long.bound == "compute",
          "H100 上短问题的预填充受带宽限制，8K 的合同受算力限制", short=short.bound, long=long.bound)
    est_long = L.prefill(cfg, LONG)
    v = {"short_n": fmt_int(SHORT), "long_n": fmt_int(LONG), "short_floor": floor_words(short),
         "long_floor": floor_words(long), "q_ratio": f"{long.seconds / short.seconds:.0f}",
         "card": h100.name, "card_tflops": f"{h100.bf16_dense_tflops:g} TFLOP/s",
         "card_bw": f"{h100.bandwidth_gb_s:,.0f} GB/s", "card_ridge": fmt_int(h100.ridge_point),
         "w_gb": f"{L.weight_bytes(cfg) / GB:.2f} GB", "layers": str(cfg.num_layers),
         "matmul_params_b": f"{L.matmul_param_count(cfg) / 1e9:.3f}",
         "matmul_gflop": f"{L.matmul_flops_per_token(cfg) / 1e9:.2f}",
         "layer_gflop": f"{(L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)) / 1e9:.2f}",
         "lm_head_gflop": f"{L.output_layer_flops(cfg) / 1e9:.2f}",
         "attn_coeff_mflop": f"{L.attention_flops_per_token(cfg, 1) / 1e6:.3f}",
         "kv_per_token_kib": f"{L.kv_bytes_per_token(cfg) / KiB:.0f} KiB",
         "kv_long_gib": f"{L.kv_bytes(cfg, LONG) / GiB:.0f} GiB",
         "kv_long_share": f"{est_long.kv_write_bytes / est_long.bytes:.1%}",
         "embed_share": f"{L.param_breakdown(cfg)['embedding'] / L.param_count(cfg):.1%}"}
    for n in (512, 2048):
        v[f"rule_int_{n}"] = fmt_int(n * L.matmul_flops_per_token(cfg) / L.weight_bytes(cfg))
        v[f"int_{n}"] = fmt_int(L.prefill(cfg, n).intensity)
    one = card_floor(cfg, 1, h100)
    v.update({"n1_read": f"{one.memory_seconds * 1e3:.2f} ms", "n1_compute": f"{one.compute_seconds * 1e6:,.0f} µs",
              "long_compute": ms(long.compute_seconds), "long_read": ms(long.memory_seconds),
              "tokens_per_s": fmt_int(P / L.matmul_flops_per_token(cfg))})
    for n in (LONG, 32768, 131072):
        e = L.prefill(cfg, n)
        v[f"attn_share_{n}"] = f"{e.attention_flops / e.flops:.0%}"
    n_star = L.prefill_crossover(cfg, P, W)
    claim(n_star > h100.ridge_point, "拐点比脊点略高：嵌入表只占字节、不出运算", cross=n_star, ridge=h100.ridge_point)
    cross = crossovers(cfg)
    low, high = min(cross, key=cross.get), max(cross, key=cross.get)
    v.update({"cross": fmt_int(n_star), "cross_floor": floor_words(card_floor(cfg, n_star, h100)),
              "cross_over_ridge": f"{n_star / h100.ridge_point - 1:.0%}",
              "cross_low": f"{fmt_int(cross[low])}（{low}）", "cross_high": f"{fmt_int(cross[high])}（{high}）"})
    # Exercise 1: the 8K and 32K contracts on an RTX 4090 and on the H100
    rtx = lookup_gpu("RTX 4090")
    for n in (LONG, 32768):
        for spec, key in ((rtx, "rtx"), (h100, "h100")):
            f = card_floor(cfg, n, spec)
            v[f"ex1_{key}_{n}"] = floor_words(f)
    v["ex1_ratio"] = f"{card_floor(cfg, LONG, rtx).seconds / long.seconds:.1f}"
    v["ex1_flops_ratio"] = f"{P / rtx.bf16_flops:.1f}"
    claim(all(card_floor(cfg, n, s).bound == "compute" for n in (LONG, 32768) for s in (rtx, h100)),
          "两张卡上 8K 和 32K 的预填充都受算力限制")
    # Exercise 2: the crossover of three models on the H100, bf16 and fp8 weights
    for name in ("qwen2.5-0.5b", MODEL, "qwen2.5-7b"):
        c = load_config(name)
        v[f"ex2_{name}"] = fmt_int(L.prefill_crossover(c, P, W))
        v[f"ex2_{name}_fp8"] = fmt_int(L.prefill_crossover(c, P, W, "fp8"))
    # Exercise 3: chunked prefill of the 8K contract
    whole = long.seconds
    for chunk in CHUNKS:
        t = chunked_floor(cfg, LONG, chunk, h100)
        v[f"ex3_{chunk}"] = f"{t * 1e3:,.1f} ms（{t / whole:.2f} 倍，{L.ceil_div(LONG, chunk)} 块）"
    claim(chunked_floor(cfg, LONG, 2048, h100) < 1.05 * whole < chunked_floor(cfg, LONG, 64, h100),
          "块比拐点大时分块几乎不亏，块远小于拐点时明显变慢")
    return v


def floor_rows() -> list[list]:
    """The page's table: the prefill of each length on the H100, the floor and its ceiling."""
    cfg, h100 = _cfg(), lookup_gpu(CARD)
    rows = []
    for n in TABLE_LENGTHS:
        e, f = L.prefill(cfg, n), card_floor(cfg, n, h100)
        rows.append([fmt_int(n), f"{e.flops / 1e12:,.3f}", f"{e.attention_flops / e.flops:.1%}",
                     f"{e.bytes / GB:.2f}", f"{e.intensity:,.0f}", ms(f.compute_seconds), ms(f.memory_seconds),
                     floor_words(f)])
    return rows


def card_rows() -> list[list]:
    """Each spec card's ridge, crossover and two prefill floors."""
    cfg, cross = _cfg(), crossovers()
    return [[s.name, fmt_int(s.ridge_point), fmt_int(cross[s.name]), floor_words(card_floor(cfg, cross[s.name], s)),
             floor_words(card_floor(cfg, LONG, s))] for s in gpu_specs()]


def plot_crossover(ax) -> None:
    """The two floors of a prefill on the H100 against n, their maximum and the crossover."""
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    cfg, h100 = _cfg(), lookup_gpu(CARD)
    lengths = np.unique(np.geomspace(1, 32768, 160).round().astype(int))
    floors = [card_floor(cfg, int(n), h100) for n in lengths]
    color = ROLE_COLORS["estimate"]
    ax.plot(lengths, [f.memory_seconds * 1e3 for f in floors], ":", color=color, lw=1.2, label="M / W（读字节）")
    ax.plot(lengths, [f.compute_seconds * 1e3 for f in floors], "--", color=color, lw=1.2, label="F / P（做运算）")
    ax.plot(lengths, [f.seconds * 1e3 for f in floors], color=color, lw=2, label="下界 max(F/P, M/W)")
    n_star = L.prefill_crossover(cfg, h100.bf16_flops, h100.bandwidth)
    ax.axvline(n_star, color="#555555", lw=1)
    ax.annotate(f"拐点 n* = {n_star}", (n_star, floors[0].memory_seconds * 1e3), xytext=(6, -18),
                textcoords="offset points", fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt 长度 n（token）")
    ax.set_ylabel("预填充的下界（ms）")
    ax.legend(loc="upper left")


# --- The lab --------------------------------------------------------------------------------------

def sweep_lengths(lab) -> tuple[int, ...]:
    """The prompt lengths the lab sweeps on this device: within the model's positions and, on a
    GPU, whose KV and MLP activations fit the free memory (the guard says so when it drops one)."""
    from minillm.lab.notebook import enough_gpu_memory

    cfg, size = lab.config, L.dtype_bytes(lab.dtype_name)
    lengths = [n for n in (SWEEP_GPU if lab.on_gpu else SWEEP_CPU) if n <= cfg.max_position_embeddings]
    need = lambda n: L.kv_bytes(cfg, n, lab.dtype_name) + 4 * n * cfg.intermediate_size * size
    return tuple(n for n in lengths if n == lengths[0] or enough_gpu_memory(lab.device, need(n)))


def logits_length(lab) -> int:
    """The prompt of the every-row-logits experiment: the sweep's longest on the CPU; 2,048 on a
    GPU, where 8,192 rows of a 128,256-word vocabulary would take 4 GiB of float32 logits."""
    return 2048 if lab.on_gpu else sweep_lengths(lab)[-1]


def linear_flops(cfg, n: int) -> int:
    """FLOPs of the linear layers of a prefill of ``n`` tokens: every layer on ``n`` rows, the
    output layer on the last row only (as the engine runs it)."""
    return n * (L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)) + L.output_layer_flops(cfg)


def linear_bytes(cfg, dtype) -> int:
    """Bytes the linear layers read: every matmul weight once (the output layer's table too, tied
    or not); not the input embedding, from which a prefill takes only its ``n`` rows."""
    return L.matmul_param_count(cfg) * L.dtype_bytes(dtype)


@dataclass
class Sweep:
    """A prefill sweep on this machine: the fastest of ``repeats`` samples per prompt length, of
    the whole prefill (``forward``) and of its linear layers alone (``linear``), with the ledger."""

    cfg: object
    dtype: str
    peak_flops: float
    bandwidth: float
    forward: dict[int, float] = field(default_factory=dict)
    linear: dict[int, float] = field(default_factory=dict)
    repeats: int = REPEATS

    @property
    def lengths(self) -> list[int]:
        return sorted(self.forward)

    def estimate(self, n: int) -> L.PrefillEstimate:
        return L.prefill(self.cfg, n, self.dtype)

    def floor(self, n: int) -> L.Floor:
        return self.estimate(n).floor(self.peak_flops, self.bandwidth)

    def mfu(self, n: int) -> float:
        """The ledger's FLOPs over the measured time, over the probed matmul rate."""
        return self.estimate(n).flops / self.forward[n] / self.peak_flops

    def shape_rate(self, n: int) -> float:
        """FLOP/s the model's own linear layers reach at ``n`` rows."""
        return linear_flops(self.cfg, n) / self.linear[n]

    def read_rate(self, n: int) -> float:
        """Bytes/s at which the linear layers read their weights at ``n`` rows."""
        return linear_bytes(self.cfg, self.dtype) / self.linear[n]

    @property
    def crossover(self) -> int:
        return L.prefill_crossover(self.cfg, self.peak_flops, self.bandwidth, self.dtype)

    @property
    def knee(self) -> float:
        """Where two measured lines meet: the time at the shortest prompt (reading the weights)
        and the per-token time at the longest extended down (computing)."""
        small, large = self.lengths[0], self.lengths[-1]
        return self.forward[small] / (self.forward[large] / large)


def sweep(model, lengths, peak_flops: float, bandwidth: float, repeats: int = REPEATS,
          rounds: int = ROUNDS) -> Sweep:
    """Time a prefill of each length (``bench.time_prefill``, the benchmark's function) and the
    model's linear layers alone at the same number of rows, one right after the other; ``rounds``
    passes over the sweep, the fastest of ``repeats`` samples in all per point."""
    from minillm.lab.bench import time_linear_layers, time_prefill

    if repeats < rounds or rounds < 1:
        raise ValueError(f"need 1 <= rounds <= repeats, got rounds={rounds}, repeats={repeats}")
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    forward, linear = {n: [] for n in lengths}, {n: [] for n in lengths}
    for _ in range(rounds):
        for n in lengths:
            forward[n] += time_prefill(model, n, repeats // rounds)
            linear[n] += time_linear_layers(model, n, repeats // rounds)
    return Sweep(model.config, dtype, peak_flops, bandwidth, {n: min(t) for n, t in forward.items()},
                 {n: min(t) for n, t in linear.items()}, repeats=repeats // rounds * rounds)


def show_ledger(cfg, dtype, P, W, lengths) -> None:
    """The ledger of the lab's model on this machine: each length's F, M and its floor."""
    show_table(["n", "运算 F", "字节 M", "强度 F/M", "F/P", "M/W", "下界"], [
        [fmt_int(n), f"{f.flops / 1e9:,.2f} GFLOP", L.fmt_bytes(f.bytes), f"{f.intensity:,.1f}",
         ms(f.compute_seconds), ms(f.memory_seconds), floor_words(f)]
        for n in lengths for f in [L.prefill(cfg, n, dtype).floor(P, W)]])


def show_sweep(s: Sweep) -> None:
    """Measured prefill against its floor, with MFU against the probed matmul rate."""
    show_table(["n", "实测（最快）", "下界", "下界 ÷ 实测", "MFU（÷ 探测的 P）"], [
        [fmt_int(n), ms(s.forward[n]), floor_words(s.floor(n)), f"{s.floor(n).share_of(s.forward[n]):.0%}",
         f"{s.mfu(n):.0%}"] for n in s.lengths])


def show_linear(s: Sweep) -> None:
    """The linear layers alone: their share of the prefill, their FLOP/s and weight-read speed."""
    from minillm.lab.notebook import remainder

    show_table(["n", "整次预填充", "线性层单独跑", "其余（注意力、归一化、Python）", "线性层的速率（算力一侧）",
                "÷ 探测的 P", "线性层读权重的速度（带宽一侧）", "÷ 探测的 W"], [
        [fmt_int(n), ms(s.forward[n]), ms(s.linear[n]), remainder(s.forward[n], s.linear[n]),
         *([f"{s.shape_rate(n) / 1e9:,.1f} GFLOP/s", f"{s.shape_rate(n) / s.peak_flops:.0%}", "—", "—"]
           if s.floor(n).bound == "compute" else
           ["—", "—", f"{s.read_rate(n) / GB:,.1f} GB/s", f"{s.read_rate(n) / s.bandwidth:.0%}"])]
        for n in s.lengths])


def plot_sweep(ax, s: Sweep) -> None:
    """Measured prefill times beside the floor and its two terms, with both crossovers."""
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    grid = np.unique(np.geomspace(s.lengths[0], s.lengths[-1], 120).round().astype(int))
    floors = [s.estimate(int(n)).floor(s.peak_flops, s.bandwidth) for n in grid]
    est, meas = ROLE_COLORS["estimate"], ROLE_COLORS["measured"]
    ax.plot(grid, [f.seconds * 1e3 for f in floors], color=est, lw=2, label="下界 max(F/P, M/W)")
    ax.plot(grid, [f.memory_seconds * 1e3 for f in floors], ":", color=est, lw=1, label="M / W")
    ax.plot(grid, [f.compute_seconds * 1e3 for f in floors], "--", color=est, lw=1, label="F / P")
    ax.plot(s.lengths, [s.forward[n] * 1e3 for n in s.lengths], "o-", color=meas, label="实测")
    ax.axvline(s.crossover, color=est, lw=1, alpha=0.6)
    ax.axvline(s.knee, color=meas, lw=1, alpha=0.6)
    ax.annotate(f"估算拐点 {s.crossover}", (s.crossover, s.floor(s.lengths[-1]).seconds * 1e3), xytext=(5, 0),
                textcoords="offset points", color=est, fontsize=10)
    ax.annotate(f"实测拐点 ≈ {s.knee:.0f}", (s.knee, s.forward[s.lengths[0]] * 1e3), xytext=(5, 8),
                textcoords="offset points", color=meas, fontsize=10)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt 长度 n（token）")
    ax.set_ylabel("一次预填充（ms）")
    ax.legend(loc="upper left")


def logits_seconds(model, n: int, repeats: int = REPEATS) -> dict[bool, float]:
    """Fastest seconds of one prefill of ``n`` tokens with logits for the last row only (False,
    as ``minillm`` does) or for every row (True)."""
    from minillm.engine.contiguous_cache import ContiguousKVCache
    from minillm.lab.bench import WARMUP
    from minillm.lab.hardware import measure_seconds

    device = model.lm_head.weight.device
    cache = ContiguousKVCache(model.config, 1, n, model.lm_head.weight.dtype, device)
    positions, attn = cache.append([0], [n])
    ids = torch.randint(model.config.vocab_size, (n,), device=device,
                        generator=torch.Generator(device).manual_seed(0))

    def prefill(every_row: bool):
        hidden = model(ids, positions, attn, cache.layer_caches)
        return model.compute_logits(hidden if every_row else hidden[-1:])

    samples = {False: [], True: []}
    for rows in samples:
        measure_seconds(lambda: prefill(rows), device, 1, warmup=WARMUP)  # warm both up first
    for _ in range(2 * repeats):  # then the two take turns, so a busy machine slows them alike
        for rows in samples:
            samples[rows] += measure_seconds(lambda: prefill(rows), device, 1, warmup=0)
    return {rows: min(t) for rows, t in samples.items()}


def every_row_floor(cfg, n: int, P: float, W: float) -> L.Floor:
    """The floor of what logits for every row of an ``n``-token prefill (``n >= 2``) add to the last
    row's: the output layer on ``n - 1`` more rows, and their float32 logits written."""
    return L.roofline_floor(L.output_layer_flops(cfg) * (n - 1), (n - 1) * cfg.vocab_size * 4, P, W)


def last_row_seconds(s: Sweep, n: int, seconds: dict[bool, float]) -> float:
    """The prefill of ``n`` tokens with the last row's logits: the sweep's point when it swept
    ``n`` (one prefill, one number), else the paired run's (``logits_seconds``)."""
    return s.forward.get(n, seconds[False])


def show_logits(s: Sweep, n: int, seconds: dict[bool, float]) -> None:
    """The last-row prefill, what every row's logits add to it (the paired difference) and the
    floor of that extra work at the profile's P and W."""
    from minillm.lab.notebook import remainder

    extra = every_row_floor(s.cfg, n, s.peak_flops, s.bandwidth)
    source = "第 2 节的实测" if n in s.forward else "和每行都算的那次轮流计时"
    show_table(["", "值"], [
        [f"n = {fmt_int(n)}，只为最后一行算 logits（{source}）", ms(last_row_seconds(s, n, seconds))],
        ["每一行都算，多出来的时间（两者轮流计时，各取最快的一次相减）", remainder(seconds[True], seconds[False])],
        [f"多出来的工作：{fmt_int(n - 1)} 行输出层、{fmt_int(n - 1)} 行 float32 logits 的写出",
         f"{extra.flops / 1e9:,.2f} GFLOP、{L.fmt_bytes(extra.bytes)} → {floor_words(extra)}"]])


def _gpu_record():
    """The newest GPU prefill record of Llama-3.1-8B (or of any preset), or None."""
    from minillm.engine.config import preset_names
    from minillm.lab import records

    found = [r for r in records.find("prefill") if r.points() and r.model in preset_names()]
    return next((r for r in found if r.model == MODEL), found[0] if found else None)


def show_comparison(s: Sweep) -> None:
    """The lab's closing table: estimate | measured here | recorded on GPU."""
    from minillm.lab.notebook import recorded
    from minillm.lab.report import comparison_table

    record = _gpu_record()
    small, large = s.lengths[0], s.lengths[-1]

    def rec_point(index):
        return recorded(record, lambda r: f"{min(r.points()[index]['seconds']) * 1e3:,.1f} ms"
                                          f"（n = {fmt_int(r.points()[index]['n'])}）")

    comparison_table([
        ("拐点 n（估算：F/P = M/W；实测：两条实测线的交点）", fmt_int(s.crossover), fmt_int(s.knee), None),
        (f"n = {fmt_int(small)} 的耗时", floor_words(s.floor(small)), ms(s.forward[small]), rec_point(0)),
        (f"n = {fmt_int(large)} 的耗时", floor_words(s.floor(large)), ms(s.forward[large]), rec_point(-1)),
        (f"n = {fmt_int(large)} 的 MFU", f"≤ {s.floor(large).flops / s.floor(large).seconds / s.peak_flops:.0%}",
         f"{s.mfu(large):.0%}", None),
    ])


def _beat_why(s: Sweep, n: int) -> str | None:
    """Why the prefill of ``n`` tokens beats its floor, in numbers; None when it does not, or
    when nothing explains it."""
    return linear_beat_words(s.forward[n], s.floor(n), s.shape_rate(n), s.read_rate(n), f"n = {fmt_int(n)} 时")


def shape_words(n: int, rate: float, peak: float, linear_extra: float, gap: float) -> str:
    """The model's own matmul rate at ``n`` rows against the probed ``peak``, and whether the
    linear layers' time over the probed rate (``linear_extra``) is most of the prefill's time over
    its floor (``gap``)."""
    head = f"模型自己的矩阵在 n = {fmt_int(n)} 时跑出 {rate / 1e9:,.1f} GFLOP/s，"
    if rate > peak:
        return head + f"比方阵探测还快（{rate / peak:.0%}）：探测用的方阵不是这些形状的上限，算力一侧的差距要到别处去找。"
    slow = head + f"是方阵探测的 {rate / peak:.0%}：矩阵越窄、越扁，矩阵乘库越难把计算单元喂满。"
    return slow + choose(
        linear_extra >= gap / 2,
        f"线性层因此比按探测速率算多花 {ms(linear_extra)}，不少于整次预填充比下界多出的 {ms(gap)} 的一半："
        "算力一侧的差距主要在这里。",
        f"线性层因此比按探测速率算多花 {ms(linear_extra)}，不到整次预填充比下界多出的 {ms(gap)} 的一半："
        "算力一侧的差距大半在线性层之外。")


def knee_words(share_small: float, share_large: float) -> str:
    """Which end of the sweep is farther from its floor: the floor's share of the measured time at
    the shortest prompt (``share_small``) against the longest (``share_large``)."""
    return choose(
        share_small < share_large,
        f"最短的 prompt 离下界比最长的远（下界占实测的 {share_small:.0%}，最长的占 {share_large:.0%}）："
        "读权重的平台被下面几项垫得比做运算的斜线更高。",
        f"最长的 prompt 离下界不比最短的近（下界占实测的 {share_large:.0%}，最短的占 {share_small:.0%}）："
        "做运算的斜线被下面几项垫得至少和读权重的平台一样高。")


def read_words(n: int, nbytes: float, seconds: float, bandwidth: float, on_gpu: bool, llc: int | None) -> str:
    """How fast the linear layers read their ``nbytes`` of weights in ``seconds`` at ``n`` rows,
    against the probed copy ``bandwidth``, and why (``llc``: the largest cache, None if unknown)."""
    rate = nbytes / seconds
    head = (f"n = {fmt_int(n)} 时，线性层读 {nbytes / MiB:,.0f} MiB 的权重用了 {ms(seconds)}，"
            f"读速度 {rate / GB:,.1f} GB/s，")
    if rate <= bandwidth:
        return head + choose(
            on_gpu,
            f"是拷贝探测的 {rate / bandwidth:.0%}：每一层的权重分给好几个矩阵-向量乘的 kernel 依次去读，"
            "每个都要启动、收尾，喂不满显存带宽，拷贝却是一整块不间断的流式读写。",
            f"是拷贝探测的 {rate / bandwidth:.0%}：矩阵-向量乘要边读边算，一个线程发出的读请求喂不满内存总线，"
            "拷贝却是纯粹的流式读写。")
    return head + choose(
        llc is None,
        f"比拷贝探测还快（{rate / bandwidth:.0%}）：只读不写，一部分权重还留在缓存里。",
        f"比拷贝探测还快（{rate / bandwidth:.0%}）：只读不写，一部分权重还留在 {L.fmt_bytes(llc or 0)} 的缓存里。")


def gap_summary(shape_slow: bool, read_slow: bool) -> str:
    """The summary's sentence on where the lab's gap to the floor comes from: the two measured
    shortfalls it names only where they were measured (``shape_slow``: the model's matmuls below
    the probed rate; ``read_slow``: its weight reads below the probed copy)."""
    if shape_slow:
        return choose(read_slow, "差距来自模型形状的矩阵乘跑不到方阵的速率、读权重比拷贝慢、账本外的固定开销和逐元素运算。",
                      "差距来自模型形状的矩阵乘跑不到方阵的速率、账本外的固定开销和逐元素运算；读权重倒比拷贝快。")
    return choose(read_slow, "差距来自读权重比拷贝慢、账本外的固定开销和逐元素运算；模型形状的矩阵乘倒比方阵跑得快。",
                  "模型形状的矩阵乘比方阵快，读权重也比拷贝快，差距来自账本外的固定开销和逐元素运算。")


def every_row_words(extra: float, floor: L.Floor) -> str:
    """Exercise 4's sentence: what every row's logits added (``extra`` seconds, a paired difference)
    against the ``floor`` of that extra work (``every_row_floor``)."""
    if extra <= 0:  # noise hid the difference this time
        return (f"两者轮流计时，这一次每行都算的那次反而快 {ms(-extra)}，差被计时噪声盖过了，量不出输出层多花的时间；"
                f"多出来的工作的下界是 {floor_words(floor)}。")
    if extra >= floor.seconds:
        return (f"两者轮流计时，每行都算的那次多出 {ms(extra)}，不低于多出来的工作（多算的输出层、多写的 logits）"
                f"的下界 {floor_words(floor)}，账本对输出层的估计站得住。")
    return choose(
        floor.bound == "compute",
        f"两者轮流计时，每行都算的那次只多出 {ms(extra)}，比多出来的工作的下界 {floor_words(floor)} 还少："
        "输出层这个又宽又扁的矩阵乘跑得比探测的方阵快，探测值不是它的上限。",
        f"两者轮流计时，每行都算的那次只多出 {ms(extra)}，比多出来的工作的下界 {floor_words(floor)} 还少："
        "多写的 logits 写得比拷贝探测还快（拷贝要读也要写，这里只写）。")


def glue_chapter(lab, s: Sweep, logits: dict[bool, float], logits_n: int) -> dict[str, str]:
    """What the chapter page quotes from this lab, glued (and returned)."""
    from minillm.lab.notebook import g_all, last_level_cache_bytes, profile_words

    cfg, dtype, words = s.cfg, s.dtype, profile_words(lab.profile)
    small, large = s.lengths[0], s.lengths[-1]
    beaten = floors_beaten((s.forward[n], s.floor(n), _beat_why(s, n)) for n in s.lengths)
    bw_side = [n for n in s.lengths if s.floor(n).bound == "memory"]
    mid = next((n for n in s.lengths[1:-1] if n >= s.crossover), s.lengths[len(s.lengths) // 2])
    points = (small, mid, large)
    v = {"device": f"{words['device']}（{words['threads']}）", "model": f"{cfg.name}（{dtype}，{'真实权重' if lab.real_weights else '随机权重'}）",
         "params": fmt_int(L.param_count(cfg)), "hidden": fmt_int(cfg.hidden_size), "weights": f"{L.weight_bytes(cfg, dtype) / MiB:,.0f} MiB",
         "probe_flops": words["flops"], "probe_shape": PROBE_SHAPES[lab.device.type], "probe_bw": words["bw"], "ridge": words["ridge"],
         "lengths": f"{fmt_int(small)} 到 {fmt_int(large)}", "repeats": str(s.repeats),
         "cross_est": fmt_int(s.crossover), "knee": fmt_int(s.knee),
         "bw_side": "、".join(fmt_int(n) for n in bw_side) or "（没有）",
         "mid_label": choose(mid >= s.crossover, "过了拐点", "中间")}
    for i, n in enumerate(points):
        v.update({f"n_{i}": fmt_int(n), f"floor_{i}": floor_words(s.floor(n)), f"t_{i}": ms(s.forward[n]),
                  f"share_{i}": f"{s.floor(n).share_of(s.forward[n]):.0%}", f"mfu_{i}": f"{s.mfu(n):.0%}"})
    claim(s.mfu(large) < 1, "最长的 prompt 的 MFU 低于 100%", mfu=s.mfu(large))
    claim(s.floor(large).bound == "compute", "扫到的最长 prompt 受算力限制", n=large)
    v["sides"] = choose(
        bool(bw_side),
        f"这台机器的脊点只有 {words['ridge']} FLOP/字节，{dtype} 的权重每个参数 {L.dtype_bytes(dtype)} 字节，"
        f"所以只有 n = {v['bw_side']} 落在带宽一侧，从 n = {fmt_int(s.crossover)} 起都受算力限制。",
        f"这台机器的脊点只有 {words['ridge']} FLOP/字节，扫到的每个 n 都受算力限制。")
    v["beaten"] = beaten_words(beaten, "扫到的每个 n，实测都不低于下界。", "那个探测值不是这种运算的上限。")
    # The two ends of the sweep, item by item
    rate, read = s.shape_rate(large), s.read_rate(small)
    rest_small = s.forward[small] - s.linear[small]
    v["rest_small"] = choose(
        rest_small > 0,
        f"整次预填充比线性层单独跑多出 {ms(rest_small)}，占 {rest_small / s.forward[small]:.0%}：这一截是注意力、"
        "归一化、RoPE、写 KV 和几百个算子在 Python 里逐个发出的固定开销，账本里没有它。",
        "整次预填充并不比线性层单独跑慢：这一次的计时噪声盖过了其余各项。")
    v["shape_words"] = shape_words(large, rate, s.peak_flops, s.linear[large] - linear_flops(cfg, large) / s.peak_flops,
                                   s.forward[large] - s.floor(large).seconds)
    v["knee_words"] = knee_words(s.floor(small).share_of(s.forward[small]), s.floor(large).share_of(s.forward[large]))
    v["read_words"] = read_words(small, linear_bytes(cfg, dtype), s.linear[small], s.bandwidth, lab.on_gpu,
                                 last_level_cache_bytes(lab.device))
    v["gap_summary"] = gap_summary(rate <= s.peak_flops, read <= s.bandwidth)
    # Logits for every row, or for the last one (exercise 4)
    v.update({"ex4_n": fmt_int(logits_n), "ex4_last": ms(last_row_seconds(s, logits_n, logits)),
              "ex4_words": every_row_words(logits[True] - logits[False],
                                           every_row_floor(cfg, logits_n, s.peak_flops, s.bandwidth)),
              "ex4_share": f"{L.output_layer_flops(cfg) * (logits_n - 1) / L.prefill(cfg, logits_n, dtype).flops:.0%}"})
    v["record_note"] = _record_note()
    return g_all(v)


def _record_note() -> str:
    """The GPU record in one sentence, or what to run to make one."""
    from minillm.lab.report import NOT_RECORDED

    record = _gpu_record()
    if record is None:
        return (f"{NOT_RECORDED}。在 GPU 上运行 `scripts/gpu_record.sh`，把写出的 JSON 放进 `data/measurements/` "
                "再构建，实验末尾的对照表就会填上 GPU 一栏")
    probe, points = record.results["probe"], record.points()
    cross = L.prefill_crossover(load_config(record.model), probe["matmul_flops"], probe["copy_bandwidth"],
                                record.results["model"]["dtype"])
    return (f"{record.device} 上的记录（{record.environment['date']}，{record.model}）：探测的矩阵乘 "
            f"{probe['matmul_flops'] / 1e12:,.0f} TFLOP/s、拷贝带宽 {probe['copy_bandwidth'] / GB:,.0f} GB/s，"
            f"估算的拐点是 {fmt_int(cross)}；n = {fmt_int(points[-1]['n'])} 的预填充用了 "
            f"{min(points[-1]['seconds']) * 1e3:,.1f} ms")
