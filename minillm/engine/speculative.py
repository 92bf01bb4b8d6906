"""Speculative decoding by prompt lookup (chapter 投机解码): propose, verify, accept.

A decode step reads all the weights to make one token per request. When a request's text repeats
itself (a summary quoting its input, code editing a given file), its next tokens can be guessed
from its own history: :class:`NgramProposer` finds the latest earlier place where the request's
last n tokens occurred and proposes the tokens that followed there. The scheduler feeds the
request's last token and the proposals as one short chunk (the paged prefill path: causal
attention over the cache) and the model runner asks :func:`verify` which tokens the step yields.
Greedy, :func:`accept_greedy` keeps the longest run of proposals the target's argmax agrees with,
plus the target's own token after it: the output is the one plain greedy decoding gives, token for
token. With temperature > 0, :func:`accept_sampled` is the rejection sampling of Leviathan et al.
(2023) for a draft that puts all its mass on the proposed token: the output is distributed as the
target's (a seeded request is reproducible, but it draws other tokens than without speculation).
The scheduler gives the rejected positions' KV slots back.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from minillm.engine.engine_config import SpeculativeConfig
from minillm.engine.sampling import SamplingParams, probabilities


class NgramProposer:
    """Prompt lookup: match the last n tokens (n from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``) against the earlier tokens; the latest match proposes what followed it."""

    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)

    def propose(self, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``min(num_speculative_tokens, max_tokens)`` tokens that followed the latest earlier
        occurrence of the longest suffix of ``token_ids`` that occurred before; [] if none did."""
        count = min(self.num_speculative_tokens, max_tokens)
        length = len(token_ids)
        if count <= 0:
            return []
        for n in self.sizes:
            if n >= length:
                continue
            suffix = list(token_ids[length - n:])
            for start in range(length - n - 1, -1, -1):  # the latest occurrence first
                if token_ids[start] == suffix[0] and list(token_ids[start:start + n]) == suffix:
                    return list(token_ids[start + n:start + n + count])
        return []


def accept_greedy(proposed: Sequence[int], targets: Sequence[int]) -> list[int]:
    """The tokens a verify step yields. ``targets[i]``: the target's greedy token after the last
    token and ``proposed[:i]`` (one more than there are proposals). The proposals are accepted while
    they equal the target's tokens; the target's token at the first mismatch (or after the last
    proposal) comes with them: ``targets[:accepted + 1]``."""
    if len(targets) != len(proposed) + 1:
        raise ValueError(f"need one target token per proposal plus one, got {len(targets)} "
                         f"for {len(proposed)} proposals")
    accepted = 0
    while accepted < len(proposed) and proposed[accepted] == targets[accepted]:
        accepted += 1
    return list(targets[:accepted + 1])


def accept_sampled(proposed: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None) -> list[int]:
    """Rejection sampling with a point-mass draft. ``probs[i]``: the target's distribution after
    the last token and ``proposed[:i]`` (``[len(proposed) + 1, V]``). Proposal x at position i is
    accepted with probability min(1, p_i(x) / q(x)) = p_i(x); at the first rejection a token is
    drawn from max(0, p_i - q), normalized: p_i without x; all accepted, one more is drawn from the
    last row. Each output token is then distributed as the target's (Leviathan et al., 2023)."""
    for i, token in enumerate(proposed):
        if torch.rand(1, generator=generator, device=probs.device).item() < probs[i, token].item():
            continue
        residual = probs[i].clone()
        residual[token] = 0
        return list(proposed[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
    return list(proposed) + [int(torch.multinomial(probs[-1], 1, generator=generator))]


def verify(proposed: Sequence[int], logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """The tokens one request's verify step yields from its ``len(proposed) + 1`` rows of logits
    (stop tokens already masked where ``min_tokens`` says): greedy, or by rejection sampling."""
    if params.greedy:
        return accept_greedy(proposed, logits.argmax(dim=-1).tolist())
    return accept_sampled(proposed, probabilities(logits, [params] * len(logits)), generator)
