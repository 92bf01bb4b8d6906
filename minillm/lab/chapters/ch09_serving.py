"""The serving lab's plumbing (``notebooks/ch09-serving.ipynb``, chapter 把引擎放到 HTTP 后面).

What lives here, out of the reader's way: the lab's scene (the twenty colleagues and their
contract, scaled to the device), the clients the lab plays (a streaming chat, the raw bytes on the
wire, a client that hangs up, a flood past the queue's limit), the tables and figures of the lab,
and :func:`glue_chapter`, which turns the results into the numbers and sentences the chapter glues.
The floor of the step that carries the contract is chapter 8's (:func:`ch08_scheduling.contract_steps`).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

from minillm.lab import estimate as L
from minillm.lab.chapters import ch08_scheduling as ch08
from minillm.lab.estimate import fmt_int
from minillm.lab.metrics import distribution
from minillm.lab.notebook import ms, room

COLLEAGUES = 20
BLOCK = 16
MAX_QUEUE = 32  # requests that may wait; the next one gets 503
QUESTION = "Explain in two sentences why a web server streams tokens to the user."  # English: SmolLM2
ANSWER_CAP = 96  # max_tokens of the streamed answer
HANG_UP_MAX, HANG_UP_AFTER, HANG_UP_WITHIN = 2048, 3, 1.0  # asks for, reads, seconds to free
TEXT_SERVER = dict(num_kv_blocks=512, max_model_len=4096)  # the real model's server
ALONE, ALONE_GAP = 10, 0.2  # short requests one by one, seconds apart: each finds the engine idle


@dataclass(frozen=True)
class Scene:
    """The chapter's scene at the lab's size: ``scale`` divides every length of the GPU scene."""

    scale: int
    contract: int  # tokens of the colleague who pastes a contract
    budget: int  # max_num_batched_tokens: tokens one engine step may compute
    output: int  # tokens each colleague asks for
    vocab_size: int
    contract_lag: float  # seconds after the others that the contract arrives: they are already in the engine

    @property
    def colleagues(self):
        """The twenty colleagues, the contract among them: the timed runs' workload."""
        return self.workload(seed=0)

    def warm_up(self, seed: int = 1):
        """The same scene with other prompts: an untimed first run (allocations, no prefix hits)."""
        return self.workload(seed)

    def workload(self, seed: int):
        """``loadgen``'s twenty colleagues with prompts drawn from ``seed``. The others arrive at once,
        the contract ``contract_lag`` later: on the same instant the order in which twenty
        connections reach the server is a race, and a contract that came in first would stall no one."""
        from dataclasses import replace

        from minillm.lab.loadgen import serving_workload

        workload = serving_workload("twenty-colleagues", self.vocab_size, COLLEAGUES, output_len=self.output,
                                    contract_len=self.contract, seed=seed)
        index = workload.input_lens.index(self.contract)
        arrivals = [self.contract_lag if i == index else t for i, t in enumerate(workload.arrival_times)]
        return replace(workload, arrival_times=arrivals)

    @property
    def contract_index(self) -> int:
        return self.colleagues.input_lens.index(self.contract)

    @property
    def pool_blocks(self) -> int:
        """A KV pool twice what all twenty need at once: memory is never the limit in this lab."""
        return 2 * room(self.colleagues.input_lens, self.output, BLOCK) // BLOCK

    @property
    def server(self) -> dict:
        """The options every timing server of the lab shares."""
        return dict(block_size=BLOCK, num_kv_blocks=self.pool_blocks)

    def __str__(self) -> str:
        return (f"合同 {fmt_int(self.contract)} 个 token，每人要 {self.output} 个 token，每步预算 "
                f"{fmt_int(self.budget)} 个 token，KV 池 {fmt_int(self.pool_blocks * BLOCK)} 个 token，"
                f"合同晚到 {ms(self.contract_lag)}"
                f"（长度是书里 GPU 场景的 1/{self.scale}）")


def scene(lab) -> Scene:
    """The GPU scene (8,192-token contract, budget 2,048, 64 tokens each) on a card with room for
    the model and the pool; a quarter of it on the CPU or a card without that room."""
    from minillm.lab.notebook import enough_gpu_memory

    full = Scene(1, 8192, 2048, 64, lab.config.vocab_size, 0.05)
    need = L.weight_bytes(lab.config, lab.dtype_name) + full.pool_blocks * BLOCK * L.kv_bytes_per_token(
        lab.config, lab.dtype_name)
    if lab.on_gpu and enough_gpu_memory(lab.device, int(1.2 * need)):
        return full
    return Scene(4, 8192 // 4, 2048 // 4, 64 // 4, lab.config.vocab_size, 0.05 if lab.on_gpu else 0.1)


# --- Section 1: one streamed answer, the bytes on the wire, a client that hangs up ---------------

def stream_chat(server, question: str = QUESTION, max_tokens: int = ANSWER_CAP) -> dict:
    """One streamed chat answer through the ``openai`` client: each chunk's arrival (seconds from
    the request), its text and finish reason, the usage of the last chunk, the whole text."""
    import openai

    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    sent = time.perf_counter()
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0.0, stream=True, stream_options={"include_usage": True})
    chunks = []
    for chunk in stream:
        choice = chunk.choices[0] if chunk.choices else None
        chunks.append({"t": time.perf_counter() - sent, "text": choice.delta.content if choice else None,
                       "finish": choice.finish_reason if choice else None,
                       "usage": chunk.usage.model_dump() if chunk.usage else None})
    return {"chunks": chunks, "text": "".join(c["text"] or "" for c in chunks),
            "usage": chunks[-1]["usage"]}


def wire_lines(server, question: str = QUESTION, max_tokens: int = 3) -> list[str]:
    """The non-empty lines of a short streamed chat answer, as the bytes arrive."""
    import httpx

    body = {"model": server.model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as response:
        return [line for line in response.iter_lines() if line]


def gauges(url: str) -> tuple[float, float, float]:
    """The server's gauges now: (requests running, requests waiting, share of KV blocks held)."""
    import httpx

    from minillm.lab.loadgen import parse_metrics

    _, values = parse_metrics(httpx.get(url + "/metrics").text)
    return values["num_requests_running"], values["num_requests_waiting"], values["kv_cache_usage_perc"]


def hang_up(server, prompt: str = QUESTION) -> dict:
    """A client asks for ``HANG_UP_MAX`` tokens and closes the connection after ``HANG_UP_AFTER``;
    the gauges while it streams, then polled until nothing runs and no KV block is held (or
    ``HANG_UP_WITHIN`` seconds pass)."""
    import httpx

    body = {"model": server.model, "prompt": prompt, "max_tokens": HANG_UP_MAX, "stream": True,
            "ignore_eos": True}
    with httpx.Client() as http, http.stream("POST", server.base_url + "/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"the server refused the request: {response.status_code} {response.read().decode()}")
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == HANG_UP_AFTER:
                during = gauges(server.url)
                break  # leaving the stream closes the connection: the hang-up
    polls, hung_up = [], time.perf_counter()
    while time.perf_counter() - hung_up < HANG_UP_WITHIN:
        polls.append((time.perf_counter() - hung_up, *gauges(server.url)))
        if polls[-1][1] == 0 and polls[-1][3] == 0:
            break
        time.sleep(0.01)
    return {"during": during, "polls": polls}


def freed(hung: dict) -> bool:
    """Whether the last poll after the hang-up saw no request running and no KV block held."""
    _, running, _, kv = hung["polls"][-1]
    return running == 0 and kv == 0


def show_stream(stream: dict, offline_text: str):
    """The chunks as they arrived, then the answer and whether the engine alone says the same."""
    from minillm.lab.report import show_answer, show_table

    rows = [[ms(c["t"]), repr(c["text"]) if c["text"] is not None else "（无）", c["finish"] or "",
             "有" if c["usage"] else ""] for c in stream["chunks"]]
    shown = rows[:4] + [["…", f"（中间 {len(rows) - 8} 块）", "", ""]] + rows[-4:] if len(rows) > 10 else rows
    show_table(["收到的时刻（从发出算起）", "这一块的文字", "finish_reason", "usage"], shown)
    show_answer(stream["text"])
    same = "一字不差" if stream["text"] == offline_text else "不一样"
    usage = stream["usage"]
    print(f"经过服务器的回答和同一进程里 lab.chat 的回答{same}；用量：prompt {usage['prompt_tokens']} 个 token，"
          f"回答 {usage['completion_tokens']} 个")


def show_hang_up(hung: dict):
    """The gauges while the client streamed, and at each poll after it hung up."""
    from minillm.lab.report import show_table

    running, waiting, kv = hung["during"]
    rows = [["挂断之前", f"{running:.0f}", f"{waiting:.0f}", f"{kv:.1%}"]]
    rows += [[f"挂断后 {ms(t)}", f"{r:.0f}", f"{w:.0f}", f"{k:.1%}"] for t, r, w, k in hung["polls"]]
    show_table(["时刻", "正在运行", "正在等待", "KV 占用"], rows)


# --- Section 2: the colleagues through HTTP, client against server ---------------------------------

def alone_workload(vocab_size: int):
    """``ALONE`` short requests, ``ALONE_GAP`` seconds apart: no queue, one prefill and the HTTP."""
    from minillm.lab.loadgen import serving_workload

    work = serving_workload("burst", vocab_size, ALONE, input_len=64, output_len=4, seed=3)
    return work.with_arrivals([i * ALONE_GAP for i in range(ALONE)])


def side_by_side(run: dict) -> dict:
    """Mean TTFT and end-to-end as the clients saw them and as the server's histograms did, and
    the server's mean queueing."""
    from minillm.lab.loadgen import server_mean

    client = run["summary"]
    return {"ttft": (client["ttft"]["mean"], server_mean(run, "time_to_first_token_seconds")),
            "e2e": (client["e2e"]["mean"], server_mean(run, "e2e_request_latency_seconds")),
            "queue": server_mean(run, "request_queue_time_seconds")}


def show_overhead(runs: dict):
    """Client against server, for each run of ``runs`` ({label: loadgen record})."""
    from minillm.lab.report import show_table

    rows = []
    for label, run in runs.items():
        both = side_by_side(run)
        for metric, name in (("ttft", "TTFT"), ("e2e", "端到端")):
            client, server = both[metric]
            rows.append([label, name, ms(client), ms(server), ms(client - server), f"{(client - server) / client:.1%}"])
        rows.append([label, "排队（服务器记的）", "", ms(both["queue"]), "", ""])
    show_table(["场景", "平均", "客户端量到", "服务器自己记的", "差：HTTP 这一层", "占客户端的比例"], rows)


def show_load(run: dict):
    """What the clients of one loadgen run saw, in a table (the CLI prints the same in English)."""
    from minillm.lab.report import show_table

    s = run["summary"]
    rows = [[label] + ["—" if s[key] is None else ms(s[key][q]) for q in ("mean", "p50", "p90", "p99")]
            for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("max_itl", "最长停顿"), ("e2e", "端到端"))]
    show_table(["", "平均", "p50", "p90", "p99"], rows)
    print(f"{s['num_requests']} 个请求，完成 {s['num_completed']} 个，出错 {s['num_errors']} 个；"
          f"输出吞吐 {s['output_throughput'] or 0:,.0f} token/s")


def plot_gauges(run: dict, contract_index: int):
    """The sampled gauges of one run: requests running and waiting, KV use, first tokens."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE

    samples = run["server_metrics"]["samples"]
    t = [x["t"] for x in samples]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7.6, 4.4), sharex=True)
    ax1.step(t, [x["num_requests_running"] for x in samples], where="post", color=PALETTE[0], label="正在运行")
    ax1.step(t, [x["num_requests_waiting"] for x in samples], where="post", color=PALETTE[3], label="正在等待")
    ax1.set_ylabel("请求数")
    ax1.legend(loc="upper right")
    ax2.step(t, [100 * x["kv_cache_usage_perc"] for x in samples], where="post", color=PALETTE[2])
    ax2.set_ylabel("KV 占用（%）")
    ax2.set_ylim(0, 100)
    for r in run["requests"]:
        if r["ttft"] is not None:
            ax2.axvline(r["start"] + r["ttft"], ymin=0, ymax=0.1, lw=1.2,
                        color=PALETTE[1] if r["index"] == contract_index else "#555555")
    ax2.set_xlabel("从第一个请求发出算起（s）")
    return fig


# --- Section 3: chunked prefill off and on, as the clients saw it --------------------------------

def gauge_interval(lab) -> float:
    """Seconds between the load generator's samples of the server's gauges in the timed bursts."""
    return 0.05 if lab.on_gpu else 0.1


def burst_settings(sc: Scene) -> dict:
    """The two servers: the whole contract in one step (and a token for each decode), or chunks
    (section 2's server)."""
    return {"不分块": dict(max_num_batched_tokens=sc.contract + COLLEAGUES, no_enable_chunked_prefill=True),
            "分块": dict(max_num_batched_tokens=sc.budget)}


def questions(run: dict, metric: str, contract_index: int) -> dict | None:
    """A latency of the short questions (every colleague but the contract), as the clients saw it."""
    return distribution([r[metric] for r in run["requests"] if r["index"] != contract_index
                         and r[metric] is not None])


def show_bursts(bursts: dict, sc: Scene):
    """The short questions' latencies and the contract's own TTFT, chunking off and on."""
    from minillm.lab.report import show_table

    settings, rows = burst_settings(sc), []
    for name, run in bursts.items():
        q = {m: questions(run, m, sc.contract_index) for m in ("ttft", "tpot", "max_itl")}
        rows.append([name, fmt_int(settings[name]["max_num_batched_tokens"]), ms(q["ttft"]["p50"]),
                     ms(q["ttft"]["p99"]), ms(q["tpot"]["p50"]), ms(q["max_itl"]["p50"]),
                     ms(run["requests"][sc.contract_index]["ttft"])])
    show_table(["", "每步预算（token）", "短问题 TTFT p50", "TTFT p99", "TPOT p50", "最长停顿 p50",
                "合同的 TTFT"], rows)


def plot_bursts(bursts: dict, sc: Scene):
    """Each colleague's TTFT in the order they were sent, chunking off and on."""
    import matplotlib.pyplot as plt

    from minillm.lab.plotting import PALETTE

    fig, ax = plt.subplots(figsize=(7.6, 3.4))
    for (name, run), color, marker in zip(bursts.items(), (PALETTE[0], PALETTE[1]), ("o", "s")):
        order = sorted(run["requests"], key=lambda r: r["index"])
        ax.plot([r["index"] + 1 for r in order], [r["ttft"] * 1e3 for r in order], marker=marker, ms=4,
                color=color, label=name)
    ax.axvline(sc.contract_index + 1, color="#777777", lw=0.8)
    ax.set_xticks(range(1, COLLEAGUES + 1, 2))
    ax.set_xlabel("同事（发出顺序；竖线是合同）")
    ax.set_ylabel("客户端量到的 TTFT（ms）")
    ax.legend()
    return fig


def stall_floors(lab, sc: Scene) -> ch08.ContractSteps:
    """Chapter 8's steps of the lab's contract at this machine's two ceilings: the other colleagues
    decoding (one token each, at the context of a short question) while it arrives."""
    others = [n for n in sc.colleagues.input_lens if n != sc.contract]
    ctx = round(statistics.fmean(others) + sc.output / 2)
    profile = lab.profile
    return ch08.contract_steps(lab.config, sc.contract, sc.budget, COLLEAGUES - 1, ctx,
                               profile.matmul_flops, profile.copy_bandwidth, lab.dtype_name, lab.device_name)


def show_stalls(bursts: dict, floors: ch08.ContractSteps, sc: Scene):
    """The measured longest stall of the short questions against the floor of the step that
    stalled them: the whole contract, or its heaviest chunk."""
    from minillm.lab.report import floor_words, show_table

    rows = []
    for name, floor in (("不分块", floors.whole), ("分块", floors.worst_chunk)):
        measured = questions(bursts[name], "max_itl", sc.contract_index)["p50"]
        rows.append([name, floor_words(floor), ms(measured), f"{floor.seconds / measured:.0%}"])
    show_table(["", "那一步的下界 max(F/P, M/W)", "实测最长停顿 p50", "下界占实测"], rows)


# --- Section 4: the queue is full -----------------------------------------------------------------

def flood(server, sc: Scene) -> dict:
    """``3 * MAX_QUEUE`` requests at once, each prompt a whole step's budget; then, with the queue
    still full, ``2 * MAX_QUEUE`` streams opened by hand to read a 503's headers."""
    import httpx

    from minillm.lab.loadgen import run_load, serving_workload

    work = serving_workload("burst", sc.vocab_size, 3 * MAX_QUEUE, input_len=sc.budget, output_len=4, seed=4)
    record = run_load(server.url, work, progress=False, sample_interval=None)
    rejected = None
    with httpx.Client() as http:
        requests = [http.build_request("POST", server.base_url + "/completions", json={
            "model": server.model, "prompt": p, "max_tokens": 4, "ignore_eos": True, "stream": True})
            for p in work.prompts[:2 * MAX_QUEUE]]
        responses = [http.send(request, stream=True) for request in requests]
        for response in responses:
            if response.status_code == 503 and rejected is None:
                rejected = {"retry_after": response.headers.get("retry-after"), "body": response.read().decode()}
        for response in responses:
            response.close()
    return {"record": record, "by_hand": rejected}


def show_flood(result: dict):
    """How the flood ended, and one 503 as the client received it."""
    from minillm.lab.report import show_english

    s = result["record"]["summary"]
    print(f"{s['num_requests']} 个请求：完成 {s['num_completed']} 个，出错 {s['num_errors']} 个，"
          f"按状态码 {s['errors_by_status'] or '（无）'}")
    hand = result["by_hand"]
    print("手工同时打开的流里，" + (f"有一个得到 503，Retry-After: {hand['retry_after']}" if hand
                                   else "这一次没有一个得到 503"))
    if hand:
        show_english(hand["body"])


# --- The closing table and the chapter's glue ----------------------------------------------------

def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.report import comparison_table

    sc, floors, bursts = r["scene"], r["floors"], r["bursts"]
    both = side_by_side(r["alone"])
    comparison_table([
        ("不分块：短问题最长的停顿", f"≥ {ms(floors.whole.seconds)}",
         ms(questions(bursts["不分块"], "max_itl", sc.contract_index)["p50"]), None),
        ("分块：短问题最长的停顿", f"≥ {ms(floors.worst_chunk.seconds)}",
         ms(questions(bursts["分块"], "max_itl", sc.contract_index)["p50"]), None),
        ("一个一个来：HTTP 这一层加在 TTFT 上的", "—", ms(both["ttft"][0] - both["ttft"][1]), None),
    ])


def chunk_ttft_words(plain_p99: float, chunked_p99: float) -> str:
    """What chunking did to the short questions' TTFT p99, as a whole sentence."""
    change = f"短问题 TTFT 的 p99 从 {ms(plain_p99)} 变成 {ms(chunked_p99)}"
    if chunked_p99 > 1.1 * plain_p99:
        return (f"分块的代价在首字：{change}，同样多的 prompt 要多走几步，每一步都要给所有正在解码的人各采样一个 token、"
                "各推一个 SSE 块。")
    if chunked_p99 >= 0.9 * plain_p99:
        return f"{change}，相差不到一成。"
    return f"{change}，反而短了：不分块时，排在合同后面的短问题要等它整段的预填充算完。"


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab (``r``: the lab's results)."""
    from minillm.lab.claims import choose, claim, floors_beaten
    from minillm.lab.notebook import g
    from minillm.lab.report import beaten_words, profile_beat_words

    lab, sc = r["lab"], r["scene"]
    g("device", lab.device_name)
    g("model", lab.config.name)
    g("scale", str(sc.scale))
    g("contract", fmt_int(sc.contract))
    g("contract_lag", ms(sc.contract_lag))
    g("budget", fmt_int(sc.budget))
    g("output", fmt_int(sc.output))
    g("pool_tokens", fmt_int(sc.pool_blocks * BLOCK))
    g("max_queue", str(MAX_QUEUE))

    # the streamed answer and the hang-up
    stream, hung = r["stream"], r["hang_up"]
    claim(stream["text"] == r["offline_text"], "the server's greedy answer is the engine's, word for word")
    text_chunks = [c for c in stream["chunks"] if c["text"]]
    g("text_model", "SmolLM2-135M-Instruct")
    g("stream_chunks", str(len(stream["chunks"])))
    g("stream_text_chunks", str(len(text_chunks)))
    g("stream_completion_tokens", str(stream["usage"]["completion_tokens"]))
    g("usage_prompt", str(stream["usage"]["prompt_tokens"]))
    g("stream_first", ms(text_chunks[0]["t"]))
    g("stream_gap", ms((text_chunks[-1]["t"] - text_chunks[0]["t"]) / max(len(text_chunks) - 1, 1)))
    g("stream_finish", stream["chunks"][-2]["finish"] or "—")
    claim(freed(hung) and hung["polls"][-1][0] < HANG_UP_WITHIN,
          f"a client that hangs up leaves nothing running and no KV block held within {HANG_UP_WITHIN} s",
          polls=hung["polls"])
    claim(hung["during"][0] >= 1 and hung["during"][2] > 0, "the streaming request ran and held KV blocks")
    g("hangup_max", fmt_int(HANG_UP_MAX))
    g("hangup_after", str(HANG_UP_AFTER))
    g("hangup_within", f"{HANG_UP_WITHIN:g} 秒")
    g("hangup_kv_during", f"{hung['during'][2]:.1%}")
    g("hangup_freed", choose(
        len(hung["polls"]) == 1,
        "关掉连接之后第一次读 /metrics，正在运行的请求数和 KV 占用就都已经是 0。",
        f"关掉连接之后 {ms(hung['polls'][-1][0])}，/metrics 上正在运行的请求数和 KV 占用回到了 0。"))

    # the colleagues through HTTP
    record, alone = r["colleagues"], r["alone"]
    s = record["summary"]
    claim(s["num_completed"] == COLLEAGUES, "every colleague's request completes", completed=s["num_completed"])
    both = {"colleagues": side_by_side(record), "alone": side_by_side(alone)}
    over = {k: v["ttft"][0] - v["ttft"][1] for k, v in both.items()}
    g("colleagues_completed", str(s["num_completed"]))
    g("colleagues_ttft_p50", ms(s["ttft"]["p50"]))
    g("colleagues_ttft_p99", ms(s["ttft"]["p99"]))
    g("peak_kv", f"{max(x['kv_cache_usage_perc'] for x in record['server_metrics']['samples']):.0%}")
    for key in both:
        g(f"{key}_ttft_client", ms(both[key]["ttft"][0]))
        g(f"{key}_ttft_server", ms(both[key]["ttft"][1]))
        g(f"{key}_overhead", ms(over[key]))
        g(f"{key}_queue", ms(both[key]["queue"]))
    g("alone_n", str(ALONE))
    share = over["colleagues"] / both["colleagues"]["ttft"][0]
    g("colleagues_note", choose(
        share < 0.5,
        f"同事们同时到达时，客户端 TTFT 的大头在服务器里：HTTP 这一层只占 {share:.0%}，"
        f"其余是排队（平均 {ms(both['colleagues']['queue'])}）和算 prompt。",
        f"同事们同时到达时，HTTP 这一层占了客户端 TTFT 的 {share:.0%}，比服务器里排队和算 prompt 的时间还多。"))
    alone_share = over["alone"] / both["alone"]["ttft"][0]
    g("poisson_note", choose(
        alone_share > share,
        f"那时排队少，HTTP 这一层在 TTFT 里的比例更显眼：上面一个一个来的短请求里它占 {alone_share:.0%}，同时到达时只占 {share:.0%}。",
        f"不过在这台机器上，一个一个来的短请求里 HTTP 这一层只占 TTFT 的 {alone_share:.0%}，并不比同时到达时的 {share:.0%} 显眼。"))
    g("cores_note", choose(
        lab.on_gpu, "这台机器上，负载生成器的事件循环、服务器的事件循环挤在同几个 CPU 核上，引擎的一步在卡上跑。",
        f"这台机器上，负载生成器的事件循环、服务器的事件循环和引擎的一步挤在同 {os.cpu_count()} 个 CPU 核上。"))
    g("alone_note", choose(
        over["alone"] > 0,
        f"一个一个来的时候没有排队，客户端比服务器多等了 {ms(over['alone'])}，占它 TTFT 的 {alone_share:.0%}。",
        f"一个一个来的时候，客户端的平均 TTFT 和服务器记的相差 {ms(over['alone'])}，在计时的起伏之内。"))

    # chunked prefill off and on
    bursts, floors = r["bursts"], r["floors"]
    q = {name: {m: questions(run, m, sc.contract_index) for m in ("ttft", "tpot", "max_itl")}
         for name, run in bursts.items()}
    claim(all(run["summary"]["num_completed"] == COLLEAGUES for run in bursts.values()),
          "every request of both bursts completes")
    for name, key in (("不分块", "plain"), ("分块", "chunked")):
        g(f"{key}_budget", fmt_int(burst_settings(sc)[name]["max_num_batched_tokens"]))
        for metric in ("ttft", "tpot", "max_itl"):
            for stat in ("p50", "p99"):
                g(f"{key}_{metric}_{stat}", ms(q[name][metric][stat]))
        g(f"{key}_contract_ttft", ms(bursts[name]["requests"][sc.contract_index]["ttft"]))
    plain, chunked = q["不分块"], q["分块"]
    g("chunk_stall_note", choose(
        chunked["max_itl"]["p50"] < 0.8 * plain["max_itl"]["p50"],
        f"分块之后，短问题最长的一次停顿（中位数）从 {ms(plain['max_itl']['p50'])} 缩到 "
        f"{ms(chunked['max_itl']['p50'])}：合同的预填充切成几段夹在解码中间，不再有一步把正在解码的人整个挡住。",
        f"这一次分块没有让短问题最长的停顿明显变短（中位数 {ms(plain['max_itl']['p50'])} 对 "
        f"{ms(chunked['max_itl']['p50'])}）。"))
    g("chunk_tpot_note", choose(
        abs(chunked["tpot"]["p50"] - plain["tpot"]["p50"]) < 0.15 * plain["tpot"]["p50"],
        f"平均出字间隔几乎不变（TPOT 中位数 {ms(plain['tpot']['p50'])} 对 {ms(chunked['tpot']['p50'])}）："
        "合同的 prompt 总要有人算，摊到每个 token 上的时间差不多。",
        f"平均出字间隔变了：TPOT 中位数从 {ms(plain['tpot']['p50'])} 变成 {ms(chunked['tpot']['p50'])}。"))
    g("chunk_ttft_note", chunk_ttft_words(plain["ttft"]["p99"], chunked["ttft"]["p99"]))
    checks = []
    for name, floor in (("不分块", floors.whole), ("分块", floors.worst_chunk)):
        measured = q[name]["max_itl"]["p50"]
        checks.append((measured, floor, profile_beat_words(measured, floor, lab.profile, f"{name}时最长的停顿")))
        key = "plain" if name == "不分块" else "chunked"
        g(f"{key}_stall_floor", ms(floor.seconds))
        g(f"{key}_stall_bound", ch08.BOUND[floor.bound])
        g(f"{key}_stall_share", f"{floor.seconds / measured:.0%}")
    g("stall_running", str(floors.running))
    g("stall_ctx", fmt_int(floors.ctx))
    g("matmul_rate", f"{lab.profile.matmul_flops / 1e9:,.1f} GFLOP/s")
    g("copy_rate", f"{lab.profile.copy_bandwidth / 1e9:,.1f} GB/s")
    floor_ratio = floors.whole.seconds / floors.worst_chunk.seconds
    measured_ratio = plain["max_itl"]["p50"] / chunked["max_itl"]["p50"]
    g("stall_ratio_note", choose(
        abs(measured_ratio / floor_ratio - 1) < 0.35,
        f"两种停顿之比，按下界约 {floor_ratio:.1f} 倍，实测 {measured_ratio:.1f} 倍：停顿的长短基本由一步里算多少 prompt token 决定。",
        f"两种停顿之比，按下界约 {floor_ratio:.1f} 倍，实测是 {measured_ratio:.1f} 倍：一步里还有不随 prompt 长度"
        "成比例的部分（每步给所有人采样、推 SSE 块的固定开销，CPU 上注意力的参考实现），在这台机器上分量不小。"))
    g("stall_floor_note", beaten_words(floors_beaten(checks), "两种停顿都比各自的下界长。"))

    # the flood
    f = r["flood"]["record"]["summary"]
    rejected = int(f["errors_by_status"].get("503", 0))
    claim(f["num_errors"] == rejected, "every failed request of the flood is a 503", errors=f["errors_by_status"])
    g("flood_n", str(f["num_requests"]))
    g("flood_note", choose(
        rejected > 0,
        f"{f['num_requests']} 个请求里，{f['num_completed']} 个完成，{rejected} 个当场得到 503：被拒绝的请求拿到的是 503、"
        "一个 Retry-After 头和一条写明原因的错误，而不是挂在那里直到超时。",
        f"这一次 {f['num_requests']} 个请求全都排上了队：引擎收得比请求来得快，队列没满过。"))
