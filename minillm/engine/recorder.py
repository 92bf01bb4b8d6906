"""What happened in a run (chapters 一次请求的一生, 调度 and 先问瓶颈): one owner for every number.

The scheduler reports each step's decisions in its ``SchedulerOutput``; :class:`Recorder` turns
them, with the step's start and end on the engine's clock, into the step log, stamps the
timestamps on each request's ``RequestMetrics`` and keeps the run's totals. Requests keep their
own counts (``num_cached_tokens``, ``num_preemptions``); the KV manager keeps only the pool's
state. The lab kit's records module writes all of it out as the run record.
"""
from __future__ import annotations

from minillm.engine.request import Request
from minillm.engine.scheduler import SchedulerOutput


class Recorder:
    """The step log, the finished requests and the run's counters (vLLM's counter names)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        """Start a new run: empty log, counters at zero."""
        self.steps: list[dict] = []
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served by the prefix cache
        self.prompt_tokens = 0  # prompt (and recomputed) tokens computed
        self.generation_tokens = 0  # tokens sampled

    def record_step(self, output: SchedulerOutput, sampled: dict[str, int], start: float, end: float,
                    num_free_blocks_before: int, num_free_blocks: int) -> None:
        """One step: stamp its requests, count its decisions and log it."""
        for request, _ in output.scheduled:
            metrics = request.metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start
            if request.request_id in sampled:
                if metrics.first_token_time is None:
                    metrics.first_token_time = end
                metrics.token_times.append(end)
        self.num_preemptions += len(output.preempted)
        self.prefix_cache_queries += output.num_prefix_queries
        self.prefix_cache_hits += output.num_cached_tokens
        self.prompt_tokens += output.num_prefill_tokens
        self.generation_tokens += len(sampled)
        self.steps.append({
            "step": len(self.steps), "start": start, "end": end,
            "scheduled": [[r.request_id, n] for r, n in output.scheduled],
            "batch_size": len(output.scheduled),
            "num_prefill_tokens": output.num_prefill_tokens,
            "num_decode_tokens": output.num_decode_tokens,
            "num_sampled": len(sampled),  # requests that got a token: their last position's logits
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
        self.finished.append(request)

    def counters(self) -> dict:
        return {"num_preemptions": self.num_preemptions,
                "prefix_query_tokens": self.prefix_cache_queries,
                "prefix_hit_tokens": self.prefix_cache_hits,
                "prompt_tokens": self.prompt_tokens, "generation_tokens": self.generation_tokens}
