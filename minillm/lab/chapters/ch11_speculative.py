"""The speculative decoding lab's plumbing (``notebooks/ch11-speculative.ipynb``, chapter 一步不止一个 token).

The ledger (the floor of a verify step of γ + 1 tokens per request beside a decode step's, the batch
at which verifying turns compute-bound, the expected accepted length τ and the speedup with the
draft's cost), the lab's measurements (``bench speculative`` on the real SmolLM2: input-grounded
and open-ended prompts, batch 1 and a larger batch; a draft of the model's own first layers at two
depths, priced by measurement), its tables and figures, and :func:`glue_chapter`. Published numbers are quoted as such, with their source.
"""
from __future__ import annotations

from minillm.lab import estimate as L
from minillm.lab.estimate import Floor, roofline_floor

CTX = 1024  # tokens of context per request in the ledger's steps
GAMMAS = (2, 4, 8)  # proposed tokens per verify step the page plots
ALPHAS = tuple(a / 100 for a in range(0, 100, 2))
NGRAM = dict(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)  # the lab's settings
LAB_BATCHES, LAB_MAX_TOKENS, LAB_REPEATS = (1, 8), 48, 2
DRAFT_LAYERS, DRAFT_GAMMA, DRAFT_MAX_TOKENS = (12, 27), 3, 32  # the self-draft runs: depths of SmolLM2's 30 layers

# Published anchors (quoted, not measured here). Spec-Bench's Leaderboard.md at commit fd2c1cd (the
# page links that version): Vicuna-7B, one RTX 3090, PyTorch 2.5.1, CUDA 12.1, greedy, batch 1.
# Method -> (overall speedup, mean accepted tokens per step, summarization speedup)
SPEC_BENCH = {"EAGLE-2": (2.19, 4.35, None), "草稿模型": (1.79, 2.28, None), "提示查找（n-gram）": (1.64, 1.73, 2.46)}


def accepted_length(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): the expected tokens a verify step yields when each of ``gamma``
    proposals is accepted with probability ``alpha``, independently, until the first rejection."""
    if not 0 <= alpha <= 1 or gamma < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 0, got {alpha}, {gamma}")
    return gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def verify_floor(cfg, gpu, batch: int, gamma: int, ctx: int = CTX, dtype="bf16") -> Floor:
    """max(F/P, M/W) of one target step that checks ``gamma`` proposals for each of ``batch``
    requests: γ + 1 positions each (γ = 0 is a plain decode step). The weights and each request's
    KV are read once; the FLOPs grow with B·(γ + 1)."""
    if batch < 1 or gamma < 0:
        raise ValueError(f"need batch >= 1 and gamma >= 0, got {batch}, {gamma}")
    positions = batch * (gamma + 1)
    flops = positions * (L.matmul_flops_per_token(cfg) + L.attention_flops_per_token(cfg, ctx))
    nbytes = L.weight_bytes(cfg, dtype) + batch * L.kv_bytes(cfg, ctx, dtype)
    return roofline_floor(flops, nbytes, gpu.bf16_flops, gpu.bandwidth)


def verify_ratio(cfg, gpu, batch: int, gamma: int, ctx: int = CTX) -> float:
    """A verify step's floor over a decode step's at the same batch."""
    return verify_floor(cfg, gpu, batch, gamma, ctx).seconds / verify_floor(cfg, gpu, batch, 0, ctx).seconds


def compute_bound_batch(cfg, gpu, gamma: int, ctx: int = CTX, limit: int = 4096) -> int | None:
    """The smallest batch whose verify step of γ + 1 positions each is compute-bound; None up to ``limit``."""
    for batch in range(1, limit + 1):
        if verify_floor(cfg, gpu, batch, gamma, ctx).bound == "compute":
            return batch
    return None


def speedup(alpha: float, gamma: int, draft_cost: float = 0.0, verify_cost: float = 1.0) -> float:
    """Tokens per unit of time over plain decoding's: τ / (γ·c + v), a draft step costing ``draft_cost``
    decode steps of the target and the verify step ``verify_cost`` of them."""
    return accepted_length(alpha, gamma) / (gamma * draft_cost + verify_cost)


def best_gamma(alpha: float, draft_cost: float, verify_cost: float = 1.0, limit: int = 16) -> int:
    """The γ in 1..``limit`` with the largest :func:`speedup`."""
    return max(range(1, limit + 1), key=lambda k: speedup(alpha, k, draft_cost, verify_cost))


def break_even_alpha(gamma: int, verify_cost: float, draft_cost: float = 0.0) -> float | None:
    """The smallest α (to 0.001) at which speculation stops being slower than plain decoding; None if none."""
    for i in range(1001):
        if speedup(i / 1000, gamma, draft_cost, verify_cost) >= 1:
            return i / 1000
    return None


def implied_overhead(speedup_x: float, tokens_per_step: float) -> float:
    """What a published (speedup, tokens per step) pair implies a step costs beyond a decode step:
    tokens per step / speedup − 1 (drafting plus verifying, in decode steps)."""
    return tokens_per_step / speedup_x - 1


def spec_bench_rows() -> list[list[str]]:
    """Spec-Bench's published speedup and tokens per step per method, and the overhead they imply."""
    return [[method, f"{x:.2f}×" + (f"（摘要 {summary:.2f}×）" if summary else ""), f"{tokens:.2f}",
             f"{implied_overhead(x, tokens):.0%}"] for method, (x, tokens, summary) in SPEC_BENCH.items()]


def verify_rows(cfg, gpus, gamma: int, batches, ctx: int = CTX) -> list[list[str]]:
    """Per card and batch: the decode floor, the verify floor, their ratio and what binds."""
    from minillm.lab.report import BOUND_WORDS

    rows = []
    for gpu in gpus:
        for b in batches:
            d, v = verify_floor(cfg, gpu, b, 0, ctx), verify_floor(cfg, gpu, b, gamma, ctx)
            rows.append([gpu.name, str(b), f"{d.seconds * 1e3:.2f} ms", f"{v.seconds * 1e3:.2f} ms",
                         f"{v.seconds / d.seconds:.2f}×", BOUND_WORDS[v.bound]])
    return rows


def plot_verify_ratio(ax, cfg, gpus, batches=tuple(2 ** i for i in range(10)), ctx: int = CTX) -> None:
    """A verify step's floor over a decode step's against the batch, one line per γ and card."""
    for gpu, style in zip(gpus, ("-", "--")):
        for gamma in GAMMAS:
            ax.plot(batches, [verify_ratio(cfg, gpu, b, gamma, ctx) for b in batches], style, marker=".",
                    label=f"{gpu.name}，γ = {gamma}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="批大小 B（请求数）", ylabel="验证一步 ÷ 解码一步（下界之比）")
    ax.legend(fontsize=8)


def plot_model(ax_tau, ax_speed, draft_cost: float) -> None:
    """τ against α for each γ (left); speedup at small batch, prompt lookup (solid) and a draft
    costing ``draft_cost`` decode steps (dashed), against α (right)."""
    for gamma in GAMMAS:
        line, = ax_tau.plot(ALPHAS, [accepted_length(a, gamma) for a in ALPHAS], label=f"γ = {gamma}")
        ax_speed.plot(ALPHAS, [speedup(a, gamma) for a in ALPHAS], color=line.get_color(), label=f"提示查找，γ = {gamma}")
        ax_speed.plot(ALPHAS, [speedup(a, gamma, draft_cost) for a in ALPHAS], color=line.get_color(),
                      linestyle="--", label=f"草稿模型，γ = {gamma}")
    ax_speed.axhline(1, color="grey", linewidth=0.8)
    ax_tau.set(xlabel="接受率 α", ylabel="每步期望产出 τ（token）")
    ax_speed.set(xlabel="接受率 α", ylabel="加速比")
    ax_tau.legend()
    ax_speed.legend(fontsize=8)


# --- The lab's measurements ----------------------------------------------------------------------

def measure(lab, tasks=("grounded", "open"), batches=LAB_BATCHES) -> dict:
    """``bench speculative`` for each (task, batch): off and on in turns in one run, one torch
    thread on the CPU. Maps (task, batch) to the bench's result."""
    from minillm.lab.bench_speculative import bench_speculative
    from minillm.lab.notebook import TEXT_MODEL

    return {(t, b): bench_speculative(TEXT_MODEL, lab.device, lab.dtype, batch=b, max_tokens=LAB_MAX_TOKENS, repeats=LAB_REPEATS,
                                      task=t, **NGRAM)
            for t in tasks for b in batches}


TASK_WORDS = {"grounded": "照抄给定段落", "open": "开放式提问"}


NO_DRAFTS = "—"  # what the table shows for a run in which nothing was proposed


def run_words(r: dict) -> dict[str, str]:
    """A run's numbers as the table and the page write them: acceptance, tokens per step over
    speculation off's, tokens per verify measured and τ by the formula from the measured acceptance
    (a dash for the last three when nothing was proposed), speedup."""
    proposed = r["num_draft_tokens"] > 0
    formula = accepted_length(r["acceptance_rate"], NGRAM["num_speculative_tokens"])
    return {"accept": f"{r['acceptance_rate']:.0%}" if proposed else NO_DRAFTS,
            "tps": f"{r['tokens_per_step_on'] / r['tokens_per_step_off']:.2f}×",
            "tau": f"{r['mean_accepted_length']:.2f}" if proposed else NO_DRAFTS,
            "formula": f"{formula:.2f}" if proposed else NO_DRAFTS, "speedup": f"{r['speedup']:.2f}×"}


def measured_rows(runs: dict) -> list[list[str]]:
    """One row per run: acceptance, tokens per step, τ measured and by the formula, times, speedup."""
    rows = []
    for (task, batch), r in runs.items():
        w = run_words(r)
        rows.append([TASK_WORDS[task], str(batch), w["accept"], w["tps"], w["tau"], w["formula"],
                     f"{r['off_s']:.2f} s", f"{r['on_s']:.2f} s", w["speedup"], "是" if r["identical"] else "否"])
    return rows


MEASURED_HEADER = ["任务", "批", "接受率", "每步 token（相对不开）", "每次验证产出（实测 τ）", "公式 τ", "关", "开", "加速",
                   "输出相同"]


def plot_measured(ax, runs: dict) -> None:
    """Grouped bars: the measured speedup per task at each batch, a grey line at 1×."""
    batches = sorted({b for _, b in runs})
    tasks = list(dict.fromkeys(t for t, _ in runs))
    width = 0.8 / len(batches)
    for i, b in enumerate(batches):
        xs = [j + (i - (len(batches) - 1) / 2) * width for j in range(len(tasks))]
        ax.bar(xs, [runs[(t, b)]["speedup"] for t in tasks], width, label=f"批 {b}")
    ax.axhline(1, color="grey", linewidth=0.8)
    ax.set_xticks(range(len(tasks)), [TASK_WORDS[t] for t in tasks])
    ax.set(ylabel="加速比（关 ÷ 开 的墙钟时间）")
    ax.legend()


def tau_sentence(run: dict, gamma: int = NGRAM["num_speculative_tokens"]) -> str:
    """Where a run's measured tokens per verify stand against τ from its measured acceptance rate;
    short verifies are blamed only when they carried a tenth or more fewer than ``gamma`` proposals."""
    from minillm.lab.claims import choose

    if not run["num_drafts"]:
        return "这次运行一次也没猜：没有做过验证，也就没有可比的 τ。"
    measured, formula = run["mean_accepted_length"], accepted_length(run["acceptance_rate"], gamma)
    if formula <= 1:
        return "一个猜测也没被接受（α = 0）：每次验证只产出目标模型自己算出的那一个 token，公式给的 τ 也正好是 1。"
    if abs(measured - formula) <= 0.1 * formula:
        return "实测的每次验证产出和公式算出的 τ 相差不到一成：这段文本上，每个猜测被接受的机会大致一样。"
    if measured > formula:
        return ("实测的每次验证产出比公式算出的 τ 多：提示查找的命中是成串的，一旦开始照抄就一路猜对，"
                "不像公式假设的那样每个位置独立地以 α 被接受。")
    return choose(run["num_draft_tokens"] / run["num_drafts"] <= 0.9 * gamma,
                  "实测的每次验证产出比公式算出的 τ 少：猜测常常不足 γ 个（查到的续写太短，或快到 max_tokens），"
                  "而公式按每次都猜满 γ 个计算。",
                  "实测的每次验证产出比公式算出的 τ 少：被接受的猜测常常一开头就断，后面的位置更难猜中。")


def batch_sentence(small: dict, big: dict, big_batch: int) -> str:
    """Whether the same text's speedup shrank from batch 1 to ``big_batch``, as a whole sentence."""
    from minillm.lab.claims import choose

    return choose(big["speedup"] < small["speedup"], f"批 {big_batch} 时，照抄给定段落的加速比批 1 时小。",
                  f"批 {big_batch} 时，照抄给定段落的加速并不比批 1 时小。")


def open_sentence(run: dict) -> str:
    """What speculation did to open-ended prompts at batch 1, as a whole sentence."""
    from minillm.lab.claims import choose

    if not run["num_draft_tokens"]:
        return "批 1 的开放式提问里，提示查找一次也没找到可猜的续写：查不到就不猜，每一步都是普通解码。"
    if not run["num_accepted_tokens"]:
        return choose(
            run["speedup"] >= 0.95,
            "批 1 的开放式提问里，提示查找猜了几次，一个也没被收下；查不到就不猜，猜错的代价只是多算几个位置，整体并不比不开慢。",
            "批 1 的开放式提问里，提示查找猜了几次，一个也没被收下，白算的位置让它比不开还慢。")
    return choose(run["speedup"] >= 0.95,
                  "开放式提问时收下的猜测不多，但查不到就不猜，猜错的代价只是多算几个位置，整体并不比不开慢。",
                  "开放式提问时反而变慢了：猜错的位置白算了，查找本身也要时间，在 CPU 上多算几个位置并不便宜。")


# --- A draft of the model's own first layers ---------------------------------------------------------

def bytes_draft_cost(cfg, num_draft_layers: int, dtype="bf16") -> float:
    """The draft's cost as the bytes ratio would have it: the matmul weights a pass of the first
    ``num_draft_layers`` layers and the output layer reads, over a whole step's."""
    draft = cfg.replace(num_layers=num_draft_layers)
    return L.matmul_weight_bytes(draft, 1, dtype) / L.matmul_weight_bytes(cfg, 1, dtype)


def measure_draft(lab, layers=DRAFT_LAYERS) -> dict:
    """``bench speculative --method draft_layers`` at batch 1 on the open-ended prompts (nothing to
    copy from), one run per draft depth. Maps the depth to the bench's result."""
    from minillm.lab.bench_speculative import bench_speculative
    from minillm.lab.notebook import TEXT_MODEL

    return {n: bench_speculative(TEXT_MODEL, lab.device, lab.dtype, batch=1, max_tokens=DRAFT_MAX_TOKENS, repeats=1,
                                 num_speculative_tokens=DRAFT_GAMMA, task="open", method="draft_layers",
                                 num_draft_layers=n)
            for n in layers}


def draft_words(r: dict, cfg) -> dict[str, str]:
    """A draft run's numbers as the table and the page write them."""
    n = r["speculative_config"]["num_draft_layers"]
    return {"accept": f"{r['acceptance_rate']:.0%}", "tau": f"{r['mean_accepted_length']:.2f}",
            "gamma": f"{r['proposals_per_verify']:.2f}", "c": f"{r['draft_cost']:.2f}",
            "c_bytes": f"{bytes_draft_cost(cfg, n):.2f}", "v": f"{r['verify_cost']:.2f}",
            "predicted": f"{r['predicted_speedup']:.2f}×", "speedup": f"{r['speedup']:.2f}×"}


DRAFT_HEADER = ["草稿层数", "接受率", "τ（实测）", "每次验证的猜测 γ", "c（实测）", "c（字节之比）", "v（实测）",
                "τ/(γc+v)", "实测加速"]


def draft_rows(drafts: dict, cfg) -> list[list[str]]:
    """One row per draft depth: acceptance, τ, γ, the measured c beside the bytes ratio, v, the
    speedup the formula predicts from them and the one measured."""
    rows = []
    for n, r in drafts.items():
        w = draft_words(r, cfg)
        rows.append([f"{n} / {cfg.num_layers}", w["accept"], w["tau"], w["gamma"], w["c"], w["c_bytes"], w["v"],
                     w["predicted"], w["speedup"]])
    return rows


def draft_sentence(drafts: dict) -> str:
    """What the two depths did, as a whole sentence: faster or not, and what depth bought (the
    deep draft's pass counts as much dearer from 1.3 times the shallow one's)."""
    from minillm.lab.claims import choose

    shallow, deep = (drafts[n] for n in sorted(drafts))
    if max(r["speedup"] for r in drafts.values()) >= 1:
        return "至少有一种深度让解码变快了：它的猜测被收下得够多，抵过了草稿自己那几遍。"
    if deep["acceptance_rate"] <= shallow["acceptance_rate"]:
        return "两种深度都让解码变慢了，而且深的草稿并没有比浅的猜得更准。"
    return choose(deep["draft_cost"] >= 1.3 * shallow["draft_cost"],
                  "两种深度都让解码变慢了：浅的草稿便宜得多，可它的猜测大多被拒；深的草稿猜得准一些，每一遍却贵得多。",
                  "两种深度都让解码变慢了：深的草稿猜得准一些，浅的却并不比它便宜多少，它的猜测又大多被拒。")


def cost_sentence(drafts: dict, cfg) -> str:
    """The shallow draft's measured c against its bytes ratio (far above: from 1.3 times), as a whole sentence."""
    from minillm.lab.claims import choose

    n = min(drafts)
    return choose(drafts[n]["draft_cost"] >= 1.3 * bytes_draft_cost(cfg, n),
                  "浅的草稿实测的 c 远高于它的字节之比：它少读的那些层省下的时间，抵不过每一遍都有的固定开销。",
                  "浅的草稿实测的 c 和它的字节之比相差不大：这台机器上每一遍的固定开销不算重。")


def predict_sentence(drafts: dict) -> str:
    """Whether τ / (γc + v) from the measured parts lands near the measured speedup (within 15%)."""
    from minillm.lab.claims import choose

    close = all(abs(r["predicted_speedup"] / r["speedup"] - 1) <= 0.15 for r in drafts.values())
    return choose(close, "用实测的 c 和 v 代进公式，预测的加速和实测的相差不到 15%：这几项已经说清了时间花在哪里。",
                  "用实测的 c 和 v 代进公式，预测的加速和实测的差了 15% 以上：一步里还有公式没算进去的开销"
                  "（例如每一遍在主机上准备输入的时间随批和长度变化），要在一台空闲的机器上重测。")


def glue_chapter(r: dict) -> None:
    """Glue what the chapter quotes from this lab."""
    from minillm.lab.claims import choose, claim
    from minillm.lab.notebook import g

    lab, runs = r["lab"], r["runs"]
    small, big = LAB_BATCHES
    g("lab_device", lab.device_name)
    g("lab_threads", lab.threads)
    g("lab_model", next(iter(runs.values()))["model"])
    g("lab_big_batch", str(big))
    g("lab_max_tokens", str(LAB_MAX_TOKENS))
    g("lab_gamma", str(NGRAM["num_speculative_tokens"]))
    for (task, batch), x in runs.items():
        for name, words in run_words(x).items():
            g(f"lab_{task}_b{batch}_{name}", words)
    claim(all(x["identical"] for x in runs.values()), "greedy outputs with and without speculation are identical")
    grounded, opened = runs[("grounded", small)], runs[("open", small)]
    g("lab_identical", choose(all(x["identical"] for x in runs.values()),
                              "每一次运行里，开和关生成的 token 都一模一样。",
                              "有一次运行里开和关生成的 token 不一样：这是引擎的错误，应当报告。"))
    g("lab_task_sentence", choose(
        grounded["speedup"] > max(1.1, opened["speedup"]) and grounded["acceptance_rate"] > opened["acceptance_rate"],
        "照抄给定段落时提示查找的猜测大多被收下，墙钟时间明显缩短；开放式提问的回答没有可抄的原文，收益也就所剩无几。",
        "这台机器上照抄给定段落的加速并不比开放式提问明显：要在一台空闲的机器上重测。"))
    g("lab_open_sentence", open_sentence(opened))
    g("lab_batch_sentence", batch_sentence(grounded, runs[("grounded", big)], big))
    g("lab_tau_sentence", tau_sentence(grounded))
    glue_drafts(r["drafts"])


def glue_drafts(drafts: dict) -> None:
    """Glue the self-draft runs: each depth's numbers, the sentences, and exercise 4's answer
    (the acceptance rate the deep draft would need to break even at its measured c and v)."""
    from minillm.engine.config import load_config
    from minillm.lab.claims import claim
    from minillm.lab.notebook import g

    cfg = load_config(next(iter(drafts.values()))["model"])
    claim(all(x["identical"] for x in drafts.values()), "greedy outputs with and without the self-draft are identical")
    claim(all(x["acceptance_rate"] < 0.5 for x in drafts.values()), "the self-draft's acceptance is low at both depths",
          acceptance=[x["acceptance_rate"] for x in drafts.values()])
    shallow, deep = (drafts[n] for n in sorted(drafts))
    claim(deep["acceptance_rate"] > shallow["acceptance_rate"], "the deeper self-draft is accepted more often",
          shallow=shallow["acceptance_rate"], deep=deep["acceptance_rate"])
    g("lab_draft_gamma", str(DRAFT_GAMMA))
    g("lab_draft_max_tokens", str(DRAFT_MAX_TOKENS))
    g("lab_num_layers", str(cfg.num_layers))
    for i, (n, x) in enumerate(sorted(drafts.items())):
        g(f"lab_draft{i}_layers", str(n))
        for name, words in draft_words(x, cfg).items():
            g(f"lab_draft{i}_{name}", words)
    g("lab_draft_sentence", draft_sentence(drafts))
    g("lab_cost_sentence", cost_sentence(drafts, cfg))
    g("lab_predict_sentence", predict_sentence(drafts))
    deep = drafts[max(drafts)]
    alpha = break_even_alpha(DRAFT_GAMMA, deep["verify_cost"], deep["draft_cost"])
    g("lab_ex4_alpha", break_even_sentence(alpha, "草稿加验证这一步"))


def break_even_sentence(alpha: float | None, step_words: str) -> str:
    """An exercise's answer as a whole sentence: the break-even acceptance rate, or that none exists
    (``step_words`` names what τ = γ + 1 would have to pay for)."""
    if alpha is None:
        return f"没有这样的接受率：即使每个猜测都被收下，τ = γ + 1 也抵不过{step_words}的花费。"
    return f"接受率至少要 {alpha:.0%}，这一步才不比普通解码慢。"
