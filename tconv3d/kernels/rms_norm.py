"""Normalisation of each voxel's channel vector by its root mean square on NDHWC tensors, with an optional fused
activation (SiLU or ReLU): two Triton kernels and their launchers. Two ways to keep the division finite, as the
video VAEs do it:

    y = act(x / sqrt(mean(x^2) + eps) * weight + bias)      torch's RMSNorm (LTX-Video, LTX-2)
    y = act(x / max(sqrt(mean(x^2)), eps) * weight + bias)  CLAMP: F.normalize(x, eps=e) * sqrt(C) with
                                                            eps = e / sqrt(C) (the RMS_norm of Wan, Qwen-Image
                                                            and HunyuanVideo 1.5)

the mean over one voxel's C channels. A channels_last_3d tensor holds each voxel's channels contiguously: the rows
of a (voxels, C) matrix, so one program normalises BLOCK_R whole rows (up to geometry.RMS_NORM_MAX_CHANNELS
channels), loaded along C, in one read and one write (stock diffusers: an fp32 copy, the norm, the division, a
cast back and the affine, each a pass of its own). fp32 arithmetic whatever the tensor dtype; the backward
recomputes the norm (no per-voxel state is kept) and reduces the weight and bias gradients per program, both summed
over the programs in a fixed order by one launch after it: deterministic, no atomics, written in the weight's dtype
(tensors.parameter_grad_dtype: a bf16 model's backward casts nothing after).
"""

import torch
import triton
import triton.language as tl

from ..geometry import NORM_ACTIVATIONS
from .launch import launch
from .split_k import sum_splits
from .tensors import cdiv, dense_voxels, empty_ndhwc, next_power_of_2, parameter_grad_dtype
from .utils import activated, activation_backward

ROW_ELEMENTS = 4096  # BLOCK_R x BLOCK_C: the rows a program takes at once
BACKWARD_ROWS = 256  # the most rows a backward program walks, reducing its weight and bias gradients over them
BACKWARD_PROGRAMS = 1024  # fewer rows a program where that many programs would not have BACKWARD_ROWS each
BACKWARD_WARPS = 8  # x, dy, x^ and g of BLOCK_R x BLOCK_C held at once: 4 warps spilled (sm_80 and sm_90)


@triton.jit
def _affine(normalized, w, b, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    z = normalized
    if HAS_WEIGHT:
        z = z * w[None, :]
    if HAS_BIAS:
        z = z + b[None, :]
    return z


@triton.jit
def _normalized(x, mean_square, eps, CLAMP: tl.constexpr, ONE_CHANNEL: tl.constexpr):
    """(x^, i): rows x over their divisor (see the module's docstring), their mean squares `mean_square`, and i = 1
    / the divisor. Rows of ONE_CHANNEL are divided by it, the root and the quotient correctly rounded: x^ = x / |x|
    is then +-1 exactly (F.normalize's), and the gradient through it, (g - x^ <g, x^>) i, exactly 0 as it should
    be. Times i, x^ came out 1 +- an ulp and that gradient g (1 - x^^2) i of rounding alone, large where |x| is
    small (Wan's test configs normalize one channel: input gradients 1e-4-1e-2 off in fp32). Wider rows keep the
    product (a correctly rounded division an element costs registers: the backward spilled at 1,024 channels)."""
    if ONE_CHANNEL:
        divisor = tl.maximum(tl.sqrt_rn(mean_square), eps) if CLAMP else tl.sqrt_rn(mean_square + eps)
        return tl.math.div_rn(x, divisor[:, None]), 1.0 / divisor
    inverse = 1.0 / (tl.maximum(tl.sqrt(mean_square), eps) if CLAMP else tl.sqrt(mean_square + eps))
    return x * inverse[:, None], inverse


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, R, C, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """y[r, c] = act(x[r, c] * inverse_rms(x[r, :]) * w[c] + b[c]) for BLOCK_R rows of the (R, C) row-major
    matrix a channels_last_3d tensor is, each row whole in one block (BLOCK_C >= C)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    mask = (rows < R)[:, None] & mask_c[None, :]
    offsets = rows[:, None] * C + offs_c[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    normalized, _ = _normalized(x, tl.sum(x * x, axis=1) / C, eps, CLAMP, BLOCK_C == 1)
    w = tl.load(w_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32) if HAS_WEIGHT else None
    b = tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32) if HAS_BIAS else None
    z = activated(_affine(normalized, w, b, HAS_WEIGHT, HAS_BIAS), ACTIVATION, 0.0)
    tl.store(y_ptr + offsets, z.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    x_ptr, dy_ptr, w_ptr, b_ptr, dx_ptr, partial_ptr, R, C, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """For ROWS rows from program_id(0) * ROWS, BLOCK_R at a time, each whole in one block: with i the row's
    inverse_rms, x^ = x * i, dz = dy * act'(z) and g = dz * w,
        dx = (g - x^ * <g, x^> / C) * i,   or g * i where CLAMP clamped the divisor (a constant there),
    and this program's sums over its rows of dz * x^ (dw) and dz (db) into row program_id(0) of the (programs, 2, C)
    partials, dw then db."""
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    w = tl.load(w_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32) if HAS_WEIGHT else None
    b = tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32) if HAS_BIAS else None
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * ROWS
    for r0 in range(0, ROWS, BLOCK_R):
        rows = first + r0 + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & mask_c[None, :]
        offsets = rows[:, None] * C + offs_c[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dz = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        mean_square = tl.sum(x * x, axis=1) / C
        normalized, inverse = _normalized(x, mean_square, eps, CLAMP, BLOCK_C == 1)
        if ACTIVATION != 0:
            dz = activation_backward(dz, _affine(normalized, w, b, HAS_WEIGHT, HAS_BIAS), ACTIVATION, 0.0)
        dw += tl.sum(dz * normalized, axis=0)
        db += tl.sum(dz, axis=0)
        g = dz
        if HAS_WEIGHT:
            g = dz * w[None, :]
        along = tl.sum(g * normalized, axis=1) / C
        if CLAMP:  # a clamped divisor is a constant: nothing flows through it
            along = tl.where(tl.sqrt(mean_square) > eps, along, 0.0)
        dx = (g - normalized * along[:, None]) * inverse[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    partial_ptr += tl.program_id(0).to(tl.int64) * 2 * C
    tl.store(partial_ptr + offs_c, dw, mask=mask_c)
    tl.store(partial_ptr + C + offs_c, db, mask=mask_c)


def _blocks(channels: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_C) of a launch over rows of `channels`."""
    block_c = next_power_of_2(max(channels, 1))
    return max(1, ROW_ELEMENTS // block_c), block_c


def rms_norm_fwd(x, weight, bias, eps: float, activation: str, clamp: bool = False) -> torch.Tensor:
    """y channels_last_3d (see the module's docstring); x 5-D with at most geometry.RMS_NORM_MAX_CHANNELS
    channels, weight and bias per channel or None."""
    x = dense_voxels(x)
    y = empty_ndhwc(x.shape, like=x)
    channels = x.shape[1]
    rows = x.numel() // channels if channels else 0
    if rows == 0:
        return y
    block_r, block_c = _blocks(channels)
    launch(
        _rms_norm_fwd_kernel, (cdiv(rows, block_r),),
        x, weight if weight is not None else x, bias if bias is not None else x, y, rows, channels, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACTIVATION=NORM_ACTIVATIONS.index(activation),
        CLAMP=clamp, BLOCK_R=block_r, BLOCK_C=block_c,
    )  # fmt: skip
    return y


def rms_norm_bwd(grad_out, x, weight, bias, eps: float, activation: str, clamp: bool = False):
    """(grad_input channels_last_3d, grad_weight, grad_bias) of rms_norm_fwd, the last two [C] in
    parameter_grad_dtype(weight)."""
    x, grad_out = dense_voxels(x), dense_voxels(grad_out)
    channels = x.shape[1]
    rows = x.numel() // channels if channels else 0
    grad_in = empty_ndhwc(x.shape, like=x)
    if rows == 0:
        zeros = torch.zeros(channels, device=x.device, dtype=parameter_grad_dtype(weight))
        return grad_in, zeros, zeros.clone()
    block_r, block_c = _blocks(channels)
    row_steps = min(BACKWARD_ROWS, cdiv(rows, BACKWARD_PROGRAMS))
    row_steps = max(block_r, cdiv(row_steps, block_r) * block_r)  # whole BLOCK_R steps
    programs = cdiv(rows, row_steps)
    # each program's sums of the weight and bias gradients, side by side (one buffer, no views of it: a compiled
    # graph would scatter a kernel's writes to a view back into its base)
    partials = torch.empty((programs, 2, channels), dtype=torch.float32, device=x.device)
    launch(
        _rms_norm_bwd_kernel, (programs,),
        x, grad_out, weight if weight is not None else x, bias if bias is not None else x, grad_in,
        partials, rows, channels, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACTIVATION=NORM_ACTIVATIONS.index(activation),
        CLAMP=clamp, BLOCK_R=block_r, BLOCK_C=block_c, ROWS=row_steps, num_warps=BACKWARD_WARPS,
    )  # fmt: skip
    # both summed over the programs in their order (deterministic), in one launch
    grad_weight, grad_bias = (
        torch.empty(channels, dtype=parameter_grad_dtype(weight), device=x.device) for _ in range(2)
    )
    sum_splits(partials, grad_weight, grad_bias)
    return grad_in, grad_weight, grad_bias
