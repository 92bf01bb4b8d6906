"""Speculative decoding (chapter 投机解码): propose, verify, accept.

A decode step reads all the weights to make one token per request. If several guessed tokens are
checked in that same step, a step yields more than one. Two proposers guess them:

- :class:`NgramProposer`, prompt lookup: when a request's text repeats itself (a summary quoting
  its input, code editing a given file), the latest earlier place where its last n tokens occurred
  proposes the tokens that followed there. It runs in the scheduler, on token ids alone.
- :class:`LayerDraft`, self-speculation (as in LayerSkip and Draft & Verify): the target's own
  first L layers, its final norm and its output layer propose the tokens one at a time. Its layers
  are the target's layers 0..L-1, so it needs no KV cache of its own: it writes their keys and
  values into the request's next slots, which the verify step then overwrites with the same
  values, up to rounding (and the layers past L with theirs). It runs in the model runner, before
  the step.

The scheduler feeds the request's last token and the proposals as one short chunk (the paged
prefill path: causal attention over the cache) and the model runner asks :func:`verify` which
tokens the step yields. Greedy, :func:`accept_greedy` keeps the longest run of proposals the
target's argmax agrees with, plus the target's own token after it: the output is the one plain
greedy decoding gives, token for token. With temperature > 0, :func:`accept_sampled` is the
rejection sampling of Leviathan et al. (2023), against the draft's distribution q (prompt lookup:
all of q's mass on the proposed token): the output is distributed as the target's (a seeded
request is reproducible, but it draws other tokens than without speculation). The scheduler gives
the rejected positions' KV slots back.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from minillm.engine.engine_config import SpeculativeConfig
from minillm.engine.request import Request
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


def accept_sampled(proposed: Sequence[int], probs: torch.Tensor, generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """Rejection sampling. ``probs[i]``: the target's distribution after the last token and
    ``proposed[:i]`` (``[len(proposed) + 1, V]``); ``draft_probs[i]``: the draft's q_i, from which
    ``proposed[i]`` was drawn (None: all of q's mass on the proposal, as in prompt lookup).
    Proposal x at position i is accepted with probability min(1, p_i(x) / q_i(x)); at the first
    rejection a token is drawn from max(0, p_i - q_i), normalized; all accepted, one more is drawn
    from the last row. Each output token is then distributed as the target's (Leviathan et al., 2023)."""
    for i, token in enumerate(proposed):
        if draft_probs is None:
            q = torch.zeros_like(probs[i])
            q[token] = 1.0
        else:
            q = draft_probs[i]
        if torch.rand(1, generator=generator, device=probs.device).item() * q[token].item() < probs[i, token].item():
            continue
        residual = (probs[i] - q).clamp_(min=0)
        return list(proposed[:i]) + [int(torch.multinomial(residual, 1, generator=generator))]
    return list(proposed) + [int(torch.multinomial(probs[-1], 1, generator=generator))]


def verify(proposed: Sequence[int], logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None, draft_probs: torch.Tensor | None = None) -> list[int]:
    """The tokens one request's verify step yields from its ``len(proposed) + 1`` rows of logits
    (stop tokens already masked where ``min_tokens`` says): greedy, or by rejection sampling
    against the draft's distributions ``draft_probs`` (None: the proposals were not drawn)."""
    if params.greedy:
        return accept_greedy(proposed, logits.argmax(dim=-1).tolist())
    return accept_sampled(proposed, probabilities(logits, [params] * len(logits)), generator, draft_probs)


class LayerDraft:
    """The target's first ``num_draft_layers`` layers, final norm and output layer as the draft.

    :meth:`propose` drafts, for every request the scheduler gave ``num_spec_tokens`` slots, that
    many tokens, one position per forward pass, all such requests batched (a request drops out
    when it has its tokens). Each pass is a decode step of the first layers over the paged cache:
    it reads layers 0..L-1 of the request's KV and writes them at the drafted position, a slot the
    scheduler has allocated and the verify step overwrites. ``num_passes`` and ``seconds`` count
    its forward passes and the wall time they took (each ends by reading its tokens back), since
    it was built: what a bench divides to price a draft pass against a target step."""

    def __init__(self, model, kv_cache, config: SpeculativeConfig):
        self.model, self.kv = model, kv_cache
        self.num_layers = config.num_draft_layers
        self.num_passes, self.seconds = 0, 0.0

    def propose(self, requests: list[Request], generators: dict) -> dict[str, torch.Tensor]:
        """Fill each request's ``spec_token_ids``: greedy ones take the draft's argmax, the others
        draw from its distribution q with their own generator. Returns request_id -> q's rows
        ``[num_spec_tokens, V]`` for the drawn ones (the rejection sampler's q)."""
        start = time.perf_counter()
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r in requests if not r.params.greedy}
        for j in range(max(r.num_spec_tokens for r in requests)):
            active = [r for r in requests if r.num_spec_tokens > j]
            batch = [(r.request_id, r.num_tokens - 1 + j, 1) for r in active]
            last = [r.spec_token_ids[-1] if j else r.output_token_ids[-1] for r in active]
            input_ids, positions, attn = self.kv.prepare_inputs(batch, last)
            hidden = self.model(input_ids, positions, attn, self.kv.layer_caches, num_layers=self.num_layers)
            logits = self.model.compute_logits(hidden)
            tokens = logits.argmax(dim=-1).tolist()
            for row, request in enumerate(active):
                if not request.params.greedy:
                    q = probabilities(logits[row:row + 1], [request.params])[0]
                    probs[request.request_id].append(q)
                    tokens[row] = int(torch.multinomial(q, 1, generator=generators.get(request.request_id)))
                request.spec_token_ids.append(tokens[row])
            self.num_passes += 1
        self.seconds += time.perf_counter() - start
        return {request_id: torch.stack(rows) for request_id, rows in probs.items()}
