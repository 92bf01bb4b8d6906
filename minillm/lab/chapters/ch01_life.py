"""The plumbing of the lab 一次请求的一生 (chapter 1, ``notebooks/ch01-life.ipynb``).

The lab's cells keep the engine calls in sight (``LLM(...)``, ``generate``, ``chat``); this module
builds their prompts from the book's English text, turns their outputs (``RequestOutput`` lists
and run records) into tables and figures, and glues the chapter's numbers and sentences.
:func:`page_numbers` is the ledger of the chapter page (the generic 7B of its story), computed
here so that the page and the tests read one arithmetic.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

from minillm.lab import estimate as L
from minillm.lab.claims import choose, claim, floors_beaten
from minillm.lab.estimate import GB, GiB, KiB, MiB, fmt_bytes, fmt_int
from minillm.lab.report import BOUND_WORDS, beaten_words, floor_words, profile_beat_words, show_table
from minillm.lab.tokens import TEXTS, count, count_tokens, from_transformers, sample_text, tokenizers

# --- Prompts ---------------------------------------------------------------------------------------

# The colleagues' questions, in English (the model is English-only); the first is the chapter's
# opening question, "用三句话解释 KV cache".
QUESTIONS = (
    sample_text("scene_en"),
    "In one sentence, what is the difference between a process and a thread?",
    "How do I reverse a list in Python? Answer in one line.",
    "Give me three tips for a productive morning, one short line each.",
    "In one sentence, what causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Suggest a name for a coffee shop next to a library.",
    "How many minutes are there in a week?",
    "Translate 'good morning' into French.",
    "What does the HTTP status code 404 mean? One sentence, please.",
    "Suggest a healthy lunch I can make in ten minutes, in one sentence.",
    "Why is the sky blue? Answer in one sentence.",
    "What is the capital of Australia?",
    "In one sentence, what is a hash function?",
    "What is the largest planet in our solar system?",
    "What is the chemical symbol for gold?",
    "In one sentence, how does binary search work?",
    "Name three benefits of regular exercise.",
    "At what temperature does water boil in Fahrenheit?",
    "What is the capital of Japan?",
)
# Four colleagues' questions about the same contract (the first is data/texts/question_en.txt).
CONTRACT_QUESTIONS = (
    sample_text("question_en"),
    "Who must issue the VAT invoice, and when?",
    "How long does the confidentiality obligation last after the contract ends?",
    "What is the cap on either party's liability?",
)
CONTRACT_INTRO = "Here is an excerpt of our service contract with Party B.\n\n"
_SLOT = "\x00"


def user(content: str) -> list[dict]:
    """One user message, as a chat template takes it."""
    return [{"role": "user", "content": content}]


def contract_ids(tokenizer, n_tokens: int, question: str = CONTRACT_QUESTIONS[0]) -> list[int]:
    """A chat prompt of exactly ``n_tokens`` tokens: the book's English contract excerpt (repeated as
    often as needed, cut to length) and then ``question``, in ``tokenizer``'s chat template."""
    text = tokenizer.apply_chat_template(user(_SLOT), tokenize=False, add_generation_prompt=True)
    before, after = text.split(_SLOT)
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    head, tail = encode(before + CONTRACT_INTRO), encode("\n\n" + question + after)
    room = n_tokens - len(head) - len(tail)
    if room < 1:
        raise ValueError(f"{n_tokens} tokens cannot hold the chat template and the question "
                         f"({len(head) + len(tail)} tokens)")
    excerpt = sample_text("contract_en")
    copies = math.ceil(room / len(encode(excerpt))) + 1
    return head + encode("\n\n".join([excerpt] * copies))[:room] + tail


def split(ids: list[int], parts: int) -> list[list[int]]:
    """``ids`` cut into ``parts`` consecutive pieces of equal length (the last takes the rest)."""
    if not 1 <= parts <= len(ids):
        raise ValueError(f"cannot split {len(ids)} tokens into {parts} pieces")
    size = len(ids) // parts
    return [ids[i * size:(i + 1) * size] for i in range(parts - 1)] + [ids[(parts - 1) * size:]]


# --- The GPU memory guard ---------------------------------------------------------------------------

ACTIVATION_RESERVE = 4 * GiB  # what one 2,048-token step of the 8B needs beside the KV, with room


def requests_that_fit(free_bytes: int, kv_bytes_each: int, requests: int,
                      reserve_bytes: int = ACTIVATION_RESERVE) -> int:
    """How many of ``requests`` requests, ``kv_bytes_each`` of KV each, fit in ``free_bytes`` once
    ``reserve_bytes`` is kept for the step's activations (at least one)."""
    return max(1, min(requests, int((free_bytes - reserve_bytes) // kv_bytes_each)))


def fitting(lab, requests: int, tokens_each: int) -> int:
    """``requests``, or fewer when this GPU's free memory cannot hold their KV (all of them on the
    CPU); says so in a sentence when it shrinks the experiment."""
    if not lab.on_gpu:
        return requests
    import torch

    free = torch.cuda.mem_get_info(lab.device)[0]
    n = requests_that_fit(free, L.kv_bytes(lab.config, tokens_each, lab.dtype_name), requests)
    if n < requests:
        print(f"这张卡现在只剩 {free / GiB:.1f} GiB 空闲显存，放不下 {requests} 个 {tokens_each:,} token 的请求，"
              f"这一节只跑 {n} 个。")
    return n


# --- One experiment's result ------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """An experiment's outputs and its engine's run record (``records.run_record``); the engine
    itself, and its KV pool, can then be let go."""

    outputs: list
    record: dict

    @property
    def metrics(self) -> list:
        return [o.metrics for o in self.outputs]

    @property
    def steps(self) -> list[dict]:
        return self.record["stats"]["steps"]

    @property
    def preemptions(self) -> int:
        return self.record["stats"]["num_preemptions"]

    def decode_steps(self, batch: int) -> list[float]:
        """Seconds of the steps in which exactly ``batch`` requests decoded and nobody prefilled."""
        return [s["end"] - s["start"] for s in self.steps
                if s["num_decode_tokens"] == batch and not s["num_prefill_tokens"]]

    def answer_lengths(self) -> list[int]:
        return [m.num_output_tokens for m in self.metrics]

    def first_token_steps(self) -> list[int]:
        """For each request, the engine step (counted from 1) at whose end its first token came."""
        ends = {s["end"]: i + 1 for i, s in enumerate(self.steps)}
        return [ends[m.first_token_time] for m in self.metrics]

    def mean_step(self) -> float:
        return statistics.fmean(s["end"] - s["start"] for s in self.steps)


def runner(lab, budget: int, block: int):
    """``run(prompts, params, pool=None, **settings)``: the prompts on a fresh engine on ``lab.model``
    (a KV pool of ``pool`` tokens, or just enough for them; ``budget`` tokens a step and no prefix
    caching unless ``settings`` say otherwise), kept as a :class:`Run`; the engine is let go."""
    from minillm import LLM
    from minillm.lab import records
    from minillm.lab.notebook import free_memory, room

    def run(prompts, params, pool=None, **settings) -> Run:
        settings = {"max_num_batched_tokens": budget, "enable_prefix_caching": False, **settings}
        pool = pool or room([len(p) for p in prompts], params.max_tokens, block)
        llm = LLM(lab.model, num_kv_blocks=pool // block, block_size=block, **settings)
        result = Run(llm.generate(prompts, params, use_tqdm=False), records.run_record(llm))
        del llm
        free_memory(lab.device)
        return result

    return run


def warm_up(run, chat, params) -> None:
    """Pay the first calls' one-time costs, untimed: a tiny run of each engine."""
    run([[1] * 64] * 2, params)
    chat.generate([[1] * 64], params, use_tqdm=False)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def seconds_words(seconds: float) -> str:
    """``850 ms`` below a second, ``3.2 s`` above."""
    return ms(seconds) if seconds < 1 else f"{seconds:,.1f} s"


FINISH_WORDS = {"stop": "遇到模型自己的结束符", "length": "写到了 max_tokens 的上限"}


def lengths_cell(lengths: list[int]) -> str:
    """Answer lengths in a table cell: ``81``, or ``29（6–81）`` (median, range)."""
    if len(lengths) == 1:
        return f"{lengths[0]}"
    return f"{statistics.median(lengths):g}（{min(lengths)}–{max(lengths)}）"


def lengths_words(lengths: list[int]) -> str:
    """Answer lengths in prose: ``回答长度的中位数是 29 个 token，最短 6 个，最长 81 个``."""
    return (f"回答长度的中位数是 {statistics.median(lengths):g} 个 token，最短 {min(lengths)} 个，"
            f"最长 {max(lengths)} 个")


def tpot_from_e2e(metrics) -> float:
    """(end-to-end − TTFT) / (output tokens − 1)."""
    return (metrics.e2e - metrics.ttft) / (metrics.num_output_tokens - 1)


# --- 1. The scene, 2. the life of a request ----------------------------------------------------------

def show_scene(scene: Run) -> None:
    out = scene.outputs[0]
    m = out.metrics
    show_table(["量", "值"], [
        ["提问（经过聊天模板）", f"{m.num_prompt_tokens} token"],
        ["回答", f"{m.num_output_tokens} token，{FINISH_WORDS[out.finish_reason]}"],
        ["首字延迟 TTFT", ms(m.ttft)],
        [f"出字间隔 TPOT（{m.num_output_tokens - 1} 个间隔的平均）", ms(m.tpot)],
        ["端到端", ms(m.e2e)],
        ["(端到端 − TTFT) / (token 数 − 1)", ms(tpot_from_e2e(m))],
    ])


def plot_life(life: Run, index: int = 1) -> None:
    """The timeline of request ``index`` of ``life``: the engine's steps above, its phases below."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE

    m = life.metrics[index]
    t0 = m.arrival_time

    def rel(t):
        return (t - t0) * 1e3

    fig, ax = plt.subplots(figsize=(7.8, 3.0))
    for s in life.steps:
        color = PALETTE[1] if s["num_prefill_tokens"] else PALETTE[0]
        ax.barh(1, rel(s["end"]) - rel(s["start"]), left=rel(s["start"]), height=0.5, color=color,
                edgecolor="white", linewidth=0.6)
    for label, start, end, color in (("排队", m.arrival_time, m.first_scheduled_time, "#BBBBBB"),
                                     ("预填充", m.first_scheduled_time, m.first_token_time, PALETTE[1]),
                                     ("解码", m.first_token_time, m.finish_time, PALETTE[0])):
        ax.barh(0, rel(end) - rel(start), left=rel(start), height=0.5, color=color, alpha=0.85, label=label)
    ax.vlines([rel(t) for t in m.token_times], -0.25, 0.25, color="black", linewidth=0.5)
    ax.annotate("首字", (rel(m.first_token_time), -0.3), xytext=(0, -13), textcoords="offset points",
                fontsize=9, ha="center")
    ax.set_yticks([0, 1], ["这个请求", "引擎的每一步"])
    ax.set_ylim(-0.85, 1.5)
    ax.set_xlabel("从到达算起的时间 (ms)；上排橙色：含预填充的步，蓝色：纯解码的步；竖线：生成的 token")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.32), ncols=3)


def show_stages(life: Run, index: int = 1) -> None:
    m = life.metrics[index]
    show_table(["阶段", "时间"], [
        ["排队（到达 → 第一次被调度）", ms(m.queueing)],
        ["预填充（第一次被调度 → 首字）", ms(m.first_token_time - m.first_scheduled_time)],
        ["首字延迟 TTFT", ms(m.ttft)],
        [f"解码（{m.num_output_tokens} 个 token）", ms(m.finish_time - m.first_token_time)],
        ["端到端", ms(m.e2e)],
    ])


# --- 3. More users at once ---------------------------------------------------------------------------

TTFT_FACTOR, TPOT_FACTOR = 10, 2  # the SLO: no worse than this many times the lone user's


def decode_floor(cfg, batch: int, ctx: float, dtype, peak_flops: float, bandwidth: float) -> L.Floor:
    """The floor max(F/P, M/W) of one decode step of ``batch`` requests at mean context ``ctx``."""
    return L.decode_step(cfg, batch, max(1, round(ctx)), bandwidth, dtype).floor(peak_flops)


def step_context(run: Run) -> float:
    """Mean context of a step in which every request of ``run`` decodes: its prompt, plus half of
    the shortest answer (the window in which all of them are still running)."""
    ms_ = run.metrics
    return statistics.fmean(m.num_prompt_tokens for m in ms_) + min(m.num_output_tokens for m in ms_) / 2


def sweep_rows(sweep: dict[int, Run], cfg, dtype, peak_flops, bandwidth) -> dict[int, dict]:
    """Per batch: the run's summary under the SLO set by the lone user, the decode floor, and the
    median step in which every request decoded."""
    from minillm.lab.metrics import SLO, summarize

    alone = sweep[1].metrics[0]
    slo = SLO(ttft=TTFT_FACTOR * alone.ttft, tpot=TPOT_FACTOR * alone.tpot)
    rows = {}
    for b, run in sweep.items():
        steps = run.decode_steps(b)
        rows[b] = {"summary": summarize(run.metrics, slo), "lengths": run.answer_lengths(),
                   "floor": decode_floor(cfg, b, step_context(run), dtype, peak_flops, bandwidth),
                   "step": statistics.median(steps) if steps else None, "slo": slo}
    return rows


def show_sweep(sweep, cfg, dtype, peak_flops, bandwidth) -> None:
    rows = sweep_rows(sweep, cfg, dtype, peak_flops, bandwidth)
    show_table(["同时在线", "回答 token：中位数（范围）", "总吞吐 (token/s)", "平均 TTFT", "平均 TPOT", "达标的比例",
                "goodput (请求/s)", "一步解码的下界", "一步实测（都在解码）"], [
        [b, lengths_cell(r["lengths"]), fmt_int(r["summary"]["output_throughput"]),
         ms(r["summary"]["ttft"]["mean"]), ms(r["summary"]["tpot"]["mean"]),
         f"{r['summary']['slo_attainment']:.0%}", f"{r['summary']['goodput']:,.2f}", floor_words(r["floor"]),
         ms(r["step"]) if r["step"] else "—"] for b, r in rows.items()])


def plot_sweep(sweep) -> None:
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    rows = {b: run.metrics for b, run in sweep.items()}
    from minillm.lab.metrics import summarize

    xs = list(rows)
    summaries = {b: summarize(m) for b, m in rows.items()}
    alone_tpot = rows[1][0].tpot
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7.8, 3.1))
    ax1.plot(xs, [summaries[b]["output_throughput"] for b in xs], "o-", color=ROLE_COLORS["measured"])
    ax1.set_ylabel("总吞吐 (token/s)")
    ax1.set_title("产能：同时在线越多越高")
    ax2.plot(xs, [summaries[b]["tpot"]["mean"] * 1e3 for b in xs], "o-", color=ROLE_COLORS["measured"],
             label="平均 TPOT")
    ax2.axhline(TPOT_FACTOR * alone_tpot * 1e3, color="black", linestyle="--", linewidth=1,
                label=f"目标：一个人时的 {TPOT_FACTOR} 倍")
    ax2.set_ylabel("ms / token")
    ax2.set_title("体验：每个人的出字间隔")
    ax2.legend(loc="upper left")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(b) for b in xs])
        ax.minorticks_off()
        ax.set_xlabel("同时在线的请求数")
        ax.set_ylim(bottom=0)


# --- 4. One long request or many short ones (and the step budget) -----------------------------------

def ab_rows(ab: dict, cfg, dtype, peak_flops, bandwidth) -> dict[int, dict]:
    """Per step budget: A's and B's TTFTs and step counts, and the prefill floor of each."""
    rows = {}
    for budget in sorted({b for b, _ in ab}):
        a, b = ab[budget, "A"], ab[budget, "B"]
        n = sum(m.num_prompt_tokens for m in a.metrics)
        rows[budget] = {
            "a": a.metrics[0].ttft, "a_steps": len(a.steps),
            "b": [m.ttft for m in b.metrics], "b_steps": len(b.steps),
            "a_floor": L.prefill(cfg, n, dtype).floor(peak_flops, bandwidth),
            "b_floor": L.prefill(cfg, n, dtype, sequences=len(b.outputs)).floor(peak_flops, bandwidth),
            "a_attention": L.prefill_attention_flops(cfg, n),
            "b_attention": L.prefill(cfg, n, dtype, sequences=len(b.outputs)).attention_flops,
            "tokens": n, "pieces": len(b.outputs),
            "a_first_step": a.first_token_steps()[0], "b_first_steps": b.first_token_steps(),
            "a_mean_step": a.mean_step(), "b_mean_step": b.mean_step(),
        }
    return rows


def show_ab(ab, budget, cfg, dtype, peak_flops, bandwidth) -> None:
    r = ab_rows(ab, cfg, dtype, peak_flops, bandwidth)[budget]
    show_table(["", f"A：1 × {fmt_int(r['tokens'])} token", f"B：{r['pieces']} × {fmt_int(r['tokens'] // r['pieces'])} token"], [
        ["首字最早", ms(r["a"]), ms(min(r["b"]))],
        ["首字平均", ms(r["a"]), ms(statistics.fmean(r["b"]))],
        ["首字最晚", ms(r["a"]), ms(max(r["b"]))],
        ["第一个字出在第几步（B 取平均）", r["a_first_step"], f"{statistics.fmean(r['b_first_steps']):.1f}"],
        ["引擎一共走了几步", r["a_steps"], r["b_steps"]],
        ["注意力运算（账本）", f"{r['a_attention'] / 1e9:,.2f} GFLOP", f"{r['b_attention'] / 1e9:,.2f} GFLOP"],
        ["整段预填充的下界", floor_words(r["a_floor"]), floor_words(r["b_floor"])],
    ])


def plot_ab(ab, budget) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from minillm.lab.plotting import PALETTE, ROLE_COLORS

    a, b = ab[budget, "A"].metrics[0].ttft, [m.ttft for m in ab[budget, "B"].metrics]
    fig, ax = plt.subplots(figsize=(7.2, 3.0))
    ax.barh([0], [a * 1e3], color=ROLE_COLORS["measured"])
    ax.barh(np.arange(1, len(b) + 1), [t * 1e3 for t in b], color=PALETTE[4])
    ax.set_yticks(np.arange(len(b) + 1), ["A：一个长请求"] + [f"B：第 {i + 1} 段" for i in range(len(b))])
    ax.invert_yaxis()
    ax.set_xlabel("TTFT (ms)")


def show_budgets(ab, cfg, dtype, peak_flops, bandwidth) -> None:
    rows = ab_rows(ab, cfg, dtype, peak_flops, bandwidth)
    show_table(["每步预算（token）", "A：首字", "A：步数", "B：平均首字", "B：最晚的首字", "B：步数"], [
        [fmt_int(budget), ms(r["a"]), r["a_steps"], ms(statistics.fmean(r["b"])), ms(max(r["b"])), r["b_steps"]]
        for budget, r in rows.items()])


# --- 5. Slow tokens ------------------------------------------------------------------------------------

def slow_rows(alone: Run, slow: Run, cfg, dtype, peak_flops, bandwidth) -> dict[str, dict]:
    """The lone short question and the batch with long contexts: TPOT, the median step in which all
    of them decoded, and that step's floor."""
    rows = {}
    for name, run in (("alone", alone), ("slow", slow)):
        b = len(run.outputs)
        steps = run.decode_steps(b)
        rows[name] = {"batch": b, "ctx": step_context(run),
                      "tpot": statistics.fmean(m.tpot for m in run.metrics),
                      "step": statistics.median(steps) if steps else None,
                      "floor": decode_floor(cfg, b, step_context(run), dtype, peak_flops, bandwidth)}
    return rows


def show_slow(alone, slow, cfg, dtype, peak_flops, bandwidth) -> None:
    rows = slow_rows(alone, slow, cfg, dtype, peak_flops, bandwidth)
    ridge = peak_flops / bandwidth
    show_table(["", "批", "平均上下文（token）", "TPOT", "一步实测（都在解码）", "账本下界", "强度 / 本机脊点"], [
        [what, r["batch"], fmt_int(r["ctx"]), ms(r["tpot"]), ms(r["step"]) if r["step"] else "—",
         floor_words(r["floor"]), f"{r['floor'].intensity:.2f} / {ridge:.2f}"]
        for what, r in zip(("一个人问一个短问题", "几个人问同一份合同"), rows.values())])


# --- 6. Failures ------------------------------------------------------------------------------------

def show_rejection(error: Exception, prompt_tokens: int, max_model_len: int) -> None:
    """The engine's refusal in Chinese, its own English words quoted beside."""
    from minillm.lab.report import show_answer

    show_table(["被拒绝的 prompt", "池子放得下的最长请求（max_model_len）", "什么时候拒绝的"], [
        [f"{fmt_int(prompt_tokens)} token", f"{fmt_int(max_model_len)} token", "入队之前，还没分配任何 KV 块"]])
    show_answer(f"ValueError: {error}")


# --- 7. The crowd --------------------------------------------------------------------------------------

def crowd_row(run: Run, index: int) -> dict:
    """TTFT before and after the contract (request ``index``), the queueing share, preemptions."""
    ms_ = run.metrics
    before, after = ms_[:index], ms_[index + 1:]
    return {"before": statistics.fmean(m.ttft for m in before),
            "after": statistics.fmean(m.ttft for m in after),
            "after_queue": sum(m.queueing for m in after) / sum(m.ttft for m in after),
            "contract": ms_[index].ttft,
            "queue_share": sum(m.queueing for m in ms_) / sum(m.ttft for m in ms_),
            "preemptions": run.preemptions, "lengths": run.answer_lengths(),
            "p90": sorted(m.ttft for m in ms_)[math.ceil(0.9 * len(ms_)) - 1]}


def show_crowd(crowd: dict[str, Run], index: int) -> None:
    rows = {name: crowd_row(run, index) for name, run in crowd.items()}
    show_table(["配置", "合同前的问题：平均 TTFT", "合同的 TTFT", "合同后的问题：平均 TTFT",
                "TTFT 里排队的占比", "抢占", "回答 token：中位数（范围）"], [
        [name, ms(r["before"]), ms(r["contract"]), ms(r["after"]), f"{r['queue_share']:.0%}",
         r["preemptions"], lengths_cell(r["lengths"])] for name, r in rows.items()])


def plot_crowd(crowd: dict[str, Run], index: int) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from minillm.lab.plotting import PALETTE

    fig, axes = plt.subplots(1, len(crowd), figsize=(7.8, 4.4), sharex=True, sharey=True)
    for ax, (name, run) in zip(axes, crowd.items()):
        rows = np.arange(len(run.outputs))
        queue = np.array([m.queueing for m in run.metrics])
        rest = np.array([m.ttft - m.queueing for m in run.metrics])
        ax.barh(rows, queue, color="#BBBBBB", label="排队")
        ax.barh(rows, rest, left=queue, color=PALETTE[1], label="调度之后到首字")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("TTFT (s)")
        ax.axhline(index, color="black", linewidth=0.6, linestyle=":")
    axes[0].set_yticks(rows, [f"{i + 1}" + ("（合同）" if i == index else "") for i in rows], fontsize=9)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2)


# --- 8. The ledger against the engine -------------------------------------------------------------------

def ledger_rows(record: dict, prompt_tokens: int, cfg, dtype) -> list[tuple[str, int, int]]:
    """(what, the ledger's bytes, the engine's bytes): weights, KV per token, the prompt's KV blocks."""
    memory = record["memory"]
    block = record["engine"]["block_size"]
    held = record["engine"]["num_kv_blocks"] - min(
        min(s["num_free_blocks_before"], s["num_free_blocks"]) for s in record["stats"]["steps"])
    return [("权重", L.weight_bytes(cfg, dtype), memory["weight_bytes"]),
            ("每 token 的 KV", L.kv_bytes_per_token(cfg, dtype), memory["kv_bytes_per_block"] // block),
            (f"{fmt_int(prompt_tokens)} token 的 prompt 的 KV",
             L.ceil_div(prompt_tokens, block) * block * L.kv_bytes_per_token(cfg, dtype),
             held * memory["kv_bytes_per_block"])]


def show_ledger(record, prompt_tokens, cfg, dtype) -> None:
    """The ledger beside the engine's own bytes; raises if they differ by a single byte."""
    rows = ledger_rows(record, prompt_tokens, cfg, dtype)
    show_table(["项", "账本", "引擎实际分配"], [[what, _bytes(a), _bytes(b)] for what, a, b in rows])
    wrong = [what for what, a, b in rows if a != b]
    if wrong:
        raise AssertionError(f"the ledger and the engine disagree on {wrong}: {rows}")


def _bytes(n: int) -> str:
    return fmt_bytes(n, "KiB" if n < MiB else "MiB")


# --- 9. Counting tokens --------------------------------------------------------------------------------

SMOLLM2 = ("SmolLM2-135M", "BPE", "SmolLM2-135M-Instruct.Q4_1.gguf")


def token_counts(smollm2_tokenizer) -> list:
    """Every text of ``data/texts`` through Mistral's two tokenizers and SmolLM2's own."""
    return count_tokens(using=(*tokenizers(), from_transformers(*SMOLLM2[:2], smollm2_tokenizer, SMOLLM2[2])))


def show_token_counts(counts) -> None:
    kinds = list(dict.fromkeys(c.tokenizer.kind for c in counts))
    models = {c.tokenizer.kind: c.tokenizer.model for c in counts}
    show_table(["文本", "字符", *[f"{models[k]}（{k}）" for k in kinds], *[f"{k}：token / 字符" for k in kinds]], [
        [f"{TEXTS[name][0]}（{TEXTS[name][1]}）", fmt_int(count(counts, name, kinds[0]).chars),
         *[fmt_int(count(counts, name, k).tokens) for k in kinds],
         *[f"{count(counts, name, k).tokens_per_char:.2f}" for k in kinds]] for name in TEXTS])


# --- The estimate beside the measurements ------------------------------------------------------------------

def floor_sentence(floor: L.Floor, measured: float, profile) -> str:
    """A whole sentence on a measurement and its floor: the floor's share of it, or why it beat it."""
    why = profile_beat_words(measured, floor, profile)
    return f"{why}。" if why else f"实测里这个下界占了 {floor.share_of(measured):.0%}。"


def floor_points(slow, sweep, ab, budget, cfg, dtype, peak_flops, bandwidth) -> list[tuple[str, L.Floor, float]]:
    """(what, its floor, the measured time) for every timed quantity of the lab: the long prompt's
    prefill, and one decode step alone, with long contexts and in the biggest batch."""
    a = ab_rows(ab, cfg, dtype, peak_flops, bandwidth)[budget]
    s = slow_rows(sweep[1], slow, cfg, dtype, peak_flops, bandwidth)
    top = max(sweep)
    big = sweep_rows(sweep, cfg, dtype, peak_flops, bandwidth)[top]
    points = [(f"{fmt_int(a['tokens'])} token 的预填充（TTFT）", a["a_floor"], a["a"]),
              ("一个短问题解码一步", s["alone"]["floor"], s["alone"]["step"]),
              (f"{s['slow']['batch']} 个长上下文一起解码一步", s["slow"]["floor"], s["slow"]["step"])]
    if big["step"] is not None:
        points.append((f"{top} 个短问题一起解码一步", big["floor"], big["step"]))
    return [p for p in points if p[2] is not None]


def plot_floors(points) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    from minillm.lab.plotting import ROLE_COLORS

    fig, ax = plt.subplots(figsize=(7.6, 0.7 * len(points) + 1.2))
    rows = np.arange(len(points))
    ax.barh(rows - 0.2, [f.seconds * 1e3 for _, f, _ in points], height=0.38, color=ROLE_COLORS["estimate"],
            label="账本的下界 max(F/P, M/W)")
    ax.barh(rows + 0.2, [t * 1e3 for _, _, t in points], height=0.38, color=ROLE_COLORS["measured"], label="本机实测")
    for row, (_, f, t) in zip(rows, points):
        ax.annotate(f"{BOUND_WORDS[f.bound]}；实测是下界的 {t / f.seconds:.1f} 倍", (t * 1e3, row + 0.2),
                    xytext=(4, 0), textcoords="offset points", va="center", fontsize=9)
    ax.set_yticks(rows, [what for what, _, _ in points])
    ax.set_xscale("log")
    ax.set_xlabel("时间 (ms，对数刻度)")
    ax.invert_yaxis()
    ax.set_xlim(right=max(t for _, _, t in points) * 1e3 * 12)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2)


def show_comparison(points, ledger, prompt_tokens: int) -> None:
    """The lab's closing table: estimate | measured here | recorded on GPU (``data/measurements``)."""
    from minillm.lab import records
    from minillm.lab.notebook import recorded
    from minillm.lab.report import comparison_table

    def on_gpu(kind, **match):
        found = next((r for r in records.find(kind) if r.points(**match)), None)
        return recorded(found, lambda r: ms(r.points(**match)[0]["median_s"]))

    gpu = [on_gpu("prefill", n=prompt_tokens), on_gpu("decode", batch=1, ctx=512)]
    rows = [(what, _bytes(a), _bytes(b), None) for what, a, b in ledger]
    rows += [(what, floor_words(f), ms(t), gpu[i] if i < len(gpu) else None)
             for i, (what, f, t) in enumerate(points)]
    comparison_table(rows)


# --- The chapter's numbers and sentences ---------------------------------------------------------------

def _glue(values: dict[str, str]) -> None:
    from myst_nb import glue

    for key, value in values.items():
        glue(key, value, display=False)


def answer_html(text: str) -> object:
    """The real model's answer as the page quotes it: English, marked ``lang="en"``."""
    import html

    from IPython.display import HTML

    return HTML(f'<blockquote lang="en">{html.escape(text).replace(chr(10), "<br/>")}</blockquote>')


def glue_chapter(lab, *, scene, life, sweep, ab, budget, slow, small, rejection, crowd, index, counts) -> dict:
    """Every number and sentence the chapter page quotes from this lab, glued; returned too (the
    tests read it)."""
    from myst_nb import glue

    from minillm.lab.gpus import gpu_specs
    from minillm.lab.notebook import profile_words

    cfg, dtype, profile = lab.config, lab.dtype_name, lab.profile
    P, W = profile.matmul_flops, profile.copy_bandwidth
    words = profile_words(profile)
    ridges = [s.ridge_point for s in gpu_specs()]
    v: dict[str, str] = {"device": words["device"], "model": cfg.name, "threads": words["threads"],
                         "hidden": fmt_int(cfg.hidden_size), "layers": str(cfg.num_layers),
                         "text_params": f"{L.param_count(lab.text_model.config) / 1e8:.2f} 亿",
                         "probe_bw": words["bw"], "probe_flops": words["flops"], "ridge": words["ridge"],
                         "weights_words": "真实权重" if lab.real_weights else "随机权重",
                         "gpu_ridges": f"{min(ridges):,.0f} 到 {max(ridges):,.0f}"}
    v.update(_scene_values(scene))
    v.update(_life_values(life))
    v.update(_sweep_values(sweep, cfg, dtype, P, W))
    v.update(_ab_values(ab, budget, cfg, dtype, P, W))
    v.update(_slow_values(sweep[1], slow, cfg, dtype, P, W, profile))
    v.update(_failure_values(small, rejection))
    v.update(_crowd_values(crowd, index))
    v.update(_token_values(counts))
    alone, ours = sweep[1].metrics[0], life.metrics[1]
    v["ttft_ratio"] = f"{ab[budget, 'A'].metrics[0].ttft / alone.ttft:.0f}"
    v["life_ttft_ratio"] = f"{ours.ttft / alone.ttft:.0f}"
    v["scale"] = str(8192 // sum(m.num_prompt_tokens for m in ab[budget, "A"].metrics))
    points = floor_points(slow, sweep, ab, budget, cfg, dtype, P, W)
    checks = [(measured, floor, profile_beat_words(measured, floor, profile, what)) for what, floor, measured in points]
    v["floors_words"] = beaten_words(floors_beaten(checks), "每一个计时都落在它的下界之上。")
    a_row = ab_rows(ab, cfg, dtype, P, W)[budget]
    v["ab_floor_words"] = floor_sentence(a_row["a_floor"], a_row["a"], profile)
    _glue(v)
    glue("answer", answer_html(scene.outputs[0].text), display=False)
    return v


def _scene_values(scene: Run) -> dict[str, str]:
    out = scene.outputs[0]
    m = out.metrics
    claim(abs(tpot_from_e2e(m) - m.tpot) <= 0.02 * m.tpot, "两种算法得到的 TPOT 相同",
          tpot=m.tpot, from_e2e=tpot_from_e2e(m))
    return {"scene_question": QUESTIONS[0], "scene_prompt": fmt_int(m.num_prompt_tokens), "scene_tokens": fmt_int(m.num_output_tokens),
            "scene_finish": FINISH_WORDS[out.finish_reason], "scene_ttft": ms(m.ttft), "scene_tpot": ms(m.tpot),
            "scene_e2e": seconds_words(m.e2e), "scene_tpot_e2e": ms(tpot_from_e2e(m)),
            "scene_tok_s": f"{1 / m.tpot:,.1f}"}


def _life_values(life: Run) -> dict[str, str]:
    contract, ours = life.metrics
    share = ours.queueing / ours.ttft
    claim(ours.queueing > 0, "排在合同后面的问题要先排队", queueing=ours.queueing)
    return {"life_contract": fmt_int(contract.num_prompt_tokens), "life_prompt": fmt_int(ours.num_prompt_tokens),
            "life_queue": ms(ours.queueing), "life_prefill": ms(ours.first_token_time - ours.first_scheduled_time),
            "life_ttft": ms(ours.ttft), "life_e2e": seconds_words(ours.e2e), "life_tokens": fmt_int(ours.num_output_tokens),
            "life_tpot": ms(ours.tpot), "life_queue_share": f"{share:.0%}",
            "life_queue_words": choose(share >= 0.5, "它自己的预填充只占一小段，大半是在等合同。",
                                       "大头仍是它自己的预填充，但排队这一段同样记在用户的账上。")}


def _sweep_values(sweep, cfg, dtype, P, W) -> dict[str, str]:
    rows = sweep_rows(sweep, cfg, dtype, P, W)
    top = max(rows)
    one, many = rows[1]["summary"], rows[top]["summary"]
    gain = many["output_throughput"] / one["output_throughput"]
    claim(gain > 1, "同时在线的请求多了，总吞吐涨上去", gain=gain)
    best = max(rows, key=lambda b: rows[b]["summary"]["goodput"])
    all_lengths = [n for r in rows.values() for n in r["lengths"]]
    bounds = {b: r["floor"].bound for b, r in rows.items()}
    first_compute = next((b for b in rows if bounds[b] == "compute"), None)
    v = {"tp_batches": "、".join(str(b) for b in rows), "tp_top": str(top), "tp_gain": f"{gain:.1f}",
         "tp_tpot_1": ms(one["tpot"]["mean"]), "tp_tpot_top": ms(many["tpot"]["mean"]),
         "tp_tpot_ratio": f"{many['tpot']['mean'] / one['tpot']['mean']:.1f}",
         "tp_ttft_factor": str(TTFT_FACTOR), "tp_tpot_factor": str(TPOT_FACTOR),
         "tp_best_goodput_b": str(best), "tp_attain_top": f"{many['slo_attainment']:.0%}",
         "tp_lengths": lengths_words(all_lengths),
         "tp_floor_1": floor_words(rows[1]["floor"]), "tp_floor_top": floor_words(rows[top]["floor"]),
         "tp_intensity_top": f"{rows[top]['floor'].intensity:.1f}", "tp_bound_top": BOUND_WORDS[bounds[top]],
         "tp_step_top": ms(rows[top]["step"]) if rows[top]["step"] else "没有全员解码的步"}
    v["tp_tpot_words"] = tpot_words(one["tpot"]["mean"], many["tpot"]["mean"], many["slo_attainment"],
                                    rows[1]["floor"].seconds, rows[top]["floor"].seconds)
    stopped = sum(o.finish_reason == "stop" for r in sweep.values() for o in r.outputs)
    v["tp_stopped_words"] = choose(
        stopped == len(all_lengths), f"{len(all_lengths)} 个回答全都停在模型自己的 EOS 上",
        f"{len(all_lengths)} 个回答里有 {stopped} 个停在模型自己的 EOS 上，其余写到了 max_tokens 的上限")
    v["tp_goodput_words"] = choose(
        best == top, f"按这个目标，goodput 也是 {top} 个同时在线时最高，达标的请求占 {many['slo_attainment']:.0%}。",
        f"按这个目标，goodput 在 {best} 个同时在线时最高；到 {top} 个，达标的请求只剩 {many['slo_attainment']:.0%}。")
    v["tp_bound_words"] = choose(
        first_compute is None,
        "表里每一行的下界都落在带宽一侧：这几个批大小在本机上都还没越过脊点。",
        f"表里的下界从 {first_compute} 个同时在线起落到算力一侧：本机的脊点只有 {P / W:.1f} FLOP/字节，"
        f"{first_compute} 个请求的解码一步已经越过它。")
    return v


def tpot_words(alone: float, top: float, attainment: float, floor_alone: float, floor_top: float) -> str:
    """What the biggest batch did to each user's TPOT (``alone`` → ``top`` seconds), and whether
    most requests still met the SLO (``attainment``); the floors explain a TPOT that did not grow."""
    grew = f"从 {ms(alone)} 变成 {ms(top)}，是一个人时的 {top / alone:.1f} 倍"
    return choose(
        top > alone,
        choose(attainment < 0.5,
               f"每个人的 TPOT 却{grew}，按下面定的目标，达标的请求已不到一半：一个服务完全可以吞吐漂亮，"
               "同时大多数用户都嫌它慢。",
               f"每个人的 TPOT 也{grew}；按下面定的目标，达标的请求仍然过半：吞吐涨上去，多数用户的体验还守得住。"),
        f"每个人的 TPOT 这一次没有变长（{ms(alone)} → {ms(top)}）：账本说一步的下界从 {ms(floor_alone)} 涨到 "
        f"{ms(floor_top)}，可实测的一步里大头是和批大小无关的固定开销，这台机器计时的起伏又比这点差别大。")


def _ab_values(ab, budget, cfg, dtype, P, W) -> dict[str, str]:
    rows = ab_rows(ab, cfg, dtype, P, W)
    r = rows[budget]
    b_mean = statistics.fmean(r["b"])
    b_step = statistics.fmean(r["b_first_steps"])
    claim(r["a_first_step"] > b_step, "按步数算，A 的第一个字比 B 的平均晚", a=r["a_first_step"], b=b_step)
    claim(r["a_floor"].bound == "compute", "长 prompt 的预填充受算力限制", intensity=r["a_floor"].intensity)
    claim(r["a_floor"].intensity >= 10 * P / W, "长 prompt 预填充的强度远在脊点之上",
          intensity=r["a_floor"].intensity, ridge=P / W)
    v = {"ab_tokens": fmt_int(r["tokens"]), "ab_pieces": str(r["pieces"]),
         "ab_piece": fmt_int(r["tokens"] // r["pieces"]), "budget": fmt_int(budget),
         "ab_a_ttft": seconds_words(r["a"]), "ab_b_first": seconds_words(min(r["b"])),
         "ab_b_mean": seconds_words(b_mean), "ab_b_last": seconds_words(max(r["b"])),
         "ab_steps_a": str(r["a_steps"]), "ab_steps_b": str(r["b_steps"]),
         "ab_attn_ratio": f"{r['a_attention'] / r['b_attention']:.1f}",
         "ab_attn_share": f"{r['a_attention'] / r['a_floor'].flops:.0%}",
         "ab_floor": floor_words(r["a_floor"]), "ab_floor_times": f"{r['a'] / r['a_floor'].seconds:.1f}",
         "ab_intensity": fmt_int(r["a_floor"].intensity)}
    last = choose(
        max(r["b"]) < r["a"], f"连 B 里最晚的一段（{seconds_words(max(r['b']))}）也比 A 早。",
        f"B 里最晚的一段（{seconds_words(max(r['b']))}）倒比 A 还晚：它排在最后，前面几段一开始解码，"
        "每一步都从预算里分走几个 token。")
    v["ab_result_words"] = choose(
        r["a"] > b_mean,
        f"A 的首字比 B 的平均首字晚：B 里最早的一段只等了 {seconds_words(min(r['b']))}。" + last,
        f"这一次按时间算，A（{seconds_words(r['a'])}）反而不比 B 的平均首字（{seconds_words(b_mean)}）晚。"
        f"按步数算并非如此：B 的 {r['pieces']} 段平均在第 {b_step:.1f} 步交出第一个字，A 要等到第 {r['a_first_step']} 步；"
        f"两次运行每一步的耗时却不一样（A 平均 {ms(r['a_mean_step'])}，B 平均 {ms(r['b_mean_step'])}），"
        "这台机器当时的负载起伏盖过了分步带来的差别。")
    v["ab_b_step"] = f"{b_step:.1f}"
    v["ab_a_step"] = str(r["a_first_step"])
    v.update(_budget_values(rows, budget))
    return v


def _budget_values(rows: dict[int, dict], base: int) -> dict[str, str]:
    """Exercise 4: A and B at a quarter, one and four times the lab's step budget."""
    small, big = min(rows), max(rows)
    a_small, a_big = rows[small]["a"], rows[big]["a"]
    v = {"ex4_small": fmt_int(small), "ex4_big": fmt_int(big)}
    for name, budget in (("small", small), ("base", base), ("big", big)):
        r = rows[budget]
        v.update({f"ex4_a_{name}": seconds_words(r["a"]), f"ex4_a_steps_{name}": str(r["a_steps"]),
                  f"ex4_b_{name}": seconds_words(statistics.fmean(r["b"])),
                  f"ex4_b_last_{name}": seconds_words(max(r["b"])), f"ex4_b_steps_{name}": str(r["b_steps"])})
    extra_steps = rows[small]["a_steps"] - rows[big]["a_steps"]
    extra = extra_steps * rows[small]["a_floor"].memory_seconds  # one more read of the weights per step
    v["ex4_a_words"] = choose(
        a_small > a_big,
        f"预算越小，A 要分的步越多（{rows[small]['a_steps']} 步对 {rows[big]['a_steps']} 步），每一步都要把权重重读一遍、"
        f"再付一遍调度的固定开销，首字就越晚：{seconds_words(a_small)} 对 {seconds_words(a_big)}。",
        f"A 要分的步数从 {rows[big]['a_steps']} 步变成 {rows[small]['a_steps']} 步，首字却没有变晚"
        f"（{seconds_words(a_small)} 对 {seconds_words(a_big)}）。多出来的 {extra_steps} 步按账本只多读 {extra_steps} 遍权重，"
        f"合起来至少 {ms(extra)}，比起整段预填充的下界 {ms(rows[small]['a_floor'].seconds)} 不算多；"
        "两次测量的差别落在这台机器计时的起伏之内。")
    b_small_mean = statistics.fmean(rows[small]["b"])
    b_big_mean = statistics.fmean(rows[big]["b"])
    v["ex4_b_words"] = choose(
        b_small_mean < b_big_mean,
        f"B 正相反：预算小的时候，短请求一段接一段地早早出字，平均首字 {seconds_words(b_small_mean)}，"
        f"比预算大时的 {seconds_words(b_big_mean)} 还早，因为一步大预算要把八段全算完才一起出字。",
        f"B 的平均首字在预算小时是 {seconds_words(b_small_mean)}，预算大时是 {seconds_words(b_big_mean)}："
        "预算放大，八段能在更少的步里算完，平均也跟着提前。")
    return v


def _slow_values(alone, slow, cfg, dtype, P, W, profile) -> dict[str, str]:
    rows = slow_rows(alone, slow, cfg, dtype, P, W)
    claim(all(r["step"] is not None for r in rows.values()), "两次运行里都有所有请求都在解码的步",
          **{name: r["step"] for name, r in rows.items()})
    for r in rows.values():  # a reader's run without such a step compares TPOTs instead (the note says so)
        r["step"] = r["tpot"] if r["step"] is None else r["step"]
    alone, many = rows["alone"], rows["slow"]
    claim(many["tpot"] > alone["tpot"], "带长上下文的一批请求出字比单个短请求慢",
          slow=many["tpot"], alone=alone["tpot"])
    claim(many["floor"].bound == "memory" and alone["floor"].bound == "memory",
          "这两种解码的一步都落在带宽一侧", slow=many["floor"].intensity, alone=alone["floor"].intensity)
    floor_ratio = many["floor"].seconds / alone["floor"].seconds
    step_ratio = many["step"] / alone["step"]
    kv = many["floor"]
    kv_share = (many["batch"] * L.kv_bytes(cfg, round(many["ctx"]), dtype)) / kv.bytes
    return {"slow_many": str(many["batch"]), "slow_ctx": fmt_int(many["ctx"]), "slow_tpot": ms(many["tpot"]),
            "slow_step": ms(many["step"]), "slow_floor": floor_words(many["floor"]),
            "slow_floor_ms": ms(many["floor"].seconds), "slow_kv_share": f"{kv_share:.0%}",
            "slow_intensity": f"{many['floor'].intensity:.2f}", "alone_step": ms(alone["step"]),
            "alone_tpot": ms(alone["tpot"]),
            "alone_floor": floor_words(alone["floor"]), "alone_floor_ms": ms(alone["floor"].seconds),
            "alone_intensity": f"{alone['floor'].intensity:.2f}",
            "alone_floor_times": f"{alone['step'] / alone['floor'].seconds:.1f}",
            "alone_overhead_words": _overhead_words(alone["floor"], alone["step"], profile),
            "slow_floor_ratio": f"{floor_ratio:.2f}", "slow_step_ratio": f"{step_ratio:.1f}",
            "slow_floor_times": f"{many['step'] / many['floor'].seconds:.1f}",
            "slow_words": slow_words(step_ratio, floor_ratio, alone["step"] / alone["floor"].seconds)}


def slow_words(step_ratio: float, floor_ratio: float, alone_times: float) -> str:
    """The measured step ratio (long contexts over the lone question) against the ledger's
    ``floor_ratio``: far above it, far below it (``alone_times``: the lone step over its floor), or
    close to it."""
    return choose(
        step_ratio > 1.5 * floor_ratio,
        f"实测的一步却慢了 {step_ratio:.1f} 倍，远多于账本说的 {floor_ratio:.2f} 倍：多出来的时间不在搬字节，"
        "而在注意力的实现怎样读 KV（CPU 上走的是 PyTorch 的参考实现，按块表把每个请求的 K、V 先拼出来再算），"
        "这笔开销账本不数。",
        choose(step_ratio < floor_ratio / 1.5,
               f"实测的两步之比却只有 {step_ratio:.1f}，远小于账本说的 {floor_ratio:.2f} 倍：两种步里都有一笔和读多少字节"
               f"无关的固定开销（一个人的那一步已是它下界的 {alone_times:.1f} 倍），它把两者的比拉向 1。",
               f"实测的一步慢了 {step_ratio:.1f} 倍，和账本说的 {floor_ratio:.2f} 倍相去不远：多出来的时间确实花在读 KV 上。"))


def _overhead_words(floor: L.Floor, step: float, profile) -> str:
    share = floor.share_of(step)
    return choose(
        share < 0.5, f"这些固定开销账本不数，在这么小的模型上占了大头：下界只占实测的 {share:.0%}。",
        choose(share <= 1, f"这些固定开销账本不数；在这台机器上它们不到实测的一半，下界占了 {share:.0%}。",
               floor_sentence(floor, step, profile)))


def _failure_values(small: Run, rejection: tuple) -> dict[str, str]:
    error, prompt_tokens, max_model_len = rejection
    claim(small.preemptions > 0, "KV 池太小时，正在跑的请求被抢占", preemptions=small.preemptions)
    claim(f"max_model_len={max_model_len}" in str(error), "拒绝的错误信息里说明了池子放得下多长",
          message=str(error))
    return {"fail_pool": fmt_int(small.record["engine"]["num_kv_blocks"] * small.record["engine"]["block_size"]),
            "fail_requests": str(len(small.outputs)), "fail_preemptions": str(small.preemptions),
            "fail_prompt": fmt_int(prompt_tokens), "fail_max_len": fmt_int(max_model_len)}


def _crowd_values(crowd: dict[str, Run], index: int) -> dict[str, str]:
    rows = {name: crowd_row(run, index) for name, run in crowd.items()}
    keys = dict(zip(crowd, ("nochunk", "chunk", "small")))
    v = {"c20_index": str(index + 1), "c20_requests": str(len(next(iter(crowd.values())).outputs))}
    for name, key in keys.items():
        r = rows[name]
        v.update({f"c20_{key}_before": seconds_words(r["before"]), f"c20_{key}_after": seconds_words(r["after"]),
                  f"c20_{key}_contract": seconds_words(r["contract"]), f"c20_{key}_queue": f"{r['queue_share']:.0%}",
                  f"c20_{key}_preempt": str(r["preemptions"]), f"c20_{key}_p90": seconds_words(r["p90"])})
    nochunk, chunk, small = (rows[n] for n in keys)
    claim(nochunk["preemptions"] == 0 and chunk["preemptions"] == 0, "KV 池够大时没有抢占",
          nochunk=nochunk["preemptions"], chunk=chunk["preemptions"])
    claim(small["preemptions"] > 0, "KV 池变小后出现了抢占", small=small["preemptions"])
    shares = [r["queue_share"] for r in rows.values()]
    v["c20_queue_range"] = f"{min(shares):.0%}–{max(shares):.0%}"
    v["c20_small_pool"] = fmt_int(small_pool_tokens(crowd))
    v["c20_lengths"] = lengths_words(rows[next(iter(keys))]["lengths"])
    v["c20_after_queue"] = f"{nochunk['after_queue']:.0%}"
    claim(nochunk["after_queue"] > 0.5, "不分块时，合同后面的问题的 TTFT 大半是排队", share=nochunk["after_queue"])
    v["c20_after_words"] = after_words(nochunk["after"], chunk["after"])
    v["c20_before_words"] = choose(
        chunk["before"] > nochunk["before"],
        f"分块也有代价：合同前面的问题要和一块块合同挤在同一步里，它们的平均 TTFT 从 {seconds_words(nochunk['before'])} "
        f"变成了 {seconds_words(chunk['before'])}。",
        f"合同前面的问题这次的平均 TTFT 没有变长（{seconds_words(nochunk['before'])} → {seconds_words(chunk['before'])}）。")
    return v


def after_words(nochunk: float, chunk: float) -> str:
    """Whether chunking the contract brought the mean TTFT of the questions after it down."""
    return choose(
        chunk < nochunk,
        f"合同后面的问题不再等前面的人写完：它们的平均 TTFT 从 {seconds_words(nochunk)} 降到 {seconds_words(chunk)}。",
        f"可合同后面那些问题的平均 TTFT 并没有因此降下来（{seconds_words(nochunk)} → {seconds_words(chunk)}）。")


def small_pool_tokens(crowd: dict[str, Run]) -> int:
    engine = list(crowd.values())[-1].record["engine"]
    return engine["num_kv_blocks"] * engine["block_size"]


def _token_values(counts) -> dict[str, str]:
    """The counts, and what the 8K-token contract (its English version cut by Tekken) becomes in
    Chinese: tokens, KV and the prefill floor of the page's 7B on an A100."""
    kinds = list(dict.fromkeys(c.tokenizer.kind for c in counts))
    zh = {k: count(counts, "contract_zh", k) for k in kinds}
    en = {k: count(counts, "contract_en", k) for k in kinds}
    claim(all(zh[k].tokens > en[k].tokens for k in kinds), "同样的内容，中文切出的 token 比英文多",
          **{f"{k}_zh": zh[k].tokens for k in kinds}, **{f"{k}_en": en[k].tokens for k in kinds})
    claim(zh["Tekken"].tokens < zh["SentencePiece"].tokens < zh["BPE"].tokens,
          "中文切得最少的是 Tekken，最多的是 SmolLM2 的 BPE", **{k: zh[k].tokens for k in kinds})
    claim(max(en[k].tokens for k in kinds) < 1.15 * min(en[k].tokens for k in kinds),
          "英文三个 tokenizer 切出的 token 相差无几", **{k: en[k].tokens for k in kinds})
    v = {}
    for k in kinds:
        t = zh[k].tokenizer
        v.update({f"tok_model_{k}": t.model, f"tok_vocab_{k}": fmt_int(t.vocab_size), f"tok_file_{k}": t.file,
                  f"tok_zh_{k}": fmt_int(zh[k].tokens), f"tok_en_{k}": fmt_int(en[k].tokens),
                  f"tok_zh_tpc_{k}": f"{zh[k].tokens_per_char:.2f}", f"tok_en_cpt_{k}": f"{en[k].chars_per_token:.1f}",
                  f"tok_ratio_{k}": f"{zh[k].tokens / en[k].tokens:.2f}",
                  f"tok_scene_zh_{k}": fmt_int(count(counts, "scene_zh", k).tokens),
                  f"tok_scene_en_{k}": fmt_int(count(counts, "scene_en", k).tokens)})
        for name in ("question_zh", "question_en"):
            v[f"tok_{name}_{k}"] = fmt_int(count(counts, name, k).tokens)
    v["tok_zh_chars"] = fmt_int(zh[kinds[0]].chars)
    v["tok_en_chars"] = fmt_int(en[kinds[0]].chars)
    v["tok_scene_zh_chars"] = fmt_int(count(counts, "scene_zh", kinds[0]).chars)
    v.update(contract_in_chinese({k: zh[k].tokens / en["Tekken"].tokens for k in kinds}))
    return v


# --- The page: the generic 7B of the story, and the contract in Chinese ----------------------------------

NOMINAL_PARAMS = 7e9  # "a 7B model": the seed's round number for the weights
CTX, EIGHT, TWENTY, LONG = 8192, 8, 20, 32768
UTIL = 0.92
CARDS = ("RTX 4090", "L40S", "A100 80GB SXM")


@functools.cache
def generic_7b():
    """The story's generic 7B: Llama-2-7B's shape (32 layers, 32 KV heads, head dim 128), fp16."""
    from minillm.engine.config import load_config

    return load_config("llama-2-7b")


def decode7(batch: int, ctx: int, spec) -> L.Floor:
    """One decode step of the generic 7B on ``spec``: every weight read once (the nominal 14 GB),
    each request's KV read, two FLOPs per parameter per token plus attention."""
    cfg = generic_7b()
    flops = batch * (2 * NOMINAL_PARAMS + L.attention_flops_per_token(cfg, ctx))
    nbytes = NOMINAL_PARAMS * 2 + batch * L.kv_bytes(cfg, ctx, "fp16")
    return L.roofline_floor(flops, nbytes, spec.bf16_flops, spec.bandwidth)


def contract_in_chinese(ratios: dict[str, float]) -> dict[str, str]:
    """The 8,192-token English contract written in Chinese, for each tokenizer's Chinese/English
    token ratio: its tokens, its KV in the 7B, its prefill floor on an A100 and how many fit on
    a 48 GiB card."""
    from minillm.lab.gpus import lookup_gpu

    cfg, a100, card = generic_7b(), lookup_gpu("A100 80GB SXM"), lookup_gpu(CARDS[1])
    leftover = card.memory_bytes * UTIL - NOMINAL_PARAMS * 2
    v = {"tok_en_kv": f"{L.kv_bytes(cfg, CTX, 'fp16') / GiB:.1f} GiB",
         "tok_en_floor": floor_words(L.prefill(cfg, CTX, "fp16").floor(a100.bf16_flops, a100.bandwidth)),
         "tok_fit48_en": str(int(leftover // L.kv_bytes(cfg, CTX, "fp16")))}
    for kind, ratio in ratios.items():
        n = round(CTX * ratio)
        v.update({f"tok_contract_{kind}": fmt_int(n), f"tok_kv_{kind}": f"{L.kv_bytes(cfg, n, 'fp16') / GiB:.1f} GiB",
                  f"tok_floor_{kind}": floor_words(L.prefill(cfg, n, "fp16").floor(a100.bf16_flops, a100.bandwidth)),
                  f"tok_fit48_{kind}": str(int(leftover // L.kv_bytes(cfg, n, "fp16")))})
    return v


def page_numbers() -> dict[str, str]:
    """Every estimate the chapter page quotes, formatted once."""
    from minillm.engine.config import load_config
    from minillm.lab.gpus import lookup_gpu

    cfg = generic_7b()
    weights = NOMINAL_PARAMS * 2
    kv_req = L.kv_bytes(cfg, CTX, "fp16")
    v = {"nominal_b": f"{NOMINAL_PARAMS / 1e9:.0f}B", "ctx": fmt_int(CTX), "ctx_k": f"{CTX // 1024}K",
         "layers7": str(cfg.num_layers), "kv_heads7": str(cfg.num_kv_heads), "head_dim7": str(cfg.head_dim),
         "max_pos7": fmt_int(cfg.max_position_embeddings), "exact_params7": f"{L.param_count(cfg) / 1e9:.2f}B",
         "exact_weights7": f"{L.weight_bytes(cfg, 'fp16') / GB:.1f} GB", "w7_gb": f"{weights / GB:.0f} GB",
         "w7_gib": f"{weights / GiB:.1f} GiB", "kv_token7": f"{L.kv_bytes_per_token(cfg, 'fp16') / KiB:.0f} KiB",
         "kv_req7": f"{kv_req / GiB:.0f} GiB", "eight": str(EIGHT), "twenty": str(TWENTY),
         "one7": f"{(weights + kv_req) / GiB:.1f} GiB", "kv_eight7": f"{EIGHT * kv_req / GiB:.0f} GiB",
         "eight7": f"{(weights + EIGHT * kv_req) / GiB:.1f} GiB", "kv_twenty7": f"{TWENTY * kv_req / GiB:.0f} GiB",
         "twenty7": f"{(weights + TWENTY * kv_req) / GiB:.0f} GiB", "util": f"{UTIL}",
         "long_ctx": f"{LONG // 1024}K", "kv_long7": f"{L.kv_bytes(cfg, LONG, 'fp16') / GiB:.0f} GiB",
         "long7": f"{(weights + L.kv_bytes(cfg, LONG, 'fp16')) / GiB:.0f} GiB"}
    for spec in map(lookup_gpu, CARDS):
        usable = spec.memory_bytes * UTIL
        key = f"{spec.memory_gib:g}"
        v.update({f"card_{key}": f"{key} GiB", f"usable_{key}": f"{usable / GiB:.1f} GiB",
                  f"fit{key}": str(int((usable - weights) // kv_req)), f"card_name_{key}": spec.name})
    usable24 = lookup_gpu(CARDS[0]).memory_bytes * UTIL
    v["spare_one24"] = f"{(usable24 - weights - kv_req) / GiB:.1f} GiB"
    claim(int((lookup_gpu(CARDS[1]).memory_bytes * UTIL - weights) // kv_req) < EIGHT,
          "八个 8K 请求放不进 48 GiB 的卡", fit=v["fit48"])
    for key, name in (("a100", "A100 80GB SXM"), ("h100", "H100 SXM"), ("h200", "H200")):
        spec = lookup_gpu(name)
        alone, with_kv, eight = decode7(1, 1, spec), decode7(1, CTX, spec), decode7(EIGHT, CTX, spec)
        claim(all(f.bound == "memory" for f in (alone, with_kv, eight)), "7B 的解码一步受带宽限制", gpu=name)
        v.update({f"{key}_name": spec.name, f"{key}_bw": f"{spec.bandwidth_gb_s:,.0f} GB/s",
                  f"{key}_floor": ms(alone.seconds), f"{key}_compute": f"{alone.compute_seconds * 1e3:.3f} ms",
                  f"{key}_tok": f"{1 / alone.seconds:.0f}", f"{key}_floor_kv": ms(with_kv.seconds),
                  f"{key}_one_tok": f"{1 / with_kv.seconds:.0f}", f"{key}_floor_eight": ms(eight.seconds),
                  f"{key}_eight_tok": f"{EIGHT / eight.seconds:.0f}", f"{key}_eight_intensity": f"{eight.intensity:.1f}",
                  f"{key}_ridge": f"{spec.ridge_point:.0f}"})
    # 70B: the weights alone outgrow one card
    big = 70e9 * 2
    a100 = lookup_gpu("A100 80GB SXM")
    v.update({"w70_gb": f"{big / GB:.0f} GB", "w70_gib": f"{big / GiB:.0f} GiB",
              "cards70": str(math.ceil(big / (a100.memory_bytes * UTIL)))})
    # Llama-3.1-8B: GQA
    cfg8 = load_config("llama-3.1-8b")
    kv8 = L.kv_bytes(cfg8, CTX)
    budget48 = L.memory_budget(cfg8, lookup_gpu(CARDS[1]).memory_bytes, UTIL)
    v.update({"kv_token8": f"{L.kv_bytes_per_token(cfg8) / KiB:.0f} KiB", "gqa8": str(cfg8.gqa_ratio),
              "ex1_kv8": f"{kv8 / GiB:.2f} GiB", "ex1_eight8": f"{(L.weight_bytes(cfg8) + EIGHT * kv8) / GiB:.1f} GiB",
              "ex1_w8": f"{L.weight_bytes(cfg8) / GiB:.2f} GiB", "ex1_fit48": str(budget48.concurrent_requests(CTX)),
              "ex1_ratio": f"{kv_req / kv8:.0f}"})
    p8 = L.prefill(cfg8, CTX)
    v["attn_share8"] = f"{p8.attention_flops / p8.flops:.0%}"
    # Without the cache: the t-th new token recomputes the K and V of the t - 1 before it
    for n, key in ((CTX // 8, "short"), (CTX, "long")):
        recomputed = n * (n - 1) // 2
        v.update({f"ex3_n_{key}": fmt_int(n), f"ex3_recomputed_{key}": fmt_int(recomputed),
                  f"ex3_ratio_{key}": fmt_int(recomputed / n)})
    v["recompute_tokens"], v["recompute_ratio"] = v["ex3_recomputed_long"], v["ex3_ratio_long"]
    # Exercise 2: the H200, and how much KV eight 8K requests may read for a step twice the lone one's
    h200 = lookup_gpu("H200")
    alone = decode7(1, 1, h200)
    allowed = 2 * alone.seconds * h200.bandwidth - weights
    v.update({"ex2_kv_eight": f"{EIGHT * kv_req / GB:.1f} GB", "ex2_allowed": f"{allowed / GB:.1f} GB",
              "ex2_allowed_tokens": fmt_int(allowed / L.kv_bytes_per_token(cfg, "fp16")),
              "ex2_eight_ratio": f"{decode7(EIGHT, CTX, h200).seconds / alone.seconds:.1f}"})
    return v
