"""The transformer (chapters 预填充 and 解码).

One decoder-only model covers Llama 2 / 3.x, Qwen2 / 2.5, Qwen3 and Mistral: RMSNorm, rotary
position embeddings (with llama3's long-context rescaling), grouped-query attention and a SwiGLU
MLP; in Mixtral and Qwen3-MoE the MLP is a set of SwiGLU experts and a router that sends each
token to k of them (``MoE``). Module and parameter names follow Hugging Face, so a checkpoint
loads by name.

The forward runs over a *flat* batch: the new tokens of every sequence in the step, concatenated
into one ``[T]`` vector, plus ``AttentionMetadata`` that says where each sequence starts and where
its keys and values live in the KV cache. A prefill of one long prompt, a decode step of many
requests, or a mix of both is the same call.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minillm.engine.attention_metadata import AttentionMetadata
from minillm.engine.config import ModelConfig
from minillm.engine.kernels import (default_backend, paged_decode_attention,
                                    paged_prefill_attention, store_kv)
from minillm.engine.parallel import TensorParallel


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like transformers (which downcasts float64 too)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = F.rms_norm(x.to(torch.float32), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE's inverse frequencies theta^(-2i/d) in float32, rescaled the llama3 way if configured.

    llama3 scaling leaves high frequencies (wavelength < original context / high_freq_factor) alone,
    divides low frequencies (wavelength > original context / low_freq_factor) by ``factor``, and
    blends the two in between. Same arithmetic as transformers' ``_compute_llama3_parameters``.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is None:
        return inv_freq
    scaling = config.rope_scaling
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos and sin of position * frequency for each token, in float32, cast to the model's dtype."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: the model is built on the meta device and materialized
        # with to_empty(), which would leave a buffer uninitialized.
        self.inv_freq = rope_inv_freq(config)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[T, 1, d]``: ``sin`` is negated on the first half, so that
        :func:`apply_rope` rotates with one ``roll`` instead of splitting, negating and joining."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].to(torch.float32) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        sin = angles.sin()
        sin[..., :freqs.shape[-1]].neg_()
        return angles.cos().to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Rotate each head of ``x`` [T, heads, d] by its token's angles (the half-split layout of HF):
    ``x * cos + (-x2, x1) * sin``, where ``(x2, x1)`` is ``x`` rolled by half a head; ``in_place``:
    into ``x`` itself (the roll its one copy)."""
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    if in_place:
        return x.mul_(cos).addcmul_(rolled, signed_sin)
    return torch.addcmul(x * cos, rolled, signed_sin)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache: project, (normalize), rotate, store, attend."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, d = config.hidden_size, config.head_dim
        self.head_dim = d
        self.scale = d ** -0.5
        self.q_proj = nn.Linear(hidden, config.q_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, config.kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, config.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.sizes = [config.q_size, config.kv_size, config.kv_size]
        self.heads = [config.num_heads, config.num_kv_heads, config.num_kv_heads]
        self.qkv_proj = None  # q_proj, k_proj and v_proj stacked into one (minillm.engine.quantization)

    def project(self, x: torch.Tensor) -> list[torch.Tensor]:
        """q, k and v of ``x``: one stacked linear when quantization stacked them, else three."""
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.sizes, dim=-1)
        return [self.q_proj(x), self.k_proj(x), self.v_proj(x)]

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k rotated by RoPE (normalized first in a qk-norm model) and v, ``[T, heads, d]`` each.
        When quantization stacked the projections (and there is no qk-norm), q and k sit side by
        side in the stacked output, which nothing else holds: one RoPE call rotates both, in place."""
        tokens = x.shape[0]
        if self.qkv_proj is not None and self.q_norm is None:
            qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)
            apply_rope(qkv[:, :-self.heads[2]], cos, sin, in_place=True)
            return qkv.split(self.heads, dim=1)
        q, k, v = (y.view(tokens, -1, self.head_dim) for y in self.project(x))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, attn: AttentionMetadata, k_cache, v_cache, backend: str):
        tokens = x.shape[0]
        q, k, v = self.rotated_qkv(x, cos, sin)
        store_kv(k, v, k_cache, v_cache, attn.slot_mapping, backend=backend)
        if attn.max_query_len == 1:
            out = paged_decode_attention(q, k_cache, v_cache, attn.block_tables, attn.seq_lens,
                                         self.scale, attn.max_seq_len, backend=backend)
        else:
            out = paged_prefill_attention(q, k_cache, v_cache, attn.block_tables, attn.cu_seqlens_q,
                                          attn.seq_lens, self.scale, backend=backend)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)
        self.gate_up_proj = None  # gate_proj and up_proj stacked into one (minillm.engine.quantization)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """gate(x) and up(x): one stacked linear when quantization stacked them, else two."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj(x).chunk(2, dim=-1)
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(*self.gate_up(x)))


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, gate activated in place: three ``[T, I]`` alive at most, and only the
    product once it returns (the memory plan's count)."""
    return F.silu(gate, inplace=True) * up


class MixtralExpert(nn.Module):
    """Mixtral's SwiGLU expert under its checkpoint's names: w2(silu(w1(x)) * w3(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Router(nn.Module):
    """The router's logits ``x W^T`` [T, experts]. Not an ``nn.Linear``, so that quantization,
    which replaces every linear, leaves the routing decisions in the model's dtype."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoE(nn.Module):
    """Mixture of experts: each token goes to the k experts of largest router probability
    (softmax over all experts, in float32 like transformers), weighted by those probabilities,
    renormalized over the k when ``norm_topk_prob`` (always in Mixtral).

    The experts run grouped: the flat batch's (token, expert) pairs are sorted by expert, and
    each expert that got tokens runs once over all of them (``index_select``), its weighted output
    added back to their rows (``index_add_``). ``expert_tokens`` keeps how many tokens each
    expert got in the last forward (the distinct experts a step read are its nonzero entries).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(config)
        expert = MixtralExpert if config.model_type == "mixtral" else MLP
        self.experts = nn.ModuleList(expert(config) for _ in range(config.num_experts))
        self.expert_tokens: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [T, k] each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        order = chosen.flatten().argsort(stable=True)  # the (token, expert) pairs, by expert
        rows, weights = order // self.top_k, weights.flatten()[order]
        self.expert_tokens = torch.bincount(chosen.flatten(), minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, self.expert_tokens):
            if count:
                picked, weight = rows[start:start + count], weights[start:start + count, None]
                out.index_add_(0, picked, (expert(x.index_select(0, picked)) * weight).to(x.dtype))
                start += count
        return out


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + mlp(norm(x)); the MLP is an ``MoE`` in
    Mixtral (named ``block_sparse_moe`` there) and Qwen3-MoE (``mlp``). Under tensor parallelism
    each half ends with the all-reduce of the ranks' partial sums."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp_name = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
        setattr(self, self.mlp_name, MoE(config) if config.is_moe else MLP(config))

    def forward(self, x, cos, sin, attn, k_cache, v_cache, backend):
        x = x + self.tp.all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, attn, k_cache,
                                                  v_cache, backend))
        return x + self.tp.all_reduce(getattr(self, self.mlp_name)(self.post_attention_layernorm(x)))


class DecoderStack(nn.Module):
    """Embeddings, the layers and the final norm: Hugging Face's ``model.*`` prefix."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        rows = tp.vocab_rows(config.vocab_size)[1]  # the table comes uninitialized: the loader fills it
        self.embed_tokens = nn.Embedding(rows, config.hidden_size, _weight=torch.empty(rows, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """The whole model: ``forward`` gives hidden states, ``compute_logits`` the next-token scores.

    ``tp``: the shard of a tensor-parallel rank (``minillm.engine.parallel``); ``config`` is then
    the shape this rank holds (its heads, KV heads and MLP width; the vocabulary stays whole)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.tp = tp
        self.config = config = tp.shard_config(config)
        self.tokenizer = None  # set by the loader when the checkpoint ships one
        self.quantization = None  # (method, group_size) when the loader quantized the linears
        self.model = DecoderStack(config, tp)
        self.rotary = RotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, tp.vocab_rows(config.vocab_size)[1], bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the output head when the config says so (Qwen2.5-0.5B)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the activations (and of every weight that is not quantized)."""
        return self.model.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None = None) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the flat batch ``input_ids`` [T] at ``positions`` [T];
        ``num_layers``: through the first layers only (then the final norm), a draft of the model."""
        x = self.tp.embed(self.model.embed_tokens, input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        backend = default_backend(x)
        layers = self.model.layers[:num_layers]
        for layer, (k_cache, v_cache) in zip(layers, kv_caches[:len(layers)], strict=True):
            x = layer(x, cos, sin, attn, k_cache, v_cache, backend)
        return self.model.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[N, vocab]`` in float32 for hidden states ``[N, hidden]``."""
        return self.tp.gather_logits(self.lm_head(hidden).float(), self.config.vocab_size)
