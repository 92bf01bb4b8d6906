"""The memory planner (chapter 一张 24 GiB 的卡放 8B 模型).

The ledger says what is left after the weights; an engine must also hold the activations of its
largest step and whatever the GPU runtime keeps outside PyTorch. The planner does what vLLM does at
start-up: load the weights, run one dummy step of ``max_num_batched_tokens`` tokens and measure its
peak, then cut what is left of ``total × gpu_memory_utilization`` into KV blocks. It checks that one
request of ``max_model_len`` fits, or finds the longest that does (``max_model_len=-1``).

Three ways to plan, one ``MemoryPlan``:

- on a CUDA device: everything measured (``source="profiled"``); ``memory_limit`` plans for a
  smaller card than the one present;
- on the CPU with ``memory_limit`` (e.g. ``"512MiB"``): an emulated card, real tensors measured;
- ``gpu_memory`` (e.g. ``"24GiB"``): a dry run for a card you do not have; the model is built on the
  meta device (no memory), the activation peak comes from ``activation_estimate`` and the memory
  outside PyTorch is ``DRY_RUN_OUTSIDE_TORCH_BYTES`` (``source="estimated"``).

A card's size is what the device reports, a little under its label (a "24 GB" card reports less
than 24 GiB). A dry run takes the size it is given: to plan for a real card, give it what that
card reports (``minillm.lab.vllm_logs.reported_memory``); on CUDA a ``memory_limit`` above what the
device reports is cut to it, with a warning.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.engine.config import ModelConfig, load_config
from minillm.engine.device import resolve_device
from minillm.engine.engine_config import EngineConfig, check_max_model_len
from minillm.engine.kv_cache import kv_bytes_per_token, kv_storage_dtype
from minillm.engine.loader import load_model, torch_dtype
from minillm.engine.memory_plan import MemoryPlan
from minillm.engine.model import Transformer
from minillm.engine.paged_cache import PagedKVCache
from minillm.engine.parallel import TensorParallel
from minillm.engine.quantization import check_shapes, quantize_model
from minillm.engine.sampling import SamplingParams, sample
from minillm.engine.units import GiB, ceil_div, fmt_bytes, parse_size

# Memory outside PyTorch on a CUDA card (the CUDA context, cuBLAS workspace, loaded kernels), which
# a dry run cannot measure. It counts what vLLM measured beside Llama-3.1-8B on an RTX 3090,
# "non_torch_memory=0.35GiB" (https://github.com/vllm-project/vllm/issues/10517), in the log
# format that counted the CUDA context there, as the profiled plan's ``other_bytes`` does.
DRY_RUN_OUTSIDE_TORCH_BYTES = round(0.35 * GiB)

# The sampler's bytes per logit at its peak (``sampling.sample`` on its dearest path, a cut that
# sorts the whole vocabulary): the float32 logits and their scaled copy, the int64 sort order, the
# probabilities best first, the mass before each token, the keep mask and the kept probabilities.
SAMPLER_BYTES_PER_LOGIT = 4 + 4 + 8 + 4 + 4 + 1 + 4

# An MoE layer's bytes per (token, expert) pair of its routing: the pair's int64 expert, the int64
# sort order and token row, the sorted float32 weight.
ROUTED_PAIR_BYTES = 8 + 8 + 8 + 4


# --- The activation peak: estimated (dry run) or measured -------------------------------------

def sampler_peak_bytes(num_rows: int, vocab_size: int) -> int:
    """Peak bytes of ``sampling.sample`` over float32 logits ``[num_rows, vocab_size]``, the logits
    included: ``SAMPLER_BYTES_PER_LOGIT`` per logit and one int64 rank per vocabulary entry."""
    return num_rows * vocab_size * SAMPLER_BYTES_PER_LOGIT + vocab_size * 8


def activation_estimate(cfg: ModelConfig, num_tokens: int, num_sampled_rows: int, dtype) -> int:
    """Activation bytes of one step of ``num_tokens`` tokens, by formula (dry-run plans).

    The largest of three moments of the step, each counting what is alive at once. In a layer, the
    caller still holds the layer's input ``[T, h]`` and the forward holds RoPE's cos and sin
    ``[T, d]`` each. Attention adds the normed input and q/k/v, then either RoPE's three copies of q
    while it rotates q (a quantized model rotates q and k in place, with one copy: less) or, in a
    qk-norm model (Qwen3), RMSNorm's copies of q while it normalizes q (the float32 result of a
    16-bit q, its float32 copy gone by then, then the result in the model's dtype and the weighted
    output). The MLP adds the residual after attention, the normed input and ``[T, I]`` three times
    (silu(gate), up, their product); an MoE layer, at most (one expert gets every token), holds
    instead of the three ``[T, I]`` its output accumulated over the experts and an expert's gathered
    rows ``[T, h]``, the router's float32 probabilities ``[T, E]``, ``ROUTED_PAIR_BYTES`` per
    (token, expert) pair, and the larger of the expert's three ``[T, I]`` and its output beside that
    output weighted in float32. Sampling: the final hidden states and the sampler's peak over
    ``[R, V]`` logits (``sampler_peak_bytes``); the rows that score prompt tokens (prompt logprobs)
    come before, at most R at a time (their float32 logits and log-softmax, 8 bytes a logit), under
    that peak. Attention is assumed fused (no ``[T, T]`` scores), as the GPU kernels are.
    """
    t, h, d, b = num_tokens, cfg.hidden_size, cfg.head_dim, torch_dtype(dtype).itemsize
    q, kv = cfg.q_size, cfg.kv_size
    upcast = 4 if b < 4 else 0  # RMSNorm's float32 result, per element of a 16-bit input
    rope = (2 * h + 2 * d + 4 * q + 2 * kv) * b
    q_norm = (2 * h + 2 * d + 2 * kv) * b + q * (3 * b + upcast) if cfg.qk_norm else 0
    attention = t * max(rope, q_norm)
    mlp = t * (3 * h + 2 * d + 3 * cfg.intermediate_size) * b
    if cfg.is_moe:
        weighted = h * (b + 4)  # an expert's output and its product with the float32 weights
        mlp = t * ((3 * h + 2 * d + 2 * h) * b + max(3 * cfg.intermediate_size * b, weighted)
                   + 4 * cfg.num_experts + ROUTED_PAIR_BYTES * cfg.num_experts_per_tok)
    sampling = t * h * b + sampler_peak_bytes(num_sampled_rows, cfg.vocab_size)
    return max(attention, mlp, sampling)


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the ``with`` block and alive at once (the CPU's
    peak meter).

    Every storage an aten op allocates (an output whose storage is not one of the op's inputs')
    counts its bytes from its creation until it is freed (a weakref finalizer on the storage, which
    takes back that storage's bytes and nothing else). Storages are told apart by identity, not by
    address: an address freed before its storage's finalizer ran (a storage resized in place, say)
    may come back to a new allocation, which counts as well. On CUDA the caching allocator keeps
    this count itself (``torch.cuda.max_memory_allocated``); the CPU has no such counter, so this
    one sees what the allocator sees, except scratch space that a kernel frees before it returns.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._counted = weakref.WeakSet()  # the live storages counted

    def _free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            nbytes = storage.nbytes()
            if not nbytes or storage in self._counted or storage.data_ptr() in inputs:
                continue  # empty, counted already, or a view or in-place result of an input
            self._counted.add(storage)
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._free, nbytes)
        return out


def _tensors(obj):
    """The tensors in an op's arguments or results (nested lists, tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _dummy_step(model: Transformer, num_tokens: int, num_seqs: int, block_size: int):
    """Inputs of the largest step, as vLLM's profile run builds it: ``num_seqs`` prompts sharing
    ``num_tokens`` evenly, each prefilled from scratch into a KV cache just big enough for them."""
    lengths = [num_tokens // num_seqs] * num_seqs
    lengths[-1] += num_tokens % num_seqs
    cache = PagedKVCache(model.config, sum(ceil_div(n, block_size) for n in lengths), block_size,
                         model.dtype, model.device)
    positions, attn = cache.append(list(range(num_seqs)), lengths)
    input_ids = torch.randint(model.config.vocab_size, (num_tokens,), device=model.device)
    return input_ids, positions, attn, cache.layer_caches, (attn.cu_seqlens_q[1:] - 1).long()


def _run_step(model: Transformer, step) -> None:
    """Forward, logits of each sequence's last token, and the sampler with temperature, top-k and
    top-p all on, its costliest path (vLLM's profile run samples with top_p=0.99 and
    top_k=vocab_size - 1)."""
    input_ids, positions, attn, kv_caches, last_tokens = step
    params = SamplingParams(temperature=1.0, top_p=0.99, top_k=model.config.vocab_size - 1)
    with torch.inference_mode():
        hidden = model(input_ids, positions, attn, kv_caches)
        logits = model.compute_logits(hidden[last_tokens])
        sample(logits, [params] * len(logits), [None] * len(logits))


def profile_activation_peak(model: Transformer, num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Measured peak bytes of the largest step, above what was allocated before it."""
    step = _dummy_step(model, num_tokens, num_seqs, block_size)
    device = step[0].device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _run_step(model, step)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with PeakTensorBytes() as meter:
        _run_step(model, step)
    return meter.peak_bytes


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers (a tied weight counts once); on the meta device
    this is what they would take."""
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


# --- The plan ---------------------------------------------------------------------------------

def plan(model, device=None, dtype=None, gpu_memory=None, engine_config: EngineConfig | None = None,
         **engine_args) -> MemoryPlan:
    """Plan the card's memory for ``model``: a preset, a directory, a ``ModelConfig`` or a loaded
    ``Transformer``; the settings are an ``EngineConfig`` or its keyword arguments
    (``gpu_memory_utilization``, ``block_size``, ``max_model_len``, ``max_num_batched_tokens``,
    ``max_num_seqs``, ``memory_limit``).

    ``gpu_memory`` (``"24GiB"``): a dry run for a card you do not have, nothing allocated.
    ``memory_limit`` (``"512MiB"``): profile on ``device`` as if it held only that much; required
    on the CPU, which has no card size of its own. Otherwise: profile the whole CUDA device.
    ``max_model_len``: None = the model's max positions; -1 = the longest that fits.
    ``tensor_parallel_size`` N > 1: the plan of one rank's card (its shard of the weights, its
    KV heads); a loaded shard plans as it is, a dry run builds rank 0's shard on the meta device.
    Raises ``MemoryPlanError`` (a ``ValueError``) when the weights, the step or one request of
    ``max_model_len`` do not fit; its message names the longest length that would.
    """
    if engine_config is not None and engine_args:
        raise ValueError("pass engine_config or its settings as keyword arguments, not both")
    config = engine_config or EngineConfig(**engine_args)
    if gpu_memory is not None and config.memory_limit is not None:
        raise ValueError("pass gpu_memory (a dry run for another card) or memory_limit (profile "
                         "this device as a smaller card), not both")
    if gpu_memory is not None and device is not None and torch.device(device).type != "meta":
        raise ValueError(f"gpu_memory plans a card you do not have, without a device; to profile "
                         f"{device} as a smaller card pass memory_limit")
    if gpu_memory is not None:
        try:
            gpu_memory = parse_size(gpu_memory)
        except ValueError as err:
            raise ValueError(f"gpu_memory: {err}") from None
    dtype = torch_dtype(dtype)
    cfg = (model.config if isinstance(model, Transformer) else
           model if isinstance(model, ModelConfig) else load_config(model))
    # a loaded model is one rank's shard already; otherwise plan rank 0's
    tp = TensorParallel() if isinstance(model, Transformer) else TensorParallel(0, config.tensor_parallel_size)
    if tp.size > 1 and gpu_memory is None:
        raise ValueError(f"tensor_parallel_size={tp.size}: profile through LLMEngine (its ranks "
                         f"profile together), or give gpu_memory for a dry run")
    check_max_model_len(config.max_model_len, cfg.max_position_embeddings)

    num_tokens = config.max_num_batched_tokens
    num_seqs = config.max_sampled_rows  # the step with the most sampled rows
    if gpu_memory is not None:
        measured = _dry_run(cfg, tp, dtype, gpu_memory, num_tokens, num_seqs, config)
    else:
        measured = _profile(model, device, dtype, config, num_tokens, num_seqs)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, measured.pop("torch_dtype"))
    result = MemoryPlan.cut(utilization=config.gpu_memory_utilization, block_size=config.block_size,
                            bytes_per_block=config.block_size * kv_bytes_per_token(tp.shard_config(cfg), kv_dtype),
                            max_model_len=None if config.max_model_len == -1 else config.max_model_len,
                            max_position_embeddings=cfg.max_position_embeddings, model=cfg.name,
                            max_num_batched_tokens=num_tokens, quantization=weight_format(config),
                            kv_cache_dtype=config.kv_cache_dtype, **measured)
    return result.checked(config.max_model_len)


def _dry_run(cfg: ModelConfig, tp: TensorParallel, dtype, card_bytes: int, num_tokens: int, num_seqs: int,
             config: EngineConfig) -> dict:
    """Weights from a model (``tp``'s shard) built (and quantized, if asked) on the meta device,
    the activation peak from the formula and the memory outside PyTorch from
    ``DRY_RUN_OUTSIDE_TORCH_BYTES``."""
    dtype = dtype or torch_dtype(cfg.torch_dtype)
    check_shapes(cfg, config.quantization, config.group_size)
    with torch.device("meta"):
        model = Transformer(cfg, tp).to(dtype)
        if config.quantization is not None:
            quantize_model(model, config.quantization, config.group_size)
    ranks = f", 1 of {tp.size} tensor-parallel ranks" if tp.size > 1 else ""
    return dict(device=f"{fmt_bytes(card_bytes)} card (dry run{ranks})", dtype=_dtype_name(dtype),
                torch_dtype=dtype, total_bytes=card_bytes, weight_bytes=model_bytes(model),
                activation_peak_bytes=activation_estimate(model.config, num_tokens, num_seqs, dtype),
                other_bytes=DRY_RUN_OUTSIDE_TORCH_BYTES, source="estimated")


def _profile(model, device, dtype, config: EngineConfig, num_tokens: int, num_seqs: int) -> dict:
    """Load (random weights: same bytes as real ones) and measure on the device."""
    memory_limit = config.memory_limit
    if isinstance(model, Transformer):
        model_device = model.device
        if device is not None and torch.device(device).type != model_device.type:
            raise ValueError(f"device {device} differs from the loaded model's device {model_device}")
        device = model_device
    device = resolve_device(device)
    if device.type == "cpu" and memory_limit is None:
        raise ValueError("memory_limit is required on the CPU (e.g. '512MiB'): it is the size of "
                         "the emulated card")
    if device.type == "cuda" and memory_limit is not None:
        memory_limit = clamp_to_device(memory_limit, torch.cuda.mem_get_info(device)[1],
                                       torch.cuda.get_device_name(device))
    if isinstance(model, Transformer) and dtype not in (None, model.dtype):
        raise ValueError(f"dtype {dtype} differs from the loaded model's {model.dtype}")
    if not isinstance(model, Transformer):
        model = load_model(model, device=device, dtype=dtype, weights="random",
                           quantization=config.quantization, group_size=config.group_size)
    weights = model_bytes(model)
    activations = profile_activation_peak(model, num_tokens, num_seqs, config.block_size)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    other = 0  # the CPU: no runtime outside PyTorch on an emulated card
    total = memory_limit
    if device.type == "cuda":
        free, device_total = torch.cuda.mem_get_info(device)
        other = (device_total - free) - torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        total = memory_limit or device_total
    if memory_limit is not None:
        name = f"{name}, limited to {fmt_bytes(memory_limit)}"
    return dict(device=name, dtype=_dtype_name(model.dtype), torch_dtype=model.dtype, total_bytes=total,
                weight_bytes=weights, activation_peak_bytes=activations, other_bytes=other,
                source="profiled")


def weight_format(config: EngineConfig) -> str:
    """The linears' weight format in words: "none", "int8" or "int4 (groups of 32)"."""
    if config.quantization == "int4":
        return f"int4 (groups of {config.group_size})"
    return config.quantization or "none"


def clamp_to_device(memory_limit: int, device_bytes: int, device_name: str) -> int:
    """``memory_limit``, or the device's reported size with a warning when the limit is above it
    (``"24GiB"`` on a "24 GB" card, which reports less)."""
    if memory_limit <= device_bytes:
        return memory_limit
    warnings.warn(f"memory_limit {fmt_bytes(memory_limit)} is more than {device_name} reports "
                  f"({fmt_bytes(device_bytes)}); planning for {fmt_bytes(device_bytes)}")
    return device_bytes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
