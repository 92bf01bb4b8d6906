"""What happened in a run (chapters 一次请求的一生, 调度 and 先问瓶颈): one owner for every number.

The scheduler reports each step's decisions in its ``SchedulerOutput``; :class:`Recorder` turns
them, with the step's start and end on the engine's clock, into the step log, stamps the
timestamps on each request's ``RequestMetrics`` and counts (vLLM's meanings): preemptions, prompt
tokens (each request's prompt once, at its first token, prefix hits included), prefill tokens
computed (recomputation included), generated tokens, prefix-cache queries and hits, steps and
finished requests by reason, and for speculative decoding the drafts (requests given proposals in
a step), the proposed tokens and the accepted ones, in all and by position (the i-th proposal of
a request, vLLM's ``spec_decode_num_*`` and ``num_accepted_tokens_per_pos``). The counters
run from the engine's start and are never reset (``totals``: what ``LLMEngine.snapshot`` and the
server's ``/metrics`` read); a run is a window on them (:meth:`reset` marks where it starts,
:meth:`counters` is the difference). Requests keep their own counts (``num_cached_tokens``,
``num_preemptions``); the speculative counts live here only (a step's in its ``SchedulerOutput``,
the sums in ``totals``); the KV manager keeps only the pool's state. The lab kit's records module writes all of it out as the run record.
"""
from __future__ import annotations

from collections import deque

from minillm.engine.request import Request
from minillm.engine.scheduler import SchedulerOutput

FINISH_REASONS = ("stop", "length", "abort")
COUNTERS = ("num_steps", "num_preemptions", "prefix_query_tokens", "prefix_hit_tokens",
            "prompt_tokens", "num_prefill_tokens", "generation_tokens",
            "num_drafts", "num_draft_tokens", "num_accepted_tokens",
            *(f"num_finished_{reason}" for reason in FINISH_REASONS))


class Recorder:
    """The step log, the finished requests and the counters. ``log_limit``: steps and finished
    requests kept (the most recent; None: all), so that a server running for weeks stays small.
    ``num_speculative_tokens``: the positions ``num_accepted_tokens_per_pos`` counts (0: none)."""

    def __init__(self, log_limit: int | None = None, num_speculative_tokens: int = 0):
        self.log_limit = log_limit
        self.totals = dict.fromkeys(COUNTERS, 0)  # since the engine was built
        self.totals["num_accepted_tokens_per_pos"] = [0] * num_speculative_tokens
        self.reset()

    def reset(self) -> None:
        """Start a new run: empty log; the run's counters start from the totals as they are now."""
        self.steps: deque[dict] = deque(maxlen=self.log_limit)
        self.finished: deque[Request] = deque(maxlen=self.log_limit)
        self._run_start = dict(self.totals)

    def record_step(self, output: SchedulerOutput, sampled: dict[str, list[int]], start: float, end: float,
                    num_free_blocks_before: int, num_free_blocks: int) -> None:
        """One step: stamp its requests, count its decisions and log it."""
        totals = self.totals
        for request, _ in output.scheduled:
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start
            if request.request_id in sampled:
                if metrics.first_token_time is None:
                    metrics.first_token_time = end
                    totals["prompt_tokens"] += request.num_prompt_tokens
                metrics.token_times += [end] * len(sampled[request.request_id])
        totals["num_steps"] += 1
        totals["num_preemptions"] += len(output.preempted)
        totals["prefix_query_tokens"] += output.num_prefix_queries
        totals["prefix_hit_tokens"] += output.num_cached_tokens
        totals["num_prefill_tokens"] += output.num_prefill_tokens
        num_generated = sum(map(len, sampled.values()))
        totals["generation_tokens"] += num_generated
        totals["num_drafts"] += output.num_drafts
        totals["num_draft_tokens"] += output.num_draft_tokens
        totals["num_accepted_tokens"] += output.num_accepted_tokens
        if output.num_drafts:  # a new list: a snapshot taken before keeps its own
            totals["num_accepted_tokens_per_pos"] = [
                total + count for total, count in zip(totals["num_accepted_tokens_per_pos"],
                                                      output.num_accepted_tokens_per_pos, strict=True)]
        self.steps.append({
            "step": totals["num_steps"] - self._run_start["num_steps"] - 1, "start": start, "end": end,
            "scheduled": [[r.request_id, n] for r, n in output.scheduled],
            "batch_size": len(output.scheduled),
            "num_prefill_tokens": output.num_prefill_tokens,
            "num_decode_tokens": output.num_decode_tokens,
            "num_sampled": len(sampled),  # requests that got a token: their last position's logits
            "num_generated": num_generated,  # tokens they got (more than one with accepted proposals)
            "num_draft_tokens": output.num_draft_tokens,
            "num_accepted_tokens": output.num_accepted_tokens,
            "num_rejected": dict(output.num_rejected),  # request_id -> computed positions given back
            "preempted": [r.request_id for r in output.preempted],
            "num_swapped_blocks": len(output.blocks_to_swap_out) + len(output.blocks_to_swap_in),
            "num_cached_tokens": output.num_cached_tokens,
            "admission_stop": output.admission_stop,
            "num_free_blocks_before": num_free_blocks_before,
            "num_free_blocks": num_free_blocks,
            "num_running": output.num_running,
            "num_waiting": output.num_waiting,
        })

    def record_finish(self, request: Request, when: float) -> None:
        """A request finished (or was aborted) at ``when``."""
        request.metrics.finish_time = when
        self.totals[f"num_finished_{request.finish_reason}"] += 1
        self.finished.append(request)

    def counters(self) -> dict:
        """This run's counters: the totals since :meth:`reset`."""
        per_pos = [now - start for now, start in zip(self.totals["num_accepted_tokens_per_pos"],
                                                     self._run_start["num_accepted_tokens_per_pos"])]
        return {**{name: self.totals[name] - self._run_start[name] for name in COUNTERS},
                "num_accepted_tokens_per_pos": per_pos}
