"""Speculative decoding by prompt lookup (chapter 投机解码): propose, verify, accept.

A decode step reads all the weights to make one token per request. When a request's text repeats
itself (a summary quoting its input, code editing a given file), its next tokens can be guessed
from its own history: :class:`NgramProposer` finds the latest earlier place where the request's
last n tokens occurred and proposes the tokens that followed there. The scheduler feeds the
request's last token and the proposals as one short chunk (the paged prefill path: causal
attention over the cache), the model runner takes the target's greedy token at every position and
:func:`accept_greedy` keeps the longest run of proposals the target agrees with, plus the target's
own token after it. The output is the one plain greedy decoding gives, token for token; the
rejected positions' KV slots are given back by the scheduler.

Only greedy requests are proposed for: a request with temperature > 0 decodes one token per step
as without speculation (its distribution stays exactly the target's).
"""
from __future__ import annotations

from collections.abc import Sequence

from minillm.engine.engine_config import SpeculativeConfig


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
