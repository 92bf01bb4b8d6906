"""The memory lab's plumbing (``notebooks/ch06-memory.ipynb``, chapter 一张 24 GiB 的卡放 8B 模型).

The card the lab plans for (24 GiB emulated on a GPU, with a guard when the GPU has less free; a
card sized from a dry run on the CPU), the planner's breakdown in Chinese (the page shows the dry
run of ``python -m minillm plan`` this way), the budget diagram, the lab's tables and figures, and
:func:`glue_chapter`. Only shapes matter here: random weights at a real shape.
"""
from __future__ import annotations

from minillm.engine.memory_plan import MemoryPlan, MemoryPlanError
from minillm.engine.units import MiB, ceil_div, fmt_bytes, fmt_int, parse_size
from minillm.lab import estimate as L

CARD, UTILIZATION = "24GiB", 0.92
GPU_CONTEXTS, CPU_CONTEXTS = (1024, 4096, 8192), (64, 128, 256)
SOURCE_WORDS = {"ledger": "账本", "estimated": "干跑（公式估算）", "profiled": "本机实测"}


# --- The card ------------------------------------------------------------------------------------

def emulated_card(lab, margin: int = 512 * MiB) -> int:
    """The card a GPU lab plans for: 24 GiB, cut to what the device reports (a "24 GB" card reports
    less: ``clamp_to_device`` would cut it too, with a warning) and to what is free now less
    ``margin`` (another process may hold part of it); a Chinese sentence says when it is smaller
    than 24 GiB. Caps PyTorch's allocator at that size."""
    import torch

    free, total = torch.cuda.mem_get_info(lab.device)
    card = min(parse_size(CARD), total, (free - margin) // MiB * MiB)
    if card < parse_size(CARD):
        print(f"{lab.device_name} 报告 {fmt_bytes(total)}，现在空闲 {fmt_bytes(free)}，放不下一张整 24 GiB 的卡："
              f"实验改按 {fmt_bytes(card)} 规划。")
    torch.cuda.set_per_process_memory_fraction(card / total, lab.device)
    return card


def cpu_card(cfg, engine_args: dict, context: int, dtype, requests: float = 4.5) -> tuple[int, MemoryPlan]:
    """A card for the CPU: the dry run's weights and activation peak plus the KV of ``requests``
    requests of ``context`` tokens, over the utilization, rounded up to a MiB. Returns it and the
    dry run it was sized from (its activation peak is the formula's)."""
    from minillm.engine.planner import plan

    args = {k: v for k, v in engine_args.items() if k != "memory_limit"}
    sizing = plan(cfg, gpu_memory="1GiB", max_model_len=-1, dtype=dtype, **args)
    needed = (sizing.weight_bytes + sizing.activation_peak_bytes
              + requests * sizing.blocks_for(context) * sizing.bytes_per_block)
    return ceil_div(int(needed / args["gpu_memory_utilization"]), MiB) * MiB, sizing


# --- The planner's breakdown, in Chinese ----------------------------------------------------------

def plan_rows(plan: MemoryPlan, contexts=GPU_CONTEXTS) -> list[list[str]]:
    """``MemoryPlan.rows`` (what ``python -m minillm plan`` prints) as the page shows it."""
    def size(n: int) -> str:
        return f"{fmt_int(n)} 字节（{fmt_bytes(n)}）"

    card = plan.device if plan.profiled else f"{fmt_bytes(plan.total_bytes)} 的卡（不碰硬件）"
    weights = "不量化（同数据类型）" if plan.quantization == "none" else plan.quantization.replace(
        "groups of", "每组")
    kv = "同数据类型（auto）" if plan.kv_cache_dtype == "auto" else plan.kv_cache_dtype
    rows = [["模型", plan.model], ["卡", card], ["数据类型", plan.dtype],
            ["权重格式", weights], ["KV cache 数据类型", kv], ["来源", SOURCE_WORDS[plan.source]], ["整张卡", size(plan.total_bytes)],
            [f"预算（× {plan.utilization}）", size(plan.budget_bytes)], ["权重", size(plan.weight_bytes)],
            [f"激活峰值（一步 {fmt_int(plan.max_num_batched_tokens)} 个 token）", size(plan.activation_peak_bytes)],
            ["PyTorch 之外的开销", size(plan.other_bytes)], ["KV 的预算", size(plan.kv_budget_bytes)],
            [f"每块字节数（{plan.block_size} 个 token）", fmt_int(plan.bytes_per_block)],
            ["KV 块数", fmt_int(plan.num_blocks)], ["KV token 数", fmt_int(plan.tokens)],
            ["max_model_len", fmt_int(plan.max_model_len)]]
    rows += [[f"同时在跑的请求 @ctx {fmt_int(c)}", fmt_int(plan.concurrent_requests(c))] for c in contexts]
    return rows


def show_plan(plan: MemoryPlan, contexts=GPU_CONTEXTS):
    from minillm.lab.report import show_table

    show_table(["项", "值"], plan_rows(plan, contexts))


def plan_error_words(err: MemoryPlanError) -> str:
    """A planner refusal in Chinese, from its numbers (the English message is the engine's)."""
    p = err.plan
    if not p.weights_fit:
        return (f"权重（{fmt_bytes(p.weight_bytes)}）放不进 {fmt_bytes(p.total_bytes)} × {p.utilization} = "
                f"{fmt_bytes(p.budget_bytes)} 的预算：换一张更大的卡，或者更小的数据类型")
    if err.max_model_len_that_fits == 0:
        return (f"连一个 KV 块（{fmt_bytes(p.bytes_per_block)}）都放不下：调小 max_num_batched_tokens，"
                f"或者调大 gpu_memory_utilization")
    needed = p.blocks_for(p.max_model_len) * p.bytes_per_block
    return (f"一个 max_model_len = {fmt_int(p.max_model_len)} 的请求要 {fmt_bytes(needed)} 的 KV，"
            f"可 KV 块一共只有 {fmt_bytes(p.kv_cache_bytes)}（{fmt_int(p.tokens)} 个 token）；"
            f"放得下的最长 max_model_len 是 {fmt_int(err.max_model_len_that_fits)}（或者传 -1 直接用它）")


def show_log(lines):
    """Lines of an English log (a vLLM start-up log), shown as English in a Chinese page."""
    import html

    from IPython.display import HTML, display

    display(HTML(f'<pre lang="en">{html.escape(chr(10).join(lines))}</pre>'))


DEDUCTION_HEADER = ["项", "字节", "折合 token", "还剩 token"]


def deductions(memory):
    """Rows from the ledger's bound to the planned tokens, one per deduction; they add up exactly."""
    from minillm.engine.config import load_config

    bound = L.memory_budget(load_config(memory.model), memory.total_bytes, memory.utilization, memory.dtype)
    per_token = memory.bytes_per_block / memory.block_size
    weights_delta = memory.weight_bytes - bound.weight_bytes
    items = [("权重：实际加载 − 账本公式", weights_delta),
             (f"最大一步的激活峰值（{fmt_int(memory.max_num_batched_tokens)} token）", memory.activation_peak_bytes),
             ("PyTorch 之外的开销", memory.other_bytes)]
    left = bound.kv_budget_bytes / per_token  # the bound in tokens, before taking whole ones
    rows = [["账本上界：卡 × 0.92 − 权重", fmt_bytes(bound.kv_budget_bytes), f"{left:,.1f}", fmt_int(left)]]
    def minus(tokens):
        return f"−{tokens:,.1f}" if tokens else "0"
    for label, size in items:
        left -= size / per_token
        rows.append([label, fmt_bytes(size), minus(size / per_token), fmt_int(left)])
    rows.append([f"只切整块（不足 {memory.block_size} token 的零头）", fmt_bytes((left - memory.tokens) * per_token),
                 minus(left - memory.tokens), fmt_int(memory.tokens)])
    rows.append([f"规划：{fmt_int(memory.num_blocks)} 块 × {memory.block_size}", fmt_bytes(memory.kv_cache_bytes),
                 fmt_int(memory.tokens), fmt_int(memory.tokens)])
    return rows


# --- The budget diagram --------------------------------------------------------------------------

def budget_diagram(ledger: MemoryPlan, dry: MemoryPlan):
    """From the whole card to the KV blocks: the ledger's boxes (blue), the planner's (orange)."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import flowchart

    blue, orange, grey = "#DCE9F5", "#FBE3D0", "#EEEEEE"
    nodes = {
        "card": (3.0, 4.6, f"整张卡\n{fmt_bytes(ledger.total_bytes)}"),
        "util": (1.0, 3.1, f"引擎可用 × {ledger.utilization}\n{fmt_bytes(ledger.budget_bytes)}"),
        "rest": (5.0, 3.1, f"不归引擎\n{fmt_bytes(ledger.total_bytes - ledger.budget_bytes)}"),
        "w": (-0.6, 1.6, f"bf16 权重\n{fmt_bytes(ledger.weight_bytes)}"),
        "left": (2.6, 1.6, f"余量 {fmt_bytes(ledger.kv_budget_bytes)}\n≤ {ledger.token_capacity:,.0f} token"),
        "act": (-0.6, 0.0, f"激活峰值\n{fmt_bytes(dry.activation_peak_bytes)}"),
        "other": (2.6, 0.0, f"PyTorch 之外\n{fmt_bytes(dry.other_bytes)}"),
        "kv": (5.8, 0.0, f"KV：{fmt_int(dry.num_blocks)} 块\n{fmt_int(dry.tokens)} token"),
    }
    edges = [("card", "util", ""), ("card", "rest", ""), ("util", "w", ""), ("util", "left", ""),
             ("left", "act", ""), ("left", "other", ""), ("left", "kv", "")]
    colors = {"card": grey, "rest": grey, "util": blue, "w": blue, "left": blue,
              "act": orange, "other": orange, "kv": orange}
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    flowchart(ax, nodes, edges, colors, width=3.0, height=1.0, fontsize=10.5)
    ax.set_ylim(-0.7, 5.3)
    return fig


# --- The lab's tables and figures -------------------------------------------------------------------

def three_ledgers(ledger: MemoryPlan, dry: MemoryPlan | None, formula: MemoryPlan, measured: MemoryPlan):
    """The ledger, the dry run and the profiled plan of the same card, side by side."""
    from minillm.lab.report import show_table

    def dry_cell(text):
        return text(dry) if dry is not None else "—（这张卡放不下干跑假定的 PyTorch 之外的开销）"

    step = fmt_int(measured.max_num_batched_tokens)
    show_table(["", "账本（估算）", "干跑（公式）", "本机实测"], [
        ["卡", fmt_bytes(ledger.total_bytes), dry_cell(lambda p: fmt_bytes(p.total_bytes)), fmt_bytes(measured.total_bytes)],
        [f"预算（× {measured.utilization}）", fmt_bytes(ledger.budget_bytes), dry_cell(lambda p: fmt_bytes(p.budget_bytes)),
         fmt_bytes(measured.budget_bytes)],
        ["权重", fmt_bytes(ledger.weight_bytes), dry_cell(lambda p: fmt_bytes(p.weight_bytes)), fmt_bytes(measured.weight_bytes)],
        [f"激活峰值（一步 {step} 个 token）", "不计", fmt_bytes(formula.activation_peak_bytes),
         fmt_bytes(measured.activation_peak_bytes)],
        ["PyTorch 之外的开销", "不计", dry_cell(lambda p: fmt_bytes(p.other_bytes)), fmt_bytes(measured.other_bytes)],
        ["KV 块数", "—", dry_cell(lambda p: fmt_int(p.num_blocks)), fmt_int(measured.num_blocks)],
        ["KV token 数", fmt_int(ledger.tokens), dry_cell(lambda p: fmt_int(p.tokens)), fmt_int(measured.tokens)],
        ["自动适配的 max_model_len", "—", dry_cell(lambda p: fmt_int(p.max_model_len)), fmt_int(measured.max_model_len)],
    ])


def show_admission(runs: list[dict], ledger: MemoryPlan):
    from minillm.lab.report import show_table

    show_table(["上下文", "账本上界", "本机规划", "提交", "同时在跑（实测）", "最大解码批", "抢占", "KV 块"], [
        [fmt_int(r["context"]), f"{ledger.requests_at(r['context']):.1f}", r["planned"], r["num_requests"],
         r["max_running"], r["max_decode_batch"], r["num_preemptions"], fmt_int(r["num_kv_blocks"])] for r in runs])


def plot_admission(runs: list[dict]):
    """Per context: requests running and waiting at each engine step, against the planned number."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    fig, axes = plt.subplots(1, len(runs), figsize=(7.6, 3.2), sharey=True)
    for ax, r in zip(axes, runs):
        steps = range(1, len(r["running"]) + 1)
        ax.step(steps, r["running"], where="post", color=ROLE_COLORS["measured"], label="在跑")
        ax.step(steps, r["waiting"], where="post", color="#888888", label="在等")
        ax.axhline(r["planned"], color=ROLE_COLORS["estimate"], ls=":", lw=1.2, label="规划数")
        ax.set_title(f"ctx {fmt_int(r['context'])}（{r['num_kv_blocks']} 块）")
        ax.set_xlabel("引擎的第几步")
    axes[0].set_ylabel("请求数")
    axes[0].legend(loc="upper right")
    return fig


def plot_plans(bars):
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import plot_memory_plans

    fig, ax = plt.subplots(figsize=(7.2, 0.75 * len(bars) + 1.6))
    plot_memory_plans(ax, bars)
    return fig


def gpu_plan_record():
    """The newest ``bench plan`` record of the 8B on an emulated 24 GiB card, or None."""
    from minillm.lab import records

    return records.latest("plan", model="llama-3.1-8b")


def recorded_admitted(record, ctx: int) -> str:
    for run in record.results.get("concurrency", []):
        if run.get("context") == ctx:
            return (f"{run['max_running']} / 规划 {run['planned']}" if "max_running" in run
                    else run.get("error", "未测"))
    return "未测"


def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.notebook import recorded
    from minillm.lab.report import comparison_table

    ledger, formula, measured, rec = r["ledger"], r["formula"], r["measured"], r["record"]
    name, card = r["lab"].config.name, fmt_bytes(r["card"])
    rows = [
        ("模型与卡", f"{name}，{card}", f"{name}，{card}，{r['lab'].device_name}",
         recorded(rec, lambda x: fmt_bytes(x.results["plan"]["total_bytes"]))),
        ("权重", fmt_bytes(ledger.weight_bytes), fmt_bytes(measured.weight_bytes),
         recorded(rec, lambda x: fmt_bytes(x.results["plan"]["weight_bytes"]))),
        ("激活峰值", f"{fmt_bytes(formula.activation_peak_bytes)}（公式）", fmt_bytes(measured.activation_peak_bytes),
         recorded(rec, lambda x: fmt_bytes(x.results["plan"]["activation_peak_bytes"]))),
        ("PyTorch 之外的开销", "不计", fmt_bytes(measured.other_bytes),
         recorded(rec, lambda x: fmt_bytes(x.results["plan"]["other_bytes"]))),
        ("KV token 数", fmt_int(ledger.tokens), fmt_int(measured.tokens),
         recorded(rec, lambda x: fmt_int(x.results["plan"]["tokens"]))),
    ]
    for run, gpu_ctx in zip(r["runs"], GPU_CONTEXTS):
        label = f"同时在跑 @ctx {fmt_int(run['context'])}"
        if gpu_ctx != run["context"]:
            label += f"（GPU 记录 @ctx {fmt_int(gpu_ctx)}）"
        rows.append((label, f"{ledger.requests_at(run['context']):.1f}", f"{run['max_running']} / 规划 {run['planned']}",
                     recorded(rec, lambda x, c=gpu_ctx: recorded_admitted(x, c))))
    comparison_table(rows)


def glue_chapter(r: dict) -> None:
    """Glue what the chapter quotes from this lab."""
    from minillm.lab.claims import claim
    from minillm.lab.notebook import g

    lab, ledger = r["lab"], r["ledger"]
    for run in r["runs"]:
        claim(run["num_free_blocks"] == run["num_kv_blocks"], "every block comes back to the pool",
              context=run["context"])
        claim(run["max_running"] == run["planned"] and run["num_preemptions"] == 0,
              "the engine runs exactly the planned number at once, the two extra wait, nobody is preempted",
              context=run["context"], ran=run["max_running"], planned=run["planned"])
        claim(ledger.requests_at(run["context"]) > run["planned"], "the ledger's bound is above the plan",
              bound=ledger.requests_at(run["context"]), planned=run["planned"])
    g("lab_device", lab.device_name)
    g("lab_model", lab.config.name)
    g("lab_card", fmt_bytes(r["card"]))
    g("lab_weights", fmt_bytes(r["measured"].weight_bytes))
    g("lab_act", fmt_bytes(r["measured"].activation_peak_bytes))
    g("lab_act_est", fmt_bytes(r["formula"].activation_peak_bytes))
    g("lab_tokens", fmt_int(r["measured"].tokens))
    g("lab_ledger_tokens", fmt_int(ledger.tokens))
    for i, run in enumerate(r["runs"]):
        g(f"lab_ctx_{i}", fmt_int(run["context"]))
        g(f"lab_est_{i}", f"{ledger.requests_at(run['context']):.1f}")
        g(f"lab_planned_{i}", fmt_int(run["planned"]))
        g(f"lab_requests_{i}", fmt_int(run["num_requests"]))
        g(f"lab_admitted_{i}", fmt_int(run["max_running"]))
    g("lab_preemptions", fmt_int(sum(run["num_preemptions"] for run in r["runs"])))
    g("lab_autofit", fmt_int(r["autofit"].max_model_len))
