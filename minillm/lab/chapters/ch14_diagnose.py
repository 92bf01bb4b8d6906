"""The diagnosis chapter's plumbing (``book/ch14-diagnose.md``, ``notebooks/ch14-diagnose.ipynb``,
chapter 先问瓶颈，再换框架).

Two halves, out of the reader's way. The lab's: three serving scenarios built to hit one wall each,
run, recorded (``records.save_run``) and read back by ``minillm.lab.diagnose``; their tables and
figure in Chinese; :func:`glue_chapter`. The page's: :func:`page_numbers`, which it glues (tensor
parallelism, quantization, mixture of experts and speculative decoding have their own chapters).
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.engine.config import load_config
from minillm.lab import estimate as L
from minillm.lab.estimate import fmt_int
from minillm.lab.notebook import ms

SYMPTOM_ZH = {"first_token": "首字慢", "tokens": "出字慢", "failure": "直接失败"}
WALL_ZH = {"compute": "算力墙", "bandwidth": "带宽墙", "capacity": "容量墙"}
BOUND_ZH = {"compute": "算力", "memory": "带宽"}
BLOCK = 16


# --- The lab: three scenarios, each built to hit one wall -----------------------------------------

@dataclass(frozen=True)
class Scenario:
    title: str
    inputs: tuple[int, ...]  # prompt lengths
    output: int  # tokens each request generates
    budget: int  # max_num_batched_tokens
    pool: int | None  # KV pool tokens; None: room for every request at once

    def pool_tokens(self) -> int:
        from minillm.lab.notebook import room

        return self.pool or room(self.inputs, self.output, BLOCK)


def scenarios(on_gpu: bool) -> dict[str, Scenario]:
    """Long prompts (compute), many decodes (bandwidth), a pool too small (capacity). On the CPU
    lengths are a quarter and the decodes few: a tiny fp32 model's decode step is bandwidth-bound
    only below a batch of about 5 on a CPU whose ridge is a few FLOP per byte."""
    s = 1 if on_gpu else 4
    decoders = 128 if on_gpu else 4
    return {
        "long_prompts": Scenario("长 prompt", (8192 // s,) * 3, 16 // s, 2048 // s, None),
        "decode_heavy": Scenario("解码为主", (128 // s,) * decoders, 256 // s, 2048 // s, None),
        "small_pool": Scenario("显存不够", (1024 // s,) * 12, 128 // s, 2048 // s, 3 * (1024 + 128) // s),
    }


def warm_up(lab) -> None:
    """One untimed run: the first allocations and kernels are not any scenario's."""
    from minillm import LLM
    from minillm.lab.notebook import greedy

    LLM(lab.model, num_kv_blocks=64).generate([[1] * 64] * 4, greedy(4), use_tqdm=False)


def roomy(s: Scenario) -> Scenario:
    """The same scenario with a KV pool that holds every request at once."""
    from dataclasses import replace

    return replace(s, pool=None)


def ceilings(lab) -> dict:
    """The ceilings MBU, MFU and each step's floor use: the spec row on a known GPU (diagnose's
    default), this build's machine profile on the CPU."""
    if lab.on_gpu:
        return {}
    return dict(bandwidth=lab.profile.copy_bandwidth, peak_flops=lab.profile.matmul_flops)


def run_scenario(lab, s: Scenario, path, pool: int | None = None):
    """Run ``s`` on the lab's model (``pool`` tokens of KV instead of the scenario's), save its
    record at ``path`` and diagnose it."""
    from minillm import LLM
    from minillm.lab import records
    from minillm.lab.diagnose import diagnose
    from minillm.lab.workload import make_workload

    llm = LLM(lab.model, num_kv_blocks=L.ceil_div(pool or s.pool_tokens(), BLOCK), block_size=BLOCK,
              max_num_batched_tokens=s.budget, enable_prefix_caching=False)
    make_workload(s.title, list(s.inputs), [s.output] * len(s.inputs), lab.config.vocab_size).run(llm)
    return diagnose(records.save_run(llm, path), **ceilings(lab))


def client_run(lab, s: Scenario, path):
    """``s`` behind the HTTP server (the same pool and budget), sent by the load generator: the
    client's run record saved at ``path`` and diagnosed."""
    from minillm.lab import records
    from minillm.lab.diagnose import diagnose_client
    from minillm.lab.loadgen import run_load, serving_workload

    work = serving_workload("burst", lab.config.vocab_size, len(s.inputs), input_len=s.inputs[0], output_len=s.output)
    warm = serving_workload("burst", lab.config.vocab_size, 2, input_len=s.inputs[0], output_len=2, seed=9)
    with lab.serve(block_size=BLOCK, num_kv_blocks=L.ceil_div(s.pool_tokens(), BLOCK),
                   max_num_batched_tokens=s.budget) as server:
        run_load(server.url, warm, progress=False, sample_interval=None)  # untimed: first allocations
        record = run_load(server.url, work, progress=False, sample_interval=0.02)
    return diagnose_client(records.save_client_run(record, path))


def share(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def show_diagnoses(runs: dict, scene: dict):
    """The three answers and the wall of each run, in Chinese (``python -m minillm diagnose``
    prints the same in English)."""
    from minillm.lab.report import show_table

    rows = []
    for name, d in runs.items():
        lat, mem, bat = d.latency, d.memory, d.batching
        rows.append([scene[name].title, SYMPTOM_ZH[d.symptom], share(lat.first_token_share),
                     f"{mem.requests_in_pool:.1f}", share(mem.peak_kv_share),
                     f"{bat.mean_decode_batch:.1f}" if bat.mean_decode_batch else "—",
                     share(bat.queueing_share_of_ttft), f"{bat.waited_steps['kv_pool']} / {bat.num_steps}",
                     lat.num_preemptions, share(bat.compute_bound_share), WALL_ZH[d.wall]])
    show_table(["场景", "哪种慢", "首字前占端到端", "池子装几个平均请求", "KV 峰值", "平均解码批", "排队占 TTFT",
                "因 KV 等待的步", "抢占", "受算力限制的步占忙碌时间", "墙"], rows)


def plot_diagnoses(runs: dict, scene: dict):
    """Left: the busy time by the side of the roofline each step's floor is on; right: what the
    users' average wait was made of."""
    import matplotlib.pyplot as plt
    import numpy as np

    from minillm.lab.plotting import PALETTE

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8.4, 3.6), sharey=True)
    y = np.arange(len(runs))
    compute = np.array([d.batching.compute_bound_share or 0.0 for d in runs.values()])
    ax1.barh(y, compute, color=PALETTE[1], label="受算力限制的步")
    ax1.barh(y, 1 - compute, left=compute, color=PALETTE[0], label="受带宽限制的步")
    ax1.set_yticks(y, [f"{scene[n].title}\n→ {WALL_ZH[d.wall]}" for n, d in runs.items()])
    ax1.invert_yaxis()
    ax1.set_xlim(0, 1)
    ax1.set_xlabel("引擎忙碌时间的占比")
    ax1.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=2)
    left = np.zeros(len(runs))
    for label, color, part in (("排队", "#BBBBBB", lambda d: d.batching.mean_queueing),
                               ("调度后到首字", PALETTE[1], lambda d: d.latency.ttft["mean"] - d.batching.mean_queueing),
                               ("首字之后", PALETTE[0], lambda d: d.latency.e2e["mean"] - d.latency.ttft["mean"])):
        widths = np.array([part(d) / d.latency.e2e["mean"] for d in runs.values()])
        ax2.barh(y, widths, left=left, color=color, label=label)
        left += widths
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("用户平均等待的构成")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=3)
    return fig


def show_fixed(before, after):
    """The small pool against a pool that holds everyone, the rest unchanged."""
    from minillm.lab.report import show_table

    show_table(["", "KV 池小", "KV 池够大"], [
        ["墙", WALL_ZH[before.wall], WALL_ZH[after.wall]],
        ["哪种慢", SYMPTOM_ZH[before.symptom], SYMPTOM_ZH[after.symptom]],
        ["平均 TTFT", ms(before.latency.ttft["mean"]), ms(after.latency.ttft["mean"])],
        ["平均 TPOT", ms(before.latency.tpot["mean"]), ms(after.latency.tpot["mean"])],
        ["平均端到端", ms(before.latency.e2e["mean"]), ms(after.latency.e2e["mean"])],
        ["平均解码批", f"{before.batching.mean_decode_batch:.1f}", f"{after.batching.mean_decode_batch:.1f}"],
        ["抢占", before.latency.num_preemptions, after.latency.num_preemptions],
    ])


def show_client(view, engine_view):
    """What the client-side record of the HTTP run told (the clients' times and the server's
    /metrics) against the engine's own record of the in-process run."""
    from minillm.lab.report import show_table

    sv = view.server_view

    def metric(x, fmt=str):
        return "—" if sv is None or x is None else fmt(x)

    show_table(["", "HTTP 那次：客户端的记录和 /metrics", "进程内那次：引擎的记录"], [
        ["哪种慢", SYMPTOM_ZH[view.symptom], SYMPTOM_ZH[engine_view.symptom]],
        ["墙", WALL_ZH[view.wall] if view.wall else "判不出", WALL_ZH[engine_view.wall]],
        ["抢占", metric(sv and sv.num_preemptions), engine_view.latency.num_preemptions],
        ["KV 峰值", metric(sv and sv.peak_kv_usage, share), share(engine_view.memory.peak_kv_share)],
        ["平均 TTFT：客户端量的", ms(view.latency.ttft["mean"]), "—"],
        ["平均 TTFT：服务器自己记的", metric(sv and sv.mean_ttft, ms), ms(engine_view.latency.ttft["mean"])],
        ["每一步的批、受哪个上限限制", "没有步日志，看不出", "有"],
    ])


def client_wall_note(view, engine_wall: str) -> str:
    """What the client-side record (``view``, a ``ClientDiagnosis``) told of the wall the engine's
    record found (``engine_wall``), as one whole sentence built only for the case that holds."""
    from minillm.lab.diagnose import KV_FULL_SHARE

    sv, wall = view.server_view, WALL_ZH[engine_wall]
    if sv is None:
        return f"服务器没有导出 /metrics，从客户端的记录判不出是哪堵墙（引擎的记录说是{wall}）。"
    if view.wall is None:
        return (f"从客户端的记录却判不出是哪堵墙（引擎的记录说是{wall}）：服务器的计数里没有抢占，"
                "仪表的采样也没碰上 KV 用满的那一刻。")
    if sv.peak_kv_usage is not None and sv.peak_kv_usage >= KV_FULL_SHARE and sv.peak_waiting:
        return (f"从客户端的记录也判得出是{WALL_ZH[view.wall]}：服务器的 KV 占用最高到了 {share(sv.peak_kv_usage)}，"
                f"同时最多有 {sv.peak_waiting:.0f} 个请求在等。")
    return (f"从客户端的记录也判得出是{WALL_ZH[view.wall]}：服务器的计数里有 {sv.num_preemptions} 次抢占，"
            "池子在有请求在跑的时候用完了。")


def client_extra_sentence(view) -> str:
    """The clients' mean TTFT against the server's own (from /metrics, the same run), as one whole
    sentence; one saying so when the server counted no TTFT."""
    sv = view.server_view
    if view.extra_ttft is None:
        return "服务器的 /metrics 里没有它自己记的 TTFT，客户端比它多等了多久，这次算不出来。"
    client, server = ms(view.latency.ttft["mean"]), ms(sv.mean_ttft)
    if view.extra_ttft >= 0:
        return (f"客户端量到的平均 TTFT 是 {client}，同一次运行里服务器自己记的是 {server}，"
                f"客户端多等的 {ms(view.extra_ttft)} 是网络、HTTP 和等下一步开始的时间。")
    return (f"客户端量到的平均 TTFT 是 {client}，同一次运行里服务器自己记的是 {server}，客户端这边反而短了 "
            f"{ms(-view.extra_ttft)}：两边计时的起止点不同，这点差别量不出网络和 HTTP 的开销。")


def comparison(r: dict):
    """The lab's "estimate | measured here | recorded on GPU" table."""
    from minillm.lab.estimate import fmt_bytes
    from minillm.lab.report import comparison_table

    lab, runs = r["lab"], r["runs"]
    long_run, decode_run, small = runs["long_prompts"], runs["decode_heavy"], runs["small_pool"]
    cfg, dtype = lab.config, lab.dtype_name
    comparison_table([
        (f"权重（{dtype}）", fmt_bytes(L.weight_bytes(cfg, dtype), "MiB"), fmt_bytes(long_run.memory.weight_bytes, "MiB"), None),
        ("每 token 的 KV", fmt_bytes(L.kv_bytes_per_token(cfg, dtype), "KiB"),
         fmt_bytes(long_run.memory.kv_bytes_per_token, "KiB"), None),
        ("算 prompt 的步：FLOP 速率", f"≤ {long_run.batching.peak_flops / 1e12:,.3f} TFLOP/s",
         f"{long_run.batching.prefill_flops_per_s / 1e12:,.3f} TFLOP/s（MFU {share(long_run.batching.mfu)}）", None),
        ("纯解码的步：读取带宽", f"≤ {decode_run.batching.bandwidth / 1e9:,.1f} GB/s",
         f"{decode_run.batching.decode_bytes_per_s / 1e9:,.1f} GB/s（MBU {share(decode_run.batching.mbu)}）", None),
        ("显存不够的场景：KV 峰值", f"{small.memory.kv_pool_tokens:,} token（整个池子）",
         f"{small.memory.peak_kv_tokens:,} token", None),
    ])


def glue_chapter(r: dict) -> None:
    """Glue every number and sentence the chapter quotes from this lab (``r``: the lab's results)."""
    from minillm.lab.claims import choose, claim
    from minillm.lab.notebook import g

    lab, runs, scene = r["lab"], r["runs"], r["scene"]
    g("device", lab.device_name)
    g("model", lab.config.name)
    g("scale_note", scale_note(scene, scenarios(on_gpu=True)))
    claim([d.wall for d in runs.values()] == ["compute", "bandwidth", "capacity"],
          "the three scenarios hit the compute, the bandwidth and the capacity wall",
          walls=[d.wall for d in runs.values()])
    for name, d in runs.items():
        s, lat, mem, bat = scene[name], d.latency, d.memory, d.batching
        g(f"{name}_requests", str(len(s.inputs)))
        g(f"{name}_prompt", fmt_int(s.inputs[0]))
        g(f"{name}_output", fmt_int(s.output))
        g(f"{name}_symptom", SYMPTOM_ZH[d.symptom])
        g(f"{name}_wall", WALL_ZH[d.wall])
        g(f"{name}_compute_share", share(bat.compute_bound_share))
        g(f"{name}_first_token_share", share(lat.first_token_share))
        g(f"{name}_queue_share", share(bat.queueing_share_of_ttft))
        g(f"{name}_decode_batch", f"{bat.mean_decode_batch:.1f}")
        g(f"{name}_preemptions", str(lat.num_preemptions))
        g(f"{name}_kv_waits", str(bat.waited_steps["kv_pool"]))
        g(f"{name}_budget_waits", str(bat.waited_steps["token_budget"]))
        g(f"{name}_steps", str(bat.num_steps))
        g(f"{name}_pool", fmt_int(mem.kv_pool_tokens))
        g(f"{name}_pool_requests", f"{mem.requests_in_pool:.1f}")
        g(f"{name}_tpot", ms(lat.tpot["mean"]))
        g(f"{name}_mbu", share(bat.mbu))
        g(f"{name}_mfu", share(bat.mfu))
    long_run, heavy, small = runs["long_prompts"], runs["decode_heavy"], runs["small_pool"]
    claim(long_run.batching.waited_steps["kv_pool"] == 0 < long_run.batching.waited_steps["token_budget"],
          "the long prompts wait for the token budget, not for KV blocks", waits=long_run.batching.waited_steps)
    claim(small.batching.waited_steps["kv_pool"] > 0 and small.latency.num_aborted == 0 and small.symptom != "failure",
          "in the small pool requests wait for KV blocks and every request still finishes",
          kv_waits=small.batching.waited_steps["kv_pool"], aborted=small.latency.num_aborted, symptom=small.symptom)
    source = "规格表" if lab.on_gpu else "本机机器画像"
    g("ceiling_source", source)
    g("ceiling_note", ceiling_note(long_run.batching, heavy.batching, source))
    claim(heavy.batching.queueing_share_of_ttft < 0.2 and heavy.batching.prefill_time_share < 0.2,
          "decoding: the requests hardly queue and the engine's time goes almost all to decoding",
          queueing=heavy.batching.queueing_share_of_ttft, prefill=heavy.batching.prefill_time_share)
    claim(heavy.symptom == "tokens" and heavy.batching.mean_decode_batch > len(scene["decode_heavy"].inputs) / 2,
          "decoding: the users feel slow tokens, and the decode batch holds most of the requests at once",
          symptom=heavy.symptom, decode_batch=heavy.batching.mean_decode_batch)
    memory, cfg, dtype = long_run.memory, lab.config, lab.dtype_name
    claim(memory.weight_bytes == L.weight_bytes(cfg, dtype) and memory.kv_bytes_per_token == L.kv_bytes_per_token(cfg, dtype),
          "the engine allocates exactly the ledger's weight bytes and KV bytes per token",
          weights=memory.weight_bytes, ledger_weights=L.weight_bytes(cfg, dtype),
          kv_per_token=memory.kv_bytes_per_token, ledger_kv_per_token=L.kv_bytes_per_token(cfg, dtype))
    claim(small.memory.requests_in_pool < len(scene["small_pool"].inputs),
          "the small pool holds fewer average requests than arrive", pool_requests=small.memory.requests_in_pool)

    # the small pool, enlarged
    fixed = r["fixed"]
    claim(fixed.latency.ttft["mean"] < small.latency.ttft["mean"] and fixed.latency.num_preemptions == 0,
          "a pool that holds everyone ends the preemptions and shortens the mean TTFT",
          ttft_before=small.latency.ttft["mean"], ttft_after=fixed.latency.ttft["mean"],
          preemptions_after=fixed.latency.num_preemptions)
    g("fixed_pool", fmt_int(fixed.memory.kv_pool_tokens))
    g("fixed_decode_batch", f"{fixed.batching.mean_decode_batch:.1f}")
    g("fixed_wall", WALL_ZH[fixed.wall])
    g("fixed_ttft_note", f"平均 TTFT 从 {ms(small.latency.ttft['mean'])} 降到 {ms(fixed.latency.ttft['mean'])}。")
    e2e_before, e2e_after = small.latency.e2e["mean"], fixed.latency.e2e["mean"]
    g("fixed_e2e_note", choose(
        e2e_after < e2e_before,
        f"平均端到端也从 {ms(e2e_before)} 缩短到 {ms(e2e_after)}。",
        f"平均端到端却从 {ms(e2e_before)} 变成了 {ms(e2e_after)}：同时在跑的请求多了，每一步更贵，"
        f"平均 TPOT 从 {ms(small.latency.tpot['mean'])} 涨到 {ms(fixed.latency.tpot['mean'])}。首字快了，出字却慢了。"))
    moved = f"墙也变了，从{WALL_ZH[small.wall]}变成了{WALL_ZH[fixed.wall]}：推开一堵墙，后面那堵就露出来了。"
    stayed = f"墙却还是{WALL_ZH[fixed.wall]}：池子放大了，这批请求还是被同一样东西卡住。"
    g("wall_change_note", choose(fixed.wall != small.wall, moved, stayed))
    g("wall_push_note", choose(fixed.wall != small.wall, moved + "服务调优就是这样一堵一堵往前推，每推一次，重新诊断一次，"
                               "也要看用户关心的那个数到底变好了没有。", stayed))

    # the client's view
    view = r["client"]
    g("client_symptom", SYMPTOM_ZH[view.symptom])
    g("client_wall_note", client_wall_note(view, small.wall))
    g("client_extra_sentence", client_extra_sentence(view))


def scale_note(scene: dict, gpu: dict) -> str:
    """Whether the lab ran the scenarios at the GPU's lengths (``gpu``: ``scenarios(on_gpu=True)``)
    or scaled down, as one whole sentence."""
    long_run, heavy = scene["long_prompts"], scene["decode_heavy"]
    if long_run == gpu["long_prompts"] and heavy == gpu["decode_heavy"]:
        return "请求的长度和个数都按 GPU 上的原样。"
    scale = gpu["long_prompts"].inputs[0] // long_run.inputs[0]
    return (f"这是 CPU，请求和输出的长度都缩小到 GPU 上的 1/{scale}，“解码为主”的请求也从 "
            f"{len(gpu['decode_heavy'].inputs)} 个减到 {len(heavy.inputs)} 个。")


def ceiling_note(prefill, decode, source: str) -> str:
    """Whether the prompt steps' MFU (``prefill``, a ``Batching``) and the decode steps' MBU
    (``decode``) stay under 100%, as one whole sentence; one above it names, in numbers, the ceiling
    (taken from ``source``, e.g. 本机机器画像) that was too low for that operation. Each ends with
    the lead-in to the page's list of what the ledger leaves out, worded for the utilizations it has."""
    mfu_over, mbu_over = bool(prefill.mfu and prefill.mfu > 1), bool(decode.mbu and decode.mbu > 1)
    flops, peak = f"{(prefill.prefill_flops_per_s or 0) / 1e9:,.1f}", f"{(prefill.peak_flops or 0) / 1e9:,.1f}"
    read, bandwidth = f"{(decode.decode_bytes_per_s or 0) / 1e9:,.1f}", f"{(decode.bandwidth or 0) / 1e9:,.1f}"
    if mfu_over and mbu_over:
        return (f"两个利用率都超过了 100%：算 prompt 的步实际达到 {flops} GFLOP/s，高于上限 {peak} GFLOP/s；"
                f"纯解码的步实际读了 {read} GB/s，高于上限 {bandwidth} GB/s。{source}里的两个上限对这两种运算都偏低，"
                "不是引擎超常发挥；这时的利用率只能看相对高低。即便如此，每一步的时间里仍有账本没算进去的部分，"
                "前面几章逐项量过：")
    if mfu_over:
        return (f"MFU 超过了 100%：算 prompt 的步实际达到 {flops} GFLOP/s，高于上限 {peak} GFLOP/s。"
                f"{source}里的矩阵乘速率对这种运算偏低，不是引擎超常发挥；这时的 MFU 只能看相对高低。"
                "MBU 离 100% 的差距来自几处，前面几章逐项量过：")
    if mbu_over:
        return (f"MBU 超过了 100%：纯解码的步实际读了 {read} GB/s，高于上限 {bandwidth} GB/s。"
                f"{source}里的带宽对这种读法偏低，不是引擎超常发挥；这时的 MBU 只能看相对高低。"
                "MFU 离 100% 的差距来自几处，前面几章逐项量过：")
    return "两个利用率都在 100% 之下。差距来自几处，前面几章逐项量过："


# --- The page ------------------------------------------------------------------------------------

def page_numbers() -> dict[str, str]:
    """Every number the page quotes, under its glue key (thresholds of the diagnosis, and the
    tensor-parallel gain in KV of two 24 GiB cards from chapter 13's ledger)."""
    from minillm.lab.chapters.ch13_parallel import kv_tokens_left
    from minillm.lab.diagnose import COMPUTE_TIME_SHARE, FIRST_TOKEN_SHARE, KV_BLOCKED_SHARE

    cfg = load_config("llama-3.1-8b")
    gain = kv_tokens_left(cfg, 2, 24) / kv_tokens_left(cfg, 1, 24)
    return {"kv_blocked_share": f"{KV_BLOCKED_SHARE:.0%}", "compute_time_share": f"{COMPUTE_TIME_SHARE:.0%}",
            "first_token_share": f"{FIRST_TOKEN_SHARE:.0%}", "tp2_gain": f"{gain:.1f}"}
