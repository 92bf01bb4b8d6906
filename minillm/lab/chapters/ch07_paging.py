"""The paging lab's plumbing (``notebooks/ch07-paging.ipynb``, chapter 分页的 KV cache).

The conversation the real model holds (one system prompt, a growing history), the ledger of what
its prompts could reuse from the prefix cache (:func:`chat_ledger`), the block bookkeeping
experiments (fragmentation, block size, hash chain against radix tree), the decode-attention
kernel's floor, the lab's tables and figures, and :func:`glue_chapter`.
"""
from __future__ import annotations

import statistics

import numpy as np

from minillm.engine.paging import KVCacheManager
from minillm.lab import estimate as L
from minillm.lab.claims import choose
from minillm.lab.estimate import GB, fmt_int
from minillm.lab.notebook import ms

PAGE, MAX_LEN = 16, 8192  # vLLM's default block size; the reservation of a contiguous cache

# One system prompt and a history that grows by a question and the model's own answer each turn.
# The model is English-only; these questions get short answers that end on its EOS.
SYSTEM_PROMPT = ("You are the help desk of a small team that shares one GPU server. Keep every answer "
                 "short: one sentence, plain words, no lists.")
QUESTIONS = (
    "What is the capital of France?",
    "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "What does a KV cache store?",
    "Why does a long prompt slow down other users?",
)
ANSWER_CAP = 128
# Where a turn's common prefix with the tokens computed before it ended (``chat_ledger``'s "break").
BREAKS = {"first": "第一轮：缓存里什么都没有",
          "end": "上一轮算过的 token 到此为止（它最后采样的那个 token 没有算 KV）",
          "template": "模板重写了更早的历史",
          "retokenized": "模型的回答经文本再切词，和它生成的 token 不一样了"}


# --- The conversation and its ledger ------------------------------------------------------------

def turn_record(prompt: list[int], output, stats: dict) -> dict:
    """One turn: its prompt, the answer, and what the engine reports about its prefix hits (the
    request's ``num_cached_tokens`` and the run's counters)."""
    return {"prompt": list(prompt), "answer": list(output.token_ids), "text": output.text,
            "finish": output.finish_reason, "cached": output.num_cached_tokens,
            "run_hits": stats["prefix_hit_tokens"], "run_queries": stats["prefix_query_tokens"],
            "prefill": stats["num_prefill_tokens"], "ttft": output.metrics.ttft}


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def computed_tokens(turn: dict) -> list[int]:
    """Tokens whose KV a finished turn computed: its prompt and its answer, but not the answer's
    last token (sampled, never fed back, so its KV was never computed)."""
    return turn["prompt"] + turn["answer"][:-1]


def reusable(prompt: list[int], earlier: list[list[int]], block_size: int) -> dict:
    """What ``prompt`` could take from a prefix cache that holds the KV of ``earlier`` token lists:
    the longest common prefix with any of them, cut to whole blocks and to one token short of the
    prompt (its last token must be computed to sample the next one)."""
    best = max((common_prefix(prompt, e) for e in earlier), default=0)
    source = next((e for e in earlier if common_prefix(prompt, e) == best), [])
    return {"lcp": best, "tokens": min(best, len(prompt) - 1) // block_size * block_size,
            "end_of_source": bool(source) and best == len(source)}


def chat_ledger(turns: list[dict], block_size: int = PAGE) -> list[dict]:
    """For each turn: the prompt, the ledger's reusable tokens (at ``block_size`` and at one token
    a block, SGLang's default page) and where the common prefix ended (a key of ``BREAKS``)."""
    rows = []
    for k, turn in enumerate(turns):
        earlier = [computed_tokens(t) for t in turns[:k]]
        r = reusable(turn["prompt"], earlier, block_size)
        previous = turns[k - 1] if k else None
        if not k:
            broke = "first"
        elif r["end_of_source"]:
            broke = "end"
        elif r["lcp"] < len(previous["prompt"]):
            broke = "template"
        else:
            broke = "retokenized"
        rows.append({"turn": k + 1, "prompt": len(turn["prompt"]), "answer": len(turn["answer"]),
                     "lcp": r["lcp"], "reusable": r["tokens"],
                     "reusable_1": reusable(turn["prompt"], earlier, 1)["tokens"],
                     "reusable_64": reusable(turn["prompt"], earlier, 64)["tokens"],
                     "cached": turn["cached"], "break": broke, "finish": turn["finish"],
                     "ttft": turn["ttft"]})
    return rows


def show_chat(turns: list[dict], questions=QUESTIONS):
    """Each turn's question and the model's answer, quoted in English."""
    from minillm.lab.report import show_answer

    show_answer("\n".join(f"User: {q}\nAssistant: {t['text']}" for q, t in zip(questions, turns)))


def show_ledger(ledger: list[dict], cold: list[float]):
    """The ledger beside the engine's own prefix hits, and TTFT with and without the cache."""
    from minillm.lab.report import show_table

    show_table(["轮", "prompt", "回答", "和已算过的 token 的公共前缀", f"账本：可复用（块 {PAGE}）",
                "引擎：命中（num_cached_tokens）", "TTFT：开缓存", "TTFT：关缓存", "公共前缀断在哪里"], [
        [r["turn"], r["prompt"], r["answer"], r["lcp"], r["reusable"], r["cached"], ms(r["ttft"]), ms(c),
         BREAKS[r["break"]]] for r, c in zip(ledger, cold)])


# --- Fragmentation and block size (pure bookkeeping) ---------------------------------------------

def fill_pool(block_size: int, num_blocks: int, lengths) -> tuple[KVCacheManager, int]:
    """Admit requests in arrival order until the first that does not fit; (manager, admitted)."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
    for i, n in enumerate(lengths):
        if not kv.allocate(f"r{i}", n):
            return kv, i
    return kv, len(lengths)


def utilization(block_size: int, lengths) -> float:
    """``KVCacheManager.utilization()`` with every request admitted (a pool of "live tokens / block
    size + one block per request", the waste bound); the slack must equal the ledger's waste."""
    kv, admitted = fill_pool(block_size, L.ceil_div(sum(lengths), block_size) + len(lengths), lengths)
    if admitted != len(lengths):
        raise AssertionError("the waste bound (< one block per request) failed")
    if kv.num_used_blocks * block_size - kv.num_live_tokens != L.paged_waste_tokens(lengths, block_size):
        raise AssertionError("the manager's slack differs from the ledger's paged_waste_tokens")
    return kv.utilization()


def estimated_utilization(block_size: int, mean_length: float) -> float:
    """The estimate: each request wastes half a block on average, (block_size - 1) / 2 slots."""
    return mean_length / (mean_length + (block_size - 1) / 2)


def fragmentation(lengths, chat_lengths, pool_tokens: int) -> dict:
    """Contiguous (a block of ``MAX_LEN``) against paged (``PAGE``): utilization and how many
    requests a pool of ``pool_tokens`` holds, estimated and measured."""
    mean = statistics.fmean(lengths)
    _, fit_contiguous = fill_pool(MAX_LEN, pool_tokens // MAX_LEN, lengths)
    _, fit_paged = fill_pool(PAGE, pool_tokens // PAGE, lengths)
    return {"mean": mean, "n": len(lengths), "max": max(lengths), "pool_tokens": pool_tokens,
            "util_contiguous": utilization(MAX_LEN, lengths), "util_paged": utilization(PAGE, lengths),
            "util_contiguous_est": mean / MAX_LEN, "util_paged_est": estimated_utilization(PAGE, mean),
            "fit_contiguous": fit_contiguous, "fit_paged": fit_paged,
            "fit_contiguous_est": pool_tokens // MAX_LEN,
            "fit_paged_est": pool_tokens / (mean + (PAGE - 1) / 2),
            "fit_paged_mean": statistics.fmean(lengths[:fit_paged]),
            "chat_contiguous": utilization(MAX_LEN, chat_lengths), "chat_paged": utilization(PAGE, chat_lengths)}


def show_fragmentation(f: dict):
    from minillm.lab.report import show_table

    show_table(["", f"连续预留（块 = {fmt_int(MAX_LEN)}）", f"分页（块 = {PAGE}）"], [
        ["利用率：估算（平均长度 ÷ 每个请求占的槽位）", f"{f['util_contiguous_est']:.1%}", f"{f['util_paged_est']:.2%}"],
        ["利用率：实测（活 token ÷ 已分配的槽位）", f"{f['util_contiguous']:.1%}", f"{f['util_paged']:.2%}"],
        [f"{fmt_int(f['pool_tokens'])} token 的池子放得下几个：估算", fmt_int(f["fit_contiguous_est"]),
         f"{f['fit_paged_est']:.1f}"],
        ["放得下几个：实测（按到达顺序放，放不下就停）", fmt_int(f["fit_contiguous"]), fmt_int(f["fit_paged"])],
        ["真实对话那几轮请求的利用率（实测）", f"{f['chat_contiguous']:.1%}", f"{f['chat_paged']:.2%}"],
    ])


def plot_block_sizes(util: dict, mean: float, kernel_us: dict, backend: str, batch_words: str):
    """Utilization against block size (estimate and measured) and the kernel's time against it."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7.6, 3.6))
    sizes = sorted(util)
    ax1.plot(sizes, [100 * estimated_utilization(b, mean) for b in sizes], "--", color=ROLE_COLORS["estimate"],
             label="估算：平均浪费半块")
    ax1.plot(sizes, [100 * util[b] for b in sizes], "o-", ms=4, color=ROLE_COLORS["measured"],
             label="实测：KVCacheManager")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel(f"块大小（token；最右 = 连续预留 {fmt_int(MAX_LEN)}）")
    ax1.set_ylabel("利用率（%）")
    ax1.set_title("利用率")
    ax1.legend(loc="lower left")
    bs = sorted(kernel_us)
    ax2.plot(bs, [kernel_us[b] for b in bs], "o-", ms=4, color=ROLE_COLORS["measured"], label=f"实测：{backend}")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(bottom=0)
    ax2.set_xlabel("块大小（token）")
    ax2.set_ylabel("每次调用（µs，单层）")
    ax2.set_title(f"解码注意力（{batch_words}）")
    ax2.legend(loc="lower left")
    return fig


# --- Hash chain against radix tree ----------------------------------------------------------------

def popular_stream(vocab_size: int, systems: int = 8, system_len: int = 1024, requests: int = 300,
                   seed: int = 30) -> list[list[int]]:
    """Requests that start with one of ``systems`` system prompts, the k-th as popular as 1/k,
    each followed by its own question."""
    from minillm.lab.workload import random_prompts, uniform_lengths

    prompts = random_prompts([system_len] * systems, vocab_size, seed=seed)
    popularity = np.array([1 / (k + 1) for k in range(systems)])
    picks = np.random.default_rng(seed + 1).choice(systems, size=requests, p=popularity / popularity.sum())
    tails = random_prompts(uniform_lengths(requests, 16, 128, seed=seed + 2), vocab_size, seed=seed + 3)
    return [prompts[k] + tail for k, tail in zip(picks, tails)]


def replay(prompts, prefix_index: str, num_blocks: int, concurrent: int = 4) -> float:
    """Requests arrive in order, at most ``concurrent`` at once, the oldest finishes first; each
    looks its prompt up, allocates and commits it. Returns the hit rate (cached / looked up)."""
    kv = KVCacheManager(num_blocks, PAGE, prefix_index=prefix_index)
    running, hits = [], 0
    for i, prompt in enumerate(prompts):
        if len(running) == concurrent:
            kv.free(running.pop(0))
        prefix = kv.cached_prefix(prompt)
        hits += len(prefix) * PAGE
        if not kv.allocate(str(i), len(prompt), prefix):
            raise AssertionError("the pool must hold the running requests")
        kv.commit(str(i), prompt)
        running.append(str(i))
    return hits / sum(len(p) for p in prompts)


def lookup_seconds(prompt: list[int], prefix_index: str, repeats: int = 21) -> float:
    """Median time of one lookup of a prompt that is entirely cached (the manager's own timer)."""
    kv = KVCacheManager(L.ceil_div(len(prompt), PAGE), PAGE, prefix_index=prefix_index)
    kv.allocate("first", len(prompt))
    kv.commit("first", prompt)
    samples = []
    for _ in range(repeats):
        before = kv.prefix_lookup_seconds
        kv.cached_prefix(prompt)
        samples.append(kv.prefix_lookup_seconds - before)
    return statistics.median(samples)


def plot_indexes(pool_sizes, pressure: dict, lookup_lengths, lookup_us: dict):
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE

    names = {"hash": "哈希链", "radix": "基数树"}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(7.6, 3.6))
    x = np.arange(len(pool_sizes))
    for k, (name, color) in enumerate((("hash", PALETTE[3]), ("radix", PALETTE[5]))):
        ax1.bar(x + (k - 0.5) * 0.38, [100 * h for h in pressure[name]], 0.38, color=color, label=names[name])
        ax2.plot(lookup_lengths, lookup_us[name], "o-", color=color, label=names[name])
    ax1.set_xticks(x, [fmt_int(n) for n in pool_sizes])
    ax1.set_xlabel("池子的块数")
    ax1.set_ylabel("命中率（%）")
    ax1.set_title("池子越小，淘汰越多")
    ax1.legend(loc="upper left")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("提示词长度（token，整段已缓存）")
    ax2.set_ylabel("一次查找（µs）")
    ax2.set_title("查找耗时")
    ax2.legend(loc="upper left")
    return fig


# --- The decode-attention kernel -------------------------------------------------------------------

def kernel_floor(cfg, batch: int, ctx: int, dtype, peak_flops: float, bandwidth: float):
    """One layer's decode attention: QK^T and PV for one query token per request over ``ctx``
    positions, reading that much K and V, at the device's two ceilings."""
    flops = batch * L.attention_flops_per_token(cfg, ctx) // cfg.num_layers
    nbytes = L.kv_bytes(cfg, batch * ctx, dtype) // cfg.num_layers
    return L.roofline_floor(flops, nbytes, peak_flops, bandwidth)


def plot_kernel(points: list[dict], bandwidth: float, backend: str, title: str):
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import ROLE_COLORS

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ctxs = [p["ctx"] for p in points]
    ax.plot(ctxs, [p["floor"].bytes / p["paged_s"] / GB for p in points], "o-", color=ROLE_COLORS["measured"],
            label=f"实测：分页解码注意力（{backend}）")
    ax.plot(ctxs, [p["floor"].bytes / p["contiguous_s"] / GB for p in points], "s--", color="#777777",
            label="实测：连续张量上的 SDPA")
    ax.axhline(bandwidth / GB, color="#000000", lw=1.2, label="本机拷贝带宽（机器画像）")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("每个请求的上下文（token）")
    ax.set_ylabel("读 K/V 的速度（GB/s）")
    ax.set_title(title)
    ax.legend(loc="lower right")
    return fig


def show_kernel(points: list[dict]):
    from minillm.lab.report import floor_words, show_table

    show_table(["上下文", "K/V 字节", "下界", "分页：实测", "连续 SDPA：实测", "分页 / 连续", "下界占实测"], [
        [fmt_int(p["ctx"]), f"{p['floor'].bytes / 2**20:,.1f} MiB", floor_words(p["floor"]),
         f"{p['paged_s'] * 1e6:,.0f} µs", f"{p['contiguous_s'] * 1e6:,.0f} µs",
         f"{p['paged_s'] / p['contiguous_s']:.2f}", f"{p['floor'].share_of(p['paged_s']):.0%}"] for p in points])


# --- The closing table and the glue ------------------------------------------------------------------

def kernel_record(field: str) -> str | None:
    """From the longest-context Triton point of the newest ``paged-decode`` GPU record, if any."""
    from minillm.lab import records
    from minillm.lab.notebook import recorded

    for record in records.find("paged-decode"):
        points = record.points(backend="triton")
        if points:
            p = max(points, key=lambda q: q["ctx"])
            if field == "fraction":
                return recorded(record, lambda r: f"{p['fraction_of_probed_bandwidth']:.0%}，上下文 {p['ctx']:,}")
            return recorded(record, lambda r: f"{p['median_s'] / p['contiguous_median_s']:.2f}")
    return None


def comparison(r: dict):
    from minillm.lab.report import comparison_table

    f, led, k = r["frag"], r["ledger"], r["kernel"][-1]
    free = "与设备无关（纯记账）"
    comparison_table([
        ("连续预留的利用率", f"{f['util_contiguous_est']:.1%}", f"{f['util_contiguous']:.1%}", free),
        (f"分页的利用率（块 {PAGE}）", f"{f['util_paged_est']:.2%}", f"{f['util_paged']:.2%}", free),
        ("24 GiB 卡放得下的请求（连续预留）", fmt_int(f["fit_contiguous_est"]), fmt_int(f["fit_contiguous"]), free),
        (f"24 GiB 卡放得下的请求（分页，块 {PAGE}）", f"{f['fit_paged_est']:.1f}", fmt_int(f["fit_paged"]), free),
        ("真实对话：前缀缓存省下的预填充 token（账本 → 引擎）", fmt_int(sum(x["reusable"] for x in led)),
         fmt_int(sum(x["cached"] for x in led)), None),
        (f"分页解码注意力（{r['backend']}，上下文 {fmt_int(k['ctx'])}）：下界占实测", "≤ 100%",
         f"{k['floor'].share_of(k['paged_s']):.0%}", kernel_record("fraction")),
        ("分页 / 连续 SDPA 的耗时比", "≈ 1（读的字节相同）", f"{k['paged_s'] / k['contiguous_s']:.2f}",
         kernel_record("ratio")),
    ])


def chat_break_notes(ledger: list[dict]) -> dict[str, str]:
    """The page's three sentences on where the chat's common prefixes broke short of the tokens
    computed before: inside an earlier answer (its text re-tokenized) in some turn, or in none."""
    n = sum(x["break"] == "retokenized" for x in ledger)
    return {
        "chat_broken_note": choose(
            n > 0,
            f"聊天模板从没改写更早的轮次，但有 {n} 轮的公共前缀断在上一轮回答的中间：模型生成的 token 解码成文本、"
            "再经聊天模板切词，切出来的 token 和它当初生成的不完全一样，从那个 token 起，缓存里的块就对不上了。",
            "聊天模板从没改写更早的轮次，每一轮的公共前缀也都一直延伸到上一轮算过的最后一个 token："
            "模型的回答解码成文本、再经聊天模板切词，切出的正是它生成的 token；换一段回答就未必如此。"),
        "chat_gap_note": choose(
            n > 0, "账本和“理想的复用”之间的差距则是实打实的：整块的截断，和文本再切词造成的断点。",
            "账本和“理想的复用”之间的差距则是实打实的：整块的截断；这段对话里，文本再切词没有造成断点。"),
        "chat_page_one_note": choose(
            n > 0, "一页一个 token 时只剩“最后一个 token 要现算”和再切词的断点这两处损失。",
            "一页一个 token 时只剩“最后一个 token 要现算”这一处损失（这段对话里再切词没有造成断点）。"),
    }


def kernel_block_note(kernel_us: dict, page: int = PAGE) -> str:
    """The page's conclusion on block size and decode attention: whether the smallest block timed
    is clearly (a quarter or more) slower than ``page``."""
    small = min(kernel_us)
    return choose(
        kernel_us[small] >= 1.25 * kernel_us[page],
        f"块很小时它却明显变慢了（块 {small} 对块 {page}），原因不在字节数：一起变长的请求轮流领块，块越小，"
        "一个请求的 token 在物理上越分散，连续的读被切成许多小段，块表本身也更长。"
        "块大小因此要两头兼顾：利用率要求它小，读取的连续性要求它别太小。",
        f"块很小时它也没有明显变慢（块 {small} 对块 {page}）：请求的 token 在物理上再分散，kernel 照样是逐个 token 去取。"
        "块大小因此主要看利用率和记账：利用率要求它小，块表的长度和前缀缓存要管的条目数要求它别太小。")


def lookup_note(hash_us: float, radix_us: float) -> str:
    """The page's sentences on which index looked a cached prompt up faster, and why."""
    ratio = max(hash_us, radix_us) / min(hash_us, radix_us)
    return choose(
        radix_us < hash_us,
        f"基数树快 {ratio:.1f} 倍：哈希链每一块都要算一次（父键, token）的哈希、再核对一次；"
        "基数树把一整段共同前缀压在一个节点里，进节点时查一次字典，之后每块只比较一次元组。",
        f"这一次反倒是哈希链快 {ratio:.1f} 倍。哈希链每一块算一次（父键, token）的哈希、再核对一次；"
        "基数树进节点时查一次字典，之后每块比较一次元组：两边每块都只做常数次操作，"
        "谁快取决于这台机器上 Python 解释器做这几步的常数。")


def lookup_scaling_note(lengths, lookup_us: dict) -> str:
    """The page's sentence on how lookup time grows with the prompt: in proportion when each
    index's time per token stays within 2x over ``lengths``."""
    spread = max(max(v) / min(v) for v in ([us / n for us, n in zip(t, lengths)] for t in lookup_us.values()))
    once = "每个请求只在第一次被调度时查一次，和它能省下的预填充相比很小。"
    return choose(
        spread < 2, "两者的耗时都和提示词长度成正比（每个 token 摊到的时间在几种长度之间相差不到一倍），而且" + once,
        f"这一次，每个 token 摊到的查找时间在几种长度之间最多差了 {spread:.1f} 倍，量不出和长度成正比。不过" + once)


def kernel_floor_note(within: bool, why: str | None) -> str:
    """The page's sentence on the kernel's floor: held, beaten for the reason ``why`` gives, or
    beaten with nothing this run measured to explain it."""
    return choose(within, "实测没有快过这个下界。", choose(
        bool(why), f"实测比这个下界还快：{why}。", "实测比这个下界还快，这一次量到的数解释不了。"))


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab."""
    from minillm.lab.claims import above_floor, claim
    from minillm.lab.notebook import g, last_level_cache_bytes, profile_words
    from minillm.lab.report import NOT_RECORDED

    lab = r["lab"]
    g("lab_device", lab.device_name)

    # the conversation
    led, turns = r["ledger"], r["turns"]
    claim(all(x["cached"] == x["reusable"] for x in led),
          "the engine's prefix hits equal the ledger's reusable tokens, turn by turn",
          cached=[x["cached"] for x in led], ledger=[x["reusable"] for x in led])
    claim(r["chat_run_hits"] == sum(x["cached"] for x in led), "the run counters add up the requests' hits")
    stops = sum(t["finish"] == "stop" for t in turns)
    claim(stops == len(turns), "every answer of the chat ends on the model's EOS", stops=stops)
    prompt_total = sum(x["prompt"] for x in led)
    hits = sum(x["cached"] for x in led)
    chat_lengths = [x["prompt"] + x["answer"] for x in led]
    g("chat_turns", str(len(led)))
    g("chat_answers", f"{min(x['answer'] for x in led)}–{max(x['answer'] for x in led)}")
    g("chat_first_prompt", fmt_int(led[0]["prompt"]))
    g("chat_last_prompt", fmt_int(led[-1]["prompt"]))
    g("chat_length_min", fmt_int(min(chat_lengths)))
    g("chat_length_max", fmt_int(max(chat_lengths)))
    g("chat_prompt_total", fmt_int(prompt_total))
    g("chat_hits", fmt_int(hits))
    g("chat_hit_share", f"{hits / prompt_total:.0%}")
    g("chat_reusable", fmt_int(sum(x["reusable"] for x in led)))
    g("chat_lcp_total", fmt_int(sum(x["lcp"] for x in led)))
    g("chat_reusable_1", fmt_int(sum(x["reusable_1"] for x in led)))
    g("chat_reusable_64", fmt_int(sum(x["reusable_64"] for x in led)))
    g("chat_computed", fmt_int(prompt_total - hits))
    g("chat_block_loss", fmt_int(sum(min(x["lcp"], x["prompt"] - 1) - x["reusable"] for x in led)))
    last = led[-1]
    g("chat_last_cached", fmt_int(last["cached"]))
    g("chat_last_computed", fmt_int(last["prompt"] - last["cached"]))
    g("chat_ttft_warm", ms(last["ttft"]))
    g("chat_ttft_cold", ms(r["cold"][-1]))
    claim(r["cold"][-1] > last["ttft"], "the last turn starts faster with the prefix cache",
          warm=last["ttft"], cold=r["cold"][-1])
    rewritten = [x["turn"] for x in led if x["break"] == "template"]
    claim(not rewritten, "the chat template renders the earlier turns unchanged", rewritten_turns=rewritten)
    for key, sentence in chat_break_notes(led).items():
        g(key, sentence)

    # fragmentation and block size
    f = r["frag"]
    claim(abs(f["util_paged"] - f["util_paged_est"]) < 0.01,
          "at block 16 the half-block estimate is within a point of the measured utilization",
          measured=f["util_paged"], estimate=f["util_paged_est"])
    for key in ("util_contiguous", "util_contiguous_est", "chat_contiguous"):
        g(key, f"{f[key]:.1%}")
    claim(f["chat_contiguous"] < 0.1, "reserved at the maximum length, the chat's requests leave it almost empty",
          utilization=f["chat_contiguous"])
    for key in ("util_paged", "util_paged_est", "chat_paged"):
        g(key, f"{f[key]:.2%}")
    g("mix_count", fmt_int(f["n"]))
    g("mix_mean", fmt_int(f["mean"]))
    g("mix_max", fmt_int(f["max"]))
    g("pool_tokens", fmt_int(f["pool_tokens"]))
    g("fit_contiguous", fmt_int(f["fit_contiguous"]))
    g("fit_paged", fmt_int(f["fit_paged"]))
    g("fit_paged_est", f"{f['fit_paged_est']:.1f}")
    g("fit_paged_mean", fmt_int(f["fit_paged_mean"]))
    g("fit_ratio", f"{f['fit_paged'] / f['fit_contiguous']:.1f}")
    g("util_paged_gap", f"{abs(f['util_paged'] - f['util_paged_est']) * 100:.2f}")
    util = r["util"]
    for bs in (256, 2048):
        g(f"util_bs{bs}", f"{util[bs]:.1%}")
        g(f"util_bs{bs}_est", f"{estimated_utilization(bs, f['mean']):.1%}")
    claim(util[2048] < estimated_utilization(2048, f["mean"]),
          "at blocks as long as the requests the measured utilization falls below the estimate")
    kus = r["kernel_us"]
    g("kernel_bs_note", kernel_block_note(kus))
    g("kernel_bs1_vs_16", f"{kus[1] / kus[PAGE]:.2f}")
    g("kernel_bs256_vs_16", f"{kus[256] / kus[PAGE]:.2f}")
    g("kernel_sweep_batch", r["kernel_sweep_words"])

    # hash chain against radix tree
    pressure = r["pressure"]
    gaps = [abs(h - x) for h, x in zip(pressure["hash"], pressure["radix"])]
    g("pressure_max_gap", f"{max(gaps) * 100:.1f}")
    g("pressure_hit_small", f"{pressure['hash'][0]:.1%}")
    g("pressure_hit_large", f"{pressure['hash'][-1]:.1%}")
    lookup = r["lookup_us"]
    g("lookup_len", fmt_int(r["lookup_lengths"][-1]))
    g("lookup_hash_us", f"{lookup['hash'][-1]:,.0f} µs")
    g("lookup_radix_us", f"{lookup['radix'][-1]:,.0f} µs")
    g("lookup_note", lookup_note(lookup["hash"][-1], lookup["radix"][-1]))
    g("lookup_scaling_note", lookup_scaling_note(r["lookup_lengths"], lookup))
    lookup_per_token = max(us / n for name in lookup for us, n in zip(lookup[name], r["lookup_lengths"])) / 1e6
    prefill_per_token = r["cold"][-1] / last["prompt"]
    claim(lookup_per_token < 0.01 * prefill_per_token,
          "a lookup costs little next to the prefill it saves (under 1% per token)",
          lookup_per_token=lookup_per_token, prefill_per_token=prefill_per_token)

    # the kernel
    k = r["kernel"][-1]
    cache = last_level_cache_bytes(lab.device)
    why = None
    if cache and k["floor"].bytes < cache:
        why = (f"一层的 K/V 只有 {k['floor'].bytes / 2**20:,.1f} MiB，装得进本机 {cache / 2**20:,.0f} MiB 的末级缓存；"
               "计时重复读同一份数据，读的是缓存，而拷贝带宽是用远大于缓存的数组量的")
    within = above_floor(k["paged_s"], k["floor"], why=why)
    g("kernel_max_error", f"{r['kernel_error']:.1e}")
    g("kernel_tolerance", f"{r['kernel_tolerance']:g}")
    g("kernel_ctx", fmt_int(k["ctx"]))
    g("kernel_batch", str(r["kernel_batch"]))
    g("kernel_paged_us", f"{k['paged_s'] * 1e6:,.0f} µs")
    g("kernel_contiguous_us", f"{k['contiguous_s'] * 1e6:,.0f} µs")
    g("kernel_ratio", f"{k['paged_s'] / k['contiguous_s']:.2f}")
    g("kernel_floor", f"{k['floor'].seconds * 1e6:,.0f} µs")
    g("kernel_floor_share", f"{k['floor'].share_of(k['paged_s']):.0%}")
    g("kernel_backend", r["backend"])
    g("kernel_floor_note", kernel_floor_note(within, why))
    claim(r["backend"] != "torch" or all(p["paged_s"] > p["contiguous_s"] for p in r["kernel"]),
          "on the CPU the torch path, which gathers a padded copy first, is slower than SDPA on contiguous tensors",
          ratios=[p["paged_s"] / p["contiguous_s"] for p in r["kernel"]])
    g("probe_bw", profile_words(lab.profile)["bw"])
    g("gpu_kernel_record", kernel_record("fraction") or NOT_RECORDED)
