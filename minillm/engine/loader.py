"""Building the model and filling in its weights (chapter 预填充).

``load_model`` accepts a Hugging Face folder (``config.json`` + ``model.safetensors``, or shards
listed in ``model.safetensors.index.json``), a ``.gguf`` file (``minillm.engine.gguf_file``: config,
dequantized weights and tokenizer from the one file; for int4, its Q4_1 matrices as stored), a
preset name under ``data/models/`` (a config only, or ``smollm2-135m``: the real
SmolLM2-135M-Instruct GGUF), a hub id (downloaded when online) or a ``ModelConfig``. The model is
first built on the meta device, which allocates nothing; then all its weights get one buffer on the
target device, and each checkpoint tensor is read straight onto that device. ``weights="random"``
fills the real shape with small random values instead, so an 8B-shaped model can be timed on a GPU
without its checkpoint and without ever holding a copy in CPU memory.
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import sys
from pathlib import Path

import torch
from torch import nn

from minillm.engine.config import ModelConfig, load_config, preset_names, resolve_checkpoint
from minillm.engine.device import pick_device
from minillm.engine.gguf_file import BLOCK_SIZE, Q4_1, GGUFFile, checked_tensors, gguf_tokenizer, hf_rows
from minillm.engine.model import RMSNorm, Router, Transformer
from minillm.engine.parallel import TensorParallel
from minillm.engine.quantization import OUTPUT_LAYER, check_quantization, check_shapes, quantize_model

WEIGHT_CHOICES = ("auto", "random")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
RANDOM_STD = 0.02  # the initializer_range of the Llama and Qwen configs
HUGE_PAGE = 2 * 2**20
MADV_HUGEPAGE = 14  # Linux's madvise advice number
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load_model(model: str | Path | ModelConfig, device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, weights: str = "auto", quantization: str | None = None,
               group_size: int = 32, tensor_parallel: TensorParallel = TensorParallel(),
               tokenizer: bool = True) -> Transformer:
    """A ready ``Transformer`` (eval mode, no gradients) with ``.config``, ``.tokenizer`` and
    ``.quantization``.

    device: default ``minillm.engine.device.pick_device()``. dtype: default the checkpoint's
    ``torch_dtype`` on CUDA, float32 on the CPU. weights: ``"auto"`` loads the checkpoint and fails
    when there is none; ``"random"`` builds the same shape with random values (seeded, so repeatable).
    quantization: ``"int8"`` or ``"int4"`` (groups of ``group_size``) quantizes the linears once
    they are loaded (``minillm.engine.quantization``); the full-precision copies are freed.
    """
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"weights must be one of {WEIGHT_CHOICES}, got {weights!r}")
    check_quantization(quantization, group_size)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else pick_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but CUDA is not available here")
    config, source = _resolve(model, weights)
    check_shapes(config, quantization, group_size)
    checkpoint = _open_checkpoint(source, config) if weights == "auto" else None
    dtype = dtype if dtype is not None else _default_dtype(config, device)

    tp = tensor_parallel
    with torch.device("meta"):
        net = Transformer(config, tp)
        full = net if tp.size == 1 else Transformer(config)  # the names and shapes to check and cut
    if checkpoint is not None:
        _check_checkpoint(full, checkpoint.shapes(), source)
    _allocate_weights(net.eval(), device, dtype, huge_pages=quantization is None)
    groups = {}  # the int4 linears' weights a checkpoint already stores as int4 groups
    if checkpoint is not None and quantization == "int4" and tp.size == 1:
        groups = checkpoint.int4_groups(_int4_weight_names(net), group_size, device)
    with torch.no_grad():
        if checkpoint is not None:
            params = dict(net.named_parameters(remove_duplicate=False))
            for name, tensor in checkpoint.tensors(device, skip=groups):
                params[name].copy_(tp.shard(name, tensor, config))
        else:
            _init_random(net, full, device)
    if quantization is not None:
        quantize_model(net, quantization, group_size, groups)
        _own_storage(net)
    net.quantization = None if quantization is None else (quantization, group_size)
    net.tokenizer = _load_tokenizer(source, checkpoint) if tokenizer else None
    return net


def checkpoint_weights(model) -> str:
    """``"auto"`` when ``model`` ships weights (a ``.gguf`` file, a folder with safetensors),
    ``"random"`` when it is only a shape (a preset, a bare config). Hub ids count as shipping them."""
    if isinstance(model, ModelConfig):
        return "random"
    source = resolve_checkpoint(model)
    if source is None:
        return "auto"
    if source.suffix == ".gguf":
        return "auto"
    has = (source / "model.safetensors").is_file() or (source / "model.safetensors.index.json").is_file()
    return "auto" if has else "random"


def _resolve(model, weights: str) -> tuple[ModelConfig, Path | None]:
    """The config and where it came from: a folder, a ``.gguf`` file, or None for a bare ModelConfig."""
    if isinstance(model, ModelConfig):
        if weights == "auto":
            raise ValueError(f"a ModelConfig ({model.name}) carries no weights: pass weights='random' "
                             f"or a checkpoint folder")
        return model, None
    source = resolve_checkpoint(model)
    if source is not None:
        return load_config(model), source
    folder = _download(str(model), weights)
    return load_config(folder).replace(name=str(model)), folder


def _download(repo_id: str, weights: str) -> Path:
    """Fetch a hub repository's config, tokenizer and (for weights='auto') safetensors."""
    where = (f"not a folder with config.json, not a .gguf file, not a preset "
             f"({', '.join(preset_names())})")
    if not _HUB_ID.fullmatch(repo_id):
        raise ValueError(f"unknown model {repo_id!r}: {where}, nor a hub id like 'org/name'")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        raise ValueError(f"model {repo_id!r} is {where}, and HF_HUB_OFFLINE is set, so it cannot "
                         f"be downloaded from the Hugging Face Hub")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "tokenizer*"] + (["*.safetensors"] if weights == "auto" else [])
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as e:  # offline, unknown repository, gated model, ...
        raise ValueError(f"model {repo_id!r} is {where}, and downloading it from the Hugging Face "
                         f"Hub failed: {type(e).__name__}: {e}") from e


TORCH_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32,
                "fp64": torch.float64, "float64": torch.float64}


def torch_dtype(dtype) -> torch.dtype | None:
    """A torch dtype from a name (``"bf16"``, ``"float32"``) or a ``torch.dtype``; None stays None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    return TORCH_DTYPES[dtype]


def _default_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    if device.type != "cuda":
        return torch.float32
    dtype = getattr(torch, config.torch_dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{config.name}: torch_dtype {config.torch_dtype!r} is not a floating "
                         f"torch dtype; pass dtype=")
    return dtype


class SafetensorsCheckpoint:
    """A Hugging Face folder's weights: ``model.safetensors``, or the shards its index lists."""

    def __init__(self, folder: Path):
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            with open(index) as f:
                self.files = sorted({folder / file for file in json.load(f)["weight_map"].values()})
        elif (folder / "model.safetensors").is_file():
            self.files = [folder / "model.safetensors"]
        else:
            raise ValueError(f"{folder} has no weights (no model.safetensors nor "
                             f"model.safetensors.index.json; a preset holds only its config): load it "
                             f"with weights='random' for random values at this shape")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        from safetensors import safe_open

        shapes = {}
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
        return {name: shape for name, shape in shapes.items() if not name.endswith("rotary_emb.inv_freq")}

    def tensors(self, device: torch.device, skip=()):
        """(name, tensor) for every tensor but those named in ``skip``, read straight onto ``device``."""
        from safetensors import safe_open

        for file in self.files:
            with safe_open(file, framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if not name.endswith("rotary_emb.inv_freq") and name not in skip:
                        yield name, f.get_tensor(name)

    def int4_groups(self, names, group_size: int, device: torch.device) -> dict:
        """None of its tensors is stored as int4 groups."""
        return {}


class GGUFCheckpoint:
    """A ``.gguf`` file's weights, dequantized to float32 one tensor at a time; a Q4_1 tensor can
    also be read as it is stored, which is already int4 in groups of 32 (``int4_groups``)."""

    def __init__(self, path: Path, config: ModelConfig):
        self.file, self.config = GGUFFile(path), config
        self.entries = checked_tensors(self.file)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tensor.shape for name, tensor in self.entries.items()}

    def tensors(self, device: torch.device, skip=()):
        """(name, float32 tensor) of every tensor but those in ``skip``, q and k rows back in
        Hugging Face's order."""
        for name, tensor in self.entries.items():
            if name not in skip:
                yield name, hf_rows(name, self.file.read(tensor), self.config)

    def int4_groups(self, names, group_size: int, device: torch.device) -> dict:
        """Name -> (codes, scale, minimum) on ``device`` of the tensors among ``names`` that the file
        stores as Q4_1, when ``group_size`` is its block's: the int4 quantization would round them back
        to these very codes, so it takes them as they are, without dequantizing."""
        if group_size != BLOCK_SIZE:
            return {}
        return {name: tuple(hf_rows(name, part, self.config).to(device) for part in self.file.read_q4_1(tensor))
                for name, tensor in self.entries.items() if name in names and tensor.ggml_type == Q4_1}


def _open_checkpoint(source: Path | None, config: ModelConfig):
    if source is None:
        raise ValueError(f"{config.name}: no checkpoint to load weights from")
    if source.suffix == ".gguf":
        return GGUFCheckpoint(source, config)
    return SafetensorsCheckpoint(source)


def _check_checkpoint(net: Transformer, shapes: dict[str, tuple[int, ...]], source: Path) -> None:
    """Every parameter present with its shape, nothing unknown: checked before allocating."""
    expected = dict(net.named_parameters(remove_duplicate=False))
    if net.config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # tied checkpoints usually leave it out
    unknown = sorted(shapes.keys() - expected.keys() - {"lm_head.weight"})
    missing = sorted(expected.keys() - shapes.keys())
    if unknown or missing:
        raise ValueError(f"{source}: checkpoint does not match {net.config.model_type} "
                         f"(missing {missing[:5]}, unexpected {unknown[:5]})")
    for name, shape in sorted(shapes.items()):
        if name in expected and shape != tuple(expected[name].shape):
            raise ValueError(f"{source.name}: {name} has shape {list(shape)}, "
                             f"the config says {tuple(expected[name].shape)}")


def _allocate_weights(net: Transformer, device: torch.device, dtype: torch.dtype, huge_pages: bool = True) -> None:
    """Give every parameter of the meta-built model its memory: slices of one buffer on ``device``.

    One buffer, so that on a Linux CPU it can be backed by 2 MiB pages as a whole: a decode step
    streams every weight once, and with 4 KiB pages the TLB misses eat into the memory bandwidth.
    Each slice starts at a multiple of 64 elements. The values are left uninitialized.
    ``huge_pages=False`` for weights about to be quantized: the buffer is freed once they are, and
    the kernel's zeroing (and compacting) of 2 MiB pages on first touch would cost load time for
    nothing.
    """
    params = list(net.named_parameters())  # a tied lm_head is listed once, as the embedding
    starts, end = [], 0
    for _, p in params:
        starts.append(end)
        end += -(-p.numel() // 64) * 64
    buffer = torch.empty(end, dtype=dtype, device=device)
    if huge_pages and device.type == "cpu" and sys.platform == "linux":
        _ask_for_huge_pages(buffer)
    for (name, p), start in zip(params, starts):
        module_name, _, attr = name.rpartition(".")
        weights = buffer[start:start + p.numel()].view(p.shape)
        net.get_submodule(module_name).register_parameter(attr, nn.Parameter(weights, requires_grad=False))
    net.tie_weights()


def _int4_weight_names(net: Transformer) -> set[str]:
    """The weights of the linears that int4 quantization turns into int4 groups (all but the output layer)."""
    return {f"{name}.weight" for name, module in net.named_modules()
            if isinstance(module, nn.Linear) and name != OUTPUT_LAYER}


def _own_storage(net: Transformer) -> None:
    """Give each parameter left after quantization (embedding, norms, biases) its own memory, so
    that the one buffer the full-precision weights shared is freed."""
    for module in net.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(param.detach().clone(), requires_grad=False))


def _ask_for_huge_pages(buffer: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned part of ``buffer``, before it is first written:
    Linux's transparent huge pages, in their usual "madvise" mode, back only ranges that ask."""
    start = -(-buffer.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (buffer.data_ptr() + buffer.nbytes) // HUGE_PAGE * HUGE_PAGE
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE)


def _init_random(net: Transformer, full: Transformer, device: torch.device) -> None:
    """Normal(0, 0.02) matrices and embeddings, zero biases, unit norms; seeded. A tensor-parallel
    shard draws each full tensor (``full``: the whole model on the meta device) and keeps its slice."""
    generator = torch.Generator(device=device).manual_seed(0)
    local = dict(net.named_modules())
    for name, module in full.named_modules():
        if isinstance(module, RMSNorm):
            local[name].weight.fill_(1.0)
        elif isinstance(module, (nn.Linear, nn.Embedding, Router)):
            weight = local[name].weight
            if module is local[name]:
                weight.normal_(0.0, RANDOM_STD, generator=generator)
            else:
                drawn = torch.empty(module.weight.shape, dtype=weight.dtype, device=device)
                weight.copy_(net.tp.shard(f"{name}.weight", drawn.normal_(0.0, RANDOM_STD, generator=generator),
                                          full.config))
            if getattr(local[name], "bias", None) is not None:
                local[name].bias.zero_()


def _load_tokenizer(source: Path | None, checkpoint=None):
    """The checkpoint's tokenizer: a folder's files through transformers, a GGUF's metadata as
    minillm's ``Tokenizer`` (the file read once with the weights when they were loaded); None when
    it ships none (presets, bare configs)."""
    if source is not None and source.suffix == ".gguf":
        return gguf_tokenizer(checkpoint.file if isinstance(checkpoint, GGUFCheckpoint) else GGUFFile(source))
    if source is None or not any((source / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)
