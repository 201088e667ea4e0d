"""Linear upsampling of NDHWC tensors by 2 (or 1) along each of D, H and W, as F.interpolate(x, scale_factor=...,
mode="trilinear") with align_corners=False computes it (MAISI's and SegResNet's decoders: 2, 2, 2; EasyAnimate's
time upsampling: 2, 1, 1): two Triton kernels and their launchers, the forward and the input gradient, both
gathers, fp32 arithmetic, one rounding.

Along an axis of n voxels upsampled by 2, output o reads source position max(o / 2 - 1/4, 0) (torch's
area_pixel_compute_source_index): input o // 2 - 1 and o // 2 with weights 1/4 and 3/4 for even o > 0, o // 2 and
o // 2 + 1 (clamped to n - 1) with 3/4 and 1/4 for odd o, input 0 alone for o = 0. So input i feeds outputs
2i - 1, 2i, 2i + 1 and 2i + 2 with weights

    1/4 (i > 0),  3/4 + 1/4 (i = 0),  3/4 + 1/4 (i = n - 1),  1/4 (i < n - 1)

and the input gradient gathers those 4 (64 in three dimensions) instead of scattering with atomics. A
channels_last_3d tensor holds each voxel's channels contiguously: a program takes BLOCK_V voxels x BLOCK_C
channels, every load a row of channels (coalesced), where torch's CUDA kernel indexes NCDHW (on a channels_last_3d
input each thread walks one voxel's channels: uncoalesced) and its backward answers an NCDHW gradient.
"""

import torch
import triton
import triton.language as tl

from .launch import launch
from .tensors import cdiv, dense_voxels, empty_ndhwc, next_power_of_2
from .utils import split_voxel

TILE_ELEMENTS = 1024  # BLOCK_V x BLOCK_C: the output (forward) or input (backward) elements a program writes


@triton.jit
def _source(o, n, FACTOR: tl.constexpr, TAP: tl.constexpr):
    """(input index, weight) of tap TAP (0 or 1) of output indices o along an axis of n inputs upsampled by
    FACTOR (1: the input itself, weight 1)."""
    if FACTOR == 1:
        return o, o.to(tl.float32) * 0.0 + 1.0  # a tensor of ones: the weights' product is indexed
    src = tl.maximum(o.to(tl.float32) * 0.5 - 0.25, 0.0)
    i0 = src.to(tl.int32)  # floor: src >= 0
    far = src - i0.to(tl.float32)
    if TAP == 0:
        return i0.to(o.dtype), 1.0 - far
    return tl.minimum(i0 + 1, n - 1).to(o.dtype), far


@triton.jit
def _sink(i, n, tap, FACTOR: tl.constexpr):
    """(output index, weight, in range) of tap `tap` (0-3, a runtime value) of input indices i along an axis of n
    inputs upsampled by FACTOR: the outputs 2i - 1 + tap that read input i, and how much (see the module's
    docstring; a tap out of range has no output and weight 0)."""
    if FACTOR == 1:
        return i, i.to(tl.float32) * 0.0 + 1.0, i >= 0
    o = 2 * i - 1 + tap
    weight = tl.where((tap == 0) | (tap == 3), 0.25, 0.75)
    weight += tl.where(((tap == 1) & (i == 0)) | ((tap == 2) & (i == n - 1)), 0.25, 0.0)
    return o, weight, (o >= 0) & (o < 2 * n)


@triton.jit
def _upsample_linear_fwd_kernel(
    x_ptr, y_ptr, V, C, D, H, W,
    FD: tl.constexpr, FH: tl.constexpr, FW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """y[v, c] = the weighted sum of x's (up to) 8 source voxels of output voxel v, for BLOCK_V of the V output
    voxels (N x D*FD x H*FH x W*FW, flat, channels_last_3d) and BLOCK_C channels."""
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (v < V)[:, None] & (c < C)[None, :]
    n, od, oh, ow = split_voxel(v, D * FD, H * FH, W * FW)
    acc = tl.zeros((BLOCK_V, BLOCK_C), dtype=tl.float32)
    for td in tl.static_range(FD):
        d, wd = _source(od, D, FD, td)
        for th in tl.static_range(FH):
            h, wh = _source(oh, H, FH, th)
            for tw in tl.static_range(FW):
                w, ww = _source(ow, W, FW, tw)
                row = ((n * D + d) * H + h) * W + w
                x = tl.load(x_ptr + row[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
                acc += x * (wd * wh * ww)[:, None]
    tl.store(y_ptr + v[:, None] * C + c[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _upsample_linear_bwd_kernel(
    dy_ptr, dx_ptr, V, C, D, H, W,
    FD: tl.constexpr, FH: tl.constexpr, FW: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dx[v, c] = the weighted sum of dy over the (up to) 64 output voxels that read input voxel v, for BLOCK_V of
    the V input voxels (N x D x H x W, flat, channels_last_3d) and BLOCK_C channels."""
    v = tl.program_id(0).to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_v = v < V
    mask_c = (c < C)[None, :]
    n, i_d, i_h, i_w = split_voxel(v, D, H, W)
    acc = tl.zeros((BLOCK_V, BLOCK_C), dtype=tl.float32)
    # 4 taps along an axis upsampled by 2, 1 along one kept; the taps along D a loop, so that the compiler holds
    # at most 16 tiles in flight (all 64 unrolled spilled)
    for td in range(3 * FD - 2):
        od, wd, md = _sink(i_d, D, td, FD)
        for th in tl.static_range(3 * FH - 2):
            oh, wh, mh = _sink(i_h, H, th, FH)
            for tw in tl.static_range(3 * FW - 2):
                ow, ww, mw = _sink(i_w, W, tw, FW)
                row = ((n * (D * FD) + od) * (H * FH) + oh) * (W * FW) + ow
                inside = (mask_v & md & mh & mw)[:, None] & mask_c
                dy = tl.load(dy_ptr + row[:, None] * C + c[None, :], mask=inside, other=0.0).to(tl.float32)
                acc += dy * (wd * wh * ww)[:, None]
    tl.store(dx_ptr + v[:, None] * C + c[None, :], acc.to(dx_ptr.dtype.element_ty), mask=mask_v[:, None] & mask_c)


VOXELS = 128  # the most voxels a program takes: each costs its index arithmetic a tap (narrow rows spilled)


def _blocks(channels: int) -> tuple[int, int]:
    """(BLOCK_V, BLOCK_C): whole rows of up to 128 channels a program, wider ones split."""
    block_c = min(next_power_of_2(max(channels, 1)), 128)
    return min(VOXELS, max(1, TILE_ELEMENTS // block_c)), block_c


def upsample_linear_fwd(x: torch.Tensor, factors) -> torch.Tensor:
    """y channels_last_3d (see the module's docstring): x 5-D, factors (fd, fh, fw) each 1 or 2."""
    x = dense_voxels(x)
    fd, fh, fw = factors
    b, c, d, h, w = x.shape
    y = empty_ndhwc((b, c, d * fd, h * fh, w * fw), like=x)
    voxels = y.numel() // c if c else 0
    if voxels == 0:
        return y
    block_v, block_c = _blocks(c)
    launch(
        _upsample_linear_fwd_kernel, (cdiv(voxels, block_v), cdiv(c, block_c)), x, y, voxels, c, d, h, w,
        FD=fd, FH=fh, FW=fw, BLOCK_V=block_v, BLOCK_C=block_c,
    )  # fmt: skip
    return y


def upsample_linear_bwd(grad_out: torch.Tensor, input_size, factors) -> torch.Tensor:
    """The input gradient of upsample_linear_fwd, channels_last_3d, for an input of `input_size` (5 ints)."""
    grad_out = dense_voxels(grad_out)
    fd, fh, fw = factors
    b, c, d, h, w = input_size
    grad_in = empty_ndhwc((b, c, d, h, w), like=grad_out)
    voxels = b * d * h * w
    if voxels == 0 or c == 0:
        return grad_in
    block_v, block_c = _blocks(c)
    launch(
        _upsample_linear_bwd_kernel, (cdiv(voxels, block_v), cdiv(c, block_c)), grad_out, grad_in, voxels, c,
        d, h, w, FD=fd, FH=fh, FW=fw, BLOCK_V=block_v, BLOCK_C=block_c,
    )  # fmt: skip
    return grad_in
