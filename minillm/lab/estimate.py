"""The ledger (chapter 为什么服务大模型难): back-of-envelope numbers from a model's config.

Pure Python, no torch: every estimate in the book is computed here from a ``ModelConfig`` and a
few hardware numbers, so prose, labs and tests quote the same arithmetic. Units: bytes, FLOPs,
seconds; ``GB`` = 1e9 bytes, ``GiB`` = 2**30 bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from minillm.engine.config import ModelConfig, tensor_parallel_shard
from minillm.engine.memory_plan import MemoryPlan
from minillm.engine.units import (GB, KiB, GiB, MiB, ceil_div, fmt_bytes,  # noqa: F401 (the ledger's units)
                                  fmt_int, parse_size)

DTYPE_BYTES = {"float64": 8, "fp64": 8, "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2,
               "float16": 2, "fp16": 2, "float8": 1, "fp8": 1, "float8_e4m3fn": 1, "int8": 1}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a dtype name (``"bf16"``, ``"float32"``) or a ``torch.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    return DTYPE_BYTES[name]


# --- Parameters and weights -------------------------------------------------------------------

def param_breakdown(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by part, counted exactly (biases, norms, tied or untied embeddings); ``mlp``
    holds every expert of an MoE model, ``router`` (MoE models only) its routers' weights."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = 2 * h * cfg.q_size + 2 * h * cfg.kv_size  # q, o and k, v projections
    attention += (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + h * cfg.o_bias
    norms = 2 * h + 2 * d * cfg.qk_norm
    router = {"router": cfg.num_layers * cfg.num_experts * h} if cfg.is_moe else {}
    return {
        "embedding": cfg.vocab_size * h,
        "attention": cfg.num_layers * attention,
        "mlp": cfg.num_layers * experts_per_layer(cfg) * expert_params(cfg),
        **router,
        "norms": cfg.num_layers * norms + h,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
    }


def experts_per_layer(cfg: ModelConfig) -> int:
    """E: the SwiGLU MLPs of a layer (1 in a dense model)."""
    return max(cfg.num_experts, 1)


def experts_per_token(cfg: ModelConfig) -> int:
    """k: the MLPs each token runs through in a layer (1 in a dense model)."""
    return max(cfg.num_experts_per_tok, 1)


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one SwiGLU MLP (one expert of an MoE layer): gate, up and down, and biases."""
    inner, h = cfg.intermediate_size, cfg.hidden_size
    return 3 * h * inner + (2 * inner + h) * cfg.mlp_bias


def param_count(cfg: ModelConfig) -> int:
    """Total parameters, as ``sum(p.numel() for p in model.parameters())`` would count them."""
    return sum(param_breakdown(cfg).values())


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: all but the experts its router did not pick (k of E per
    layer); the total in a dense model."""
    idle = experts_per_layer(cfg) - experts_per_token(cfg)
    return param_count(cfg) - cfg.num_layers * idle * expert_params(cfg)


def matmul_param_count(cfg: ModelConfig) -> int:
    """Weights that take part in a matrix multiply per token: every linear layer it runs (in an
    MoE layer the router and the k experts picked) and the output projection (tied or not); the
    input embedding is a table lookup, norms and biases are adds."""
    h = cfg.hidden_size
    mlp = experts_per_token(cfg) * 3 * h * cfg.intermediate_size + cfg.num_experts * h
    per_layer = 2 * h * cfg.q_size + 2 * h * cfg.kv_size + mlp
    return cfg.num_layers * per_layer + cfg.vocab_size * h


def matmul_weight_bytes(cfg: ModelConfig, tokens: int = 1, dtype="bf16") -> float:
    """Bytes of the matmul weights a forward of ``tokens`` tokens reads (:func:`matmul_param_count`
    in ``dtype``): in an MoE model the experts they are expected to touch, not only one token's k
    (:func:`experts_touched`)."""
    further = experts_touched(cfg, tokens) - experts_per_token(cfg)
    matmul_expert = 3 * cfg.hidden_size * cfg.intermediate_size
    return (matmul_param_count(cfg) + cfg.num_layers * further * matmul_expert) * dtype_bytes(dtype)


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of every linear layer the engine runs, every expert's and the output layer
    included (an MoE router is not one: quantization leaves it in the model's dtype)."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    layer = [(cfg.q_size, h), (cfg.kv_size, h), (cfg.kv_size, h), (h, cfg.q_size)]
    layer += [(inner, h), (inner, h), (h, inner)] * experts_per_layer(cfg)
    return layer * cfg.num_layers + [(cfg.vocab_size, h)]


def quantized_linear_bytes(out_features: int, in_features: int, quantization: str, group_size: int = 32) -> int:
    """Bytes of one linear's weights in a quantized format (minillm.engine.quantization): int8,
    one byte per weight and a float32 scale per row; int4, half a byte per weight and two 2-byte
    numbers (scale, minimum) per group of ``group_size``."""
    if quantization == "int8":
        return out_features * in_features + 4 * out_features
    if quantization == "int4":
        return out_features * in_features // 2 + 4 * out_features * in_features // group_size
    raise ValueError(f"quantization must be 'int8' or 'int4', got {quantization!r}")


def weight_bytes(cfg: ModelConfig, dtype="bf16", quantization: str | None = None, group_size: int = 32) -> int:
    """Bytes of all weights stored in ``dtype`` (every expert: they all live on the card); with
    ``quantization`` ("int8", "int4"), every linear of the layers in that format, the output
    layer in int8 (it then no longer shares the embedding's memory) and the rest (embedding
    table, norms, routers, biases) in ``dtype``."""
    if quantization is None:
        return param_count(cfg) * dtype_bytes(dtype)
    parts = param_breakdown(cfg)
    rest = parts["embedding"] + parts["norms"] + parts.get("router", 0)
    biases = (cfg.q_size + 2 * cfg.kv_size) * cfg.qkv_bias + cfg.hidden_size * cfg.o_bias
    biases += (2 * cfg.intermediate_size + cfg.hidden_size) * cfg.mlp_bias * experts_per_layer(cfg)
    *layers, (vocab, hidden) = linear_shapes(cfg)
    linears = sum(quantized_linear_bytes(n, k, quantization, group_size) for n, k in layers)
    linears += quantized_linear_bytes(vocab, hidden, "int8")
    return (rest + cfg.num_layers * biases) * dtype_bytes(dtype) + linears


def expert_bytes(cfg: ModelConfig, dtype="bf16", quantization: str | None = None, group_size: int = 32) -> int:
    """Bytes of one expert (one SwiGLU MLP) as stored: see :func:`weight_bytes`."""
    h, inner = cfg.hidden_size, cfg.intermediate_size
    biases = (2 * inner + h) * cfg.mlp_bias * dtype_bytes(dtype)
    if quantization is None:
        return expert_params(cfg) * dtype_bytes(dtype)
    shapes = [(inner, h), (inner, h), (h, inner)]
    return biases + sum(quantized_linear_bytes(n, k, quantization, group_size) for n, k in shapes)


def experts_touched(cfg: ModelConfig, batch: int) -> float:
    """Expected distinct experts a layer runs for ``batch`` tokens if the router picked each
    token's k of E uniformly: E·(1 − (1 − k/E)^B). k at one token, towards E as B grows; 1 in a
    dense model."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    e, k = experts_per_layer(cfg), experts_per_token(cfg)
    return e * (1 - (1 - k / e) ** batch)


def weight_bytes_read(cfg: ModelConfig, batch: int, dtype="bf16", quantization: str | None = None,
                      group_size: int = 32) -> float:
    """Weight bytes a decode step of ``batch`` tokens reads: all of them but the experts no token
    was routed to (:func:`experts_touched`, uniform routing); all of them in a dense model."""
    idle = experts_per_layer(cfg) - experts_touched(cfg, batch)
    return (weight_bytes(cfg, dtype, quantization, group_size)
            - cfg.num_layers * idle * expert_bytes(cfg, dtype, quantization, group_size))


def decode_read_bytes(cfg: ModelConfig, dtype: str = "bf16", quantization: str | None = None, group_size: int = 32,
                      experts: float | None = None) -> float:
    """Weight bytes a decode step really reads: the ledger's ``weight_bytes`` less the embedding
    table, which a step only looks rows up in, unless the output layer is that same table (tied
    and unquantized); in an MoE model whose step runs ``experts`` distinct experts per layer
    (:func:`experts_touched`, or counted), less the experts no token was routed to."""
    table = param_breakdown(cfg)["embedding"] * dtype_bytes(dtype)
    tied_and_read = cfg.tie_word_embeddings and quantization is None
    idle = 0 if experts is None else cfg.num_layers * (experts_per_layer(cfg) - experts)
    return (weight_bytes(cfg, dtype, quantization, group_size) - (0 if tied_and_read else table)
            - idle * expert_bytes(cfg, dtype, quantization, group_size))


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
class Floor:
    """The one lower bound of the book on an operation's time: ``max(F / P, M / W)``.

    ``F`` FLOPs and ``M`` bytes, as the engine does and moves them; ``P`` FLOP/s and ``W`` bytes/s,
    the device's two ceilings. ``bound`` names the ceiling that binds: ``"compute"`` when the work
    takes longer to compute than its bytes take to move, else ``"memory"``.
    """

    flops: float
    bytes: float
    peak_flops: float
    bandwidth: float

    @property
    def compute_seconds(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_seconds(self) -> float:
        return self.bytes / self.bandwidth

    @property
    def seconds(self) -> float:
        return max(self.compute_seconds, self.memory_seconds)

    @property
    def bound(self) -> str:
        return "compute" if self.compute_seconds >= self.memory_seconds else "memory"

    @property
    def intensity(self) -> float:
        """FLOP per byte moved; the work is compute-bound when it exceeds the ridge point P / W."""
        return self.flops / self.bytes

    def share_of(self, measured_seconds: float) -> float:
        """The floor as a share of a measured time: 1 means the measurement hit the ceiling."""
        return self.seconds / measured_seconds


def roofline_floor(flops: float, nbytes: float, peak_flops: float, bandwidth: float) -> Floor:
    """``Floor`` of ``flops`` FLOPs moving ``nbytes`` bytes on a device of ``peak_flops`` FLOP/s and
    ``bandwidth`` bytes/s."""
    if flops < 0 or nbytes <= 0 or peak_flops <= 0 or bandwidth <= 0:
        raise ValueError(f"need flops >= 0, bytes, peak_flops and bandwidth > 0; got {flops}, "
                         f"{nbytes}, {peak_flops}, {bandwidth}")
    return Floor(flops, nbytes, peak_flops, bandwidth)


@dataclass(frozen=True)
class PrefillEstimate:
    """One forward over ``sequences`` prompts of ``n`` tokens in all, as the engine runs it: every
    token through every layer, the output layer only for each sequence's last token. A chunk of a
    prompt (:func:`prefill_chunk`) also reads back the KV of the positions before it."""

    n: int
    linear_flops: int
    attention_flops: int
    weight_bytes: int
    kv_write_bytes: int
    kv_read_bytes: int = 0

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_write_bytes + self.kv_read_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (weights read, KV written and read back)."""
        return self.flops / self.bytes

    def floor(self, peak_flops: float, bandwidth: float) -> Floor:
        return roofline_floor(self.flops, self.bytes, peak_flops, bandwidth)

    def time_floor(self, peak_flops: float, bandwidth: float) -> float:
        """Seconds no device with these ceilings can beat: max(F / P, M / W)."""
        return self.floor(peak_flops, bandwidth).seconds


def output_layer_flops(cfg: ModelConfig) -> int:
    """The output projection (hidden -> vocabulary) for one token."""
    return 2 * cfg.vocab_size * cfg.hidden_size


def prefill(cfg: ModelConfig, n: int, dtype="bf16", sequences: int = 1) -> PrefillEstimate:
    """The ledger of prefilling ``n`` prompt tokens split into ``sequences`` equal prompts (one
    by default): the layers for all ``n`` tokens, the output layer for ``sequences`` of them."""
    if n < 0 or sequences < 1 or (n and sequences > n):
        raise ValueError(f"need n >= 0 and 1 <= sequences <= n, got sequences={sequences}, n={n}")
    layers = n * (matmul_flops_per_token(cfg) - output_layer_flops(cfg))
    attention = sequences * prefill_attention_flops(cfg, n // sequences)
    logits = min(sequences, n) * output_layer_flops(cfg)  # no prompt token, no logits
    return PrefillEstimate(n, layers + logits, attention,
                           weight_bytes(cfg, dtype), kv_bytes(cfg, n, dtype))


def prefill_chunk(cfg: ModelConfig, start: int, end: int, prompt_len: int, dtype="bf16") -> PrefillEstimate:
    """Positions [start, end) of a ``prompt_len``-token prompt whose first ``start`` positions are
    already cached (chunked prefill, chapters 预填充 and 调度): every layer for each of its tokens,
    causal attention to every position up to its own, the earlier positions' KV read back, and the
    output layer only when the chunk ends the prompt (that step samples the first token)."""
    if not 0 <= start < end <= prompt_len:
        raise ValueError(f"need 0 <= start < end <= prompt_len, got start={start}, end={end}, "
                         f"prompt_len={prompt_len}")
    layers = (end - start) * (matmul_flops_per_token(cfg) - output_layer_flops(cfg))
    logits = output_layer_flops(cfg) if end == prompt_len else 0
    attention = prefill_attention_flops(cfg, end) - prefill_attention_flops(cfg, start)
    return PrefillEstimate(end - start, layers + logits, attention, weight_bytes(cfg, dtype),
                           kv_bytes(cfg, end - start, dtype), kv_bytes(cfg, start, dtype))


def prefill_crossover(cfg: ModelConfig, peak_flops: float, bandwidth: float, dtype="bf16") -> int:
    """The shortest prompt whose prefill takes longer to compute than to read (F/P >= M/W):
    below it prefill is bandwidth-bound, from it on compute-bound (chapter 预填充)."""
    def compute_bound(n):
        return prefill(cfg, n, dtype).floor(peak_flops, bandwidth).bound == "compute"

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
    """One decode step: ``batch`` requests each add one token at context ``ctx``. ``weight_bytes``:
    the weights it reads (in an MoE model only the experts its tokens are routed to, expected
    ``experts_touched`` per layer)."""

    batch: int
    ctx: int
    weight_bytes: float
    kv_read_bytes: int
    linear_flops: int
    attention_flops: int
    bandwidth: float
    experts_touched: float = 1.0  # per layer; 1 in a dense model

    @property
    def bytes(self) -> float:
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

    def floor(self, peak_flops: float, bandwidth: float | None = None) -> Floor:
        """``max(F / P, M / W)`` of the step (``bandwidth`` defaults to the estimate's own)."""
        return roofline_floor(self.flops, self.bytes, peak_flops, bandwidth or self.bandwidth)

    @property
    def time_floor(self) -> float:
        """Seconds to read the step's bytes at ``bandwidth``."""
        return self.bytes / self.bandwidth

    @property
    def tokens_per_s(self) -> float:
        """Upper bound on aggregate decode tok/s: batch / time floor."""
        return self.batch / self.time_floor

    def mbu(self, measured_seconds: float) -> float:
        """Model bandwidth utilization of a step measured at ``measured_seconds``: the bytes the
        step reads (not all the weights, in an MoE model) per second, over ``bandwidth``."""
        return self.bytes / measured_seconds / self.bandwidth


def decode_step(cfg: ModelConfig, batch: int, ctx: int, bandwidth: float, dtype="bf16",
                quantization: str | None = None, group_size: int = 32, kv_dtype=None) -> DecodeEstimate:
    """The ledger of one decode step for ``batch`` requests at context ``ctx``, bandwidth W B/s;
    weights in ``quantization`` (see :func:`weight_bytes`), of an MoE model only the experts the
    batch touches (:func:`weight_bytes_read`), KV in ``kv_dtype`` (default ``dtype``)."""
    if batch < 1 or ctx < 1 or bandwidth <= 0:
        raise ValueError(f"need batch >= 1, ctx >= 1, bandwidth > 0; got {batch}, {ctx}, {bandwidth}")
    return DecodeEstimate(batch, ctx, weight_bytes_read(cfg, batch, dtype, quantization, group_size),
                          batch * kv_bytes(cfg, ctx, kv_dtype or dtype),
                          batch * matmul_flops_per_token(cfg),
                          batch * attention_flops_per_token(cfg, ctx), bandwidth,
                          experts_touched(cfg, batch))


def mixed_step(cfg: ModelConfig, running: int, ctx: int, span: tuple[int, int], prompt_len: int,
               peak_flops: float, bandwidth: float, dtype="bf16") -> Floor:
    """The floor of one step that decodes a token for each of ``running`` requests at context
    ``ctx`` and computes positions ``span = (start, end)`` of a ``prompt_len``-token prompt, as the
    engine runs a chunk of a prefill beside decodes (chapters 调度 and serving): the chunk's ledger
    (:func:`prefill_chunk`) and the decodes' FLOPs and KV reads; the weights are read once for both."""
    if running < 0:
        raise ValueError(f"need running >= 0, got {running}")
    chunk = prefill_chunk(cfg, *span, prompt_len, dtype)
    flops, nbytes = chunk.flops, chunk.bytes
    if running:
        decode = decode_step(cfg, running, ctx, bandwidth, dtype)
        flops, nbytes = flops + decode.flops, nbytes + decode.kv_read_bytes
    return roofline_floor(flops, nbytes, peak_flops, bandwidth)


def decode_intensity_limit(cfg: ModelConfig, ctx: int) -> float:
    """A decode step's FLOP per byte as the batch grows without bound at context ``ctx``: the
    weights are read once for the whole batch and no longer count, each request's FLOPs over its
    own KV bytes (bf16) remain (chapter 解码)."""
    return (matmul_flops_per_token(cfg) + attention_flops_per_token(cfg, ctx)) / kv_bytes(cfg, ctx)


def decode_always_bandwidth_bound_from(cfg: ModelConfig, ridge: float) -> float:
    """The context above which no batch makes a decode step compute-bound on a device whose ridge
    point is ``ridge`` FLOP/byte: where :func:`decode_intensity_limit` falls to the ridge."""
    kv = kv_bytes_per_token(cfg)
    return matmul_flops_per_token(cfg) / kv / (ridge - attention_flops_per_token(cfg, 1) / kv)


def compute_bound_batch(step, peak_flops: float) -> int | None:
    """The smallest batch whose step ``step(batch)`` (a dense model's :class:`DecodeEstimate`) is
    compute-bound at ``peak_flops``, or None when no batch is: the weights are read once per step,
    each request adds FLOPs f and KV bytes k, so the step crosses at B = (weights / W) / (f / P - k / W),
    if f / P > k / W (chapters 量化, 投机解码)."""
    one = step(1)
    per_request = one.flops / peak_flops - one.kv_read_bytes / one.bandwidth
    if per_request <= 0:
        return None
    batch = max(1, int(one.weight_bytes / one.bandwidth / per_request))
    while batch > 1 and step(batch - 1).floor(peak_flops).bound == "compute":
        batch -= 1
    while step(batch).floor(peak_flops).bound == "memory":
        batch += 1
    return batch


def cost_per_million(tokens_per_s: float, price_per_hour: float) -> float:
    """US$ per million generated tokens at ``tokens_per_s`` on a machine rented at ``price_per_hour``
    (chapter 量化)."""
    if tokens_per_s <= 0 or price_per_hour < 0:
        raise ValueError(f"need tokens_per_s > 0 and price_per_hour >= 0, got {tokens_per_s}, {price_per_hour}")
    return price_per_hour / 3600 / tokens_per_s * 1e6


# --- Speculative decoding (chapter 投机解码) ----------------------------------------------------

def verify_step(cfg: ModelConfig, batch: int, ctx: int, bandwidth: float, proposals: int,
                dtype="bf16") -> DecodeEstimate:
    """A decode step that also checks ``proposals`` guessed tokens per request: γ + 1 positions
    each, so (γ + 1) times the FLOPs of :func:`decode_step` over the same bytes (the weights once,
    each request's KV once; the few new positions' KV is left out)."""
    if proposals < 0:
        raise ValueError(f"proposals must be >= 0, got {proposals}")
    step = decode_step(cfg, batch, ctx, bandwidth, dtype)
    return replace(step, linear_flops=step.linear_flops * (proposals + 1),
                   attention_flops=step.attention_flops * (proposals + 1))


def accepted_length(alpha: float, gamma: int) -> float:
    """τ = (1 − α^(γ+1)) / (1 − α): the tokens a verify step yields on average when each of
    ``gamma`` proposals is accepted with probability ``alpha``, independently, up to the first
    rejection, plus the target's own token."""
    if not 0 <= alpha <= 1 or gamma < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 0, got {alpha}, {gamma}")
    return gamma + 1.0 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speculative_speedup(alpha: float, gamma: int, draft_cost: float = 0.0, verify_cost: float = 1.0) -> float:
    """S = τ / (γ·c + v): tokens per unit of time over plain decoding's, a draft pass costing
    ``draft_cost`` plain decode steps and the verify step ``verify_cost`` of them."""
    return accepted_length(alpha, gamma) / (gamma * draft_cost + verify_cost)


# --- Memory budget ----------------------------------------------------------------------------

def memory_budget(cfg: ModelConfig, gpu_memory, utilization: float = 0.92, dtype="bf16",
                  kv_dtype=None, kv_config: ModelConfig | None = None) -> MemoryPlan:
    """The ledger's bound on a card of ``gpu_memory`` bytes (or ``"24GiB"``) at ``utilization``:
    budget minus weights, all of it KV, counted per token (``block_size=1``). The planner
    (``minillm.engine.planner``) takes the activation peak and the memory outside PyTorch off too.
    ``kv_config``: count the KV of another shape on the same leftover (the seeds' MHA variant)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    total = parse_size(gpu_memory)
    return MemoryPlan.cut(total_bytes=total, utilization=utilization, weight_bytes=weight_bytes(cfg, dtype),
                          activation_peak_bytes=0, other_bytes=0, block_size=1,
                          bytes_per_block=kv_bytes_per_token(kv_config or cfg, kv_dtype or dtype),
                          max_model_len=None,
                          max_position_embeddings=cfg.max_position_embeddings, model=cfg.name,
                          device=f"{fmt_bytes(total)} card (ledger)", dtype=str(dtype),
                          max_num_batched_tokens=0, source="ledger")


def paged_waste_tokens(lengths, block_size: int) -> int:
    """Slots allocated but unused when each request takes whole blocks: < one block each."""
    return sum(ceil_div(n, block_size) * block_size - n for n in lengths)


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix_hit_tokens(prompt_len: int, common: int, block_size: int) -> int:
    """Tokens a prompt takes from a prefix cache of whole blocks, when ``common`` of its tokens
    match tokens whose KV the cache holds: whole blocks only, and never the prompt's last token
    (it is computed, so that its logits give the first new token)."""
    return min(common, prompt_len - 1) // block_size * block_size


# --- Scheduling (chapter 调度) ----------------------------------------------------------------------

def slot_schedule(output_lens, slots: int, static: bool = False) -> list[tuple[int, int]]:
    """(first step, end step) of each request when a request takes one step per output token (its
    prefill step yields the first), at most ``slots`` run at once, first come first served.
    ``static``: a batch of ``slots`` starts only when the previous one has entirely finished;
    otherwise a freed slot takes the next request at the next step (continuous batching)."""
    spans = []
    if static:
        start = 0
        for first in range(0, len(output_lens), slots):
            batch = output_lens[first:first + slots]
            spans += [(start, start + o) for o in batch]
            start += max(batch)
    else:
        free_at = [0] * slots
        for o in output_lens:
            slot = min(range(slots), key=free_at.__getitem__)
            spans.append((free_at[slot], free_at[slot] + o))
            free_at[slot] += o
    return spans


@dataclass(frozen=True)
class ChunkedPrefill:
    """The steps around a ``prompt_len``-token prompt that arrives while ``running`` requests decode
    at context ``ctx``, under a step budget of ``budget`` tokens: an ordinary decode step, the one
    step that computes the whole prompt when chunking is off, and each chunk's step when it is on
    (the decodes go first, one token each, so a chunk is ``budget - running`` prompt tokens)."""

    prompt_len: int
    budget: int
    running: int
    ctx: int
    decode: Floor
    whole: Floor
    spans: tuple[tuple[int, int], ...]
    chunks: tuple[Floor, ...]

    @property
    def chunk_tokens(self) -> int:
        return self.budget - self.running

    @property
    def chunk_count(self) -> int:
        return len(self.spans)

    @property
    def worst_chunk(self) -> Floor:
        return max(self.chunks, key=lambda f: f.seconds)

    @property
    def chunked_seconds(self) -> float:
        """All the chunks' steps together: the same prefill, and the weights read once per chunk."""
        return sum(f.seconds for f in self.chunks)


def chunked_prefill(cfg: ModelConfig, prompt_len: int, budget: int, running: int, ctx: int,
                    peak_flops: float, bandwidth: float, dtype="bf16") -> ChunkedPrefill:
    """:class:`ChunkedPrefill` at a device's two ceilings: each step's floor is :func:`mixed_step`'s
    (the decodes and a span of the prompt, the weights read once)."""
    if not 0 <= running < budget:
        raise ValueError(f"need 0 <= running < budget, got running={running}, budget={budget}")
    chunk = budget - running
    ends = [*range(chunk, prompt_len, chunk), prompt_len]
    spans = tuple(zip([0, *ends[:-1]], ends))

    def step(span):
        return mixed_step(cfg, running, ctx, span, prompt_len, peak_flops, bandwidth, dtype)

    decode = decode_step(cfg, max(running, 1), ctx, bandwidth, dtype).floor(peak_flops, bandwidth)
    return ChunkedPrefill(prompt_len, budget, running, ctx, decode, step((0, prompt_len)), spans,
                          tuple(step(s) for s in spans))


# --- Tensor parallelism (chapter 一张卡放不下) ------------------------------------------------------

def card_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape one card of ``tp`` holds, as the engine cuts it (``minillm.engine.parallel``):
    its heads, KV heads (replicated beyond the model's) and MLP width, and its rows of the
    embedding and the output layer (the vocabulary padded to a multiple of ``tp``). Counting this
    shape with the ledger above gives one card's weights, KV, FLOPs and bytes."""
    return tensor_parallel_shard(cfg, tp).replace(vocab_size=ceil_div(cfg.vocab_size, tp))


def weight_bytes_per_card(cfg: ModelConfig, tp: int, dtype="bf16") -> int:
    """Weight bytes on each card: 1/tp of every split matrix, the norms (and the o and down
    biases) whole."""
    return weight_bytes(card_config(cfg, tp), dtype)


def kv_bytes_per_token_per_card(cfg: ModelConfig, tp: int, dtype="bf16") -> int:
    """One token's K and V on each card: its ``max(1, n_kv / tp)`` KV heads in every layer, so
    beyond ``tp = n_kv`` a card's KV per token stops shrinking."""
    return kv_bytes_per_token(card_config(cfg, tp), dtype)


def allreduces_per_token(cfg: ModelConfig) -> int:
    """All-reduces a forward makes per layer pass: two per layer, after the attention's output
    projection and after the MLP's down projection (the embedding's one per step not counted)."""
    return 2 * cfg.num_layers


def allreduce_message_bytes(cfg: ModelConfig, tokens: int = 1, dtype="bf16") -> int:
    """Bytes of one all-reduce's message: the ``[tokens, hidden]`` partial sums."""
    return tokens * cfg.hidden_size * dtype_bytes(dtype)


def ring_bytes_per_card(nbytes: float, tp: int) -> float:
    """Bytes each card sends (and receives) in a ring all-reduce of ``nbytes``: 2 (tp − 1) / tp of
    them (a reduce-scatter, then an all-gather)."""
    return 2 * (tp - 1) / tp * nbytes


@dataclass(frozen=True)
class AllReduceCost:
    """The α–β model of one all-reduce: ``latency`` seconds per call (α, whatever the size) plus
    each card's ring bytes over the link's ``bandwidth`` (β, bytes/s per direction)."""

    latency: float
    bandwidth: float

    def seconds(self, nbytes: float, tp: int) -> float:
        """One all-reduce of ``nbytes`` across ``tp`` cards (0 on one card)."""
        if tp == 1:
            return 0.0
        return self.latency + ring_bytes_per_card(nbytes, tp) / self.bandwidth

    def latency_share(self, nbytes: float, tp: int) -> float:
        """Share of one all-reduce's time that is α, the per-call latency."""
        return self.latency / self.seconds(nbytes, tp)


@dataclass(frozen=True)
class TensorParallelDecode:
    """One decode step on ``tp`` cards: each card's floor ``max(F/P, M/W)`` over its shard, then
    the step's all-reduces one after another (none overlapped with compute)."""

    tp: int
    card: DecodeEstimate  # one card's share of the step
    floor: Floor  # one card's roofline floor
    num_allreduces: int  # per step
    allreduce_bytes: int  # one message
    allreduce_seconds: float  # all of the step's, α–β

    @property
    def seconds(self) -> float:
        return self.floor.seconds + self.allreduce_seconds

    @property
    def allreduce_share(self) -> float:
        """Share of the step the all-reduces take."""
        return self.allreduce_seconds / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.card.batch / self.seconds


def tensor_parallel_decode(cfg: ModelConfig, tp: int, batch: int, ctx: int, peak_flops: float,
                           bandwidth: float, link: AllReduceCost, dtype="bf16") -> TensorParallelDecode:
    """The decode floor of ``batch`` requests at context ``ctx`` on ``tp`` cards of ``peak_flops``
    and ``bandwidth``, joined by ``link``: each card reads its shard of the weights and KV and
    computes its share of the FLOPs, then waits for ``2 L`` all-reduces of ``batch × hidden``."""
    card = decode_step(card_config(cfg, tp), batch, ctx, bandwidth, dtype)
    message = allreduce_message_bytes(cfg, batch, dtype)
    count = allreduces_per_token(cfg) if tp > 1 else 0
    return TensorParallelDecode(tp, card, card.floor(peak_flops), count, message,
                                count * link.seconds(message, tp))
