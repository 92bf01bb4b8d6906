"""The straightforward generator (chapters 预填充, 解码 and KV cache): one static batch.

All prompts are prefilled together in one flat forward, then every step decodes one token for each
request still running; a request leaves the batch when it stops. The KV cache is the contiguous
one, sized for the longest request. With ``use_cache=False`` nothing is kept between steps: each
step recomputes every token of every sequence, the cost the KV cache exists to avoid. The engine
of the later chapters replaces this loop with continuous batching over a paged cache.
"""
from __future__ import annotations

import torch

from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.engine.kv_cache import KVCache
from minillm.engine.model import Transformer
from minillm.engine.sampling import SamplingParams, apply_penalties, make_generator, mask_early_stops, sample


def generate(model: Transformer, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
             use_cache: bool = True, kv_cache: KVCache | None = None) -> list[list[int]]:
    """Generated token ids for each prompt (prompt excluded; a stop token is included).

    ``kv_cache``: where prompt i keeps its keys and values, as request ``i``; default a
    ``ContiguousKVCache`` sized for the longest request. A ``PagedKVCache`` works the same.
    """
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    params_list = _params_per_prompt(params, prompts)
    _check_prompts(model.config, prompts, params_list)
    generators = [make_generator(p.seed, model.device) for p in params_list]
    outputs: list[list[int]] = [[] for _ in prompts]
    running = list(range(len(prompts)))
    if use_cache and kv_cache is None:
        max_len = max(len(p) + sp.max_tokens for p, sp in zip(prompts, params_list))
        kv_cache = ContiguousKVCache(model.config, len(prompts), max_len, model.dtype, model.device)
    new_tokens = [list(p) for p in prompts]
    while running:
        if use_cache:
            logits = _last_logits(model, kv_cache, running, new_tokens)
        else:  # a fresh cache every step: the whole sequence is computed again
            sequences = [list(prompts[r]) + outputs[r] for r in running]
            fresh = ContiguousKVCache(model.config, len(running), max(map(len, sequences)),
                                      model.dtype, model.device)
            logits = _last_logits(model, fresh, list(range(len(running))), sequences)
        params = [params_list[r] for r in running]
        logits = mask_early_stops(logits, params, [len(outputs[r]) for r in running],
                                  model.config.eos_token_ids)
        logits = apply_penalties(logits, params, [prompts[r] for r in running], [outputs[r] for r in running])
        tokens = sample(logits, params, [generators[r] for r in running]).tolist()
        still_running = []
        for row, token in zip(running, tokens):
            outputs[row].append(token)
            if _stops(model.config.eos_token_ids, params_list[row], outputs[row]):
                if use_cache:
                    kv_cache.free(row)
            else:
                still_running.append(row)
        running = still_running
        new_tokens = [[outputs[r][-1]] for r in running]
    return outputs


def _last_logits(model: Transformer, cache: KVCache, requests: list[int],
                 token_lists: list[list[int]]) -> torch.Tensor:
    """One forward of each request's new tokens; logits of each one's last token ``[len(requests), V]``."""
    positions, attn = cache.append(requests, [len(t) for t in token_lists])
    input_ids = torch.tensor([t for tokens in token_lists for t in tokens], device=model.device)
    hidden = model(input_ids, positions, attn, cache.layer_caches)
    return model.compute_logits(hidden[attn.cu_seqlens_q[1:] - 1])


def _stops(eos_token_ids, params: SamplingParams, output: list[int]) -> bool:
    token = output[-1]
    return (len(output) >= params.max_tokens or token in params.stop_token_ids
            or (not params.ignore_eos and token in eos_token_ids))


def _params_per_prompt(params, prompts) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * len(prompts)
    if not isinstance(params, (list, tuple)) or len(params) != len(prompts) \
            or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError(f"params must be one SamplingParams or a list of one per prompt "
                         f"({len(prompts)}), got {params!r}")
    return list(params)


def _check_prompts(config, prompts, params_list: list[SamplingParams]) -> None:
    """Reject bad prompts before any compute: each error names the prompt and the limit."""
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        if isinstance(prompt, str) or not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt {i} must be a list of token ids (tokenize text first), "
                             f"got {type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        if params.stop or params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError(f"prompt {i}: generate returns token ids only; stop strings and logprobs "
                             f"need the engine (minillm.LLM)")
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, int)
               or not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]!r} outside the vocabulary "
                             f"[0, {config.vocab_size})")
        if len(prompt) + params.max_tokens > config.max_position_embeddings:
            raise ValueError(f"prompt {i}: {len(prompt)} prompt tokens + max_tokens "
                             f"{params.max_tokens} = {len(prompt) + params.max_tokens} exceeds the "
                             f"model's max_position_embeddings {config.max_position_embeddings}")
