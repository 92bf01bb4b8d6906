"""Continuous batching under a token budget (chapter 调度).

One call to :meth:`Scheduler.schedule` decides one engine step: which requests compute how many
tokens. There is no prefill phase and no decode phase: a request that still has prompt tokens to
compute and a request that needs its next token share the same budget of
``max_num_batched_tokens``. Running requests go first (a decode costs one token), then waiting
requests in arrival order (FCFS). A long prompt is split over several steps (chunked prefill) so it
does not stall everyone's next token; prompt blocks found in the prefix cache are not computed at
all. When the KV pool runs out, the most recently admitted request is preempted: by *recompute*
(drop its KV and compute it again later) or by *swap* (copy its KV blocks to a CPU pool and back).

:class:`StaticBatchScheduler` is the baseline the chapter compares against: a batch is formed,
runs to completion, and only then is the next batch taken.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING

from minillm.metrics import RequestMetrics
from minillm.paging import KVCacheManager

if TYPE_CHECKING:
    from minillm.sampling import SamplingParams

PREEMPTION_MODES = ("recompute", "swap")


def check_scheduler_args(max_num_seqs: int, max_num_batched_tokens: int, preemption_mode: str) -> None:
    """Reject bad scheduler settings (called by the engine before it loads anything)."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if preemption_mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # back in the waiting queue, its KV dropped or swapped to the CPU
    FINISHED = "finished"


@dataclass
class Request:
    """One request's tokens and progress as the scheduler sees them; ``metrics`` holds its
    timestamps (seconds on the engine's clock), which the engine fills in."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (GPU pool)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    swapped_out: bool = False  # its KV waits in the CPU pool (swap preemption)
    num_prefix_hit_tokens: int = 0  # tokens served by the prefix cache (cumulative)
    num_preemptions: int = 0
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self):
        self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without copying the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class SchedulerOutput:
    """What one engine step computes.

    ``scheduled``: (request, number of new tokens) in batch order. The engine first copies
    ``blocks_to_swap_out`` (gpu_block, cpu_block) pairs to the CPU, then ``blocks_to_swap_in``
    (cpu_block, gpu_block) pairs back to the GPU, then runs the forward pass.
    """

    scheduled: list[tuple[Request, int]]
    preempted: list[Request]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching: requests join and leave the running batch at every step."""

    def __init__(self, kv_manager: KVCacheManager, *, max_model_len: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True,
                 preemption_mode: str = "recompute", num_cpu_blocks: int = 0,
                 eos_token_ids: tuple[int, ...] = ()):
        check_scheduler_args(max_num_seqs, max_num_batched_tokens, preemption_mode)
        pool_tokens = kv_manager.num_blocks * kv_manager.block_size
        if not 2 <= max_model_len <= pool_tokens:
            raise ValueError(f"max_model_len must be in [2, {pool_tokens}] (the KV pool holds "
                             f"{kv_manager.num_blocks} blocks x {kv_manager.block_size} tokens), "
                             f"got {max_model_len}")
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.eos_token_ids = frozenset(eos_token_ids)
        # Swapped-out KV lives in a second pool, managed with the same block bookkeeping.
        self.cpu_kv = (KVCacheManager(num_cpu_blocks, kv_manager.block_size,
                                      enable_prefix_caching=False)
                       if preemption_mode == "swap" and num_cpu_blocks > 0 else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; reject one that could never be scheduled (the loop never spins)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        if request.num_prompt_tokens + 1 > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens + 1 "
                f"generated token exceeds max_model_len={self.max_model_len} (the KV pool holds "
                f"{self.kv.num_blocks * self.kv.block_size} tokens)")
        if not self.enable_chunked_prefill and request.num_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"request {request.request_id!r}: prompt of {request.num_prompt_tokens} tokens does "
                f"not fit max_num_batched_tokens={self.max_num_batched_tokens} with chunked prefill "
                f"disabled (enable it or raise the budget)")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def abort(self, request_id: str) -> Request:
        """Finish a request now with reason "abort" and free its blocks."""
        request = self.requests.get(request_id)
        if request is None:
            raise ValueError(f"unknown or finished request_id {request_id!r}")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, "abort")
        return request

    def _finish(self, request: Request, reason: str) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request.request_id in self.kv:  # a waiting request holds no blocks
            self.kv.free(request.request_id)
        if request.swapped_out:
            self.cpu_kv.free(request.request_id)
            request.swapped_out = False
        del self.requests[request.request_id]

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's (request, num_new_tokens) under the token budget and the KV pool."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []

        # 1. Running requests, oldest first. Preempting always takes the newest one, which has not
        #    been scheduled yet this step (or is the request itself).
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:  # a long recompute that waits for a fuller budget
                index += 1
                continue
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                preempted.append(victim)
                swap_out += self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                budget -= num_new
                index += 1

        # 2. Waiting requests, FCFS, unless this step already had to preempt (memory is tight).
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs and self._may_admit(self.waiting[0])):
            request = self.waiting[0]
            num_cached = 0
            if not request.swapped_out and request.num_computed_tokens == 0:
                num_cached = self.kv.match_prefix(request.request_id, request.all_token_ids)
                request.num_computed_tokens = num_cached
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0 or not self.kv.allocate(request.request_id,
                                                    request.num_computed_tokens + num_new):
                if not request.swapped_out:  # give back the prefix blocks it matched
                    self.kv.free(request.request_id)
                    request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if request.swapped_out:
                swap_in += self._swap_in(request)
            request.num_prefix_hit_tokens += num_cached
            self.prefix_hit_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted, swap_out, swap_in)

    def _may_admit(self, request: Request) -> bool:
        """Continuous batching admits whenever there is room; the static baseline overrides it."""
        return True

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to compute now: all that remain, or a chunk of them, or 0 (wait)."""
        remaining = request.num_uncomputed_tokens
        if remaining <= budget:
            return remaining
        # Without chunking a prompt goes whole or not at all; only a recomputed request can be
        # longer than the whole budget, and it is computed in budget-sized pieces.
        if self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
            return budget
        return 0

    def _preempt(self, request: Request) -> list[tuple[int, int]]:
        """Take a running request off the GPU pool; requeue it at the front of the waiting queue."""
        self.num_preemptions += 1
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        swap_out: list[tuple[int, int]] = []
        num_blocks = -(-request.num_computed_tokens // self.kv.block_size)
        if (self.cpu_kv is not None and num_blocks > 0
                and self.cpu_kv.allocate(request.request_id, request.num_computed_tokens)):
            gpu_blocks = self.kv.block_table(request.request_id)[:num_blocks]
            swap_out = list(zip(gpu_blocks, self.cpu_kv.block_table(request.request_id)))
            request.swapped_out = True
        else:  # recompute (also the fallback when the CPU pool is full)
            request.num_computed_tokens = 0
        self.kv.free(request.request_id)
        self.waiting.appendleft(request)
        return swap_out

    def _swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Pair the request's CPU blocks with its freshly allocated GPU blocks; free the CPU ones."""
        cpu_blocks = self.cpu_kv.block_table(request.request_id)
        gpu_blocks = self.kv.block_table(request.request_id)[:len(cpu_blocks)]
        self.cpu_kv.free(request.request_id)
        request.swapped_out = False
        return list(zip(cpu_blocks, gpu_blocks))

    # -- after the forward pass ------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests by their computed tokens and append the sampled ones.

        ``sampled`` maps request_id -> new token for the requests whose tokens are now all
        computed. Returns the requests that finished in this step (their blocks are freed).
        """
        finished = []
        block_size = self.kv.block_size
        for request, num_new in output.scheduled:
            before = request.num_computed_tokens
            request.num_computed_tokens += num_new
            if request.num_computed_tokens // block_size > before // block_size:  # a block filled up
                self.kv.commit(request.request_id, request.token_ids(0, request.num_computed_tokens))
            token = sampled.get(request.request_id)
            if token is None:
                continue
            request.output_token_ids.append(token)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _stop_reason(self, request: Request, token: int) -> str | None:
        params = request.params
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None


class StaticBatchScheduler(Scheduler):
    """The baseline: take up to ``max_num_seqs`` waiting requests as one batch, run it to completion,
    and only then take the next batch (no request joins a batch in flight)."""

    def __init__(self, kv_manager: KVCacheManager, **kwargs):
        super().__init__(kv_manager, **kwargs)
        self.batch: set[str] = set()  # ids of the batch in flight

    def _may_admit(self, request: Request) -> bool:
        if not self.batch:
            self.batch = {r.request_id for r in islice(self.waiting, self.max_num_seqs)}
        return request.request_id in self.batch

    def _finish(self, request: Request, reason: str) -> None:
        super()._finish(request, reason)
        self.batch.discard(request.request_id)
