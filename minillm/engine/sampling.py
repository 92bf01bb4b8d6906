"""Choosing the next token from the logits (chapter 解码).

vLLM's order, batched over the rows: the raw logits give the logprobs a request asks for. While a
request has fewer than ``min_tokens`` outputs, its stop tokens (EOS unless ``ignore_eos``, and
``stop_token_ids``) are masked out, so neither greedy nor a draw can end it early. Then
``logit_bias`` is added and the penalties applied (:func:`apply_penalties`): repetition (a logit of
a token seen in the prompt or the output divided by it when positive, multiplied when negative),
frequency (minus it times the token's count in the output) and presence (minus it once the token
is in the output). Temperature 0 is greedy (argmax). Otherwise the logits are divided by the
temperature, cut to the ``top_k`` best tokens, to the smallest set whose probability reaches
``top_p`` and to the tokens at least ``min_p`` times as likely as the best one, and one token is
drawn. A temperature below :data:`MIN_TEMPERATURE` is raised to it (vLLM's rule: smaller ones
overflow the scaled logits), ``top_k`` past the vocabulary keeps it all, and the best token
survives any ``top_p`` or ``min_p``. Each request may carry its own seeded ``torch.Generator``, so its draws do not depend on
which other requests share the batch. A request with ``structured_outputs`` has the logits its
grammar forbids masked before the draw (:mod:`minillm.engine.structured`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minillm.engine.structured import StructuredOutputsParams

MIN_TEMPERATURE = 1e-2  # vLLM's floor for a temperature > 0 (its _MAX_TEMP)
SEED_LIMIT = 2**64  # a seed is in [0, SEED_LIMIT): what torch.Generator.manual_seed takes


TOP_P_CANDIDATES = 1024  # the best tokens a top-p cut is looked for among before sorting them all
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (OpenAI's and vLLM's bound)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens for one request and when to stop."""

    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    max_tokens: int = 16  # generated tokens at most
    min_tokens: int = 0  # generated tokens before EOS, stop tokens or stop strings may end it
    ignore_eos: bool = False  # keep going past the model's end-of-sequence tokens
    stop_token_ids: tuple[int, ...] = ()  # extra tokens that end the request (and are returned)
    seed: int | None = None  # per-request random seed; None = the global generator
    stop: tuple[str, ...] = ()  # strings that end the text before them (needs a tokenizer)
    presence_penalty: float = 0.0  # subtracted from the logit of every token in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) the logits of tokens seen
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # drop tokens less likely than min_p times the best one
    logprobs: int | None = None  # the sampled token's logprob and this many top ones; None = none
    prompt_logprobs: int | None = None  # each prompt token's logprob (after the first) and this many
    # top ones, given the tokens before it; None = none. Its prompt is computed whole (no prefix cache)
    structured_outputs: StructuredOutputsParams | None = None  # JSON the output must be (a grammar)

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit), got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not (_is_int(self.seed) and 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be None or an int in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a sequence of token ids (ints >= 0), "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        self.stop = tuple(s for s in self.stop if s)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = none), got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logit_bias, dict) or not all(
                _is_int(t) and t >= 0 and _is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()):
            raise ValueError(f"logit_bias must map token ids (ints >= 0) to numbers in [-100, 100], "
                             f"got {self.logit_bias!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")
            if self.ignore_eos or self.min_tokens:  # the grammar ends the output with EOS
                raise ValueError(f"{'ignore_eos' if self.ignore_eos else 'min_tokens'} cannot be combined "
                                 f"with structured outputs: the grammar decides where the output ends")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def cuts(self) -> bool:
        """Whether top-k, top-p or min-p may drop tokens (else a draw needs no sorting)."""
        return bool(self.top_k) or self.top_p < 1 or self.min_p > 0

    @property
    def penalized(self) -> bool:
        """Whether :func:`apply_penalties` changes this request's logits."""
        return bool(self.logit_bias) or (self.presence_penalty, self.frequency_penalty,
                                         self.repetition_penalty) != (0, 0, 1)


@dataclass
class TokenLogprob:
    """A token's log-probability under the model given the tokens before it (its raw logits, vLLM's
    default), and the ``top`` most likely tokens' ``(token_id, logprob)`` there, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def make_generator(seed: int | None, device) -> torch.Generator | None:
    """A generator seeded for one request, or None to use torch's global one."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def mask_early_stops(logits: torch.Tensor, params_list: list[SamplingParams],
                     num_output_tokens: list[int], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """The logits with -inf for the stop tokens of every row whose request has fewer than ``min_tokens``
    outputs (EOS unless ``ignore_eos``, and ``stop_token_ids``; ids past the vocabulary skipped)."""
    rows, cols = [], []
    for row, (params, done) in enumerate(zip(params_list, num_output_tokens, strict=True)):
        if done < params.min_tokens:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
            ids = [t for t in stops if t < logits.shape[-1]]
            rows += [row] * len(ids)
            cols += ids
    if not rows:
        return logits
    return logits.index_put((torch.tensor(rows, device=logits.device),
                             torch.tensor(cols, device=logits.device)),
                            torch.tensor(-math.inf, dtype=logits.dtype, device=logits.device))


def apply_penalties(logits: torch.Tensor, params_list: list[SamplingParams],
                    prompts: list[Sequence[int]], outputs: list[Sequence[int]]) -> torch.Tensor:
    """The logits (float32 at least) with each row's ``logit_bias`` added and its repetition,
    frequency and presence penalties applied, counted over that row's ``prompts`` and ``outputs``
    token ids; unchanged when no row asks for any."""
    if not any(p.penalized for p in params_list):
        return logits
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits, device = logits.to(dtype), logits.device

    def rows_of(lists):
        rows = [row for row, ids in enumerate(lists) for _ in ids]
        ids = [t for ids in lists for t in ids]
        return torch.tensor(rows, dtype=torch.long), torch.tensor(ids, dtype=torch.long)

    bias_rows, bias_ids = rows_of([list(p.logit_bias) for p in params_list])
    bias = torch.tensor([b for p in params_list for b in p.logit_bias.values()], dtype=dtype)
    logits = logits.index_put((bias_rows.to(device), bias_ids.to(device)), bias.to(device), accumulate=True)
    counts = torch.zeros(logits.shape, dtype=dtype)
    counts.index_put_(rows_of(outputs), torch.ones(()), accumulate=True)
    seen = counts > 0
    seen[rows_of(prompts)] = True
    counts, seen = counts.to(device), seen.to(device)
    repetition, frequency, presence = torch.tensor(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params_list],
        dtype=dtype, device=device).T[:, :, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency * counts - presence * (counts > 0)


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """Each row's chosen token's logprob and its ``num_top`` best tokens', from raw ``logits``
    (one device-to-host copy)."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
    top = logprobs.topk(max(num_top), dim=-1) if max(num_top) else None
    chosen = chosen.tolist()
    top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top else ([[]] * len(tokens),) * 2
    return [TokenLogprob(token, value, list(zip(ids[:k], values[:k])))
            for token, value, ids, values, k in zip(tokens, chosen, top_ids, top_values, num_top, strict=True)]


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of ``logits`` in float32, divided by their temperatures."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    return logits.float() / temperature[:, None]


def _best_first(scaled: torch.Tensor, params: list[SamplingParams], top_p: torch.Tensor):
    """``(probs, order)``: the probabilities (over the whole vocabulary) of the best tokens of each
    row of ``scaled``, best first, and their ids: the fewest that hold every token a cut may keep
    (a row's ``top_k`` best, or its best ``TOP_P_CANDIDATES`` once they hold its ``top_p`` mass),
    found by ``topk``; all of them, sorted, when some row may keep more."""
    vocab = scaled.shape[-1]
    width = max(min(p.top_k, vocab) if p.top_k else TOP_P_CANDIDATES if p.top_p < 1 else vocab for p in params)
    if width < vocab:
        best, order = scaled.topk(width, dim=-1)
        probs = (best - scaled.logsumexp(dim=-1, keepdim=True)).exp()
        has_top_k = torch.tensor([bool(p.top_k) for p in params], device=scaled.device)
        if bool((has_top_k | (probs.sum(dim=-1) >= top_p)).all()):  # the next token is cut in every row
            return probs, order
    best, order = scaled.sort(dim=-1, descending=True)
    return best.softmax(dim=-1), order


def _kept_probs(scaled: torch.Tensor, params: list[SamplingParams]):
    """Rows of ``scaled`` logits as probabilities of their best tokens in descending order
    (:func:`_best_first`), with the tokens top-k, top-p and min-p cut set to zero (not
    renormalized): ``(probs, order, keep)``."""
    vocab, device = scaled.shape[-1], scaled.device
    top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs, order = _best_first(scaled, params, top_p)
    rank = torch.arange(probs.shape[-1], device=device)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
    keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None]) | (rank == 0)  # the best stays
    if any(p.min_p for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        keep &= probs >= min_p[:, None] * probs[:, :1]
    return probs * keep, order, keep


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is drawn from (temperature > 0), ``[N, V]`` in token order: what
    :func:`sample` draws from, for rejection sampling to compare with."""
    scaled = _scaled(logits, params)
    probs, order, _ = _kept_probs(scaled, params)
    return torch.zeros_like(scaled).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))


def sample(logits: torch.Tensor, params_list: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V], row i sampled with ``params_list[i]``."""
    tokens = logits.argmax(dim=-1)
    drawn_rows = [i for i, p in enumerate(params_list) if p.temperature > 0]
    if not drawn_rows:
        return tokens
    rows = torch.tensor(drawn_rows, device=logits.device)
    params = [params_list[i] for i in drawn_rows]
    scaled = _scaled(logits[rows], params)
    if any(p.cuts for p in params):  # the best tokens first; the kept ones are a prefix
        probs, order, keep = _kept_probs(scaled, params)
        last = keep.sum(dim=-1, keepdim=True) - 1
    else:  # nothing is cut: draw in token order, with no sort
        probs, order, last = scaled.softmax(dim=-1), None, scaled.shape[-1] - 1

    # Inverse-CDF draw: u ~ U[0, 1) from the request's own generator, then the first token whose
    # cumulative (unnormalized) mass exceeds u * total.
    u = torch.cat([torch.rand(1, device=logits.device, generator=generators[i]) for i in drawn_rows])
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=last)
    tokens[rows] = (picks if order is None else order.gather(1, picks))[:, 0]
    return tokens
