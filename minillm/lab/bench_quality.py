"""What quantization costs in quality (chapter 量化): perplexity and top-1 agreement.

The text is real English that every Python installation ships: the Python Language Reference's
help topics (``pydoc_data.topics``, © Python Software Foundation, PSF License 2.0), in a fixed
order, cut to the first ``tokens`` tokens of the model's tokenizer. It is scored in windows of
``window`` tokens, each a fresh prefill through the engine's own forward and KV cache, so an fp8
cache is read back by the attention exactly as in serving. For every position the model predicts
the next token; perplexity is exp(mean negative log-likelihood), and top-1 agreement is the share
of positions whose most likely next token is the unquantized model's.
"""
from __future__ import annotations

import json
import math

import torch

from minillm.engine.contiguous_cache import ContiguousKVCache
from minillm.engine.device import resolve_device
from minillm.engine.engine_config import add_quantization_options
from minillm.engine.kv_cache import kv_storage_dtype
from minillm.engine.loader import load_model
from minillm.engine.model import Transformer
from minillm.lab.bench_cli import add_options, report

TEXT_SOURCE = "the Python Language Reference's help topics (pydoc_data.topics, PSF License 2.0)"
DEFAULT_TOKENS = 4096
WINDOW = 512


def quality_text() -> str:
    """The evaluation text: every help topic of the running Python, in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def text_tokens(tokenizer, tokens: int) -> list[int]:
    """The first ``tokens`` token ids of :func:`quality_text`."""
    ids = tokenizer.encode(quality_text(), add_special_tokens=False)
    if len(ids) < tokens:
        raise ValueError(f"the text has only {len(ids):,} tokens, fewer than {tokens:,}")
    return ids[:tokens]


@torch.inference_mode()
def window_hidden(model: Transformer, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """The output layer's input ``[len(ids), hidden]`` (after the final norm) for one window,
    prefilled into a cache of ``kv_dtype``."""
    cache = ContiguousKVCache(model.config, 1, len(ids), kv_dtype, model.device)
    positions, attn = cache.append([0], [len(ids)])
    return model(torch.tensor(ids, device=model.device), positions, attn, cache.layer_caches)


def window_logits(model: Transformer, ids: list[int], kv_dtype: torch.dtype) -> torch.Tensor:
    """float32 logits ``[len(ids), vocab]`` of one window, prefilled into a cache of ``kv_dtype``."""
    return model.compute_logits(window_hidden(model, ids, kv_dtype))


def score(model: Transformer, ids: list[int], kv_cache: str = "auto", window: int = WINDOW,
          reference: list[torch.Tensor] | None = None) -> dict:
    """Negative log-likelihood and top-1 choices over ``ids`` in windows; against ``reference``
    (the baseline's top-1 choices per window), the share that agree."""
    kv_dtype = kv_storage_dtype(kv_cache, model.dtype)
    nll, count, agree, choices = 0.0, 0, 0, []
    for w, start in enumerate(range(0, len(ids) - 1, window)):
        chunk = ids[start:start + window + 1]
        logits = window_logits(model, chunk[:-1], kv_dtype)
        targets = torch.tensor(chunk[1:], device=logits.device)
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(targets)
        top1 = logits.argmax(dim=-1)
        choices.append(top1)
        if reference is not None:
            agree += int((top1 == reference[w]).sum())
    return {"perplexity": math.exp(nll / count), "tokens": count, "choices": choices,
            "top1_agreement": agree / count if reference is not None else None}


def bench_quality(model_name: str, quantization: str | None = None, group_size: int = 32,
                  kv_cache_dtype: str = "auto", device=None, tokens: int = DEFAULT_TOKENS,
                  window: int = WINDOW) -> dict:
    """The quantized model (and/or fp8 KV) against the unquantized one on the same text: perplexity
    of each, their ratio, top-1 agreement, tokens scored."""
    device = resolve_device(device)
    baseline_model = load_model(model_name, device=device)
    if baseline_model.tokenizer is None:
        raise ValueError(f"{model_name} has no tokenizer: quality is measured on text")
    ids = text_tokens(baseline_model.tokenizer, tokens)
    baseline = score(baseline_model, ids, window=window)
    del baseline_model
    model = load_model(model_name, device=device, quantization=quantization, group_size=group_size)
    measured = score(model, ids, kv_cache_dtype, window, reference=baseline["choices"])
    return {"model": model.config.name, "dtype": str(model.dtype).removeprefix("torch."),
            "quantization": quantization, "group_size": group_size if quantization == "int4" else None,
            "kv_cache_dtype": kv_cache_dtype, "text": TEXT_SOURCE, "window": window,
            "tokens": measured["tokens"], "perplexity": measured["perplexity"],
            "baseline_perplexity": baseline["perplexity"],
            "perplexity_ratio": measured["perplexity"] / baseline["perplexity"],
            "top1_agreement": measured["top1_agreement"]}


def format_quality(result: dict) -> str:
    what = result["quantization"] or "no weight quantization"
    if result["group_size"]:
        what += f" (groups of {result['group_size']})"
    return "\n".join([
        f"model {result['model']} ({result['dtype']}), {what}, KV cache {result['kv_cache_dtype']}",
        f"text: {result['tokens']:,} tokens of {result['text']}, windows of {result['window']}",
        f"perplexity {result['perplexity']:.3f} vs {result['baseline_perplexity']:.3f} unquantized "
        f"({result['perplexity_ratio'] - 1:+.2%}); top-1 next-token agreement {result['top1_agreement']:.2%}"])


# --- python -m minillm bench quality ---------------------------------------------------------------

def add_cli(bench_commands) -> None:
    cmd = bench_commands.add_parser("quality", help="perplexity and top-1 agreement of a quantized "
                                                    "model (or an fp8 KV cache) against the unquantized one")
    add_options(cmd, model="smollm2-135m", dtype=None, out=None)  # a model with weights and a tokenizer
    add_quantization_options(cmd)
    cmd.add_argument("--tokens", type=int, default=DEFAULT_TOKENS)
    cmd.add_argument("--window", type=int, default=WINDOW)
    cmd.add_argument("--json", action="store_true", help="print one JSON object")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    return report(args, "quality", {}, lambda device: bench_quality(
        args.model, args.quantization, args.group_size, args.kv_cache_dtype, device, args.tokens, args.window),
        json.dumps if args.json else format_quality)
