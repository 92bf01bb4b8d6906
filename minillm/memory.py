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
  meta device (no memory) and the activation peak comes from ``activation_estimate``
  (``source="estimated"``).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minillm.config import ModelConfig, load_config
from minillm.estimate import GiB, MiB, ceil_div, dtype_bytes, fmt_int, kv_bytes_per_token, parse_size
from minillm.hardware import describe_device, resolve_device
from minillm.loader import TORCH_DTYPES, load_model, torch_dtype
from minillm.model import AttentionMetadata, Transformer

class MemoryPlanError(ValueError):
    """The model or the requested length does not fit; ``plan`` holds the breakdown and
    ``max_model_len_that_fits`` the longest request that would (0 when nothing fits)."""

    def __init__(self, message: str, plan: "MemoryPlan", max_model_len_that_fits: int):
        super().__init__(message)
        self.plan = plan
        self.max_model_len_that_fits = max_model_len_that_fits


@dataclass(frozen=True)
class MemoryPlan:
    """Where the memory of one card goes: weights, activations, other overhead, KV blocks."""

    model: str
    device: str
    dtype: str
    total_bytes: int  # the card (or the emulated card)
    utilization: float  # gpu_memory_utilization
    weight_bytes: int
    activation_peak_bytes: int  # peak of the largest step, above the weights
    other_bytes: int  # outside PyTorch: CUDA context, driver, other processes (0 on CPU, dry run)
    block_size: int
    bytes_per_block: int
    num_blocks: int
    max_model_len: int
    max_position_embeddings: int
    max_num_batched_tokens: int
    source: str  # "profiled" (measured here) or "estimated" (dry run)

    @property
    def profiled(self) -> bool:
        return self.source == "profiled"

    @property
    def budget_bytes(self) -> int:
        """What the engine may use: total × utilization."""
        return int(self.total_bytes * self.utilization)

    @property
    def kv_budget_bytes(self) -> int:
        """The budget minus weights, activation peak and other overhead (negative: nothing fits)."""
        return self.budget_bytes - self.weight_bytes - self.activation_peak_bytes - self.other_bytes

    @property
    def kv_cache_bytes(self) -> int:
        """What the KV blocks take: whole blocks only."""
        return self.num_blocks * self.bytes_per_block

    @property
    def unused_bytes(self) -> int:
        """The rest of the card: outside the budget, and the last partial block."""
        used = self.weight_bytes + self.activation_peak_bytes + self.other_bytes + self.kv_cache_bytes
        return self.total_bytes - used

    @property
    def tokens(self) -> int:
        """KV slots in the block pool."""
        return self.num_blocks * self.block_size

    def blocks_for(self, context: int) -> int:
        """Blocks one request of ``context`` tokens holds."""
        return ceil_div(context, self.block_size)

    def fits(self, context: int) -> bool:
        """Whether one request of ``context`` tokens fits in the block pool."""
        return self.blocks_for(context) <= self.num_blocks

    def concurrent_requests(self, context: int) -> int:
        """How many requests of ``context`` tokens the pool holds at once."""
        if context < 1:
            raise ValueError(f"context must be >= 1, got {context}")
        return self.num_blocks // self.blocks_for(context)

    def longest_fitting_len(self) -> int:
        """The largest max_model_len that fits, found by binary search over lengths as vLLM does
        for ``max_model_len=-1`` (0 when not even one token fits)."""
        shortest, longest = 0, self.max_position_embeddings
        while shortest < longest:
            middle = (shortest + longest + 1) // 2
            if self.fits(middle):
                shortest = middle
            else:
                longest = middle - 1
        return shortest

    def as_dict(self) -> dict:
        """Fields and derived numbers, for JSON records."""
        derived = {name: getattr(self, name) for name in
                   ("profiled", "budget_bytes", "kv_budget_bytes", "kv_cache_bytes", "unused_bytes", "tokens")}
        return {**dataclasses.asdict(self), **derived}

    def rows(self, contexts=(1024, 4096, 8192)) -> list[tuple[str, str]]:
        """The breakdown as (label, value) rows, integers with thousands separators."""

        def size(n: int) -> str:
            return f"{fmt_int(n)} B ({_human(n)})"

        rows = [("model", self.model), ("device", self.device), ("dtype", self.dtype),
                ("source", self.source),
                ("total", size(self.total_bytes)),
                (f"budget (x {self.utilization})", size(self.budget_bytes)),
                ("weights", size(self.weight_bytes)),
                (f"activation peak ({fmt_int(self.max_num_batched_tokens)} tokens)",
                 size(self.activation_peak_bytes)),
                ("other overhead", size(self.other_bytes)),
                ("KV budget", size(self.kv_budget_bytes)),
                (f"bytes per block ({self.block_size} tokens)", fmt_int(self.bytes_per_block)),
                ("KV blocks", fmt_int(self.num_blocks)),
                ("KV tokens", fmt_int(self.tokens)),
                ("max_model_len", fmt_int(self.max_model_len))]
        rows += [(f"concurrent requests @ctx {fmt_int(c)}", fmt_int(self.concurrent_requests(c)))
                 for c in contexts]
        return rows


# --- The activation peak: estimated (dry run) or measured -------------------------------------

def activation_estimate(cfg: ModelConfig, num_tokens: int, num_sampled_rows: int, dtype) -> int:
    """Activation bytes of one step of ``num_tokens`` tokens, by formula (dry-run plans).

    The largest of three moments of the step, each counting what is alive at once:
    attention: residual and normed input ``[T, h]``, q/k/v ``[T, q + 2·kv]``, output ``[T, q]``;
    MLP: residual and normed input, gate, up and their product ``[T, I]`` each;
    sampling: the final hidden states and, for the sampled rows, fp32 logits and probabilities
    ``[R, V]`` each. Attention is assumed fused (no ``[T, T]`` scores), as the GPU kernels are.
    """
    t, h, b = num_tokens, cfg.hidden_size, dtype_bytes(dtype)
    attention = t * (2 * h + 2 * cfg.q_size + 2 * cfg.kv_size) * b
    mlp = t * (2 * h + 3 * cfg.intermediate_size) * b
    sampling = t * h * b + 2 * num_sampled_rows * cfg.vocab_size * 4
    return max(attention, mlp, sampling)


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the ``with`` block and alive at once (the CPU's
    peak meter).

    Every storage an aten op allocates (an output whose storage is not one of the op's inputs')
    counts from its creation until it is freed (a weakref finalizer on the storage). On CUDA the
    caching allocator keeps this count itself (``torch.cuda.max_memory_allocated``); the CPU has no
    such counter, so this one sees what the allocator sees, except scratch space that a kernel
    frees before it returns.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}  # data pointer of each live storage -> its bytes

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key in self._sizes or not storage.nbytes():
                continue
            if any(t.untyped_storage().data_ptr() == key for t in _tensors((args, kwargs))):
                continue  # a view or an in-place result: memory made before, or counted already
            self._sizes[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            weakref.finalize(storage, self._free, key)
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
    ``num_tokens`` evenly, each prefilled from scratch into its own blocks of a KV cache just big
    enough for them."""
    cfg, device = model.config, model.device
    lengths = [num_tokens // num_seqs] * num_seqs
    lengths[-1] += num_tokens % num_seqs
    blocks = [ceil_div(n, block_size) for n in lengths]
    first_blocks = [0, *itertools.accumulate(blocks)][:-1]
    block_tables = torch.zeros(num_seqs, max(blocks), dtype=torch.int32)
    for i, (first, n) in enumerate(zip(first_blocks, blocks)):
        block_tables[i, :n] = torch.arange(first, first + n)
    cache = torch.zeros(cfg.num_layers, 2, sum(blocks), block_size, cfg.num_kv_heads, cfg.head_dim,
                        dtype=model.dtype, device=device)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    attn = AttentionMetadata(
        cu_seqlens_q=cu_seqlens.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat([first * block_size + torch.arange(n)
                                for first, n in zip(first_blocks, lengths)]).to(device),
        max_query_len=max(lengths))
    input_ids = torch.randint(cfg.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    kv_caches = [(cache[layer, 0], cache[layer, 1]) for layer in range(cfg.num_layers)]
    last_tokens = (cu_seqlens[1:] - 1).long().to(device)
    return input_ids, positions, attn, kv_caches, last_tokens


def _run_step(model: Transformer, step) -> None:
    """Forward, logits of each sequence's last token, and their probabilities (the sampler's copy)."""
    input_ids, positions, attn, kv_caches, last_tokens = step
    with torch.inference_mode():
        hidden = model(input_ids, positions, attn, kv_caches)
        logits = model.compute_logits(hidden[last_tokens])
        torch.softmax(logits, dim=-1)


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

def plan(model, device=None, gpu_memory_utilization: float = 0.92, block_size: int = 16,
         max_model_len: int | None = None, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
         dtype=None, gpu_memory=None, memory_limit=None) -> MemoryPlan:
    """Plan the card's memory for ``model``: a preset, a directory, a ``ModelConfig`` or a loaded
    ``Transformer``.

    ``gpu_memory`` (``"24GiB"``): a dry run for a card you do not have, nothing allocated.
    ``memory_limit`` (``"512MiB"``): profile on ``device`` as if it held only that much; required
    on the CPU, which has no card size of its own. Otherwise: profile the whole CUDA device.
    ``max_model_len``: None = the model's max positions; -1 = the longest that fits.
    Raises ``MemoryPlanError`` (a ``ValueError``) when the weights, the step or one request of
    ``max_model_len`` do not fit; its message names the longest length that would.
    """
    for name, value in (("block_size", block_size), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_num_seqs", max_num_seqs)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < -1
                                      or max_model_len == 0):
        raise ValueError(f"max_model_len must be a positive integer, -1 (the longest that fits) "
                         f"or None (the model's max positions), got {max_model_len!r}")
    if gpu_memory is not None and memory_limit is not None:
        raise ValueError("pass gpu_memory (a dry run for another card) or memory_limit (profile "
                         "this device as a smaller card), not both")
    if gpu_memory is not None and device is not None and torch.device(device).type != "meta":
        raise ValueError(f"gpu_memory plans a card you do not have, without a device; to profile "
                         f"{device} as a smaller card pass memory_limit")
    card_bytes = None
    for name, size in (("gpu_memory", gpu_memory), ("memory_limit", memory_limit)):
        if size is not None:
            try:
                card_bytes = parse_size(size)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
    dtype = torch_dtype(dtype)
    cfg = (model.config if isinstance(model, Transformer) else
           model if isinstance(model, ModelConfig) else load_config(model))
    if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len:,} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings:,}")

    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    if gpu_memory is not None:
        measured = _dry_run(cfg, dtype, card_bytes, max_num_batched_tokens, num_seqs)
    else:
        measured = _profile(model, device, dtype, card_bytes, max_num_batched_tokens,
                            num_seqs, block_size)
    bytes_per_block = block_size * kv_bytes_per_token(cfg, measured["dtype"])
    kv_budget = (int(measured["total_bytes"] * gpu_memory_utilization) - measured["weight_bytes"]
                 - measured["activation_peak_bytes"] - measured["other_bytes"])
    result = MemoryPlan(model=cfg.name, utilization=gpu_memory_utilization, block_size=block_size,
                        bytes_per_block=bytes_per_block, num_blocks=max(kv_budget, 0) // bytes_per_block,
                        max_model_len=max_model_len or cfg.max_position_embeddings,
                        max_position_embeddings=cfg.max_position_embeddings,
                        max_num_batched_tokens=max_num_batched_tokens, **measured)
    return _check_fit(result, max_model_len)


def _dry_run(cfg: ModelConfig, dtype, card_bytes: int, num_tokens: int, num_seqs: int) -> dict:
    """Weights from a model built on the meta device, the activation peak from the formula; the
    overhead outside PyTorch is unknown without the card and counted as 0."""
    dtype = dtype or torch_dtype(cfg.torch_dtype)
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    return dict(device=f"{_human(card_bytes)} card (dry run)", dtype=_dtype_name(dtype),
                total_bytes=card_bytes, weight_bytes=model_bytes(model),
                activation_peak_bytes=activation_estimate(cfg, num_tokens, num_seqs, dtype),
                other_bytes=0, source="estimated")


def _profile(model, device, dtype, memory_limit: int | None, num_tokens: int, num_seqs: int,
             block_size: int) -> dict:
    """Load (random weights: same bytes as real ones) and measure on the device."""
    if isinstance(model, Transformer):
        model_device = model.device
        if device is not None and torch.device(device).type != model_device.type:
            raise ValueError(f"device {device} differs from the loaded model's device {model_device}")
        device = model_device
    device = resolve_device(device)
    if device.type == "cpu" and memory_limit is None:
        raise ValueError("memory_limit is required on the CPU (e.g. '512MiB'): it is the size of "
                         "the emulated card")
    if device.type == "cuda" and (memory_limit or 0) > torch.cuda.mem_get_info(device)[1]:
        raise ValueError(f"memory_limit {memory_limit:,} B exceeds the device's "
                         f"{torch.cuda.mem_get_info(device)[1]:,} B")
    if isinstance(model, Transformer) and dtype not in (None, model.dtype):
        raise ValueError(f"dtype {dtype} differs from the loaded model's {model.dtype}")
    if not isinstance(model, Transformer):
        model = load_model(model, device=device, dtype=dtype, weights="random")
    weights = model_bytes(model)
    activations = profile_activation_peak(model, num_tokens, num_seqs, block_size)
    name = describe_device(device).name
    other = 0  # the CPU: no runtime outside PyTorch on an emulated card
    total = memory_limit
    if device.type == "cuda":
        free, device_total = torch.cuda.mem_get_info(device)
        other = (device_total - free) - torch.cuda.memory_reserved(device)
        torch.cuda.empty_cache()
        total = memory_limit or device_total
    if memory_limit is not None:
        name = f"{name}, limited to {_human(memory_limit)}"
    return dict(device=name, dtype=_dtype_name(model.dtype), total_bytes=total,
                weight_bytes=weights, activation_peak_bytes=activations, other_bytes=other,
                source="profiled")


def _human(n: int) -> str:
    """``24 GiB``, ``512 MiB``, ``6.86 GiB``: GiB from 1 GiB up, else MiB."""
    unit, scale = ("GiB", GiB) if abs(n) >= GiB else ("MiB", MiB)
    return f"{round(n / scale, 2):g} {unit}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_fit(result: MemoryPlan, max_model_len: int | None) -> MemoryPlan:
    """The weights must fit, then one KV block, then one request of ``max_model_len`` (-1: the
    longest that fits)."""
    if result.weight_bytes > result.budget_bytes:
        raise MemoryPlanError(
            f"the weights alone ({_human(result.weight_bytes)}) do not fit in the budget of "
            f"{_human(result.budget_bytes)} ({_human(result.total_bytes)} x {result.utilization}): "
            f"use a bigger card or a smaller dtype", result, 0)
    longest = result.longest_fitting_len()
    if longest == 0:
        raise MemoryPlanError(
            f"no room for one KV block: weights {_human(result.weight_bytes)} + activation peak "
            f"{_human(result.activation_peak_bytes)} + other {_human(result.other_bytes)} leave "
            f"{_human(result.kv_budget_bytes)} of the {_human(result.budget_bytes)} budget, a block "
            f"needs {_human(result.bytes_per_block)}; lower max_num_batched_tokens or raise "
            f"gpu_memory_utilization", result, 0)
    if max_model_len == -1:
        return dataclasses.replace(result, max_model_len=longest)
    if not result.fits(result.max_model_len):
        needed = result.blocks_for(result.max_model_len) * result.bytes_per_block
        raise MemoryPlanError(
            f"one request of max_model_len {result.max_model_len:,} needs {_human(needed)} of KV but "
            f"the KV blocks hold {_human(result.kv_cache_bytes)} ({result.tokens:,} tokens); the "
            f"longest max_model_len that fits is {longest:,} (or pass -1 to use it)", result, longest)
    return result


# --- python -m minillm plan ---------------------------------------------------------------------

def add_cli(subparsers) -> None:
    """Register ``plan`` on the ``python -m minillm`` subparsers."""
    cmd = subparsers.add_parser("plan", help="where a card's memory goes: weights, activations, KV blocks")
    cmd.add_argument("--model", required=True, help="preset name or directory with config.json")
    cmd.add_argument("--gpu-memory", help="dry run for a card you do not have, e.g. 24GiB, 80GB")
    cmd.add_argument("--memory-limit", help="profile this device as a card of this size, e.g. 512MiB "
                                            "(required on the CPU)")
    cmd.add_argument("--device", help="cpu or cuda (default: $MINILLM_DEVICE, else CUDA if present)")
    cmd.add_argument("--util", type=float, default=0.92, help="gpu_memory_utilization (default 0.92)")
    cmd.add_argument("--max-model-len", type=int, help="default: the model's max positions; -1: the "
                                                       "longest that fits")
    cmd.add_argument("--block-size", type=int, default=16)
    cmd.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="tokens of the largest step, profiled (default 2048)")
    cmd.add_argument("--max-num-seqs", type=int, default=256)
    cmd.add_argument("--dtype", choices=sorted(TORCH_DTYPES), help="default: the model's")
    cmd.add_argument("--json", action="store_true", help="print JSON instead of a table")
    cmd.set_defaults(func=run_cli)


def run_cli(args) -> int:
    """Print the plan; exit code 2 with a one-line reason when it does not fit."""
    try:
        result = plan(args.model, device=args.device, gpu_memory_utilization=args.util,
                      block_size=args.block_size, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      max_num_seqs=args.max_num_seqs, dtype=args.dtype,
                      gpu_memory=args.gpu_memory, memory_limit=args.memory_limit)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        rows = result.rows()
        width = max(len(label) for label, _ in rows)
        print("\n".join(f"{label:<{width}}  {value}" for label, value in rows))
    return 0
