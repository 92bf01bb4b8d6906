"""Fewer bytes per weight (chapter 量化): weight-only int8 and int4 linear layers.

A decode step reads every weight once, so bytes per weight set its floor. Two formats:

* **int8**, per output channel: ``w ≈ scale[o] · q[o, i]`` with ``q`` in [-127, 127] and
  ``scale = max|w[o, :]| / 127``: 1 byte per weight plus one float per row.
* **int4**, in groups of ``group_size`` (32 or 128) along the input dimension, asymmetric:
  ``w ≈ scale · q + min`` with ``q`` in [0, 16), ``scale = (max - min) / 15`` per group: half a
  byte per weight plus a scale and a minimum (two fp16, 4 bytes) per group, so 0.625 bytes per
  weight at group 32 and 0.53 at group 128. Weights that already sit on such a grid (a GGUF Q4_1
  file's: ``w = d · q + m`` with fp16 ``d`` and ``m``) would come back exactly, so the loader hands
  a Q4_1 file's codes, ``d`` and ``m`` over as they are stored (``groups``). torch's CPU kernel wants
  the form ``(q - 8) · scale + zero`` with bf16 ``scale`` and ``zero = min + 8 · scale``: on the
  CPU the parameters are rounded to bf16 once more.

The linears of every layer are quantized, and the output layer too, always to int8: its rows
score the whole vocabulary, and int4 groups there cost a small model far more quality than
anywhere else (``python -m minillm bench quality`` measures it). An MoE model's experts are
linears like the others and are quantized with them; its routers (``model.Router``, not linears)
keep the routing decisions in the model's dtype. The embedding table (a lookup), the norms and
attention stay in the model's dtype. Each quantized layer computes with the kernel
its device has: on the CPU torch's weight-only kernels (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``), which stream their bytes only with bf16 activations (with float32 ones
they fall back to loops slower than a float32 matmul); on a GPU the Triton kernel of
``minillm.engine.kernels.triton_quant``, which dequantizes each tile in registers. In float64 (the
parity tests) both compute with the dequantized weights, exactly. Under ``torch.compile`` (a
compiled decode step, ``decode_graph.CompiledDecode``) an int8 layer's product for one row is
written as what it is, ``sum_i x[i] · q[o, i]`` times ``scale[o]``: Inductor fuses the int8 to
float conversion into one loop over the int8 rows, which reads each weight once, in float32 (written
eagerly, the same expression would build the float32 weights first).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minillm.engine.engine_config import GROUP_SIZES, QUANTIZATIONS

INT4_LEVELS = 15  # q in [0, 15]
INT4_OFFSET = 8  # torch's CPU kernel computes (q - 8) * scale + zero
INT8_MAX = 127


def check_quantization(quantization, group_size: int) -> None:
    """``ValueError`` unless ``quantization`` is None, "int8" or "int4" and ``group_size`` is one
    the int4 kernels take."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")


def check_shapes(config, quantization, group_size: int) -> None:
    """``ValueError`` when a linear of ``config`` cannot be quantized as asked: int4 groups must
    tile every input dimension (hidden size, attention width, MLP width)."""
    if quantization != "int4":
        return
    bad = sorted({k for k in (config.hidden_size, config.q_size, config.intermediate_size) if k % group_size})
    if bad:
        raise ValueError(f"{config.name}: int4 groups of {group_size} do not tile input dimension(s) "
                         f"{bad}; use group_size={min(GROUP_SIZES)}")


# --- the formats ---------------------------------------------------------------------------------

def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 ``[N, K]``, scale float32 ``[N]``) with ``weight ≈ scale[:, None] * q``."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
    q = (w / scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)  # one temporary
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 ``[N, K]`` in [0, 15], scale ``[N, K / g]``, minimum ``[N, K / g]``, both fp16)
    with ``weight ≈ scale * q + minimum`` per group of ``group_size`` along K."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of group_size {group_size}")
    groups = weight.float().reshape(n, k // group_size, group_size)
    low = groups.amin(dim=-1).half()
    scale = ((groups.amax(dim=-1) - low.float()) / INT4_LEVELS).half()
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = (groups - low.float()[..., None]).div_(safe[..., None]).round_().clamp_(0, INT4_LEVELS)
    return q.to(torch.uint8).reshape(n, k), scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, group_size: int) -> torch.Tensor:
    """Float32 ``[N, K]`` weights of int4 codes ``q`` and their groups' ``scale`` and ``minimum``."""
    n, k = q.shape
    groups = q.reshape(n, k // group_size, group_size).float()
    return (groups * scale.float()[..., None] + minimum.float()[..., None]).reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, ``[N, K / 2]`` uint8: code ``2j`` in the low nibble of byte ``j``."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


# --- the layers ----------------------------------------------------------------------------------

class Int8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int8 per output channel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_int8(linear.weight.detach())
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x.is_cuda:
            from minillm.engine.kernels.triton_quant import int8_linear

            y = int8_linear(rows, self.qweight, self.scale)
        elif x.dtype == torch.float64:  # exact, for the parity tests
            y = rows @ self.dequantized().to(x.dtype).t()
        elif torch.compiler.is_compiling() and rows.shape[0] == 1:  # one pass over the int8 rows
            y = (rows * self.qweight).sum(-1)[None] * self.scale
        else:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight,
                                                   self.scale.to(torch.bfloat16)).to(x.dtype)
        y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` stored as int4 codes in groups of ``group_size`` along the
    input, in the layout of its device's kernel: on a GPU two codes per byte and each group's
    fp16 scale and minimum (``[K / g, N, 2]``); on the CPU torch's packed layout and its bf16
    ``(scale, min + 8 · scale)`` pairs. ``groups``: the weights' (codes, scale, minimum) when they
    are already int4 groups (``quantize_int4``'s form), taken instead of ``linear``'s values."""

    def __init__(self, linear: nn.Linear, group_size: int, groups=None):
        super().__init__()
        q, scale, low = groups if groups is not None else quantize_int4(linear.weight.detach(), group_size)
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        self.kernel = "triton" if linear.weight.device.type == "cuda" else "cpu"
        if self.kernel == "cpu":
            params = torch.stack((scale.float(), low.float() + INT4_OFFSET * scale.float()), dim=-1)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            params = params.to(torch.bfloat16)
        else:
            params, packed = torch.stack((scale, low), dim=-1), pack_int4(q)
        self.register_buffer("qweight", packed)
        self.register_buffer("group_params", params.transpose(0, 1).contiguous())  # [K / g, N, 2]
        self.bias = linear.bias

    def dequantized(self) -> torch.Tensor:
        """The float32 weights the kernel computes with (``[N, K]``)."""
        if self.kernel == "cpu":
            eye = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.qweight.device)
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye, self.qweight, self.group_size, self.group_params).float().t().contiguous()
        low, high = self.qweight & 0x0F, self.qweight >> 4
        q = torch.stack((low, high), dim=-1).reshape(self.out_features, self.in_features)
        params = self.group_params.transpose(0, 1)
        return dequantize_int4(q, params[..., 0], params[..., 1], self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if x.is_cuda:
            from minillm.engine.kernels.triton_quant import int4_linear

            y = int4_linear(rows, self.qweight, self.group_params, self.group_size)
        elif x.dtype == torch.float64:  # exact, for the parity tests
            y = rows @ self.dequantized().to(x.dtype).t()
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.qweight, self.group_size, self.group_params).to(x.dtype)
        y = y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


OUTPUT_LAYER = "lm_head"


STACKS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def stack_linears(linears: list[nn.Linear], values: bool = True) -> nn.Linear:
    """One linear over the same input whose output rows are those of ``linears``, in order;
    ``values=False``: its weight left uninitialized (its values come from elsewhere)."""
    first = linears[0]
    stacked = nn.Linear(first.in_features, sum(lin.out_features for lin in linears),
                        bias=first.bias is not None, device="meta")
    weight = (torch.cat([lin.weight for lin in linears]) if values else
              torch.empty(stacked.weight.shape, dtype=first.weight.dtype, device=first.weight.device))
    stacked.weight = nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        stacked.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return stacked


def quantize_model(model: nn.Module, quantization: str, group_size: int = 32, groups=None) -> nn.Module:
    """Replace every linear of the layers with its ``quantization`` twin and the output layer with
    its int8 one, in place (a tied output layer gets its own copy; the embedding table stays).

    The linears that read the same input are stacked first (``STACKS``: q, k and v; gate and up),
    so that a step runs one quantized kernel where it ran three (or two), converting its input to
    bf16 once. Both formats quantize each output row on its own, so the stacked rows are exactly
    the separate ones'. ``groups``: weight name -> (codes, scale, minimum) of the int4 linears whose
    weights are already int4 groups of ``group_size`` (a Q4_1 GGUF's, as the loader read them):
    taken as they are, their float values never read."""
    check_quantization(quantization, group_size)
    groups = dict(groups or {})
    with torch.no_grad():
        for prefix, module in list(model.named_modules()):
            for stacked_name, names in STACKS.items():
                if getattr(module, stacked_name, False) is None:  # a stack slot this module leaves empty
                    _stack(module, prefix, stacked_name, names, groups, group_size)
        targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
        for name, linear in targets:
            parent_name, _, attr = name.rpartition(".")
            int4 = quantization == "int4" and name != OUTPUT_LAYER
            setattr(model.get_submodule(parent_name), attr,
                    Int4Linear(linear, group_size, groups.get(f"{name}.weight")) if int4 else Int8Linear(linear))
    return model


def _stack(module: nn.Module, prefix: str, stacked_name: str, names: tuple[str, ...], groups: dict,
           group_size: int) -> None:
    """Stack ``module``'s linears ``names`` into ``stacked_name``. When ``groups`` holds all their
    weights, the stack's groups are theirs row after row; when it holds only some (a file that
    stores, say, v in another format), those are dequantized into their weights first."""
    sources = [f"{prefix}.{name}.weight" for name in names]
    stored = all(source in groups for source in sources)
    if stored:
        parts = zip(*(groups.pop(source) for source in sources))
        groups[f"{prefix}.{stacked_name}.weight"] = tuple(torch.cat(part) for part in parts)
    for name, source in zip(names, sources):
        if source in groups:
            getattr(module, name).weight.copy_(dequantize_int4(*groups.pop(source), group_size))
    setattr(module, stacked_name, stack_linears([getattr(module, name) for name in names], values=not stored))
    for name in names:
        delattr(module, name)


def warmup_quantized(model: nn.Module) -> None:
    """On CUDA, run each quantized layer once per distinct shape (a decode-sized and a
    prefill-sized input), so that the Triton matmul compiles before any timed step."""
    seen = set()
    for module in model.modules():
        if not isinstance(module, (Int8Linear, Int4Linear)) or not module.qweight.is_cuda:
            continue
        key = (type(module), module.in_features, module.out_features, getattr(module, "group_size", 0))
        if key not in seen:
            seen.add(key)
            for rows in (1, 32):
                module(torch.zeros(rows, module.in_features, dtype=model.dtype, device=module.qweight.device))
