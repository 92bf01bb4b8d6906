"""The scheduling lab's plumbing (``notebooks/ch08-scheduling.ipynb``, chapter 调度).

Four things live here, out of the reader's way: the questions the real model answers (their answers
end on its own EOS and set every request's output length), the step-by-step ledger of a long prompt
arriving while others decode (:func:`contract_steps`; :func:`contract_on_gpu` is the chapter's
8,192-token contract on an H100, the one computation chapters 8 and 9 both quote), the tables and
figures of the lab, and :func:`glue_chapter`, which turns the lab's results into the numbers and
sentences the chapter glues.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.engine_config import EngineConfig
from minillm.lab import estimate as L
from minillm.lab.estimate import Floor, fmt_int, roofline_floor
from minillm.lab.gpus import lookup_gpu
from minillm.lab.notebook import ms

# Short questions in English (the model is English-only), picked so that the real model's answers
# end on its EOS and spread from a few words to a paragraph, as a chat's do.
QUESTIONS = (
    "What is the capital of France?",
    "Explain the KV cache in three sentences.",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Give two reasons to learn a second language.",
    "What is 12 times 12?",
    "Which ocean is the largest?",
    "How many days are in a leap year?",
    "Name the primary colors.",
    "What is the chemical symbol for gold?",
)
ANSWER_CAP = 160  # max_tokens while the real model answers; every answer above ends well before it
TEXTS = Path(__file__).resolve().parents[3] / "data" / "texts"


def contract_prompt(engine) -> list[int]:
    """The contract of chapter 1 (``data/texts/contract_en.txt``) and its question, through the
    model's chat template, as token ids."""
    text = (TEXTS / "contract_en.txt").read_text(encoding="utf-8").strip()
    question = (TEXTS / "question_en.txt").read_text(encoding="utf-8").strip()
    return engine.chat_prompt_ids([{"role": "user", "content": f"{text}\n\n{question}"}])


# --- The contract: a long prompt arrives while others decode ------------------------------------

def prefill_span_flops(cfg: ModelConfig, start: int, end: int, prompt_len: int) -> int:
    """FLOPs of computing prompt positions [start, end) as the engine does: every layer for each
    token, causal attention to all positions before it, and the output layer only once the last
    position of the prompt is computed (that step samples the first token)."""
    layers = (end - start) * (L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg))
    attention = L.prefill_attention_flops(cfg, end) - L.prefill_attention_flops(cfg, start)
    return layers + attention + (L.output_layer_flops(cfg) if end == prompt_len else 0)


def step_floor(cfg: ModelConfig, decode: L.DecodeEstimate, span: tuple[int, int] | None,
               prompt_len: int, peak_flops: float, bandwidth: float, dtype) -> Floor:
    """One step's floor ``max(F/P, M/W)``: the running requests' decodes, plus (``span``) prompt
    positions [start, end) of a prefill; its bytes are the weights once, the decodes' KV, the
    span's KV written and the earlier positions' KV read back."""
    flops, nbytes = decode.flops, decode.bytes
    if span is not None:
        start, end = span
        flops += prefill_span_flops(cfg, start, end, prompt_len)
        nbytes += L.kv_bytes(cfg, end - start, dtype) + L.kv_bytes(cfg, start, dtype)
    return roofline_floor(flops, nbytes, peak_flops, bandwidth)


@dataclass(frozen=True)
class ContractSteps:
    """The steps around a long prompt that arrives while ``running`` requests decode, at a
    device's two ceilings: an ordinary decode step, the one step that computes the whole prompt
    when chunking is off, and the chunks when it is on. Each chunked step serves the running
    decodes first (one token each), so a chunk is ``budget - running`` prompt tokens."""

    device: str
    prompt_len: int
    budget: int
    running: int
    ctx: int
    decode: Floor
    whole: Floor
    spans: tuple[tuple[int, int], ...]
    chunks: tuple[Floor, ...]

    @property
    def chunk_tokens(self) -> int:
        return self.budget - self.running

    @property
    def chunk_count(self) -> int:
        return len(self.spans)

    @property
    def worst_chunk(self) -> Floor:
        return max(self.chunks, key=lambda f: f.seconds)

    @property
    def chunked_seconds(self) -> float:
        """All the chunked steps together: the same prefill, the weights read once per chunk."""
        return sum(f.seconds for f in self.chunks)


def contract_steps(cfg: ModelConfig, prompt_len: int, budget: int, running: int, ctx: int,
                   peak_flops: float, bandwidth: float, dtype="bf16", device: str = "") -> ContractSteps:
    """:class:`ContractSteps` of a ``prompt_len``-token prompt under a step budget of ``budget``
    tokens, ``running`` requests decoding at context ``ctx``."""
    if not 0 <= running < budget:
        raise ValueError(f"need 0 <= running < budget, got running={running}, budget={budget}")
    decode = L.decode_step(cfg, max(running, 1), ctx, bandwidth, dtype)
    chunk = budget - running
    ends = list(range(chunk, prompt_len, chunk)) + [prompt_len]
    spans = tuple(zip([0] + ends[:-1], ends))
    floor = dict(prompt_len=prompt_len, peak_flops=peak_flops, bandwidth=bandwidth, dtype=dtype)
    return ContractSteps(device, prompt_len, budget, running, ctx,
                         step_floor(cfg, decode, None, **floor),
                         step_floor(cfg, decode, (0, prompt_len), **floor),
                         spans, tuple(step_floor(cfg, decode, s, **floor) for s in spans))


# The chapter's scene on a real card: twenty colleagues, eight at once, one 8K contract.
COLLEAGUES, SLOTS, CONTRACT, SCENE_CTX, SCENE_GPU = 20, 8, 8192, 1024, "H100 SXM"


def contract_on_gpu(gpu: str = SCENE_GPU, model: str = "llama-3.1-8b", contract: int = CONTRACT,
                    budget: int | None = None, running: int = SLOTS - 1,
                    ctx: int = SCENE_CTX) -> ContractSteps:
    """The chapter's contract on a GPU, estimated from its datasheet: Llama-3.1-8B in bf16, the
    engine's default step budget, the ``SLOTS - 1`` colleagues who hold the other places decoding
    at context ``ctx`` (their tokens go first in every step). Chapters 8 and 9 both quote these
    numbers (glued from the scheduling lab under ``contract_gpu_*``)."""
    spec = lookup_gpu(gpu)
    budget = EngineConfig().max_num_batched_tokens if budget is None else budget
    return contract_steps(load_config(model), contract, budget, running, ctx, spec.bf16_flops,
                          spec.bandwidth, "bf16", spec.name)


def contract_words(steps: ContractSteps, prefix: str = "contract_gpu_") -> dict[str, str]:
    """The numbers of ``steps`` as the book prints them, under the glue keys ``prefix + name``."""
    words = {
        "device": steps.device,
        "len": fmt_int(steps.prompt_len),
        "budget": fmt_int(steps.budget),
        "running": str(steps.running),
        "ctx": fmt_int(steps.ctx),
        "decode_step": ms(steps.decode.seconds),
        "decode_bound": BOUND[steps.decode.bound],
        "whole": ms(steps.whole.seconds),
        "whole_bound": BOUND[steps.whole.bound],
        "whole_x": f"{steps.whole.seconds / steps.decode.seconds:.0f}",
        "whole_tflop": f"{steps.whole.flops / 1e12:,.0f}",
        "chunk_tokens": fmt_int(steps.chunk_tokens),
        "chunks": str(steps.chunk_count),
        "first_chunk": ms(steps.chunks[0].seconds),
        "worst_chunk": ms(steps.worst_chunk.seconds),
        "worst_chunk_x": f"{steps.worst_chunk.seconds / steps.decode.seconds:.0f}",
        "chunked_total": ms(steps.chunked_seconds),
    }
    return {prefix + key: value for key, value in words.items()}


BOUND = {"compute": "算力", "memory": "带宽"}


# --- Static against continuous batching, in slot-steps (the chapter's estimate) -----------------

def slot_spans(output_lens, slots: int, static: bool) -> list[tuple[int, int]]:
    """(first step, end step) of each request when a request takes one step per output token (its
    prefill step yields the first) and at most ``slots`` run at once, first come first served."""
    spans = []
    if static:  # a batch starts when the previous one has entirely finished
        start = 0
        for first in range(0, len(output_lens), slots):
            batch = output_lens[first:first + slots]
            spans += [(start, start + o) for o in batch]
            start += max(batch)
    else:  # a freed slot takes the next request at the next step
        free_at = [0] * slots
        for o in output_lens:
            slot = min(range(slots), key=free_at.__getitem__)
            spans.append((free_at[slot], free_at[slot] + o))
            free_at[slot] += o
    return spans


def slot_estimate(output_lens, slots: int) -> dict:
    """Steps and idle slot-steps of both schedules, and the lower bound ceil(sum o / S)."""
    out = {"lower_bound": L.ceil_div(sum(output_lens), slots)}
    for name in ("static", "continuous"):
        spans = slot_spans(output_lens, slots, name == "static")
        steps = max(end for _, end in spans)
        out[name] = {"spans": spans, "steps": steps, "idle": 1 - sum(output_lens) / (slots * steps),
                     "idle_steps": slots * steps - sum(output_lens),
                     "starts": [start for start, _ in spans]}
    return out


# --- What a run did, from the engine's own step log --------------------------------------------

def run_summary(llm, outputs, slots: int | None = None) -> dict:
    """One run: its step log, tokens, the requests' metrics, and the kit's summary of them."""
    from minillm.lab.metrics import summarize

    stats = llm.stats()
    steps = stats["steps"]
    run = {"steps": steps, "tokens": [o.token_ids for o in outputs],
           "metrics": [o.metrics for o in outputs], "summary": summarize([o.metrics for o in outputs]),
           "step_median": statistics.median(s["end"] - s["start"] for s in steps),
           "seconds": sum(s["end"] - s["start"] for s in steps),
           "preemptions": stats["num_preemptions"],
           "prefill_tokens": sum(s["num_prefill_tokens"] for s in steps),
           "swapped_blocks": sum(s["num_swapped_blocks"] for s in steps),
           "blocks_back": stats["num_free_blocks"] == stats["num_kv_blocks"],
           "num_kv_blocks": stats["num_kv_blocks"]}
    if slots is not None:
        run["idle"] = 1 - sum(s["batch_size"] for s in steps) / (slots * len(steps))
    decode_only = [s["end"] - s["start"] for s in steps if s["num_prefill_tokens"] == 0]
    run["decode_step"] = statistics.median(decode_only) if decode_only else None
    return run


def answer_lengths(answers) -> dict:
    """How long the real model's answers turned out, and how each ended."""
    lens = [len(a.token_ids) for a in answers]
    return {"lens": lens, "min": min(lens), "max": max(lens), "median": statistics.median(lens),
            "sum": sum(lens), "stops": sum(a.finish_reason == "stop" for a in answers),
            "n": len(lens)}


def show_answers(answers, questions=QUESTIONS):
    """The length of each real answer (a table) and the first answer, quoted in English."""
    from minillm.lab.report import show_answer, show_table

    show_table(["#", "问题的 prompt（token）", "回答（token）", "怎么结束的"], [
        [i + 1, len(a.prompt_token_ids), len(a.token_ids), FINISH[a.finish_reason]]
        for i, a in enumerate(answers)])
    show_answer(f"Q: {questions[1]}\nA: {answers[1].text}")


FINISH = {"stop": "模型自己的 EOS", "length": "到了 max_tokens 上限", "abort": "被中止"}


def pool_blocks(prompt_lens, output_lens, block_size: int = 16) -> int:
    """KV blocks that hold every request at its full length at once."""
    return sum(L.ceil_div(n + o, block_size) for n, o in zip(prompt_lens, output_lens))


def show_batching(runs: dict, estimate: dict):
    """Static against continuous: steps, idle slots, throughput, TTFT and TPOT."""
    from minillm.lab.report import show_table

    s, c = runs["static"], runs["continuous"]
    show_table(["", "静态批处理", "连续批处理"], [
        ["步数：估算", fmt_int(estimate["static"]["steps"]), f"≥ {fmt_int(estimate['lower_bound'])}"],
        ["步数：实测", fmt_int(len(s["steps"])), fmt_int(len(c["steps"]))],
        ["空闲槽位：估算", f"{estimate['static']['idle']:.0%}", f"{estimate['continuous']['idle']:.0%}"],
        ["空闲槽位：实测", f"{s['idle']:.0%}", f"{c['idle']:.0%}"],
        ["一步的耗时（中位数）", ms(s["step_median"]), ms(c["step_median"])],
        ["输出吞吐", *[f"{r['summary']['output_throughput']:,.0f} token/s" for r in (s, c)]],
        ["TTFT p50 / p90", *[f"{ms(r['summary']['ttft']['p50'])} / {ms(r['summary']['ttft']['p90'])}"
                             for r in (s, c)]],
        ["TPOT p50 / p90", *[f"{ms(r['summary']['tpot']['p50'])} / {ms(r['summary']['tpot']['p90'])}"
                             for r in (s, c)]],
    ])


def tpot_words(static_p50: float, continuous_p50: float) -> str:
    """The page's sentence on the median TPOT of continuous against static batching."""
    from minillm.lab.claims import choose

    return choose(
        continuous_p50 > static_p50,
        f"连续批处理的出字间隔（TPOT p50）比静态批处理长（{ms(continuous_p50)} 对 {ms(static_p50)}）："
        "新请求的预填充插进了别人正在解码的步里，那一步要多算一段 prompt，批里每个人的下一个字都陪着等。",
        f"连续批处理的出字间隔（TPOT p50）这一次没有变长（{ms(continuous_p50)} 对 {ms(static_p50)}）；"
        "可新请求的预填充插进别人正在解码的步里时，那一步会变慢，下一节专门量这件事。")


def plot_timelines(runs: dict, num_requests: int):
    """One row per request, one mark per step it is scheduled in: prompt steps dark, decodes light."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from minillm.lab.plotting import PALETTE

    fig, axes = plt.subplots(2, 1, figsize=(7.2, 5.4), sharex=True)
    for ax, (name, title) in zip(axes, (("static", "静态批处理"), ("continuous", "连续批处理"))):
        steps = runs[name]["steps"]
        order = {rid: i for i, rid in enumerate(dict.fromkeys(r for s in steps for r, _ in s["scheduled"]))}
        for s in steps:
            for rid, n in s["scheduled"]:
                color = PALETTE[1] if n > 1 else PALETTE[4]
                ax.broken_barh([(s["step"], 1)], (order[rid] - 0.4, 0.8), lw=0, color=color)
        ax.set_ylim(num_requests - 0.5, -0.5)
        ax.set_ylabel("请求（进门顺序）")
        ax.set_title(f"{title}：{len(steps)} 步，空闲槽位 {runs[name]['idle']:.0%}")
        ax.grid(False)
    axes[1].set_xlabel("引擎的第几步")
    axes[0].legend(handles=[Patch(color=PALETTE[1], label="预填充"), Patch(color=PALETTE[4], label="解码")],
                   loc="upper right")
    return fig


# --- The contract in the lab ----------------------------------------------------------------------

def token_gaps(metrics) -> np.ndarray:
    return np.diff(metrics.token_times)


def contract_result(steps: list[dict], outputs: dict, contract_id: str = "contract") -> dict:
    """What the decoding requests saw while the contract was computed: their TPOT, their longest
    wait between two tokens, and the contract's own TTFT; the longest step."""
    shorts = [o for rid, o in outputs.items() if rid != contract_id]
    return {"steps": steps, "outputs": outputs,
            "tpot": statistics.fmean(o.metrics.tpot for o in shorts),
            "worst_gap": max(token_gaps(o.metrics).max() for o in shorts),
            "contract_ttft": outputs[contract_id].metrics.ttft,
            "slowest_step": max(s["end"] - s["start"] for s in steps),
            "decode_step": statistics.median(s["end"] - s["start"] for s in steps if s["num_prefill_tokens"] == 0),
            "chunks": [n for s in steps for rid, n in s["scheduled"] if rid == contract_id and n > 1]}


def lab_contract(lab, answerer) -> tuple[list[int], int, bool]:
    """The lab's contract, its chunked step budget, and whether it is the real text: 8,192 random
    tokens and 2,048 on a GPU with 4 GiB free, else the real contract through ``answerer``'s chat
    template (:func:`contract_prompt`) and 128."""
    from minillm.lab.notebook import enough_gpu_memory
    from minillm.lab.workload import random_prompts

    if lab.on_gpu and enough_gpu_memory(lab.device, 4 * 2**30):
        return random_prompts([CONTRACT], lab.config.vocab_size, seed=11)[0], 2048, False
    return contract_prompt(answerer), 128, True


CONTRACT_ANSWER = 8  # tokens the lab's contract generates: its prefill is what is measured


def serve_contract(model, prompts, output_lens, contract: list[int], budget: int | None,
                   join_after: int = 4, block_size: int = 16) -> dict:
    """``prompts`` decode (greedy, ``output_lens`` tokens each) and the contract arrives after
    ``join_after`` steps; chunked with a step budget of ``budget`` tokens, or (None) unchunked with
    a budget that holds the whole contract. The run's :func:`contract_result`."""
    from minillm import LLMEngine
    from minillm.lab.notebook import greedy

    engine = LLMEngine(model, block_size=block_size,
                       num_kv_blocks=pool_blocks([len(contract)] + [len(p) for p in prompts],
                                                 [CONTRACT_ANSWER] + list(output_lens), block_size),
                       enable_chunked_prefill=budget is not None, enable_prefix_caching=False,
                       max_num_batched_tokens=budget or len(contract) + len(prompts))
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"q{i}", prompt, greedy(n))
    finished = {}
    while engine.has_unfinished():
        if len(engine.recorder.steps) == join_after:
            engine.add_request("contract", contract, greedy(CONTRACT_ANSWER))
        finished.update({out.request_id: out for out in engine.step() if out.finished})
    return contract_result(engine.stats()["steps"], finished)


def show_contract(runs: dict, est: ContractSteps):
    """Chunking off against on: the slowest step (with its floor), the decoders' TPOT and worst
    gap, the contract's TTFT."""
    from minillm.lab.report import floor_words, show_table

    off, on = runs[False], runs[True]
    show_table(["", "不分块", f"分块（每步 {fmt_int(est.budget)} token）"], [
        ["合同的 prompt 分几步算", "1", str(len(on["chunks"]))],
        ["最慢一步：下界", floor_words(est.whole), floor_words(est.worst_chunk)],
        ["最慢一步：实测", ms(off["slowest_step"]), ms(on["slowest_step"])],
        ["纯解码的一步（中位数，合同不在的时候）", ms(off["decode_step"]), ms(on["decode_step"])],
        ["正在解码的请求：平均 TPOT", ms(off["tpot"]), ms(on["tpot"])],
        ["正在解码的请求：两个 token 之间最长的等待", ms(off["worst_gap"]), ms(on["worst_gap"])],
        ["合同自己的 TTFT", ms(off["contract_ttft"]), ms(on["contract_ttft"])],
    ])


def plot_contract_steps(runs: dict, est: ContractSteps, join_after: int):
    """Each step's time, chunking off and on, with the floors of the slowest steps."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE, ROLE_COLORS

    fig, ax = plt.subplots(figsize=(7.2, 3.8))
    for chunked, color, label in ((False, PALETTE[0], "不分块"), (True, PALETTE[1], "分块")):
        steps = runs[chunked]["steps"]
        ax.plot([s["step"] for s in steps], [(s["end"] - s["start"]) * 1e3 for s in steps], "o-", ms=3,
                color=color, label=f"实测：{label}")
    ax.axhline(est.whole.seconds * 1e3, color=ROLE_COLORS["estimate"], ls="--", lw=1,
               label="下界：整段合同的那一步")
    ax.axhline(est.worst_chunk.seconds * 1e3, color=ROLE_COLORS["estimate"], ls=":", lw=1,
               label="下界：最重的一块")
    ax.axvline(join_after, color="#777777", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel(f"引擎的第几步（竖线：第 {join_after} 步后合同到达）")
    ax.set_ylabel("这一步的耗时（ms）")
    ax.legend(loc="upper right")
    return fig


# --- Preemption ---

def swap_bandwidth(lab) -> float:
    """Bytes/s one way for swapped KV blocks: GPU -> pinned host memory, timed, on a GPU; on the
    CPU a memory-to-memory copy, half the profile's copy bandwidth (which counts read + write)."""
    if not lab.on_gpu:
        return lab.profile.copy_bandwidth / 2
    import torch

    from minillm.lab.notebook import median_seconds

    gpu = torch.empty(256 * 2**20, dtype=torch.uint8, device=lab.device)
    host = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    return gpu.numel() / median_seconds(lambda: host.copy_(gpu), lab.device)


# ---------------------------------------------------------------------------------------------

def schedule_floor(cfg: ModelConfig, steps: list[dict], ctx: int, peak_flops: float, bandwidth: float,
                   dtype) -> float:
    """Seconds no device with these ceilings can beat for the steps the engine actually took: each
    step's ``max(F/P, M/W)`` from its own counts (tokens computed, requests sampled), every token
    attending to ``ctx`` positions, the weights read once a step; summed."""
    body = L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)
    total = 0.0
    for s in steps:
        tokens = s["num_prefill_tokens"] + s["num_decode_tokens"]
        flops = (tokens * (body + L.attention_flops_per_token(cfg, ctx))
                 + s["num_sampled"] * L.output_layer_flops(cfg))
        nbytes = (L.weight_bytes(cfg, dtype) + L.kv_bytes(cfg, s["num_decode_tokens"] * ctx, dtype)
                  + L.kv_bytes(cfg, s["num_prefill_tokens"], dtype))
        total += roofline_floor(flops, nbytes, peak_flops, bandwidth).seconds
    return total


def preemption_estimate(cfg, runs: dict, prompt_lens, output_lens, block_size: int, peak_flops: float,
                        bandwidth: float, swap_bandwidth: float, dtype) -> dict:
    """Each run's floor from the schedule the engine took (:func:`schedule_floor`, plus the swap
    copies at ``swap_bandwidth`` one way), and what the preemption itself costs: the recomputed
    tokens as one prefill's floor, or the blocks copied out and back in."""
    ctx = round(statistics.fmean(prompt_lens) + statistics.fmean(output_lens) / 2)
    block_bytes = L.kv_bytes(cfg, block_size, dtype)
    floors = {label: schedule_floor(cfg, r["steps"], ctx, peak_flops, bandwidth, dtype)
              + r["swapped_blocks"] * block_bytes / swap_bandwidth for label, r in runs.items()}
    recomputed = runs["重算"]["prefill_tokens"] - runs["充足"]["prefill_tokens"]
    recompute_self = roofline_floor(
        recomputed * (L.matmul_flops_per_token(cfg) - L.output_layer_flops(cfg)
                      + L.attention_flops_per_token(cfg, ctx) / 2),
        L.weight_bytes(cfg, dtype) + L.kv_bytes(cfg, recomputed, dtype), peak_flops, bandwidth).seconds
    base = floors["充足"]
    return {"ctx": ctx, "floors": floors, "recomputed": recomputed, "recompute": recompute_self,
            "swap": runs["换出"]["swapped_blocks"] * block_bytes / swap_bandwidth,
            "extra": {label: floors[label] - base for label in ("重算", "换出")}}


def show_preemption(runs: dict, est: dict):
    from minillm.lab.report import show_table

    base = runs["充足"]
    show_table(["", "池子（块）", "抢占次数", "步数", "重算的 token", "换出 + 换入的块", "总耗时：下界之和",
                "总耗时：实测", "比充足池子多花：估算", "多花：实测"], [
        [label, fmt_int(r["num_kv_blocks"]), fmt_int(r["preemptions"]), fmt_int(len(r["steps"])),
         fmt_int(r["prefill_tokens"] - base["prefill_tokens"]), fmt_int(r["swapped_blocks"]),
         ms(est["floors"][label]), ms(r["seconds"]),
         ms(est["extra"][label]) if label in est["extra"] else "—",
         ms(r["seconds"] - base["seconds"]) if label in est["extra"] else "—"]
        for label, r in runs.items()])


def press_words(extra: dict, recompute: float, swap: float, small_batch: int, small_decode: Floor,
                weight_bytes: float) -> str:
    """The page's sentences on what the small pool costs by the floors: the recompute run's extra
    floor (``extra``, each small-pool run's over the full pool's) split into the recompute itself
    and the rest, the swap run's into the copies and the rest, and why the rest is what it is: the
    ledger floor of a decode step of ``small_batch`` requests (the most the small pool held at
    once) on this machine's profile, ``small_decode``."""
    from minillm.lab.claims import choose

    batch_part, swap_rest = extra["重算"] - recompute, extra["换出"] - swap
    recompute_words = choose(
        batch_part > recompute,
        f"按下界算，重算多花的 {ms(extra['重算'])} 里，重算本身只占 {ms(recompute)}，其余 {ms(batch_part)} "
        "来自池子小了、同时跑的请求少了、步数多了。",
        f"按下界算，重算多花的 {ms(extra['重算'])} 里，至少一半是重算本身（{ms(recompute)}），"
        f"池子小了、同时跑的请求少了、步数多了只占 {ms(batch_part)}。")
    swap_words = choose(
        swap_rest > swap,
        f"换出多花的 {ms(extra['换出'])} 里，拷贝只占 {ms(swap)}，其余 {ms(swap_rest)} 也来自批变小。",
        f"换出多花的 {ms(extra['换出'])} 里，至少一半是拷贝本身（{ms(swap)}），批变小只占 {ms(swap_rest)}。")
    bound_words = choose(
        small_decode.bound == "memory",
        f"按这台机器的机器画像，小池子里最多同时跑 {small_batch} 个请求，解码一步的下界受带宽限制："
        f"每一步都要把 {fmt_int(weight_bytes / 2**20)} MiB 的权重整读一遍，步数多一步，下界就多一份；"
        "GPU 上解码一步也受带宽限制，这一份“批变小”的代价同样躲不掉。",
        f"按这台机器的机器画像，小池子里最多同时跑 {small_batch} 个请求，解码一步的下界仍受算力限制"
        f"（每步的权重只有 {fmt_int(weight_bytes / 2**20)} MiB）：请求少了，一步的运算跟着少，"
        "多出来的步几乎不抬高下界之和。GPU 上解码一步受带宽限制，步数多一步就多读一遍权重，"
        "这一份“批变小”的代价会显眼得多。")
    return recompute_words + swap_words + bound_words


# --- Goodput -----------------------------------------------------------------------------------

def online_point(rate: float, summary: dict, steps: list[dict]) -> dict:
    return {"rate": rate, "throughput": summary["request_throughput"], "goodput": summary["goodput"],
            "attainment": summary["slo_attainment"], "ttft_p90": summary["ttft"]["p90"],
            "step": statistics.median(s["end"] - s["start"] for s in steps)}


def goodput_words(best: dict, capacity: float) -> str:
    """The page's sentence on the highest measured goodput (``best``, an :func:`online_point`)
    against the offline throughput ``capacity`` (requests/s) taken as its upper bound."""
    from minillm.lab.claims import choose

    return choose(
        best["goodput"] <= capacity,
        f"实测的 goodput 最高 {best['goodput']:,.2f} 请求/s（请求率 {best['rate']:,.2f} 请求/s 时），"
        f"没有超过离线吞吐（{capacity:,.2f} 请求/s）这个上限。",
        f"实测的 goodput 最高 {best['goodput']:,.2f} 请求/s，比离线吞吐（{capacity:,.2f} 请求/s）这个“上限”还高："
        "离线那一次也只是一次计时，在这台共享的机器上会被别的进程拖慢，量低了。")


def plot_goodput(online: list[dict], capacity: float, slo):
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    rates = [p["rate"] for p in online]
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax.plot(rates, [min(r, capacity) for r in rates], "--", color=ROLE_COLORS["estimate"],
            label="估算上限：min(请求率, 离线吞吐)")
    ax.plot(rates, [p["throughput"] for p in online], "s-", color="#777777", label="实测：完成的请求 / s")
    ax.plot(rates, [p["goodput"] for p in online], "o-", color=ROLE_COLORS["measured"], label="实测：goodput")
    ax.set_xlabel("请求率（请求 / s，泊松到达）")
    ax.set_ylabel("请求 / s")
    ax.set_title(f"TTFT ≤ {ms(slo.ttft)}，TPOT ≤ {ms(slo.tpot)}")
    ax.legend(loc="upper left")
    return fig


def show_goodput(online: list[dict]):
    from minillm.lab.report import show_table

    show_table(["请求率", "完成的请求 / s", "goodput", "满足 SLO 的比例", "TTFT p90"], [
        [f"{p['rate']:,.2f} /s", f"{p['throughput']:,.2f}", f"{p['goodput']:,.2f}", f"{p['attainment']:.0%}",
         ms(p["ttft_p90"])] for p in online])


def bench_pool(model: str, scale: float) -> int:
    """KV blocks that hold the throughput workload of ``bench_throughput`` at ``scale`` at once (a
    pool for that workload only, so the benchmark plans nothing on a card others are using)."""
    from minillm.lab.workload import throughput_workload

    workload = throughput_workload(load_config(model).vocab_size, scale=scale)
    return pool_blocks(workload.input_lens, workload.output_lens)


def show_bench(bench: dict):
    """``bench_throughput``'s result as a Chinese table (the CLI prints the same in English)."""
    from minillm.lab.report import show_table

    w = bench["workload"]
    show_table(["", "minillm（连续批处理 + 分页）", "transformers generate()（静态批处理 + 填充）"], [
        ["输出吞吐", *[f"{bench[n]['output_throughput']:,.0f} token/s" for n in ("minillm", "transformers")]],
        ["实际算的 token", *[fmt_int(bench[n]["computed_tokens"]) for n in ("minillm", "transformers")]],
        ["总耗时", *[f"{bench[n]['seconds']:,.2f} s" for n in ("minillm", "transformers")]],
    ])
    print(f"{bench['model']}，{w['num_requests']} 个请求，长度 {w['length_range'][0]}–{w['length_range'][1]} token；"
          f"输出吞吐之比 {bench['ratio']:.2f}，算的 token 之比（transformers / minillm）{bench['work_ratio']:.2f}")


# --- The closing table and the chapter's glue ----------------------------------------------------

def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.report import comparison_table

    b, c, p = r["batching"], r["contract"], r["press"]
    s, k = b["runs"]["static"], b["runs"]["continuous"]
    est = b["estimate"]
    comparison_table([
        ("静态批处理的空闲槽位", f"{est['static']['idle']:.0%}", f"{s['idle']:.0%}", None),
        ("连续 / 静态 的输出吞吐", f"{est['static']['steps'] / est['continuous']['steps']:.2f}×（步数之比）",
         f"{k['summary']['output_throughput'] / s['summary']['output_throughput']:.2f}×", None),
        (f"不分块：合同到达的那一步（{fmt_int(c['est'].prompt_len)} token）", ms(c["est"].whole.seconds),
         ms(c["runs"][False]["slowest_step"]), None),
        ("分块：最慢的一步", ms(c["est"].worst_chunk.seconds), ms(c["runs"][True]["slowest_step"]), None),
        ("重算抢占：这批请求的总耗时", f"≥ {ms(p['est']['floors']['重算'])}", ms(p["runs"]["重算"]["seconds"]), None),
        ("换出抢占：这批请求的总耗时", f"≥ {ms(p['est']['floors']['换出'])}", ms(p["runs"]["换出"]["seconds"]), None),
        ("goodput 的上限", f"≤ {r['capacity']:,.2f} 请求/s（离线吞吐）",
         f"{max(q['goodput'] for q in r['online']):,.2f} 请求/s", None),
        (f"minillm / transformers 输出吞吐（{r['bench']['model']}）", "—", f"{r['bench']['ratio']:.2f}×",
         r["bench_record"]),
    ])


def throughput_record() -> str | None:
    """The minillm / transformers ratio of the newest GPU throughput record, if there is one."""
    from minillm.lab import records
    from minillm.lab.notebook import recorded

    for record in records.find("throughput"):
        if "ratio" in record.results:
            return recorded(record, lambda rec: f"{rec.results['ratio']:.2f}×")
    return None


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab (``r``: the lab's results)."""
    from minillm.lab.claims import choose, claim, floors_beaten
    from minillm.lab.notebook import g
    from minillm.lab.report import NOT_RECORDED, beaten_words, profile_beat_words

    lab = r["lab"]
    for key, value in contract_words(contract_on_gpu()).items():
        g(key, value)
    g("lab_device", lab.device_name)
    g("lab_model", lab.config.name)
    g("lab_weights", "真实权重" if lab.real_weights else "随机权重")

    # the real answers
    a = r["answers"]
    claim(a["stops"] == a["n"], "every answer ends on the model's own EOS", stops=a["stops"], n=a["n"])
    g("ans_n", str(a["n"]))
    g("ans_min", fmt_int(a["min"]))
    g("ans_max", fmt_int(a["max"]))
    g("ans_median", f"{a['median']:g}")
    g("ans_sum", fmt_int(a["sum"]))

    # static against continuous
    b = r["batching"]
    s, c, est = b["runs"]["static"], b["runs"]["continuous"], b["estimate"]
    claim(s["tokens"] == c["tokens"], "the schedule never changes the greedy tokens")
    claim(len(s["steps"]) == est["static"]["steps"] and abs(s["idle"] - est["static"]["idle"]) < 1e-9,
          "static batching takes exactly the estimated steps and idle slots",
          steps=len(s["steps"]), estimate=est["static"]["steps"])
    claim(len(c["steps"]) >= est["lower_bound"], "the continuous steps are at least the lower bound")
    speedup = c["summary"]["output_throughput"] / s["summary"]["output_throughput"]
    steps_ratio = est["static"]["steps"] / est["continuous"]["steps"]
    g("mix_slots", str(b["slots"]))
    for name, run in b["runs"].items():
        g(f"{name}_steps", fmt_int(len(run["steps"])))
        g(f"{name}_steps_est", fmt_int(est[name]["steps"]))
        g(f"{name}_idle", f"{run['idle']:.0%}")
        g(f"{name}_idle_est", f"{est[name]['idle']:.0%}")
        g(f"{name}_tput", f"{run['summary']['output_throughput']:,.0f} token/s")
        g(f"{name}_step_ms", ms(run["step_median"]))
        for q in ("p50", "p90"):
            g(f"{name}_ttft_{q}", ms(run["summary"]["ttft"][q]))
            g(f"{name}_tpot_{q}", ms(run["summary"]["tpot"][q]))
    g("lower_bound_steps", fmt_int(est["lower_bound"]))
    g("speedup", f"{speedup:.2f}")
    g("speedup_est", f"{steps_ratio:.2f}")
    cheaper_static = s["step_median"] < c["step_median"]
    g("speedup_note", choose(
        speedup < steps_ratio and cheaper_static,
        f"实测的吞吐之比（{speedup:.2f}）比步数之比（{steps_ratio:.2f}）小：静态批处理那些半空的步更便宜"
        f"（中位数 {ms(s['step_median'])} 对 {ms(c['step_median'])}），空着的槽位没有白白浪费那么多时间。",
        f"实测的吞吐之比是 {speedup:.2f}，步数之比是 {steps_ratio:.2f}，两种调度一步的耗时"
        f"（中位数 {ms(s['step_median'])} 对 {ms(c['step_median'])}）没有把两者拉开多少。"))
    g("ttft_note", choose(
        c["summary"]["ttft"]["p90"] < s["summary"]["ttft"]["p90"],
        "连续批处理把尾部的首字延迟压了下来：后面的请求不必等前一批里最长的那个写完。",
        "这一次连续批处理的 TTFT p90 并不比静态的短。"))
    g("tpot_note", tpot_words(s["summary"]["tpot"]["p50"], c["summary"]["tpot"]["p50"]))

    # the contract
    k = r["contract"]
    off, on, cest = k["runs"][False], k["runs"][True], k["est"]
    claim(all(off["outputs"][i].token_ids == on["outputs"][i].token_ids for i in off["outputs"]),
          "chunking never changes the greedy tokens")
    steps = (("不分块时最慢的那一步", off["slowest_step"], cest.whole), ("分块后最慢的那一步", on["slowest_step"], cest.worst_chunk))
    checks = [(measured, floor, profile_beat_words(measured, floor, lab.profile, what)) for what, measured, floor in steps]
    g("contract_floor_note", beaten_words(floors_beaten(checks), "两步都比下界慢，差在哪里见本章最后一节。"))
    claim(on["worst_gap"] < off["worst_gap"], "chunking shortens the decoders' longest wait",
          on=on["worst_gap"], off=off["worst_gap"])
    g("contract_len", fmt_int(cest.prompt_len))
    g("contract_real", "真实合同（data/texts/contract_en.txt）加上一个问题，经聊天模板渲染"
      if k["real"] else "随机 token（这里的模型是随机权重，内容不影响耗时）")
    g("contract_shorts", str(cest.running))
    g("contract_decoder_lens", "、".join(fmt_int(n) for n in k["decoder_lens"]))
    g("contract_budget", fmt_int(cest.budget))
    g("contract_chunks", str(len(on["chunks"])))
    g("contract_decode_step", ms(off["decode_step"]))
    g("contract_whole_floor", ms(cest.whole.seconds))
    g("contract_whole_bound", BOUND[cest.whole.bound])
    g("contract_chunk_floor", ms(cest.worst_chunk.seconds))
    for name, run in (("plain", off), ("chunked", on)):
        g(f"{name}_slowest", ms(run["slowest_step"]))
        g(f"{name}_tpot", ms(run["tpot"]))
        g(f"{name}_gap", ms(run["worst_gap"]))
        g(f"{name}_contract_ttft", ms(run["contract_ttft"]))
    g("plain_gap_steps", f"{off['worst_gap'] / off['decode_step']:.0f}")
    g("tpot_ratio", f"{off['tpot'] / on['tpot']:.2f}")
    g("contract_tpot_note", choose(
        off["tpot"] > 1.1 * off["decode_step"],
        f"这次停顿也进了 TPOT：正在解码的请求的平均 TPOT 从纯解码时的一步 {ms(off['decode_step'])} 涨到了 "
        f"{ms(off['tpot'])}，一次停顿摊进几十个 token 的平均里，仍然看得出来。",
        f"摊进几十个 token 的平均里，这次停顿在 TPOT 上不太显眼：平均 {ms(off['tpot'])}，纯解码的一步 "
        f"{ms(off['decode_step'])}。"))
    g("chunk_tpot_note", choose(
        on["tpot"] >= 0.95 * off["tpot"],
        f"分块没有把平均 TPOT 降下来（{ms(on['tpot'])}）：总的计算一点没少，每一块还要和别人的解码挤在同一步里、"
        f"再读一遍权重。它降的是最长的那一次等待：从 {ms(off['worst_gap'])} 降到 {ms(on['worst_gap'])}。",
        f"分块把平均 TPOT 降到了 {ms(on['tpot'])}，最长的那一次等待从 {ms(off['worst_gap'])} 降到 {ms(on['worst_gap'])}。"))
    g("contract_ttft_note", choose(
        on["contract_ttft"] > off["contract_ttft"],
        "代价落在合同自己身上：它的首字晚了，因为每一块都要和别人的解码挤在同一步里，还要多读几遍权重。",
        "这一次合同自己的首字也没有因为分块变晚：每块多读的几遍权重，淹没在计时的起伏里了。"))

    # preemption
    p = r["press"]
    runs, pest = p["runs"], p["est"]
    claim(runs["重算"]["tokens"] == runs["换出"]["tokens"] == runs["充足"]["tokens"],
          "preemption never changes the greedy tokens")
    claim(all(run["blocks_back"] for run in runs.values()), "every block comes back to the pool")
    claim(runs["重算"]["preemptions"] > 0 and runs["换出"]["swapped_blocks"] > 0,
          "the small pool preempts", preemptions=runs["重算"]["preemptions"])
    g("press_n", str(p["n"]))
    g("press_full", fmt_int(runs["充足"]["num_kv_blocks"]))
    g("press_tight", fmt_int(runs["重算"]["num_kv_blocks"]))
    claim(all(run["seconds"] >= pest["floors"][label] for label, run in runs.items()),
          "no run beats the sum of its steps' floors", floors=pest["floors"])
    claim(runs["充足"]["preemptions"] == 0, "the full pool never preempts", preemptions=runs["充足"]["preemptions"])
    for key, label in (("base", "充足"), ("recompute", "重算"), ("swap", "换出")):
        g(f"press_{key}_steps", fmt_int(len(runs[label]["steps"])))
    g("base_preemptions", fmt_int(runs["充足"]["preemptions"]))
    g("recompute_preemptions", fmt_int(runs["重算"]["preemptions"]))
    g("swap_preemptions", fmt_int(runs["换出"]["preemptions"]))
    g("recomputed_tokens", fmt_int(pest["recomputed"]))
    g("swapped_blocks", fmt_int(runs["换出"]["swapped_blocks"]))
    g("recompute_est", ms(pest["recompute"]))
    g("swap_est", ms(pest["swap"]))
    for key, label in (("base", "充足"), ("recompute", "重算"), ("swap", "换出")):
        g(f"{key}_floor_sum", ms(pest["floors"][label]))
        g(f"{key}_seconds", ms(runs[label]["seconds"]))
    for key, label in (("recompute", "重算"), ("swap", "换出")):
        g(f"{key}_extra_est", ms(pest["extra"][label]))
        g(f"{key}_extra", ms(runs[label]["seconds"] - runs["充足"]["seconds"]))
    small_batch = max(step["batch_size"] for step in runs["重算"]["steps"])
    small_decode = L.decode_step(lab.config, small_batch, pest["ctx"], lab.profile.copy_bandwidth,
                                 lab.dtype_name).floor(lab.profile.matmul_flops)
    g("press_note", press_words(pest["extra"], pest["recompute"], pest["swap"], small_batch, small_decode,
                                L.weight_bytes(lab.config, lab.dtype_name)))

    medians = {label: run["step_median"] for label, run in runs.items()}
    spread = max(medians.values()) / min(medians.values())
    g("press_steps_note", choose(
        spread > 1.2,
        "实测多花的时间和估算对不上的另一半原因在这台机器上：三次运行里一步耗时的中位数分别是 "
        + "、".join(f"{label} {ms(v)}" for label, v in medians.items())
        + f"，最多差 {spread - 1:.0%}。在一台共享的机器上，一步耗时的起伏和重算、换出本身一样大，"
        "两种停法谁多花得多，要在 GPU 上、用更多的请求才分得清。",
        "三次运行里一步耗时的中位数分别是 " + "、".join(f"{label} {ms(v)}" for label, v in medians.items())
        + "，差得不多：多花的时间主要就是多出来的那些步。"))

    # goodput
    best = max(r["online"], key=lambda q: q["goodput"])
    top, low = r["online"][-1], r["online"][0]
    g("capacity", f"{r['capacity']:,.2f} 请求/s")
    g("slo_ttft", ms(r["slo"].ttft))
    g("slo_tpot", ms(r["slo"].tpot))
    g("slo_ttft_steps", str(r["slo_steps"][0]))
    g("slo_tpot_steps", str(r["slo_steps"][1]))
    g("best_goodput", f"{best['goodput']:,.2f} 请求/s")
    g("goodput_rates", "、".join(f"{q['rate']:,.2f}" for q in r["online"]))
    g("goodput_note", goodput_words(best, r["capacity"]))
    g("goodput_top_note", choose(
        top["goodput"] < best["goodput"],
        f"请求率加到 {top['rate']:,.2f} 请求/s 时，只有 {top['attainment']:.0%} 的请求满足 SLO，"
        f"goodput 降到 {top['goodput']:,.2f} 请求/s，完成的请求却还有 {top['throughput']:,.2f} 个/s。",
        f"请求率加到 {top['rate']:,.2f} 请求/s 时，goodput 还是 {top['goodput']:,.2f} 请求/s："
        f"这批请求只有 {len(r['batching']['runs']['continuous']['metrics'])} 个，队列还没排长就跑完了。"))
    g("goodput_low_note", choose(
        low["attainment"] >= 0.75,
        f"请求率只有 {low['rate']:,.2f} 请求/s 时，{low['attainment']:.0%} 的请求满足 SLO。",
        f"即使请求率只有 {low['rate']:,.2f} 请求/s，也只有 {low['attainment']:.0%} 的请求满足 SLO："
        "几步之内的 SLO 很紧，这台共享机器上偶尔一次卡顿就让一批请求同时超标。"))

    # the throughput bench
    bench = r["bench"]
    g("bench_model", bench["model"])
    g("bench_requests", fmt_int(bench["workload"]["num_requests"]))
    g("bench_ratio", f"{bench['ratio']:.2f}")
    g("bench_minillm", f"{bench['minillm']['output_throughput']:,.0f} token/s")
    g("bench_hf", f"{bench['transformers']['output_throughput']:,.0f} token/s")
    g("gpu_throughput_record", r["bench_record"] or NOT_RECORDED)
