"""Find the wall before changing the engine (chapter 先问瓶颈，再换框架).

``diagnose(record)`` reads the run record of one run (``minillm.lab.records.run_record(llm)`` or the
JSON file ``records.save_run`` wrote) and answers three questions before anyone reaches for another
framework:

1. **Which kind of slow?** The first token (TTFT), the tokens after it (TPOT), or outright failure
   (requests that ended without their answer: aborted, or refused). A preempted request still
   finishes: users see it as a slow first token or a stall, and the wall below says why.
2. **Where does the memory go?** The ledger of weights, the KV pool and what is left, measured
   (the record's memory section) beside the estimate (``minillm.lab.estimate``).
3. **Did batches form?** The batch of every step, how much of the TTFT was spent in the queue, and
   why requests waited: the KV pool, the token budget or ``max_num_seqs``.

From these it names the wall:

- **capacity** when the KV pool ran out: any preemption, or requests left waiting in at least
  ``KV_BLOCKED_SHARE`` of the steps although the token budget and ``max_num_seqs`` had room;
- else **compute** when steps whose floor ``max(F/P, M/W)`` is set by the compute ceiling took at
  least ``COMPUTE_TIME_SHARE`` of the engine's busy time (F and M from the ledger, step by step;
  P and W the device's ceilings). Without ceilings (a CPU record and none given) the steps that
  computed prompts stand in for the compute-bound ones, and the evidence says so;
- else **bandwidth**: the time went to steps bound by moving weights and KV.

The numbers behind the verdict are kept on the :class:`Diagnosis` and printed by ``report()``.

``diagnose_client(record)`` reads what the load generator saw instead (a client run record,
``minillm.lab.loadgen``): it answers question 1 from the clients' own times, names the capacity
wall when the server's scraped metrics show it (preemptions, or a queue while the KV pool was
full), and says plainly what a client cannot know (no step log, no ledger, no per-request split).
"""
from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass

from minillm.engine.config import ModelConfig
from minillm.engine.memory_plan import MemoryPlan
from minillm.engine.scheduler import ADMISSION_STOPS
from minillm.engine.units import fmt_bytes, fmt_or_dash, fmt_seconds
from minillm.lab import estimate as ledger
from minillm.lab import loadgen
from minillm.lab.gpus import find_gpu
from minillm.lab.metrics import distribution
from minillm.lab.records import CLIENT_RUN_FORMAT, load_client_run, load_record, load_run

SYMPTOMS = ("first_token", "tokens", "failure")
WALLS = ("compute", "bandwidth", "capacity")
KV_BLOCKED_SHARE = 0.1  # steps in which the KV pool kept requests waiting: capacity from here up
COMPUTE_TIME_SHARE = 0.5  # busy time in compute-bound steps: compute from here up
FIRST_TOKEN_SHARE = 0.5  # the wait before the first token, of end-to-end: first token slow from here up
KV_FULL_SHARE = 0.9  # KV use from which requests left waiting mean the pool is the limit

@dataclass(frozen=True)
class Latency:
    """Question 1, what users feel. Distributions are {mean, p50, p90, p99} in seconds."""

    num_requests: int
    num_aborted: int
    num_preemptions: int
    num_preempted_requests: int | None  # None: a client-side record cannot tell
    ttft: dict | None
    tpot: dict | None
    e2e: dict | None
    first_token_share: float | None  # mean TTFT / mean end-to-end: the wait before the first token


@dataclass(frozen=True)
class MemoryUse:
    """Question 2, the memory: the card's plan (when the engine planned its pool) and what the run
    used of the pool, measured bytes beside the ledger's estimate."""

    plan: MemoryPlan | None  # None when the KV pool was sized by hand
    weight_bytes: int
    weight_bytes_estimate: int
    kv_bytes_per_token: float
    kv_bytes_per_token_estimate: int
    kv_cache_bytes: int
    kv_pool_tokens: int
    peak_kv_tokens: int  # most pool slots held at once (whole blocks)
    mean_request_tokens: float  # prompt + output of the average request

    @property
    def peak_kv_share(self) -> float:
        return self.peak_kv_tokens / self.kv_pool_tokens

    @property
    def requests_in_pool(self) -> float:
        """How many average requests the KV pool holds at once."""
        return self.kv_pool_tokens / self.mean_request_tokens


@dataclass(frozen=True)
class Batching:
    """Question 3, the schedule: did batches form, or did requests queue (and why)."""

    num_steps: int
    busy_seconds: float  # sum of step durations
    mean_batch: float  # requests scheduled per step
    max_batch: int
    mean_decode_batch: float | None  # decode tokens per step, over steps that decoded
    max_num_seqs: int
    queueing_share_of_ttft: float | None  # sum of queueing / sum of TTFT
    mean_queueing: float | None
    waited_steps: dict  # reason -> steps that ended with requests still waiting for that reason
    prefill_time_share: float  # busy time attributed to prompt tokens (mixed steps split by tokens)
    compute_bound_share: float | None  # busy time in steps whose floor is compute-bound (None: no ceilings)
    decode_bytes_per_s: float | None  # matmul weights + KV read per pure decode step / its duration
    prefill_flops_per_s: float | None  # FLOPs of steps that carried prompt tokens / their duration
    bandwidth: float | None  # the ceilings compared against (spec row or caller's), B/s
    peak_flops: float | None  # FLOP/s
    num_computed_positions: int = 0  # token positions the steps ran through the model (proposals included)
    num_rejected_positions: int = 0  # of those, proposals the target rejected: computed, never output

    @property
    def rejected_share(self) -> float:
        """Share of the computed positions that speculation threw away."""
        return self.num_rejected_positions / self.num_computed_positions if self.num_computed_positions else 0.0

    @property
    def kv_blocked_share(self) -> float:
        return self.waited_steps["kv_pool"] / self.num_steps

    @property
    def mbu(self) -> float | None:
        """Model bandwidth utilization of the decode steps."""
        if self.decode_bytes_per_s is None or self.bandwidth is None:
            return None
        return self.decode_bytes_per_s / self.bandwidth

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilization of the steps that computed prompts."""
        if self.prefill_flops_per_s is None or self.peak_flops is None:
            return None
        return self.prefill_flops_per_s / self.peak_flops


@dataclass(frozen=True)
class Diagnosis:
    """The verdict (``symptom``, ``wall``), the numbers behind it, and the reasons in words."""

    model: str
    device: str
    symptom: str  # one of SYMPTOMS
    wall: str  # one of WALLS
    latency: Latency
    memory: MemoryUse
    batching: Batching
    evidence: tuple[str, ...]  # why this wall, each line with its numbers

    def as_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        """The three answers and the verdict as plain text (what the CLI prints)."""
        lat, mem, bat = self.latency, self.memory, self.batching
        lines = [f"minillm diagnose: {self.model} on {self.device}, {lat.num_requests} requests, "
                 f"{bat.num_steps} steps, {bat.busy_seconds:.3f} s busy",
                 *_symptom_lines(self.symptom, lat)]
        lines.append(f"   aborted {lat.num_aborted}, preemptions {lat.num_preemptions} "
                     f"({lat.num_preempted_requests} requests preempted)")
        lines += ["", "2. Ledger",
                  f"   weights {_bytes(mem.weight_bytes)} (estimate {_bytes(mem.weight_bytes_estimate)})",
                  f"   KV per token {_bytes(mem.kv_bytes_per_token)} (estimate "
                  f"{_bytes(mem.kv_bytes_per_token_estimate)})",
                  f"   KV pool {_bytes(mem.kv_cache_bytes)} = {mem.kv_pool_tokens:,} tokens = "
                  f"{mem.requests_in_pool:.1f} requests of the mean {mem.mean_request_tokens:,.0f} tokens",
                  f"   peak KV in use {mem.peak_kv_tokens:,} tokens ({mem.peak_kv_share:.0%} of the pool)"]
        if mem.plan is not None:
            plan = mem.plan
            lines.append(f"   card {_bytes(plan.total_bytes)}, budget {_bytes(plan.budget_bytes)}, "
                         f"activation peak {_bytes(plan.activation_peak_bytes)}, other "
                         f"{_bytes(plan.other_bytes)}, unused {_bytes(plan.unused_bytes)}")
        else:
            lines.append("   card size not in the record (KV pool set by hand): headroom unknown")
        waited = ", ".join(f"{bat.waited_steps[r]} for {_WAIT_TEXT[r]}"
                           for r in ADMISSION_STOPS if bat.waited_steps[r])
        lines += ["", "3. Batches",
                  f"   batch per step: mean {bat.mean_batch:.1f}, max {bat.max_batch} "
                  f"(max_num_seqs {bat.max_num_seqs}); mean decode batch "
                  f"{fmt_or_dash(bat.mean_decode_batch, '.1f')}",
                  f"   queueing: {fmt_or_dash(bat.queueing_share_of_ttft, '.0%')} of TTFT "
                  f"(mean {fmt_seconds(bat.mean_queueing)})",
                  f"   steps that ended with requests waiting: {waited or 'none'}",
                  f"   busy time on prompts (prefill) {bat.prefill_time_share:.0%}, on decode "
                  f"{1 - bat.prefill_time_share:.0%}",
                  f"   busy time in compute-bound steps (floor max(F/P, M/W)): "
                  f"{fmt_or_dash(bat.compute_bound_share, '.0%')}"]
        if bat.decode_bytes_per_s is not None:
            mbu = f" = {bat.mbu:.0%} of {bat.bandwidth / 1e9:,.0f} GB/s (MBU)" if bat.mbu is not None else ""
            lines.append(f"   decode steps read {bat.decode_bytes_per_s / 1e9:,.2f} GB/s{mbu}")
        if bat.prefill_flops_per_s is not None:
            mfu = f" = {bat.mfu:.0%} of {bat.peak_flops / 1e12:,.3f} TFLOP/s (MFU)" if bat.mfu is not None else ""
            lines.append(f"   prompt steps computed {bat.prefill_flops_per_s / 1e12:,.3f} TFLOP/s{mfu}")
        if bat.num_rejected_positions:
            lines.append(f"   speculation: {bat.num_rejected_positions:,} of {bat.num_computed_positions:,} "
                         f"computed positions rejected ({bat.rejected_share:.0%} of the work thrown away)")
        lines += ["", f"Wall: {self.wall} ({_WALL_TEXT[self.wall]})"]
        lines += [f"   - {line}" for line in self.evidence]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


_SYMPTOM_TEXT = {"first_token": "the first token (TTFT)", "tokens": "the tokens after the first (TPOT)",
                 "failure": "outright failure (requests that ended without their answer)"}
_WAIT_TEXT = {"kv_pool": "KV blocks", "token_budget": "the token budget",
              "max_num_seqs": "max_num_seqs", "static_batch": "the static batch to finish"}
_WALL_TEXT = {"compute": "prompts are computed at the matrix rate of the device",
              "bandwidth": "every decode step reads all weights and KV from memory",
              "capacity": "the KV pool is too small for the requests in flight"}


# --- Reading a record ----------------------------------------------------------------------------

def _config(record: dict) -> ModelConfig:
    if not isinstance(record["model"], dict):
        raise ValueError("the record's model section is not a ModelConfig: not an object")
    model = dict(record["model"])
    model["eos_token_ids"] = tuple(model.get("eos_token_ids", ()))
    try:
        return ModelConfig(**model)
    except TypeError as err:
        raise ValueError(f"the record's model section is not a ModelConfig: {err}") from None


# --- The three questions -------------------------------------------------------------------------

def diagnose(record, bandwidth: float | None = None, peak_flops: float | None = None) -> Diagnosis:
    """Diagnose one run: ``record`` is ``records.run_record(llm)`` or the path of its JSON.

    ``bandwidth`` (B/s) and ``peak_flops`` (FLOP/s) are the ceilings the decode and prompt steps
    are compared with (MBU, MFU); default: the spec row of the record's GPU in ``data/gpus.csv``,
    none for a CPU (pass ``minillm.lab.hardware.probe_device()``'s numbers there).
    """
    record = load_run(record)
    cfg = _config(record)
    device = record.get("device") or {}
    spec = find_gpu(device.get("name", "")) if device.get("type") == "cuda" else None
    bandwidth = bandwidth if bandwidth is not None else (spec.bandwidth if spec else None)
    peak_flops = peak_flops if peak_flops is not None else (spec.bf16_flops if spec else None)
    latency = _latency(record)
    memory = _memory(record, cfg)
    batching = _batching(record, cfg, bandwidth, peak_flops)
    symptom = _symptom(latency)
    wall, evidence = _wall(latency, memory, batching)
    return Diagnosis(cfg.name, device.get("name", "unknown device"), symptom, wall, latency,
                     memory, batching, tuple(evidence))


def _latency(record: dict) -> Latency:
    requests = record["requests"]
    values = {name: [r[name] for r in requests if r[name] is not None] for name in ("ttft", "e2e")}
    tpots = [r["tpot"] for r in requests if r.get("tpot") is not None]
    both = [r for r in requests if r["ttft"] is not None and r["e2e"] is not None]
    share = None
    if both and sum(r["e2e"] for r in both) > 0:
        share = sum(r["ttft"] for r in both) / sum(r["e2e"] for r in both)
    return Latency(
        num_requests=len(requests),
        num_aborted=sum(r["finish_reason"] == "abort" for r in requests),
        num_preemptions=record["stats"]["num_preemptions"],
        num_preempted_requests=sum(r.get("num_preemptions", 0) > 0 for r in requests),
        ttft=distribution(values["ttft"]), tpot=distribution(tpots), e2e=distribution(values["e2e"]),
        first_token_share=share)


def _memory(record: dict, cfg: ModelConfig) -> MemoryUse:
    engine, memory, steps = record["engine"], record["memory"], record["stats"]["steps"]
    block_size, num_blocks = engine["block_size"], engine["num_kv_blocks"]
    fewest_free = min(min(s["num_free_blocks_before"], s["num_free_blocks"]) for s in steps)
    plan = memory["plan"] and MemoryPlan.from_dict(memory["plan"])
    requests = record["requests"]
    return MemoryUse(
        plan=plan,
        weight_bytes=memory["weight_bytes"],
        weight_bytes_estimate=ledger.weight_bytes(cfg, record["dtype"]),
        kv_bytes_per_token=memory["kv_bytes_per_block"] / block_size,
        kv_bytes_per_token_estimate=ledger.kv_bytes_per_token(cfg, record["dtype"]),
        kv_cache_bytes=memory["kv_cache_bytes"],
        kv_pool_tokens=num_blocks * block_size,
        peak_kv_tokens=(num_blocks - fewest_free) * block_size,
        mean_request_tokens=statistics.fmean(r["num_prompt_tokens"] + r["num_output_tokens"]
                                             for r in requests))


def _batching(record: dict, cfg: ModelConfig, bandwidth, peak_flops) -> Batching:
    engine, steps, requests = record["engine"], record["stats"]["steps"], record["requests"]
    durations = [s["end"] - s["start"] for s in steps]
    busy = sum(durations)
    prefill_time = sum(d * s["num_prefill_tokens"] / (s["num_prefill_tokens"] + s["num_decode_tokens"])
                       for s, d in zip(steps, durations) if s["num_prefill_tokens"])
    decode_batches = [s["num_decode_tokens"] for s in steps if s["num_decode_tokens"]]
    queued = [r for r in requests if r["queueing"] is not None and r["ttft"] is not None]
    ttft_sum = sum(r["ttft"] for r in queued)
    waited = dict.fromkeys(ADMISSION_STOPS, 0)
    for step in steps:
        if step["admission_stop"] is not None:
            waited[step["admission_stop"]] += 1
    ledgers = _step_ledgers(record, cfg)
    decode = [(nbytes, d) for (flops, nbytes), s, d in zip(ledgers, steps, durations) if not s["num_prefill_tokens"]]
    prefill = [(flops, d) for (flops, nbytes), s, d in zip(ledgers, steps, durations) if s["num_prefill_tokens"]]
    compute_share = None
    if bandwidth and peak_flops and busy > 0:
        compute_share = sum(d for (flops, nbytes), d in zip(ledgers, durations)
                            if ledger.roofline_floor(flops, nbytes, peak_flops, bandwidth).bound == "compute") / busy
    return Batching(
        num_steps=len(steps), busy_seconds=busy,
        mean_batch=statistics.fmean(s["batch_size"] for s in steps),
        max_batch=max(s["batch_size"] for s in steps),
        mean_decode_batch=statistics.fmean(decode_batches) if decode_batches else None,
        max_num_seqs=engine["max_num_seqs"],
        queueing_share_of_ttft=sum(r["queueing"] for r in queued) / ttft_sum if ttft_sum > 0 else None,
        mean_queueing=statistics.fmean(r["queueing"] for r in queued) if queued else None,
        waited_steps=waited, prefill_time_share=prefill_time / busy if busy > 0 else 0.0,
        compute_bound_share=compute_share, decode_bytes_per_s=_rate(decode), prefill_flops_per_s=_rate(prefill),
        bandwidth=bandwidth, peak_flops=peak_flops,
        num_computed_positions=sum(n for s in steps for _, n in s["scheduled"]),
        num_rejected_positions=sum(sum(s.get("num_rejected", {}).values()) for s in steps))


def _rate(work: list[tuple[float, float]]) -> float | None:
    """Work per second over (work, seconds) pairs; None without time."""
    seconds = sum(d for _, d in work)
    return sum(w for w, _ in work) / seconds if seconds > 0 else None


def _step_ledgers(record: dict, cfg: ModelConfig) -> list[tuple[float, float]]:
    """(FLOPs, bytes) of every step by the ledger: the layers for each scheduled token, causal
    attention to its context, the output layer for each sampled row (a request verifying k
    proposals samples k + 1); the matmul weights read once (of an MoE model, the experts the
    step's tokens are expected to touch; the input embedding is a lookup of a few rows, not a read
    of the table) and the KV of every scheduled request's context read or written. Rejected
    proposals are billed like the others: they were computed. With a draft of the first L layers
    (``speculative_config`` method ``draft_layers``) the step also ran its passes: pass j over
    the requests with more than j proposals, each reading the first L layers' and the output
    layer's weights and L layers of the KV. Contexts are replayed from the step log: a request's
    context grows by its scheduled tokens less its rejected ones and restarts at 0 when it is
    preempted by recompute."""
    engine, memory = record["engine"], record["memory"]
    kv_per_token = memory["kv_bytes_per_block"] / engine["block_size"]
    layer_flops = ledger.matmul_flops_per_token(cfg) - ledger.output_layer_flops(cfg)
    attention_per_position = ledger.attention_flops_per_token(cfg, 1)
    spec = engine.get("speculative_config") or {}
    draft = cfg.replace(num_layers=spec["num_draft_layers"]) if spec.get("method") == "draft_layers" else None
    computed: dict[str, int] = {}
    out = []
    for step in record["stats"]["steps"]:
        if engine["preemption_mode"] == "recompute":
            for request_id in step["preempted"]:
                computed[request_id] = 0
        kv_tokens = 0
        rows = step["num_sampled"] + step.get("num_draft_tokens", 0)
        flops = rows * ledger.output_layer_flops(cfg)  # logits only where sampled
        rejected = step.get("num_rejected", {})
        drafts = []  # (context before the step, proposals) of each verifying request
        for request_id, num_new in step["scheduled"]:
            before = computed.get(request_id, 0)
            if request_id in rejected:
                drafts.append((before, num_new - 1))
            computed[request_id] = before + num_new - rejected.get(request_id, 0)
            kv_tokens += before + num_new
            # new token j attends to before + j + 1 positions
            flops += num_new * layer_flops + attention_per_position * (num_new * before + num_new * (num_new + 1) // 2)
        tokens = sum(num_new for _, num_new in step["scheduled"])
        nbytes = ledger.matmul_weight_bytes(cfg, max(tokens, 1), record["dtype"]) + kv_tokens * kv_per_token
        if draft is not None and drafts:
            draft_flops, draft_bytes = _draft_ledger(draft, drafts, kv_per_token * draft.num_layers / cfg.num_layers,
                                                     record["dtype"])
            flops, nbytes = flops + draft_flops, nbytes + draft_bytes
        out.append((flops, nbytes))
    return out


def _draft_ledger(draft: ModelConfig, drafts: list[tuple[int, int]], kv_per_token: float,
                  dtype) -> tuple[float, float]:
    """(FLOPs, bytes) of a step's draft passes: ``draft``, the model cut to the draft's layers;
    ``drafts``, (context before the step, proposals) of each verifying request; ``kv_per_token``,
    the draft layers' share."""
    flops = nbytes = 0.0
    for j in range(max(k for _, k in drafts)):
        active = [ctx for ctx, k in drafts if k > j]
        flops += sum(ledger.matmul_flops_per_token(draft) + ledger.attention_flops_per_token(draft, ctx + j + 1)
                     for ctx in active)
        nbytes += ledger.matmul_weight_bytes(draft, len(active), dtype) + sum(ctx + j + 1 for ctx in active) * kv_per_token
    return flops, nbytes


# --- The verdict ---------------------------------------------------------------------------------

def _symptom(latency: Latency) -> str:
    """Failure when requests ended without their answer (aborted, or refused on the client side);
    else the larger part of the average wait: before the first token (TTFT) or after it."""
    if latency.num_aborted:
        return "failure"
    if latency.first_token_share is not None and latency.first_token_share >= FIRST_TOKEN_SHARE:
        return "first_token"
    return "tokens"


def _wall(latency: Latency, memory: MemoryUse, batching: Batching) -> tuple[str, list[str]]:
    """Capacity first (the pool decides who may run at all), then what the busy time went to."""
    evidence = []
    if latency.num_preemptions:
        evidence.append(f"{latency.num_preemptions} preemptions: the KV pool ran out with "
                        f"requests running ({latency.num_preempted_requests} requests thrown back)")
    if batching.kv_blocked_share >= KV_BLOCKED_SHARE:
        evidence.append(f"requests waited for KV blocks in {batching.waited_steps['kv_pool']} of "
                        f"{batching.num_steps} steps ({batching.kv_blocked_share:.0%}) while the "
                        f"token budget and max_num_seqs had room")
    if evidence:
        evidence.append(f"the pool holds {memory.kv_pool_tokens:,} tokens = "
                        f"{memory.requests_in_pool:.1f} average requests; peak use "
                        f"{memory.peak_kv_share:.0%}")
        return "capacity", evidence
    if batching.compute_bound_share is not None:
        compute = batching.compute_bound_share >= COMPUTE_TIME_SHARE
        evidence.append(f"{batching.compute_bound_share:.0%} of the busy time went to steps whose floor "
                        f"max(F/P, M/W) is set by the compute ceiling ({batching.peak_flops / 1e12:,.3f} "
                        f"TFLOP/s against {batching.bandwidth / 1e9:,.1f} GB/s)")
    else:
        compute = batching.prefill_time_share >= COMPUTE_TIME_SHARE
        evidence.append(f"{batching.prefill_time_share:.0%} of the busy time computed prompt tokens; no "
                        f"ceilings were given (--bandwidth, --peak-tflops), so those steps stand in for "
                        f"the compute-bound ones")
    if compute:
        if batching.mfu is not None:
            evidence.append(f"the steps that computed prompts ran at {batching.mfu:.0%} of the peak FLOP rate (MFU)")
        if latency.first_token_share is not None:
            evidence.append(f"the wait before the first token is {latency.first_token_share:.0%} "
                            f"of the end-to-end time")
        return "compute", evidence
    evidence.append(f"{1 - batching.prefill_time_share:.0%} of the busy time went to decode steps, "
                    f"mean decode batch {fmt_or_dash(batching.mean_decode_batch, '.1f')}")
    if batching.mbu is not None:
        evidence.append(f"decode steps moved {batching.mbu:.0%} of the memory bandwidth (MBU)")
    if batching.queueing_share_of_ttft is not None:
        evidence.append(f"queueing is {batching.queueing_share_of_ttft:.0%} of TTFT: batches formed")
    return "bandwidth", evidence


# --- What a client saw (the load generator's record) ---------------------------------------------

@dataclass(frozen=True)
class ServerView:
    """What the server's Prometheus metrics showed over a client run: counter deltas, gauge peaks
    (sampled), and means of its own latency histograms."""

    backend: str  # the metric prefix: "minillm" or "vllm"
    num_preemptions: int
    num_aborted: int  # requests the server counted as aborted (hang-ups included)
    peak_kv_usage: float | None  # share of the KV blocks held
    peak_waiting: float | None
    peak_running: float | None
    mean_ttft: float | None  # arrival at the engine to first token
    mean_queue_time: float | None  # arrival at the engine to first scheduled
    prefix_hit_share: float | None  # prompt tokens the prefix cache served


@dataclass(frozen=True)
class ClientDiagnosis:
    """Question 1 from the clients' times; the capacity wall if the server's metrics show it."""

    server: str
    symptom: str  # one of SYMPTOMS
    wall: str | None  # "capacity", or None: not decidable from the client side
    latency: Latency  # over the requests that completed; num_aborted counts every failure
    num_errors: int
    errors_by_status: dict
    num_hung_up: int
    server_view: ServerView | None  # None: the server exported no metrics
    extra_ttft: float | None  # the clients' mean TTFT (every request with a token) minus the server's
    evidence: tuple[str, ...]
    cannot_tell: tuple[str, ...]

    def as_dict(self) -> dict:
        return asdict(self)

    def report(self) -> str:
        lat, view = self.latency, self.server_view
        lines = [f"minillm diagnose (client side): {lat.num_requests} requests to {self.server}",
                 *_symptom_lines(self.symptom, lat)]
        statuses = f" {self.errors_by_status}" if self.errors_by_status else ""
        lines.append(f"   failed {lat.num_aborted} ({self.num_errors} errors{statuses}, "
                     f"{lat.num_aborted - self.num_errors} aborted by the server); "
                     f"{self.num_hung_up} clients hung up on purpose")
        lines += ["", "2. What the server's metrics showed"]
        if view is None:
            lines.append("   nothing: the server exported no Prometheus metrics")
        else:
            lines += [f"   preemptions {view.num_preemptions}; peak KV use "
                      f"{fmt_or_dash(view.peak_kv_usage, '.0%')}; "
                      f"peak waiting {fmt_or_dash(view.peak_waiting, '.0f')}, peak running "
                      f"{fmt_or_dash(view.peak_running, '.0f')}",
                      f"   its own TTFT: mean {fmt_seconds(view.mean_ttft)}, of which queueing "
                      f"{fmt_seconds(view.mean_queue_time)}; prefix cache served "
                      f"{fmt_or_dash(view.prefix_hit_share, '.0%')} of prompt tokens"]
            if self.extra_ttft is not None:
                lines.append(f"   the clients waited {fmt_seconds(self.extra_ttft)} longer for the "
                             f"first token on average: network, HTTP and the wait for the next step")
        verdict = (f"{self.wall} ({_WALL_TEXT[self.wall]})" if self.wall else
                   f"not decidable from the client side; the time went mostly to "
                   f"{_LEAN_TEXT[self.symptom]}")
        lines += ["", f"Wall: {verdict}"] + [f"   - {line}" for line in self.evidence]
        lines += ["", "What a client-side record cannot tell:"] + [f"   - {line}" for line in self.cannot_tell]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


_LEAN_TEXT = {"first_token": "the first token: prompts being computed (compute) or the queue",
              "tokens": "the tokens after the first: decode steps (bandwidth)",
              "failure": "failed requests"}
_CANNOT_TELL = (
    "how each request's TTFT splits into queueing, prompt computation and the network (the "
    "server's histograms give means, not per request)",
    "the batch of each step and what held requests back (the token budget or max_num_seqs), nor "
    "whether steps were compute- or bandwidth-bound (MFU, MBU): that needs the engine's step log "
    "(minillm.lab.records.save_run)",
    "the memory ledger (weights, KV bytes per token, the pool in bytes): /metrics gives KV use "
    "as a share only",
    "short peaks between two samples of the gauges")


def diagnose_client(record) -> ClientDiagnosis:
    """Diagnose a load generator run: ``record`` is ``loadgen.run_load``'s result or its JSON."""
    record = load_client_run(record)
    summary = loadgen.summarize_clients([loadgen.ClientRequest(**r) for r in record["requests"]],
                                        record["duration_s"])
    view = _server_view(record)
    ttft, e2e = summary["ttft"], summary["e2e"]
    latency = Latency(
        num_requests=summary["num_requests"], num_aborted=summary["num_errors"] + summary["num_aborted"],
        num_preemptions=view.num_preemptions if view else 0, num_preempted_requests=None,
        ttft=ttft, tpot=summary["tpot"], e2e=e2e,
        first_token_share=ttft["mean"] / e2e["mean"] if ttft and e2e and e2e["mean"] > 0 else None)
    wall, evidence = _client_wall(view)
    server = f"{record['server']['url']} ({record['server']['model']})"
    ttfts = [r["ttft"] for r in record["requests"] if r["ttft"] is not None]
    extra_ttft = (statistics.fmean(ttfts) - view.mean_ttft
                  if ttfts and view is not None and view.mean_ttft is not None else None)
    cannot_tell = _CANNOT_TELL if view else ("anything the server saw: it exported no Prometheus "
                                             "metrics (queue, KV use, preemptions)",) + _CANNOT_TELL
    return ClientDiagnosis(server, _symptom(latency), wall, latency, summary["num_errors"],
                           dict(sorted(summary["errors_by_status"].items())), summary["num_hung_up"],
                           view, extra_ttft, tuple(evidence), cannot_tell)


def _server_view(record: dict) -> ServerView | None:
    metrics = record["server_metrics"]
    if not metrics:
        return None
    delta, samples = metrics["delta"], metrics["samples"]

    def peak(gauge):
        return max((s[gauge] for s in samples if s.get(gauge) is not None), default=None)

    queries = delta.get("prefix_cache_queries_total", 0)
    return ServerView(
        backend=record["server"]["backend"], num_preemptions=round(delta.get("num_preemptions_total", 0)),
        num_aborted=round(delta.get("request_success_total.abort", 0)),
        peak_kv_usage=peak("kv_cache_usage_perc"), peak_waiting=peak("num_requests_waiting"),
        peak_running=peak("num_requests_running"),
        mean_ttft=loadgen.server_mean(record, "time_to_first_token_seconds"),
        mean_queue_time=loadgen.server_mean(record, "request_queue_time_seconds"),
        prefix_hit_share=delta.get("prefix_cache_hits_total", 0) / queries if queries else None)


def _client_wall(view: ServerView | None) -> tuple[str | None, list[str]]:
    """Capacity when the metrics show the KV pool ran out; otherwise undecided, with the reasons."""
    if view is None:
        return None, ["the server exported no metrics: only the clients' times are known"]
    evidence = []
    if view.num_preemptions:
        evidence.append(f"{view.num_preemptions} preemptions: the KV pool ran out with requests running")
    if view.peak_kv_usage is not None and view.peak_kv_usage >= KV_FULL_SHARE and view.peak_waiting:
        evidence.append(f"KV use peaked at {view.peak_kv_usage:.0%} while up to "
                        f"{view.peak_waiting:.0f} requests waited")
    if evidence:
        return "capacity", evidence
    evidence.append(f"no preemption, and KV use peaked at {fmt_or_dash(view.peak_kv_usage, '.0%')}: "
                    f"the pool was not the limit")
    if view.mean_queue_time is not None and view.mean_ttft:
        evidence.append(f"queueing was {view.mean_queue_time / view.mean_ttft:.0%} of the server's "
                        f"TTFT (up to {fmt_or_dash(view.peak_waiting, '.0f')} waiting): the token budget, "
                        f"max_num_seqs or the prompts ahead held requests back")
    return None, evidence


# --- Formatting ----------------------------------------------------------------------------------

def _symptom_lines(symptom: str, lat: Latency) -> list[str]:
    """Answer 1 of a report: the symptom and the latency distributions behind it."""
    lines = ["", f"1. Which kind of slow: {_SYMPTOM_TEXT[symptom]}", f"   TTFT {_dist(lat.ttft)}",
             f"   TPOT {_dist(lat.tpot)}", f"   end-to-end {_dist(lat.e2e)}"]
    if lat.first_token_share is not None:
        lines.append(f"   the wait before the first token is {lat.first_token_share:.0%} of "
                     f"the end-to-end time")
    return lines


def _dist(d: dict | None) -> str:
    if d is None:
        return "-"
    return f"mean {fmt_seconds(d['mean'])}, p50 {fmt_seconds(d['p50'])}, p90 {fmt_seconds(d['p90'])}"


def _bytes(x: float | None) -> str:
    return "-" if x is None else fmt_bytes(x)


# --- python -m minillm diagnose ------------------------------------------------------------------

def add_cli(subparsers) -> None:
    """Register ``diagnose RECORD.json`` on the ``python -m minillm`` subparsers."""
    cmd = subparsers.add_parser("diagnose", help="which wall a run hit, from its run record "
                                                 "(records.save_run) or a loadgen record")
    cmd.add_argument("record", help="the JSON run record of an engine run or of python -m minillm loadgen")
    cmd.add_argument("--bandwidth", type=float, help="memory bandwidth in GB/s to compare decode "
                                                     "steps with (default: the GPU's spec row)")
    cmd.add_argument("--peak-tflops", type=float, help="matrix rate in TFLOP/s to compare prompt "
                                                       "steps with (default: the GPU's spec row)")
    cmd.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Print the diagnosis; exit code 2 with a one-line reason for a bad record."""
    try:
        record = load_record(args.record)
        result = diagnose_client(record) if record["format"] == CLIENT_RUN_FORMAT else diagnose(
            record, bandwidth=args.bandwidth * 1e9 if args.bandwidth else None,
            peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.report())
    return 0
