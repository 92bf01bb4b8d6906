"""Triton matmuls over quantized weights (chapter 量化): ``y = x W^T`` with ``W`` read as int8 or
int4 and dequantized tile by tile in registers, so only the quantized bytes cross the memory bus.

One kernel serves both formats (``BITS`` is a compile-time constant):

* int8: ``qweight [N, K]`` int8, ``scale [N]`` float32: ``y = (x · q^T) * scale``;
* int4: ``qweight [N, K / 2]`` uint8, two codes per byte (code ``2j`` in the low nibble of byte
  ``j``), ``group_params [K / g, N, 2]`` fp16: each group of ``g`` weights along K dequantizes as
  ``q * scale + min``. A K tile is one group, so each tile needs one scale and one minimum per
  output row.

Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``; decode steps have few rows, so
``BLOCK_M`` is 16 (``tl.dot``'s minimum) and the rows past M are masked. The row count is not
specialized, so each layer shape compiles once (``minillm.engine.quantization.warmup_quantized``
does it before the first step). Under ``TRITON_INTERPRET=1`` (CPU tests) the dot runs in float32,
as in ``triton_attention``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.engine.kernels.triton_attention import INTERPRET, MIN_DOT_ROWS

BLOCK_N = 64
INT8_BLOCK_K = 64


@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _quant_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                         BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        if BITS == 8:
            w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask_n[:, None],
                        other=0).to(tl.float32)
        else:
            offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_b[None, :], mask=mask_n[:, None],
                             other=0)
            codes = tl.join(packed & 0x0F, packed >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
            group = k0 // BLOCK_K
            scale = tl.load(s_ptr + (group * N + offs_n) * 2, mask=mask_n, other=0.0).to(tl.float32)
            low = tl.load(s_ptr + (group * N + offs_n) * 2 + 1, mask=mask_n, other=0.0).to(tl.float32)
            w = codes * scale[:, None] + low[:, None]
        if DOT_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if BITS == 8:
        acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _launch(x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, n: int, bits: int,
            block_k: int) -> torch.Tensor:
    m, k = x.shape
    if k % block_k:
        raise ValueError(f"in_features {k} must be a multiple of {block_k}")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, MIN_DOT_ROWS), triton.cdiv(n, BLOCK_N))
    _quant_matmul_kernel[grid](x, qweight, params, y, m, n, k, x.stride(0), qweight.stride(0), y.stride(0),
                               BITS=bits, BLOCK_M=MIN_DOT_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
                               DOT_FP32=INTERPRET or x.dtype == torch.float32, num_warps=4)
    return y


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (scale[:, None] * qweight [N, K])^T`` in ``x``'s dtype."""
    return _launch(x, qweight, scale, qweight.shape[0], bits=8, block_k=INT8_BLOCK_K)


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, group_params: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """``x [M, K]`` times the int4 weights ``qweight [N, K / 2]`` (groups of ``group_size``)."""
    return _launch(x, qweight, group_params, qweight.shape[0], bits=4, block_k=group_size)
