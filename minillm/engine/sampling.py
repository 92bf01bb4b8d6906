"""Choosing the next token from the logits (chapter 解码).

Temperature 0 is greedy (argmax). While a request has fewer than ``min_tokens`` outputs, its stop
tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are masked out of the logits first, so
neither greedy nor a draw can end it early (vLLM's rule). Otherwise the logits are divided by the temperature, cut to the
``top_k`` best tokens and to the smallest set whose probability reaches ``top_p``, and one token is
drawn. Each request may carry its own seeded ``torch.Generator``, so its draws do not depend on
which other requests share the batch. A request with ``structured_outputs`` has the logits its
grammar forbids masked first (:mod:`minillm.engine.structured`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minillm.engine.structured import StructuredOutputsParams


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    structured_outputs: StructuredOutputsParams | None = None  # JSON the output must be (a grammar)

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not self.temperature >= 0 or math.isinf(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
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
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a sequence of token ids (ints >= 0), "
                             f"got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(self.stop_token_ids)
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


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Rows of ``logits`` in float32, divided by their temperatures."""
    temperature = torch.tensor([p.temperature for p in params], device=logits.device)
    return logits.float() / temperature[:, None]


def _kept_probs(scaled: torch.Tensor, params: list[SamplingParams]):
    """Rows of ``scaled`` logits as probabilities in descending order, with the tokens top-k and
    top-p cut set to zero (not renormalized): ``(probs, order, keep)``."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)

    vocab, device = scaled.shape[-1], scaled.device
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    rank = torch.arange(vocab, device=device)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
    keep = (rank < top_k[:, None]) & (mass_before < top_p[:, None])  # the best token always stays
    return probs * keep, order, keep


def probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row is drawn from (temperature > 0), ``[N, V]`` in token order: what
    :func:`sample` draws from, for rejection sampling to compare with."""
    probs, order, _ = _kept_probs(_scaled(logits, params), params)
    return torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(dim=-1, keepdim=True))


def sample(logits: torch.Tensor, params_list: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token id per row of ``logits`` [N, V], row i sampled with ``params_list[i]``."""
    tokens = logits.argmax(dim=-1)
    drawn_rows = [i for i, p in enumerate(params_list) if p.temperature > 0]
    if not drawn_rows:
        return tokens
    rows = torch.tensor(drawn_rows, device=logits.device)
    params = [params_list[i] for i in drawn_rows]
    probs, order, keep = _kept_probs(_scaled(logits[rows], params), params)

    # Inverse-CDF draw: u ~ U[0, 1) from the request's own generator, then the first token whose
    # cumulative (unnormalized) mass exceeds u * total. The kept tokens are a prefix of the order.
    u = torch.cat([torch.rand(1, device=logits.device, generator=generators[i]) for i in drawn_rows])
    cdf = probs.cumsum(dim=-1)
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    picks = torch.minimum(picks, keep.sum(dim=-1, keepdim=True) - 1)
    tokens[rows] = order.gather(1, picks)[:, 0]
    return tokens
