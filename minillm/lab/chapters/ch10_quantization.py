"""The quantization lab's plumbing (``notebooks/ch10-quantization.ipynb``, chapter 每个数少几个字节).

The formats the chapter compares (weights unquantized / int8 / int4, KV in the model's dtype or
fp8), the ledger's numbers for them (bytes per weight, the bytes a decode step reads, the batch at
which a step turns compute-bound, tokens that fit on a card, cost per million tokens), the lab's
measurements (one linear per format, decode in turns with the baseline through ``bench decode``,
quality through ``bench quality``'s scoring), its tables and figures, and :func:`glue_chapter`.
Published GPU numbers are quoted as such, with their source, never as measurements of ours.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from minillm.engine.units import fmt_int
from minillm.lab import estimate as L

CARD, CONTEXTS = "24GiB", (4096, 8192)
EXAMPLE_PRICE_PER_HOUR = 2.00  # US$ per GPU-hour: a round example, not any provider's quote
SLO_STEP_SECONDS = 0.05  # every request gets a token at least every 50 ms (20 tok/s each)

# Published anchors (quoted, not measured here; the page links their sources): gpt-fast's README
# benchmarks and Marlin's
GPT_FAST = {None: (104.9, 1397.31), "int8": (155.58, 1069.20), "int4": (196.80, 862.69)}  # tok/s, GB/s
MARLIN_IDEAL, MARLIN_GROUP = 3.87, 128  # fp16 x int4 on an A10, near ideal up to batch 16-32


@dataclass(frozen=True)
class Format:
    """A weight format (``None`` = the model's dtype) and a KV cache dtype ("auto" or "fp8")."""

    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    group_size: int = 32

    def label(self, dtype: str = "bf16") -> str:
        weights = self.quantization or dtype
        if self.quantization == "int4":
            weights += f"（每组 {self.group_size}）"
        kv = "fp8" if self.kv_cache_dtype == "fp8" else dtype
        return f"{weights} 权重 + {kv} KV"

    def tick(self, dtype: str = "bf16") -> str:
        """Two short lines for a figure's axis (the caption names int4's group size)."""
        return f"{self.quantization or dtype} 权重\n{self.kv_dtype(dtype)} KV"

    def kv_dtype(self, dtype: str = "bf16") -> str:
        return "fp8" if self.kv_cache_dtype == "fp8" else dtype


BASELINE = Format()
GRID = tuple(Format(q, kv) for q in (None, "int8", "int4") for kv in ("auto", "fp8"))  # the 24 GiB table
MEASURED = (Format("int8"), Format("int4"), Format(kv_cache_dtype="fp8"), Format("int4", "fp8"))  # the lab's


def dtype_word(lab) -> str:
    """The lab's dtype as the tables write it: fp32 on the CPU, bf16 on a GPU."""
    return {"float32": "fp32", "bfloat16": "bf16"}.get(lab.dtype_name, lab.dtype_name)


# --- The ledger -----------------------------------------------------------------------------------

def bytes_per_weight(quantization: str | None, group_size: int = 32, in_features: int = 4096,
                     dtype: str = "bf16") -> float:
    """Bytes one weight of a linear with ``in_features`` inputs takes, its share of the format's
    scales and minimums included."""
    if quantization is None:
        return float(L.dtype_bytes(dtype))
    return L.quantized_linear_bytes(1, in_features, quantization, group_size) / in_features


def decode_read_bytes(cfg, dtype: str = "bf16", quantization: str | None = None, group_size: int = 32) -> int:
    """Weight bytes a decode step really reads: the ledger's ``weight_bytes`` less the embedding
    table, which a step only looks rows up in, unless the output layer is that same table (tied
    and unquantized)."""
    table = L.param_breakdown(cfg)["embedding"] * L.dtype_bytes(dtype)
    tied_and_read = cfg.tie_word_embeddings and quantization is None
    return L.weight_bytes(cfg, dtype, quantization, group_size) - (0 if tied_and_read else table)


def step(cfg, spec, fmt: Format, batch: int, ctx: int):
    """The ledger's decode step of ``batch`` requests at ``ctx`` on ``spec`` (a ``GPUSpec``), bf16."""
    return L.decode_step(cfg, batch, ctx, spec.bandwidth, "bf16", fmt.quantization, fmt.group_size,
                         fmt.kv_dtype())


def compute_bound_batch(cfg, spec, fmt: Format, ctx: int) -> int | None:
    """The smallest batch whose decode step at ``ctx`` is compute-bound (F/P >= M/W), or None when
    no batch is: each request adds FLOPs f and KV bytes k, the weights W_b are read once, so the
    step crosses at B = (W_b / W) / (f / P - k / W) when f / P > k / W."""
    one = step(cfg, spec, fmt, 1, ctx)
    per_request = one.flops / spec.bf16_flops - one.kv_read_bytes / spec.bandwidth
    if per_request <= 0:
        return None
    batch = max(1, int(one.weight_bytes / spec.bandwidth / per_request))
    while step(cfg, spec, fmt, batch, ctx).floor(spec.bf16_flops).bound == "memory":
        batch += 1
    return batch


def plans(cfg, card=CARD, formats=GRID) -> dict:
    """The planner's dry run (``python -m minillm plan``) of ``cfg`` on ``card`` for each format."""
    from minillm.engine.planner import plan

    return {f: plan(cfg, gpu_memory=card, quantization=f.quantization, group_size=f.group_size,
                    kv_cache_dtype=f.kv_cache_dtype, max_model_len=-1) for f in formats}


def plan_rows(dry: dict, contexts=CONTEXTS) -> list[list[str]]:
    from minillm.engine.units import KiB, fmt_bytes

    base = dry[BASELINE].tokens
    return [[f.label(), fmt_bytes(p.weight_bytes), f"{p.bytes_per_block / p.block_size / KiB:.0f} KiB",
             fmt_int(p.num_blocks), fmt_int(p.tokens), f"{p.tokens / base:.2f}×",
             *[fmt_int(p.concurrent_requests(c)) for c in contexts]] for f, p in dry.items()]


def slo_serving(cfg, spec, fmt: Format, plan, ctx: int, slo: float = SLO_STEP_SECONDS) -> tuple[int, float]:
    """(batch, tokens/s) of one card at context ``ctx``: the most requests the plan holds whose
    decode step floor still meets ``slo`` seconds, and the floor's throughput at that batch (an
    upper bound). (0, 0.0) when not even one request meets it."""
    batch = plan.concurrent_requests(ctx)
    while batch and step(cfg, spec, fmt, batch, ctx).floor(spec.bf16_flops).seconds > slo:
        batch -= 1
    if not batch:
        return 0, 0.0
    return batch, batch / step(cfg, spec, fmt, batch, ctx).floor(spec.bf16_flops).seconds


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """US$ per million output tokens at ``tokens_per_s`` on a card rented at ``price_per_hour``."""
    if tokens_per_s <= 0 or price_per_hour < 0:
        raise ValueError(f"need tokens_per_s > 0 and price_per_hour >= 0, got {tokens_per_s}, {price_per_hour}")
    return price_per_hour / 3600 / tokens_per_s * 1e6


def gpt_fast_rows(cfg) -> list[list[str]]:
    """gpt-fast's published Llama-2-7B batch-1 numbers beside the ledger's bytes per token."""
    base = GPT_FAST[None][0]
    rows = []
    for q, (tok_s, gb_s) in GPT_FAST.items():
        ledger = L.weight_bytes(cfg, "bf16", q, 32)
        rows.append([q or "bf16", f"{tok_s:g}", f"{gb_s:,.2f}", f"{gb_s / tok_s:.2f} GB", f"{ledger / 1e9:.2f} GB",
                     f"{tok_s / base:.2f}×", f"{L.weight_bytes(cfg) / ledger:.2f}×"])
    return rows


# --- The lab's measurements ----------------------------------------------------------------------------

def time_linears(device, shape=(4096, 4096), repeats: int = 20) -> list[dict]:
    """One gemv (a single token) through one ``shape`` (out, in) linear per format on ``device``:
    fp32 and bf16 ``F.linear``, the engine's ``Int8Linear`` and ``Int4Linear`` (group 32) fed fp32
    (bf16 on a GPU) activations as the engine feeds them; the median time and the weight bytes per
    second it streamed."""
    import torch

    from minillm.engine.quantization import Int4Linear, Int8Linear
    from minillm.lab.notebook import median_seconds

    n, k = shape
    torch.manual_seed(0)
    linear = torch.nn.Linear(k, n, bias=False, device=device)
    act = torch.bfloat16 if device.type == "cuda" else torch.float32
    bf16 = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    bf16.weight.data.copy_(linear.weight)
    layers = [("fp32 F.linear", linear, torch.float32, 4 * n * k),
              ("bf16 F.linear", bf16, torch.bfloat16, 2 * n * k),
              ("int8（每行一个 scale）", Int8Linear(linear), act, L.quantized_linear_bytes(n, k, "int8")),
              ("int4（每组 32）", Int4Linear(linear, 32), act, L.quantized_linear_bytes(n, k, "int4", 32))]
    rows = []
    with torch.inference_mode():
        for name, layer, dtype, nbytes in layers:
            x = torch.randn(1, k, device=device, dtype=dtype)
            seconds = median_seconds(lambda: layer(x), device, repeats=repeats, warmup=3)
            rows.append({"layer": name, "bytes": nbytes, "seconds": seconds, "bandwidth": nbytes / seconds})
    return rows


def measure_speed(lab, formats=MEASURED, batches=(1, 8), ctx: int = 256, steps: int = 8) -> dict:
    """One ``bench decode`` run: at every point the baseline and each format timed in turns, at the
    lab model's shape (random weights: timing does not depend on their values). Returns the
    formats and the run's points (``variant``, ``batch``, ``median_s``, ``speedup``, ``estimate``)."""
    from minillm.lab.bench import bench_decode

    (group_size,) = {f.group_size for f in formats}
    points = bench_decode(lab.model_name, device=lab.device, dtype=lab.dtype, batches=batches, contexts=(ctx,),
                          steps=steps, variants=[(f.quantization, f.kv_cache_dtype) for f in formats],
                          group_size=group_size)["points"]
    return {"formats": formats, "points": points}


def speed_rows(speed: dict, cfg, dtype: str) -> list[dict]:
    """Per format and batch: measured speedup over the run's one baseline beside two bytes ratios,
    the ledger's (all weights and the KV) and the bytes decode really reads (no embedding table)."""
    from minillm.lab.bench import variant_name

    base = {(p["batch"], p["ctx"]): p for p in speed["points"] if p["variant"] == "baseline"}
    rows = []
    for f in speed["formats"]:
        for quant in (p for p in speed["points"] if p["variant"] == variant_name(f.quantization, f.kv_cache_dtype)):
            b = base[quant["batch"], quant["ctx"]]
            kv = b["estimate"]["kv_read_bytes"], quant["estimate"]["kv_read_bytes"]
            read = (decode_read_bytes(cfg, dtype) + kv[0]) / (
                decode_read_bytes(cfg, dtype, f.quantization, f.group_size) + kv[1])
            rows.append({"format": f, "batch": quant["batch"], "ctx": quant["ctx"],
                         "baseline_ms": b["median_s"] * 1e3, "ms": quant["median_s"] * 1e3,
                         "speedup": quant["speedup"], "ledger_ratio": b["estimate"]["bytes"] / quant["estimate"]["bytes"],
                         "read_ratio": read})
    return rows


def baselines(rows: list[dict]) -> dict[int, float]:
    """The run's one baseline ms per step at each batch (every format's row carries it)."""
    return {r["batch"]: r["baseline_ms"] for r in rows}


def measure_quality(lab, formats=MEASURED, tokens: int = 2048, window: int = 512) -> dict:
    """``bench quality``'s scoring of the real SmolLM2 for each format against the unquantized model
    on the same text (the baseline scored once): perplexity, its ratio, top-1 agreement."""
    from minillm.engine.loader import load_model
    from minillm.lab.bench_quality import score, text_tokens
    from minillm.lab.notebook import TEXT_MODEL

    base_model = lab.text_model
    ids = text_tokens(base_model.tokenizer, tokens)
    base = score(base_model, ids, window=window)
    out = {BASELINE: {"perplexity": base["perplexity"], "ratio": 1.0, "top1": 1.0, "tokens": base["tokens"]}}
    for f in formats:
        model = base_model if f.quantization is None else load_model(
            TEXT_MODEL, device=lab.device, dtype=base_model.dtype, quantization=f.quantization,
            group_size=f.group_size)
        m = score(model, ids, f.kv_cache_dtype, window, reference=base["choices"])
        out[f] = {"perplexity": m["perplexity"], "ratio": m["perplexity"] / base["perplexity"],
                  "top1": m["top1_agreement"], "tokens": m["tokens"]}
    return out


# --- Tables and figures ----------------------------------------------------------------------------------

def show_linears(rows: list[dict]):
    from minillm.engine.units import fmt_bytes
    from minillm.lab.report import show_table

    fp32 = rows[0]["seconds"]
    show_table(["层", "权重字节", "一次 gemv", "流过的权重 GB/s", "比 fp32 快"], [
        [r["layer"], fmt_bytes(r["bytes"]), f"{r['seconds'] * 1e3:,.3f} ms", f"{r['bandwidth'] / 1e9:,.1f}",
         f"{fp32 / r['seconds']:.2f}×"] for r in rows])


def show_speed(rows: list[dict], dtype: str):
    """Each batch's baseline once, then every format timed beside it."""
    from minillm.lab.report import show_table

    table = []
    for batch, base_ms in baselines(rows).items():
        table.append([f"{BASELINE.label(dtype)}（基线）", batch, f"{base_ms:,.1f}", "1.00×", "1.00×", "1.00×"])
        table += [[r["format"].label(dtype), batch, f"{r['ms']:,.1f}", f"{r['speedup']:.2f}×",
                   f"{r['ledger_ratio']:.2f}×", f"{r['read_ratio']:.2f}×"] for r in rows if r["batch"] == batch]
    show_table(["格式", "批", "ms/步", "实测加速", "账本字节之比", "解码实读字节之比"], table)


def show_quality(quality: dict, dtype: str):
    from minillm.lab.report import show_table

    show_table(["格式", "困惑度", "相对基线", "top-1 一致"], [
        [f.label(dtype), f"{q['perplexity']:.3f}", f"{q['ratio'] - 1:+.2%}", f"{q['top1']:.1%}"]
        for f, q in quality.items()])


def show_costs(rows: list[dict], price_per_hour: float, dtype: str):
    """Tokens per second measured here (the baseline once per batch, then every format) and what a
    million of them cost at ``price_per_hour``."""
    from minillm.lab.report import show_table

    table = []
    for batch, base_ms in baselines(rows).items():
        table += [[label, batch, f"{batch / step_ms * 1e3:,.1f}", f"{cost_per_million(batch / step_ms * 1e3, price_per_hour):,.2f}"]
                  for label, step_ms in [(f"{BASELINE.label(dtype)}（基线）", base_ms)] +
                  [(r["format"].label(dtype), r["ms"]) for r in rows if r["batch"] == batch]]
    show_table(["格式", "批", "tok/s", "每百万 token（美元）"], table)


def plot_speedup(rows: list[dict], dtype: str, batch: int = 1):
    """Per format at ``batch``: the measured speedup beside the two bytes ratios."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    rows = [r for r in rows if r["batch"] == batch]
    fig, ax = plt.subplots(figsize=(7.2, 3.6))
    x = range(len(rows))
    bars = [("账本字节之比", "ledger_ratio", "#9BBBD9"), ("解码实读字节之比", "read_ratio", ROLE_COLORS["estimate"]),
            ("实测加速", "speedup", ROLE_COLORS["measured"])]
    for i, (name, key, color) in enumerate(bars):
        ax.bar([j + (i - 1) * 0.27 for j in x], [r[key] for r in rows], 0.27, label=name, color=color)
    ax.axhline(1, color="#888888", lw=0.8)
    ax.set_xticks(list(x), [r["format"].tick(dtype) for r in rows])
    ax.set_ylabel(f"相对基线（{dtype}），批 = {batch}")
    ax.legend(loc="upper left")
    return fig


def plot_tokens(dry: dict):
    """Tokens the planner fits on the card per format (the 24 GiB dry run)."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE

    fig, ax = plt.subplots(figsize=(7.2, 3.4))
    labels = [f.tick() for f in dry]
    tokens = [p.tokens for p in dry.values()]
    ax.bar(labels, tokens, color=[PALETTE[0] if f.kv_cache_dtype == "auto" else PALETTE[1] for f in dry])
    for i, t in enumerate(tokens):
        ax.text(i, t, fmt_int(t), ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("放得下的 KV token")
    ax.yaxis.set_major_formatter(lambda v, _: fmt_int(v))
    return fig


def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.notebook import recorded
    from minillm.lab.records import latest
    from minillm.lab.report import comparison_table

    record = latest("decode", model="llama-3.1-8b")

    def recorded_speedup(rec, f: Format):
        hits = [p["speedup"] for p in rec.results["points"] if "speedup" in p and p["batch"] == 1
                and (p.get("quantization"), p.get("kv_cache_dtype")) == (f.quantization, f.kv_cache_dtype)]
        return f"{hits[0]:.2f}×" if hits else None

    rows = []
    for row in (x for x in r["speed"] if x["batch"] == 1):
        f = row["format"]
        rows.append((f"B=1 解码加速：{f.label(r['dtype'])}", f"{row['read_ratio']:.2f}×（实读字节之比）",
                     f"{row['speedup']:.2f}×", recorded(record, lambda rec, f=f: recorded_speedup(rec, f))))
    for f, q in r["quality"].items():
        if f != BASELINE:
            rows.append((f"困惑度：{f.label(r['dtype'])}", "—", f"{q['ratio'] - 1:+.2%}", None))
    comparison_table(rows)


def speedup_sentence(row: dict, fp32_streams_slower: bool, dtype: str) -> str:
    """Where one measured speedup stands against the bytes decode reads, as a whole sentence;
    ``fp32_streams_slower``: the fp32 gemv moved fewer bytes a second than the quantized layers
    (it explains a speedup past the bytes only when the baseline, ``dtype``, is fp32)."""
    if row["read_ratio"] < 1.05:
        if row["speedup"] < 0.9:
            return "这个上下文里省下的字节本来就少，把 fp8 读回来却要多做一次类型转换，实测反而更慢。"
        if row["speedup"] > 1.1:
            return "这个上下文里省下的字节本来就少，字节之比解释不了实测的这点差别。"
        return "这个上下文里省下的字节本来就少，实测也没有明显的加速。"
    if row["speedup"] > 1.1 * row["read_ratio"]:
        if fp32_streams_slower and dtype == "fp32":
            return ("实测加速比解码实读字节之比还大：省下的不只是字节，基线的 fp32 矩阵乘本身就读得慢，"
                    "量化层换成 bf16 的激活，走的是更快的路径。")
        return "实测加速比解码实读字节之比还大，线性层的计时也解释不了它：这个数要在一台空闲的机器上重测。"
    if row["speedup"] >= 0.8 * row["read_ratio"]:
        return "实测加速接近解码实读字节之比：这个格式的 kernel 把少掉的字节兑成了时间。"
    return "实测加速明显低于解码实读字节之比：字节少了，时间却没有跟着字节走。"


def fp8_big_sentence(row: dict, on_gpu: bool) -> str:
    """What fp8 KV did at the lab's larger batch (``row``, one of :func:`speed_rows`), as a whole
    sentence: faster, about even (only where the KV saved is a small share of the step's bytes), or
    slower, and why on this kind of device."""
    if row["speedup"] >= 1.1:
        return "批大一些时 fp8 KV 快了一些：批越大，KV 在一步字节里占得越多，省下的字节开始兑成时间。"
    if row["speedup"] >= 0.9:
        if row["read_ratio"] < 1.25:
            return "批大一些时 fp8 KV 和基线差不多快：这个上下文里 KV 只占一步字节的一小部分，省下的字节不多。"
        return "批大一些时 fp8 KV 省下了不少字节，实测却和基线差不多快：读回时的类型转换把省下的时间用掉了。"
    if on_gpu:
        return "批大一些时 fp8 KV 反而更慢：这个上下文里省下的 KV 字节不多，读回时的类型转换却每步都要做。"
    return ("批大一些时 fp8 KV 反而更慢：CPU 上的注意力先把 fp8 的 K、V 整段转回 fp32 再算（minillm/engine/kernels/"
            "reference.py 的 _attend），这次转换比省下的字节更费时；GPU 上的 Triton 注意力 kernel 在每个分块里就地转换。")


def quality_sentence(int8_ratio: float, int4_ratio: float) -> str:
    """Whether int8's perplexity rose more than int4's (ratios to the unquantized model's), as a whole sentence."""
    from minillm.lab.claims import choose

    return choose(int8_ratio > int4_ratio,
                  "于是字节多一倍的 int8，困惑度反而比 int4 涨得多：int4 的网格就是检查点的网格，int8 的不是。",
                  "可这一次量到的 int8 困惑度涨得并不比 int4 多：重新舍入的误差在这段文本上没有显出来。")


def lin_int8_sentence(int8_bandwidth: float, int4_bandwidth: float) -> str:
    """The int8 gemv's weight bytes a second against the int4 one's (alike within 0.8–1.25), as a whole sentence."""
    ratio = int8_bandwidth / int4_bandwidth
    if ratio > 1.25:
        return "int8 层每秒流过的权重字节比 int4 层多得多：int4 的 kernel 读字节读得慢，它少掉的字节没能全部兑成时间。"
    if ratio >= 0.8:
        return "int8 层每秒流过的权重字节和 int4 层相当：两个 kernel 读字节一样快，字节少的那个就快。"
    return "int8 层每秒流过的权重字节远少于 int4 层：它的 kernel 读字节读得慢，少掉的字节没能全部兑成时间。"


def lin_bf16_sentence(fp32_seconds: float, bf16_seconds: float, dtype: str) -> str:
    """What the bf16 gemv says about the quantized layers' speedup over a ``dtype`` baseline, as a whole sentence."""
    from minillm.lab.claims import choose

    if dtype != "fp32":
        return f"这台机器上的基线本身就是 {dtype}，整个模型的实测加速里没有“fp32 换成 bf16”的一份。"
    return choose(bf16_seconds < 0.9 * fp32_seconds,
                  f"它比 fp32 快 {fp32_seconds / bf16_seconds:.2f} 倍，量化层的加速里有这一份。",
                  "这台机器上 bf16 的 F.linear 并不比 fp32 快，量化层的加速不是换精度换来的。")


def glue_chapter(r: dict) -> None:
    """Glue what the chapter quotes from this lab."""
    from minillm.engine.units import fmt_bytes
    from minillm.lab.claims import choose, claim
    from minillm.lab.notebook import g

    lab, dtype = r["lab"], r["dtype"]
    g("lab_device", lab.device_name)
    g("lab_model", lab.config.name)
    g("lab_dtype", dtype)
    g("lab_threads", lab.threads)
    by = {(x["format"], x["batch"]): x for x in r["speed"]}
    lin = {x["layer"].split("（")[0].split(" ")[0]: x for x in r["linears"]}
    fp32_slower = lin["fp32"]["bandwidth"] < min(lin["int8"]["bandwidth"], lin["int4"]["bandwidth"])
    batches = sorted({x["batch"] for x in r["speed"]})
    claim(r["q4_exact"], "int4 (group 32) reproduces the Q4_1 checkpoint's weights exactly")
    g("lab_q4_exact", choose(r["q4_exact"], "int4（每组 32）量化再解回去，和检查点里的权重一位不差。",
                             "int4（每组 32）量化再解回去，和检查点里的权重并不完全相同。"))
    g("lab_int8_err", f"{r['int8_error']:.1e}")
    g("lab_ctx", fmt_int(r["speed"][0]["ctx"]))
    g("lab_big_batch", str(batches[-1]))
    for key, f in (("int8", MEASURED[0]), ("int4", MEASURED[1]), ("fp8kv", MEASURED[2]), ("int4fp8", MEASURED[3])):
        for b in batches:
            x = by[(f, b)]
            g(f"lab_{key}_b{b}_speedup", f"{x['speedup']:.2f}×")
            g(f"lab_{key}_b{b}_ledger", f"{x['ledger_ratio']:.2f}×")
            g(f"lab_{key}_b{b}_read", f"{x['read_ratio']:.2f}×")
        g(f"lab_{key}_b1_ms", f"{by[(f, 1)]['ms']:,.1f} ms")
        q = r["quality"][f]
        g(f"lab_{key}_ppl", f"{q['perplexity']:.3f}")
        g(f"lab_{key}_ppl_delta", f"{q['ratio'] - 1:+.2%}")
        g(f"lab_{key}_top1", f"{q['top1']:.1%}")
        g(f"lab_{key}_sentence", speedup_sentence(by[(f, 1)], fp32_slower, dtype))
    g("lab_base_b1_ms", f"{baselines(r['speed'])[1]:,.1f} ms")
    q4, q8 = r["quality"][MEASURED[1]]["ratio"], r["quality"][MEASURED[0]]["ratio"]
    g("lab_quality_order", quality_sentence(q8, q4))
    g("lab_base_ppl", f"{r['quality'][BASELINE]['perplexity']:.3f}")
    g("lab_quality_tokens", fmt_int(r["quality"][BASELINE]["tokens"]))
    int4, int8 = by[(MEASURED[1], 1)], by[(MEASURED[0], 1)]
    g("lab_int4_vs_int8", choose(int4["speedup"] > int8["speedup"],
                                 "int4 比 int8 快，字节更少的格式也更快。",
                                 "int8 反而不比 int4 慢：字节之比在这台机器上没有决定快慢。"))
    claim(r["quality"][MEASURED[1]]["ratio"] < 1.05 and r["quality"][MEASURED[0]]["ratio"] < 1.01,
          "int4 perplexity within 5% of the unquantized model, int8 within 1%",
          int4=r["quality"][MEASURED[1]]["ratio"], int8=r["quality"][MEASURED[0]]["ratio"])
    fp32 = lin["fp32"]["seconds"]
    for key in ("fp32", "bf16", "int8", "int4"):
        g(f"lin_{key}_ms", f"{lin[key]['seconds'] * 1e3:,.3f} ms")
        g(f"lin_{key}_gbs", f"{lin[key]['bandwidth'] / 1e9:,.1f} GB/s")
        g(f"lin_{key}_x", f"{fp32 / lin[key]['seconds']:.2f}×")
        g(f"lin_{key}_bytes", fmt_bytes(lin[key]["bytes"]))
    g("lin_int8_sentence", lin_int8_sentence(lin["int8"]["bandwidth"], lin["int4"]["bandwidth"]))
    g("lin_bf16_sentence", lin_bf16_sentence(fp32, lin["bf16"]["seconds"], dtype))
    g("lab_fp8_big", fp8_big_sentence(by[(MEASURED[2], batches[-1])], lab.on_gpu))
    g("lab_price", f"{r['price_per_hour']:.2f}")
    for key, f in (("base", BASELINE), ("int4", MEASURED[1])):
        tok_s = 1e3 / (baselines(r["speed"])[1] if f == BASELINE else int4["ms"])
        g(f"lab_cost_{key}", f"{cost_per_million(tok_s, r['price_per_hour']):,.2f}")
