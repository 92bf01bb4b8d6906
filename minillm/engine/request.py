"""One request as the engine sees it (chapters 一次请求的一生 and 调度).

A :class:`Request` holds its tokens, its progress through the KV cache, its own counters (prefix
hits, preemptions) and :class:`RequestMetrics`, the timestamps of its life on the engine's clock.
Its :class:`~minillm.engine.detokenizer.Detokenizer` turns its tokens into text and finds its stop
strings. A :class:`RequestOutput` is what the caller gets back after each step: the tokens and text
so far, the ones just made (for streaming), their logprobs and the prompt's if asked for and, at the
end, why it stopped.
"""
from __future__ import annotations

import enum
from dataclasses import InitVar, asdict, dataclass, field

from minillm.engine.detokenizer import Detokenizer
from minillm.engine.sampling import SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled yet
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    PREEMPTED = "preempted"  # back in the waiting queue, its KV dropped or swapped to the CPU
    FINISHED = "finished"


def time_per_output_token(first_token_time: float, last_token_time: float,
                          num_output_tokens: int) -> float | None:
    """TPOT, vLLM's definition: the time from the first token to the last over the tokens after the
    first; None below two tokens. The engine's ``RequestMetrics`` and the load generator's clients
    both use it."""
    if num_output_tokens < 2:
        return None
    return (last_token_time - first_token_time) / (num_output_tokens - 1)


def inter_token_latencies(token_times: list[float]) -> list[float]:
    """The gaps between consecutive tokens (vLLM's inter-token latency, one per gap)."""
    return [later - earlier for earlier, later in zip(token_times, token_times[1:])]


@dataclass
class RequestMetrics:
    """Timestamps of one request's life (seconds on the engine's clock); the engine fills them in."""

    arrival_time: float
    num_prompt_tokens: int = 0
    tokenized_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    finish_time: float | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def queueing(self) -> float | None:
        """Time spent waiting before the first step that computed any of its tokens."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (:func:`time_per_output_token`)."""
        times = self.token_times
        return time_per_output_token(times[0], times[-1], len(times)) if times else None

    @property
    def max_itl(self) -> float | None:
        """The longest gap between two tokens: the stall a reader sees."""
        return max(inter_token_latencies(self.token_times), default=None)

    @property
    def completed(self) -> bool:
        """Finished, for whatever reason: an aborted request's latencies happened too."""
        return self.finish_time is not None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival to finish."""
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def to_dict(self) -> dict:
        return {**asdict(self), "queueing": self.queueing, "ttft": self.ttft, "tpot": self.tpot,
                "max_itl": self.max_itl, "e2e": self.e2e, "num_output_tokens": self.num_output_tokens}


@dataclass
class Request:
    """One request's tokens, progress and counters as the scheduler and the runner see them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: InitVar[float] = 0.0  # kept by its metrics, the one owner of its timestamps
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (GPU pool)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_cached_tokens: int = 0  # prompt tokens it did not compute at its first admission: the prefix
    # cache served them, or its prompt_of request shared them (vLLM's name)
    num_preemptions: int = 0
    num_spec_tokens: int = 0  # proposed tokens this step verifies (the scheduler decides how many)
    spec_token_ids: list[int] = field(default_factory=list)  # those tokens (vLLM's name); a draft model's
    # are filled in by the model runner when the step runs
    tokenizer: object = None  # for its text and stop strings; None: token ids only
    prompt_of: str | None = None  # the request whose prompt KV blocks it shares (n > 1)
    metrics: RequestMetrics = field(init=False)
    detokenizer: Detokenizer = field(init=False)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, if asked for
    prompt_logprobs: list[TokenLogprob | None] = field(init=False)  # if asked for: one per prompt
    # token computed so far, None for the first (nothing before it to score it by)

    def __post_init__(self, arrival_time: float):
        self.metrics = RequestMetrics(arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        self.detokenizer = Detokenizer(self.tokenizer, self.params.stop, self.params.min_tokens)
        self.prompt_logprobs = [None] if self.params.prompt_logprobs is not None else []

    @property
    def num_prompt_tokens(self) -> int:
        return self.metrics.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def unscored_prompt(self, start: int, num_new: int) -> range:
        """The positions among ``num_new`` computed from ``start`` whose logits give prompt logprobs
        it asks for and has not got yet: position p's score prompt token p + 1."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(start + num_new, self.num_prompt_tokens - 1))

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without copying the whole list."""
        prompt_len = self.num_prompt_tokens
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    @property
    def swapped_out(self) -> bool:
        """Preempted with its KV kept (in the swap pool): recompute drops it all."""
        return self.status is RequestStatus.PREEMPTED and self.num_computed_tokens > 0

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to compute before the next token can be sampled (1 for a decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


class RequestOutput:
    """A request after one step: the tokens that step made (``new_token_ids``, for streaming) and,
    through ``token_ids``, all its generated tokens so far (copied only when read). With a
    tokenizer, ``new_text`` is the text safe to send since the request's previous output and
    ``text`` all of it so far (the whole answer once finished, cut before a stop string); None
    without one. The text is decoded when first read (or by :meth:`detokenize`), so a caller that
    reads only the last output's ``text`` decodes once, not at every step: read (or
    :meth:`detokenize`) a request's outputs in step order, before the next step runs.
    ``new_logprobs``: one :class:`~minillm.engine.sampling.TokenLogprob` per new token when the
    request asked for logprobs (all of them so far: ``logprobs``), else None. ``prompt_logprobs``:
    when asked for, one per prompt token (None for the first, vLLM's shape), else None."""

    __slots__ = ("request_id", "prompt_token_ids", "new_token_ids", "finished", "finish_reason", "metrics",
                 "num_cached_tokens", "new_logprobs", "prompt_logprobs", "_request", "_num_outputs",
                 "_new_text", "_text")

    def __init__(self, request: Request, new_token_ids: list[int]):
        self.request_id = request.request_id
        self.prompt_token_ids = request.prompt_token_ids
        self.new_token_ids = new_token_ids
        self.finished = request.is_finished
        self.finish_reason = request.finish_reason  # "stop" | "length" | "abort" once finished
        self.metrics = request.metrics
        self.num_cached_tokens = request.num_cached_tokens  # prompt tokens served by the prefix cache
        self._new_text = self._text = None
        self.new_logprobs = (request.logprobs[len(request.logprobs) - len(new_token_ids):]
                             if request.params.logprobs is not None else None)
        self.prompt_logprobs = request.prompt_logprobs if request.params.prompt_logprobs is not None else None
        self._request, self._num_outputs = request, len(request.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self._request.output_token_ids[:self._num_outputs]

    def detokenize(self) -> None:
        """Decode this output's text now (once; nothing without a tokenizer)."""
        if self._new_text is None and self._request.tokenizer is not None:
            self._new_text = self._request.detokenizer.take()
            self._text = self._request.detokenizer.sent

    @property
    def new_text(self) -> str | None:
        self.detokenize()
        return self._new_text

    @property
    def text(self) -> str | None:
        self.detokenize()
        return self._text

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self._request.logprobs[:self._num_outputs] if self._request.params.logprobs is not None else None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, token_ids={self.token_ids}, "
                f"finished={self.finished}, finish_reason={self.finish_reason!r})")
