"""The ledger (chapter 为什么服务大模型难): back-of-envelope numbers from a model's config.

Pure Python, no torch: every estimate in the book is computed here from a ``ModelConfig`` and a
few hardware numbers, so prose, labs and tests quote the same arithmetic. Units: bytes, FLOPs,
seconds; ``GB`` = 1e9 bytes, ``GiB`` = 2**30 bytes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from minillm.config import ModelConfig

GB = 10**9
GiB = 2**30
MiB = 2**20
KiB = 2**10

DTYPE_BYTES = {"float64": 8, "fp64": 8, "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2,
               "float16": 2, "fp16": 2, "float8": 1, "fp8": 1, "int8": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name (``"bf16"``, ``"float32"``) or a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": GB, "tb": 10**12,
          "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40}


def parse_size(text: str | int | float) -> int:
    """Bytes in ``"24GiB"``, ``"80GB"``, ``"512MiB"`` or a plain number; positive only."""
    if isinstance(text, (int, float)):
        value, unit = float(text), "b"
    else:
        match = _SIZE.match(str(text))
        if not match:
            raise ValueError(f"cannot read the size {text!r}: write a positive number with a unit, "
                             f"e.g. 24GiB, 80GB, 512MiB")
        value, unit = float(match.group(1)), (match.group(2) or "b").lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return size


# --- Parameters and weights -------------------------------------------------------------------

def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, counted exactly (biases, norms, tied or untied embeddings)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = 2 * h * cfg.q_size + 2 * h * cfg.kv_size  # q, o and k, v projections
    attention += (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + h * cfg.o_bias
    mlp = 3 * h * cfg.intermediate_size + (2 * cfg.intermediate_size + h) * cfg.mlp_bias
    norms = 2 * h + 2 * d * cfg.qk_norm
    return {
        "embedding": cfg.vocab_size * h,
        "attention": cfg.num_layers * attention,
        "mlp": cfg.num_layers * mlp,
        "norms": cfg.num_layers * norms + h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
    }


def param_count(cfg: ModelConfig) -> int:
    """Total parameters, as ``sum(p.numel() for p in model.parameters())`` would count them."""
    return sum(param_breakdown(cfg).values())


def matmul_param_count(cfg: ModelConfig) -> int:
    """Weights that take part in a matrix multiply per token: every linear layer and the output
    projection (tied or not); the input embedding is a table lookup, norms and biases are adds."""
    h = cfg.hidden_size
    per_layer = 2 * h * cfg.q_size + 2 * h * cfg.kv_size + 3 * h * cfg.intermediate_size
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def weight_bytes(cfg: ModelConfig, dtype="bf16") -> int:
    """Bytes of all weights stored in ``dtype``."""
    return param_count(cfg) * dtype_bytes(dtype)


# --- FLOPs ------------------------------------------------------------------------------------

def matmul_flops_per_token(cfg: ModelConfig) -> int:
    """One multiply-add (2 FLOPs) per matmul weight per token."""
    return 2 * matmul_param_count(cfg)


def attention_flops_per_token(cfg: ModelConfig, ctx: int) -> int:
    """QK^T and PV for one new token attending to ``ctx`` positions: 4·L·c·n_h·d."""
    return 4 * cfg.num_layers * ctx * cfg.num_heads * cfg.head_dim


def prefill_attention_flops(cfg: ModelConfig, n: int) -> int:
    """Causal attention of an ``n``-token prompt: token i attends to i+1 positions."""
    return attention_flops_per_token(cfg, 1) * n * (n + 1) // 2


# --- KV cache ---------------------------------------------------------------------------------

def kv_bytes_per_token(cfg: ModelConfig, dtype="bf16") -> int:
    """K and V for every layer and KV head: 2·L·n_kv·d·bytes."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_bytes(cfg: ModelConfig, tokens: int, dtype="bf16") -> int:
    """KV bytes of ``tokens`` tokens (one request of that context, or many summed)."""
    return tokens * kv_bytes_per_token(cfg, dtype)


def preallocation_waste(reserved_tokens: int, used_tokens: int) -> float:
    """Share of a pre-allocated KV reservation that holds no token."""
    if not 0 <= used_tokens <= reserved_tokens or reserved_tokens <= 0:
        raise ValueError(f"need 0 <= used ({used_tokens}) <= reserved ({reserved_tokens}), reserved > 0")
    return 1 - used_tokens / reserved_tokens


# --- Roofline: prefill and decode -------------------------------------------------------------

def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOP per byte at which a device turns from bandwidth-bound to compute-bound (P / W)."""
    return peak_flops / bandwidth


def attainable_flops(intensity: float, peak_flops: float, bandwidth: float) -> float:
    """The roofline: min(P, I·W)."""
    return min(peak_flops, intensity * bandwidth)


@dataclass(frozen=True)
class PrefillEstimate:
    """One forward over an ``n``-token prompt."""

    n: int
    linear_flops: int
    attention_flops: int
    weight_bytes: int
    kv_write_bytes: int

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        """Linear FLOPs per weight byte: about n (the seeds' measure)."""
        return self.linear_flops / self.weight_bytes

    def time_floor(self, peak_flops: float, bandwidth: float) -> float:
        """Seconds no device with these ceilings can beat: max(F / P, M / W)."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)


def prefill(cfg: ModelConfig, n: int, dtype="bf16") -> PrefillEstimate:
    """The ledger of prefilling one ``n``-token prompt."""
    return PrefillEstimate(n, n * matmul_flops_per_token(cfg), prefill_attention_flops(cfg, n),
                           weight_bytes(cfg, dtype), kv_bytes(cfg, n, dtype))


def prefill_crossover(cfg: ModelConfig, peak_flops: float, bandwidth: float, dtype="bf16") -> int:
    """The shortest prompt whose prefill takes longer to compute than to read (F/P >= M/W):
    below it prefill is bandwidth-bound, from it on compute-bound (chapter 预填充)."""
    def compute_bound(n):
        est = prefill(cfg, n, dtype)
        return est.flops / peak_flops >= est.bytes / bandwidth

    high = 1
    while not compute_bound(high):
        high *= 2
    low = high // 2  # not compute-bound (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if compute_bound(mid) else (mid, high)
    return high


@dataclass(frozen=True)
class DecodeEstimate:
    """One decode step: ``batch`` requests each add one token at context ``ctx``."""

    batch: int
    ctx: int
    weight_bytes: int
    kv_read_bytes: int
    linear_flops: int
    attention_flops: int
    bandwidth: float

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes

    @property
    def kv_intensity(self) -> float:
        """Attention FLOPs per KV byte read: n_h / n_kv in 2-byte KV, whatever the batch."""
        return self.attention_flops / self.kv_read_bytes

    @property
    def time_floor(self) -> float:
        """Seconds to read the step's bytes at ``bandwidth``."""
        return self.bytes / self.bandwidth

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on aggregate decode tok/s: batch / time floor."""
        return self.batch / self.time_floor


def decode_step(cfg: ModelConfig, batch: int, ctx: int, bandwidth: float, dtype="bf16") -> DecodeEstimate:
    """The ledger of one decode step for ``batch`` requests at context ``ctx``, bandwidth W B/s."""
    if batch < 1 or ctx < 1 or bandwidth <= 0:
        raise ValueError(f"need batch >= 1, ctx >= 1, bandwidth > 0; got {batch}, {ctx}, {bandwidth}")
    return DecodeEstimate(batch, ctx, weight_bytes(cfg, dtype), batch * kv_bytes(cfg, ctx, dtype),
                          batch * matmul_flops_per_token(cfg),
                          batch * attention_flops_per_token(cfg, ctx), bandwidth)


# --- Memory budget ----------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryBudget:
    """GPU memory × utilization − weights: what is left for KV (and activations, overhead)."""

    gpu_memory: int
    utilization: float
    weight_bytes: int
    kv_bytes_per_token: int

    @property
    def usable(self) -> float:
        return self.gpu_memory * self.utilization

    @property
    def left(self) -> float:
        """Bytes left after weights (negative when the weights alone do not fit)."""
        return self.usable - self.weight_bytes

    @property
    def weights_fit(self) -> bool:
        return self.left > 0

    @property
    def tokens(self) -> float:
        """Upper bound on KV tokens if everything left went to KV."""
        return max(self.left, 0) / self.kv_bytes_per_token

    def concurrent_requests(self, ctx: int) -> float:
        """How many requests of context ``ctx`` that many tokens hold."""
        return self.tokens / ctx


def memory_budget(cfg: ModelConfig, gpu_memory, utilization: float = 0.92, dtype="bf16",
                  kv_dtype=None) -> MemoryBudget:
    """The budget on a card of ``gpu_memory`` bytes (or ``"24GiB"``) at ``utilization``."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    return MemoryBudget(parse_size(gpu_memory), utilization, weight_bytes(cfg, dtype),
                        kv_bytes_per_token(cfg, kv_dtype or dtype))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def paged_waste_tokens(lengths, block_size: int) -> int:
    """Slots allocated but unused when each request takes whole blocks: < one block each."""
    return sum(ceil_div(n, block_size) * block_size - n for n in lengths)


def fmt_int(x: float) -> str:
    """``8,030,261,248``: integers with thousands separators, as the book prints them."""
    return f"{round(x):,}"


def fmt_bytes(x: float, unit: str = "GiB", digits: int = 2) -> str:
    """``14.96 GiB``, ``16.06 GB``, ``128 KiB``."""
    scale = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "KB": 10**3, "MB": 10**6, "GB": GB}[unit]
    return f"{x / scale:,.{digits}f} {unit}"
