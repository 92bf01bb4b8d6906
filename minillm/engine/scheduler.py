"""Continuous batching under a token budget (chapter 调度).

One call to :meth:`Scheduler.schedule` decides one engine step: which requests compute how many
tokens. There is no prefill phase and no decode phase: a request that still has prompt tokens to
compute and a request that needs its next token share the same budget of
``max_num_batched_tokens``. Running requests go first (a decode costs one token), then waiting
requests in arrival order (FCFS). A long prompt is split over several steps (chunked prefill) so it
does not stall everyone's next token; prompt blocks found in the prefix cache are not computed at
all. When the KV pool runs out, the most recently admitted request is preempted: by *recompute*
(drop its KV and compute it again later) or by *swap* (copy its KV blocks to a CPU pool and back).
A request made ``prompt_of`` another (one of ``n`` answers to a prompt) shares that request's full
prompt blocks instead of computing them: it is admitted once they are computed by the end of the
step, and computes only the tail of its prompt (one request writes the blocks, every layer stores
a step's KV before attending, so the same step may read them).
A request that asks for its prompt's logprobs computes its whole prompt, taking neither cached nor
shared blocks (vLLM V1's rule): only computed positions have logits.
With speculative decoding on, a request due for its next token also computes the tokens
:mod:`minillm.engine.speculative` proposes for it, if the budget and the pool have room for them;
:meth:`Scheduler.update` keeps the accepted ones and gives back the rejected ones' KV slots.

:class:`StaticBatchScheduler` is the baseline the chapter compares against: a batch is formed,
runs to completion, and only then is the next batch taken.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from minillm.engine.engine_config import EngineConfig
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.request import Request, RequestStatus
from minillm.engine.speculative import NgramProposer

ADMISSION_STOPS = ("kv_pool", "token_budget", "max_num_seqs", "static_batch")


@dataclass
class SchedulerOutput:
    """What one engine step computes, and why it computes no more.

    ``scheduled``: (request, number of new tokens) in batch order. The engine first copies
    ``blocks_to_swap_out`` (gpu_block, cpu_block) pairs to the CPU, then ``blocks_to_swap_in``
    (cpu_block, gpu_block) pairs back to the GPU, then runs the forward pass. The counts are this
    step's decisions; whoever keeps run totals sums them. ``num_draft_tokens``: proposed tokens
    verified this step (each request's are in its ``spec_token_ids``), for ``num_drafts`` requests;
    :meth:`Scheduler.update` fills in ``num_accepted_tokens``, how many the target accepted,
    ``num_accepted_tokens_per_pos``, how often the i-th proposal of a request was accepted, and
    ``num_rejected``: request_id -> its positions computed this step whose KV was given back.
    """

    scheduled: list[tuple[Request, int]]
    num_prefill_tokens: int  # prompt tokens (or recomputed ones) computed this step
    num_decode_tokens: int  # requests that compute just their next token
    preempted: list[Request]
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    num_prefix_queries: int  # prompt tokens the requests admitted this step looked up in the prefix cache
    num_cached_tokens: int  # of those, found cached: prefill they skip
    admission_stop: str | None  # why requests are left waiting (one of ADMISSION_STOPS); None: none wait
    num_running: int
    num_waiting: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_rejected: dict[str, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching: requests join and leave the running batch at every step.

    ``config`` is the engine's, resolved: ``num_kv_blocks`` and ``max_model_len`` are known and the
    engine has checked them against the pool. ``kv_cache`` allocates, frees, swaps (when it has a
    swap pool) and looks prompts up in the prefix cache; the scheduler asks it and keeps no blocks.
    """

    def __init__(self, kv_cache: PagedKVCache, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()):
        self.kv = kv_cache
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.requests: dict[str, Request] = {}  # every unfinished request
        spec = config.speculative_config
        self.num_speculative_tokens = 0 if spec is None else spec.num_speculative_tokens
        self.proposer = NgramProposer(spec) if spec is not None and spec.method == "ngram" else None

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request; one that could never be scheduled (the loop would spin) is refused here,
        the one place admission is checked, before anything is held for it."""
        config, request_id, num_prompt_tokens = self.config, request.request_id, request.num_prompt_tokens
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if num_prompt_tokens == 0:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if num_prompt_tokens + 1 > config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_prompt_tokens} tokens + 1 generated token "
                f"exceeds max_model_len={config.max_model_len} (the KV pool holds "
                f"{config.pool_tokens} tokens)")
        if not config.enable_chunked_prefill and num_prompt_tokens > config.max_num_batched_tokens:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_prompt_tokens} tokens does not fit "
                f"max_num_batched_tokens={config.max_num_batched_tokens} with chunked prefill "
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
        """The one place a request's finish reason is written: "stop", "length" or "abort"."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.detokenizer.finish()
        self.kv.free(request.request_id)  # whatever it holds, in the pool or swapped out
        del self.requests[request.request_id]

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's (request, num_new_tokens) under the token budget and the KV pool."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        num_decode = num_drafts = num_draft = 0

        # 1. Running requests, oldest first. Preempting always takes the newest one, which has not
        #    been scheduled yet this step (or is the request itself).
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_new_tokens(request.num_uncomputed_tokens, budget)
            if num_new == 0:  # a long recompute that waits for a fuller budget
                index += 1
                continue
            self._propose(request, budget)
            num_new += request.num_spec_tokens
            while not self.kv.allocate(request.request_id, request.num_computed_tokens + num_new):
                victim = self.running.pop()
                preempted.append(victim)
                swap_out += self._preempt(victim)
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new))
                num_decode += _is_decode(request, num_new - request.num_spec_tokens)
                num_drafts += bool(request.num_spec_tokens)
                num_draft += request.num_spec_tokens
                budget -= num_new
                index += 1

        # 2. Waiting requests, FCFS, until something stops admission (the reason is reported).
        #    A request with no KV (new, or preempted by recompute) starts from its cached prefix.
        queries = cached_total = 0
        stop = None
        while self.waiting:
            stop = self._admission_blocked(budget, preempted)
            if stop is not None:
                break
            request = self.waiting[0]
            reuse = request.num_computed_tokens == 0 and request.params.prompt_logprobs is None
            shared = self._shared_prompt(request, scheduled) if reuse else []
            if shared is None:  # its prompt's blocks are still being computed, within the budget
                stop = "token_budget"
                break
            prefix = shared or (self.kv.cached_prefix(request.all_token_ids) if reuse else [])
            num_computed = request.num_computed_tokens + len(prefix) * self.kv.block_size
            num_new = self._num_new_tokens(request.num_tokens - num_computed, budget)
            if num_new == 0 or not self.kv.allocate(request.request_id, num_computed + num_new, prefix):
                stop = "token_budget" if num_new == 0 else "kv_pool"
                break
            self.waiting.popleft()
            if request.swapped_out:
                swap_in += self.kv.swap_in(request.request_id)
            if reuse and not shared:
                queries += request.num_tokens
                cached_total += num_computed
            if request.status is RequestStatus.WAITING:  # its first admission
                request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            num_decode += _is_decode(request, num_new)  # a request swapped back in decodes at once
            budget -= num_new
        num_batched = sum(n for _, n in scheduled)
        return SchedulerOutput(scheduled, num_batched - num_decode - num_draft, num_decode, preempted,
                               swap_out, swap_in, queries, cached_total, stop if self.waiting else None,
                               len(self.running), len(self.waiting), num_drafts, num_draft,
                               num_accepted_tokens_per_pos=[0] * self.num_speculative_tokens)

    def _shared_prompt(self, request: Request, scheduled: list[tuple[Request, int]]) -> list[int] | None:
        """The blocks of its ``prompt_of`` request's prompt that a request starts with (the full
        ones before the last prompt token, whose logits it needs): ``[]`` when it shares none (no
        such request running), None when they are not all computed by the end of this step."""
        parent = self.requests.get(request.prompt_of) if request.prompt_of is not None else None
        if parent is None or parent.status is not RequestStatus.RUNNING:
            return []
        num_blocks = (request.num_prompt_tokens - 1) // self.kv.block_size
        computed = parent.num_computed_tokens + next((n for r, n in scheduled if r is parent), 0)
        if computed < num_blocks * self.kv.block_size:
            return None
        return self.kv.manager.block_table(parent.request_id)[:num_blocks]

    def _propose(self, request: Request, budget: int) -> None:
        """How many tokens to verify with a request's next one (``request.num_spec_tokens``):
        ``num_speculative_tokens`` within the budget, ``max_tokens`` and ``max_model_len``; with
        prompt lookup as many as it finds (``request.spec_token_ids``), the draft model's are
        drafted when the step runs. Only if the pool has room for them without preempting anyone
        (0 otherwise, and without speculation)."""
        request.num_spec_tokens, request.spec_token_ids = 0, []
        if not self.num_speculative_tokens or not request.output_token_ids or request.num_uncomputed_tokens != 1:
            return
        room = min(self.num_speculative_tokens, budget - 1,
                   request.params.max_tokens - len(request.output_token_ids) - 1,
                   self.config.max_model_len - request.num_tokens - 1)
        proposed = self.proposer.propose(request.all_token_ids, room) if self.proposer else []
        count = len(proposed) if self.proposer else max(room, 0)
        if count and self.kv.allocate(request.request_id, request.num_tokens + count):
            request.num_spec_tokens, request.spec_token_ids = count, proposed

    def _admission_blocked(self, budget: int, preempted: list[Request]) -> str | None:
        """Why the head of the waiting queue cannot be admitted this step, before looking at it."""
        if preempted:  # memory is tight: this step already threw a request back
            return "kv_pool"
        if budget <= 0:
            return "token_budget"
        if len(self.running) >= self.config.max_num_seqs:
            return "max_num_seqs"
        if not self._may_admit(self.waiting[0]):
            return "static_batch"
        return None

    def _may_admit(self, request: Request) -> bool:
        """Continuous batching admits whenever there is room; the static baseline overrides it."""
        return True

    def _num_new_tokens(self, remaining: int, budget: int) -> int:
        """Of the ``remaining`` tokens a request must compute, how many now: all, a chunk, or 0 (wait)."""
        if remaining <= budget:
            return remaining
        # Without chunking a prompt goes whole or not at all; only a recomputed request can be
        # longer than the whole budget, and it is computed in budget-sized pieces.
        if self.config.enable_chunked_prefill or remaining > self.config.max_num_batched_tokens:
            return budget
        return 0

    def _preempt(self, request: Request) -> list[tuple[int, int]]:
        """Take a running request off the GPU pool, to the swap pool if the cache has room there
        (else it recomputes); requeue it at the front of the waiting queue."""
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        swap_out = self.kv.swap_out(request.request_id, request.num_computed_tokens)
        if not swap_out:
            request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        return swap_out

    # -- after the forward pass ------------------------------------------------------------------
    def update(self, output: SchedulerOutput, sampled: dict[str, list[int]],
               logprobs: dict[str, list] | None = None,
               prompt_logprobs: dict[str, list] | None = None) -> list[Request]:
        """Advance the scheduled requests by their computed tokens and append the sampled ones.

        ``sampled`` maps request_id -> new tokens for the requests whose tokens are now all
        computed: one, or with proposals the accepted ones and the target's token after them (the
        rejected ones' KV slots go back). Tokens are appended until one stops the request; each
        list is cut to the tokens kept. ``logprobs``: request_id -> one per sampled token, for the
        requests that asked (kept alongside the tokens); ``prompt_logprobs``: request_id -> those of
        the prompt tokens its computed positions scored, for the requests that asked. Returns the
        requests that finished in this step (their blocks are freed).
        """
        finished = []
        block_size = self.kv.block_size
        for request, num_new in output.scheduled:
            before = request.num_computed_tokens
            tokens = sampled.get(request.request_id, [])
            proposed, request.spec_token_ids, request.num_spec_tokens = request.spec_token_ids, [], 0
            if proposed:
                accepted = len(tokens) - 1
                num_new -= len(proposed) - accepted  # the rejected ones' KV is not kept
                output.num_accepted_tokens += accepted
                output.num_rejected[request.request_id] = len(proposed) - accepted
                for position in range(accepted):
                    output.num_accepted_tokens_per_pos[position] += 1
            reason = None
            for kept, token in enumerate(tokens, 1):
                request.output_token_ids.append(token)
                reason = self._stop_reason(request, token)
                if reason is not None:
                    del tokens[kept:]
                    break
            if logprobs and request.request_id in logprobs:
                request.logprobs += logprobs[request.request_id][:len(tokens)]
            if prompt_logprobs and request.request_id in prompt_logprobs:
                request.prompt_logprobs += prompt_logprobs[request.request_id]
            request.num_computed_tokens = min(before + num_new, request.num_tokens)
            if proposed and reason is None:
                self.kv.truncate(request.request_id, request.num_computed_tokens)
            if request.num_computed_tokens // block_size > before // block_size:  # a block filled up
                self.kv.commit(request.request_id, request.token_ids(0, request.num_computed_tokens))
            if reason is not None:
                self.running.remove(request)
                self._finish(request, reason)
                finished.append(request)
        return finished

    def _stop_reason(self, request: Request, token: int) -> str | None:
        """Why ``token`` (just appended) ends the request: a stop string its text now holds, a stop
        token ("stop"), or its length ("length"); None if it goes on."""
        params = request.params
        if request.detokenizer.add([token]):
            return "stop"
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            return "stop"
        if (len(request.output_token_ids) >= params.max_tokens
                or request.num_tokens >= self.config.max_model_len):
            return "length"
        return None


def _is_decode(request: Request, num_new: int) -> bool:
    """Whether the step computes just the request's last sampled token (its next one is due)."""
    return num_new == 1 and bool(request.output_token_ids) and request.num_uncomputed_tokens == 1


class StaticBatchScheduler(Scheduler):
    """The baseline: take up to ``max_num_seqs`` waiting requests as one batch, run it to completion,
    and only then take the next batch (no request joins a batch in flight)."""

    def __init__(self, kv_cache: PagedKVCache, config: EngineConfig, eos_token_ids: tuple[int, ...] = ()):
        super().__init__(kv_cache, config, eos_token_ids)
        self.batch: set[str] = set()  # ids of the batch in flight

    def _may_admit(self, request: Request) -> bool:
        if not self.batch:
            self.batch = {r.request_id for r in islice(self.waiting, self.config.max_num_seqs)}
        return request.request_id in self.batch

    def _finish(self, request: Request, reason: str) -> None:
        super()._finish(request, reason)
        self.batch.discard(request.request_id)


SCHEDULERS = {"continuous": Scheduler, "static": StaticBatchScheduler}
