"""Depthwise Conv3d (groups == Cin, Cout = Cin x multiplier): direct kernels for the three directions, and their
launchers. One input channel per group leaves nothing for a GEMM tile to reduce over (a 27-long reduction per
output, a 16-wide MMA at most 1/16 used per multiplier), so each program takes a tile of voxels x a block of
channels and sums the taps in registers: loads run along the contiguous NDHWC channels, accumulation is fp32,
and the taps are unrolled. The weight gradient reduces over voxels in fixed-order splits (no atomics).

A channel multiplier ties input channel ci to outputs ci x multiplier + r. Every load reads a contiguous run of
channels (16-byte vectors on a GPU), never x[.., co // multiplier] or go[.., ci x multiplier + r] for a run of
co or ci: the compiler cannot see such addresses as contiguous and loads them one element at a time (sm_90, bf16,
multiplier 2: 72 loads a forward tap row where the multiplier-1 layer issues 30). The forward gives each program
one r (grid axis 1: channel block x r), the gradients split the run in registers (REPEAT).
"""

import torch
import triton
import triton.language as tl

from ..geometry import ConvGeometry
from .config import KernelConfig
from .launch import launch
from .tensors import cdiv
from .utils import split_voxel


@triton.jit
def _depthwise_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, C_IN, D_IN, H_IN, W_IN, D_OUT, H_OUT, W_OUT,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_wo, stride_wd, stride_wh, stride_ww,
    stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, MULTIPLIER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """y[m, ci * MULTIPLIER + r] = sum over taps of x[voxel(m) + tap, ci] * w[ci * MULTIPLIER + r, tap] (+ bias);
    zeros padding. Grid axis 1 is (block of BLOCK_C input channels, r): the program reads its input channels
    contiguously and writes every MULTIPLIER-th output channel (the output is written once, the input read 27
    times)."""
    r = tl.program_id(1) % MULTIPLIER
    offs_m = tl.program_id(0).to(tl.int64 if WIDE else tl.int32) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = (tl.program_id(1) // MULTIPLIER) * BLOCK_C + tl.arange(0, BLOCK_C)  # input channels
    offs_co = offs_c * MULTIPLIER + r
    mask_m = offs_m < M
    mask_c = offs_c < C_IN
    n, od, oh, ow = split_voxel(offs_m, D_OUT, H_OUT, W_OUT)
    d0 = (od * STRIDE_D - PAD_D).to(tl.int32)
    h0 = (oh * STRIDE_H - PAD_H).to(tl.int32)
    w0 = (ow * STRIDE_W - PAD_W).to(tl.int32)
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    # kd and kh loop at run time, kw is unrolled: a full unroll hoists all 27 taps' loads and spills.
    for kd in range(KD):
        id_ = d0 + kd * DIL_D
        for kh in range(KH):
            ih = h0 + kh * DIL_H
            for kw in tl.static_range(KW):
                iw = w0 + kw * DIL_W
                inside = mask_m & (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
                x_rows = (n * stride_xn + id_.to(n.dtype) * stride_xd + ih.to(n.dtype) * stride_xh
                          + iw.to(n.dtype) * stride_xw)  # fmt: skip
                x_ptrs = x_ptr + x_rows[:, None] + (offs_c * stride_xc)[None, :]
                x = tl.load(x_ptrs, mask=inside[:, None] & mask_c[None, :], other=0.0)
                w = tl.load(w_ptr + offs_co * stride_wo + kd * stride_wd + kh * stride_wh + kw * stride_ww, mask=mask_c)
                acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_co, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    y_rows = n * stride_yn + od * stride_yd + oh * stride_yh + ow * stride_yw
    y_ptrs = y_ptr + y_rows[:, None] + offs_co[None, :] * stride_yc
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def _depthwise_dgrad_kernel(
    go_ptr, w_ptr, bias_ptr, gi_ptr,
    M, C_IN, D_IN, H_IN, W_IN, D_OUT, H_OUT, W_OUT,
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_wo, stride_wd, stride_wh, stride_ww,
    stride_in, stride_ic, stride_id, stride_ih, stride_iw,
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, MULTIPLIER: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, REPEAT: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """gi[i, ci] = sum over taps and j < MULTIPLIER of go[(i + pad - tap * dil) / stride, ci * MULTIPLIER + j]
    * w[ci * MULTIPLIER + j, tap] (+ bias[ci]: a transposed convolution's), over the taps for which that division
    is exact (the forward's taps flipped;
    a strided layer's other taps are masked, the tile is voxels whatever the phase). REPEAT (_repeats): the block's
    BLOCK_C x MULTIPLIER output channels are one contiguous load a voxel, viewed as [BLOCK_C, MULTIPLIER] and summed
    over j in registers; otherwise a gather per j (every MULTIPLIER-th channel: element by element)."""
    offs_m = tl.program_id(0).to(tl.int64 if WIDE else tl.int32) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # input channels
    mask_m = offs_m < M
    mask_c = offs_c < C_IN
    n, id_, ih, iw = split_voxel(offs_m, D_IN, H_IN, W_IN)
    # Kept non-negative before dividing: Triton's // truncates towards zero.
    d0 = (id_ + PAD_D).to(tl.int32)
    h0 = (ih + PAD_H).to(tl.int32)
    w0 = (iw + PAD_W).to(tl.int32)
    if REPEAT:  # the block's output channels: as one run, and as [BLOCK_C, MULTIPLIER]
        offs_co = tl.program_id(1) * BLOCK_C * MULTIPLIER + tl.arange(0, BLOCK_C * MULTIPLIER)
        offs_co2 = offs_c[:, None] * MULTIPLIER + tl.arange(0, MULTIPLIER)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for kd in range(KD):  # run-time loops, kw unrolled: as in the forward
        td = d0 - kd * DIL_D
        od = td // STRIDE_D
        ok_d = (td >= 0) & (od * STRIDE_D == td) & (od < D_OUT)
        for kh in range(KH):
            th = h0 - kh * DIL_H
            oh = th // STRIDE_H
            ok_h = (th >= 0) & (oh * STRIDE_H == th) & (oh < H_OUT)
            for kw in tl.static_range(KW):
                tw = w0 - kw * DIL_W
                ow = tw // STRIDE_W
                hit = mask_m & ok_d & ok_h & (tw >= 0) & (ow * STRIDE_W == tw) & (ow < W_OUT)
                go_rows = (n * stride_gn + od.to(n.dtype) * stride_gd + oh.to(n.dtype) * stride_gh
                           + ow.to(n.dtype) * stride_gw)  # fmt: skip
                tap = kd * stride_wd + kh * stride_wh + kw * stride_ww
                if REPEAT:
                    go = tl.load(go_ptr + go_rows[:, None] + (offs_co * stride_gc)[None, :],
                                 mask=hit[:, None] & (offs_co < C_IN * MULTIPLIER)[None, :], other=0.0)  # fmt: skip
                    go = tl.reshape(go, (BLOCK_M, BLOCK_C, MULTIPLIER))
                    w = tl.load(w_ptr + offs_co2 * stride_wo + tap, mask=mask_c[:, None])
                    acc += tl.sum(go.to(tl.float32) * w.to(tl.float32)[None, :, :], axis=2)
                else:
                    for j in range(MULTIPLIER):  # at run time: unrolled with kw, the gathers spill
                        co = offs_c * MULTIPLIER + j
                        go = tl.load(go_ptr + go_rows[:, None] + (co * stride_gc)[None, :],
                                     mask=hit[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
                        w = tl.load(w_ptr + co * stride_wo + tap, mask=mask_c)
                        acc += go.to(tl.float32) * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    gi_rows = n * stride_in + id_ * stride_id + ih * stride_ih + iw * stride_iw
    gi_ptrs = gi_ptr + gi_rows[:, None] + offs_c[None, :] * stride_ic
    tl.store(gi_ptrs, acc.to(gi_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def _depthwise_wgrad_kernel(
    go_ptr, x_ptr, out_ptr,
    M, C_OUT, D_IN, H_IN, W_IN, D_OUT, H_OUT, W_OUT, SPLIT_ROWS,
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_os, stride_oo,
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, MULTIPLIER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, REPEAT: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Partial sums, one per split of the output voxels (grid axis 1): out[split, co, tap] = sum over the split's
    voxels m of go[m, co] * x[voxel(m) + tap, co // MULTIPLIER]. One program per (channel block, tap): its
    reduction is a per-channel sum over voxels, kept in a [BLOCK_M, Q, R] fp32 tile (co = q * R + r) and folded at
    the end. REPEAT (_repeats): R = MULTIPLIER, so q is an input channel, loaded once for its R outputs;
    otherwise R = 1 and each output channel gathers its input channel."""
    R: tl.constexpr = MULTIPLIER if REPEAT else 1
    Q: tl.constexpr = BLOCK_C // R
    taps: tl.constexpr = KD * KH * KW
    tap = tl.program_id(0) % taps
    offs_c = (tl.program_id(0) // taps) * BLOCK_C + tl.arange(0, BLOCK_C)  # output channels
    offs_q = (tl.program_id(0) // taps) * Q + tl.arange(0, Q)
    mask_c = offs_c < C_OUT
    mask_q = offs_q < C_OUT // R
    x_cols = (offs_q // (MULTIPLIER // R)) * stride_xc
    kw = tap % KW
    kh = (tap // KW) % KH
    kd = tap // (KW * KH)
    row_start = tl.program_id(1).to(tl.int64) * SPLIT_ROWS
    row_end = tl.minimum(row_start + SPLIT_ROWS, M)
    acc = tl.zeros((BLOCK_M, Q, R), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        # Each step splits its voxel indices and forms its addresses: in int32 unless a tensor has 2^31 elements
        # (WIDE; an int64 division is a subroutine: 487 instructions a step on sm_90 against 315).
        n, od, oh, ow = split_voxel(offs_m if WIDE else offs_m.to(tl.int32), D_OUT, H_OUT, W_OUT)
        id_ = (od * STRIDE_D - PAD_D + kd * DIL_D).to(tl.int32)
        ih = (oh * STRIDE_H - PAD_H + kh * DIL_H).to(tl.int32)
        iw = (ow * STRIDE_W - PAD_W + kw * DIL_W).to(tl.int32)
        inside = mask_m & (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
        go_rows = n * stride_gn + od * stride_gd + oh * stride_gh + ow * stride_gw
        go = tl.load(go_ptr + go_rows[:, None] + (offs_c * stride_gc)[None, :],
                     mask=mask_m[:, None] & mask_c[None, :], other=0.0)  # fmt: skip
        x_rows = (n * stride_xn + id_.to(n.dtype) * stride_xd + ih.to(n.dtype) * stride_xh
                  + iw.to(n.dtype) * stride_xw)  # fmt: skip
        x = tl.load(x_ptr + x_rows[:, None] + x_cols[None, :], mask=inside[:, None] & mask_q[None, :], other=0.0)
        acc += tl.reshape(go, (BLOCK_M, Q, R)).to(tl.float32) * x.to(tl.float32)[:, :, None]
    out_ptrs = out_ptr + tl.program_id(1) * stride_os + offs_c * stride_oo + tap
    tl.store(out_ptrs, tl.reshape(tl.sum(acc, axis=0), (BLOCK_C,)).to(out_ptr.dtype.element_ty), mask=mask_c)


# Tensors of up to this many elements are indexed in int32 arithmetic (WIDE beyond).
_INT32_ELEMENTS = 2**31 - 1


def _wide(*tensors: torch.Tensor) -> bool:
    """Whether an index into one of the tensors may pass int32: its last element's offset, whatever the strides.
    Once a launch: a dense channels_last_3d tensor's last offset is numel - 1, read without walking its strides in
    Python (about 1 us against 6 for two tensors on the CI machine)."""
    for t in tensors:
        if t.numel() < _INT32_ELEMENTS and t.is_contiguous(memory_format=torch.channels_last_3d):
            continue
        if sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)) >= _INT32_ELEMENTS:
            return True
    return False


# The input gradient's REPEAT tile loads BLOCK_C x multiplier output-gradient channels a voxel: at most this many.
_DGRAD_REPEAT_COLUMNS = 256


def _repeats(direction: str, multiplier: int, block_c: int) -> bool:
    """Whether a kernel's block of block_c channels reads the channels that the multiplier ties together (an input
    channel and its multiplier outputs) as one contiguous run, split in registers: where the multiplier is a power
    of two (tile dimensions are), it divides the weight gradient's block of outputs, and the input gradient's run
    of block_c x multiplier outputs stays within _DGRAD_REPEAT_COLUMNS. Otherwise they gather."""
    if multiplier & (multiplier - 1):
        return False
    return block_c % multiplier == 0 if direction == "wgrad" else block_c * multiplier <= _DGRAD_REPEAT_COLUMNS


def _geometry_arguments(geom: ConvGeometry) -> tuple:
    return (*geom.stride, *geom.front_padding, *geom.dilation)


def _weight_strides(weight: torch.Tensor) -> tuple:
    """(Cout, 1, kd, kh, kw) weight strides without the single input channel's."""
    so, _, sd, sh, sw = weight.stride()
    return so, sd, sh, sw


def depthwise_fwd(x, weight, bias, y, geom: ConvGeometry, config: KernelConfig) -> torch.Tensor:
    rows, multiplier = geom.output_voxels, geom.group_out_channels
    grid = (cdiv(rows, config.block_m), cdiv(geom.in_channels, config.block_n) * multiplier)
    launch(
        _depthwise_fwd_kernel, grid,
        x, weight, bias if bias is not None else x, y,
        rows, geom.in_channels, *geom.in_size, *geom.out_size,
        *x.stride(), *_weight_strides(weight), *y.stride(),
        *_geometry_arguments(geom),
        *geom.kernel, MULTIPLIER=multiplier, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_C=config.block_n, WIDE=_wide(x, y), num_warps=config.num_warps, num_stages=1,
    )  # fmt: skip
    return y


def depthwise_dgrad(grad_out, weight, bias, grad_in, geom: ConvGeometry, config: KernelConfig) -> torch.Tensor:
    rows = geom.input_voxels
    grid = (cdiv(rows, config.block_m), cdiv(geom.in_channels, config.block_n))
    launch(
        _depthwise_dgrad_kernel, grid,
        grad_out, weight, bias if bias is not None else grad_in, grad_in,
        rows, geom.in_channels, *geom.in_size, *geom.out_size,
        *grad_out.stride(), *_weight_strides(weight), *grad_in.stride(),
        *_geometry_arguments(geom),
        *geom.kernel, MULTIPLIER=geom.group_out_channels, HAS_BIAS=bias is not None,
        BLOCK_M=config.block_m, BLOCK_C=config.block_n,
        REPEAT=_repeats("dgrad", geom.group_out_channels, config.block_n),
        WIDE=_wide(grad_out, grad_in), num_warps=config.num_warps, num_stages=1,
    )  # fmt: skip
    return grad_in


def depthwise_wgrad(grad_out, x, out, geom: ConvGeometry, config: KernelConfig, rows_per_split: int) -> None:
    """Fills out, [splits, Cout, taps, 1]: each split's partial sum over its rows_per_split output voxels (the
    caller adds the splits in a fixed order)."""
    rows, c_out, taps, multiplier = geom.output_voxels, geom.out_channels, geom.taps, geom.group_out_channels
    grid = (cdiv(c_out, config.block_n) * taps, out.shape[0])
    launch(
        _depthwise_wgrad_kernel, grid,
        grad_out, x, out,
        rows, c_out, *geom.in_size, *geom.out_size, rows_per_split,
        *grad_out.stride(), *x.stride(), out.stride(0), out.stride(1),
        *_geometry_arguments(geom),
        *geom.kernel, MULTIPLIER=multiplier,
        BLOCK_M=config.block_m, BLOCK_C=config.block_n,
        REPEAT=_repeats("wgrad", multiplier, config.block_n), WIDE=_wide(grad_out, x),
        num_warps=config.num_warps, num_stages=1,
    )  # fmt: skip
