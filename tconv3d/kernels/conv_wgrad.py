"""Conv3d weight gradient: split-K implicit-GEMM Triton kernels on NDHWC tensors (one tap a program, or (tap,
output channel) pairs for few output channels), a deterministic reduction of the splits, and their launcher."""

from dataclasses import replace

import torch
import triton
import triton.language as tl

from ..geometry import ConvGeometry
from . import grouped
from .config import (
    KernelConfig,
    channel_blocks,
    channel_sources,
    gemm_view,
    packs_out_taps,
    packs_taps,
    pointer_tiles,
    split_rows,
)
from .conv_depthwise import depthwise_wgrad
from .conv_fwd import border_widths, interior_part, leaves_border_ring, ring_voxels
from .conv_gluon import conv3d_wgrad_gluon
from .conv_tma import conv3d_wgrad_tma, wgrad_tma_patches
from .launch import launch
from .split_k import sum_splits
from .tensors import cdiv, ndhwc
from .utils import (
    border_gather,
    channel_run,
    dense_ndhwc_strides,
    dot_flags,
    gather_tile,
    mma,
    ndhwc_strides,
    next_voxels,
    ring_voxel,
    run_aligned,
    runs_aligned,
    second_source_arguments,
    select,
    tap_bits,
    tap_inside,
    tap_pairs,
    unseen_run,
    voxel_steps,
    wide_rows,
)


@triton.jit
def _conv3d_wgrad_kernel(
    # pointers
    go_ptr, x_ptr, out_ptr,
    # sizes (D_IN counts the P_FRAMES frames of the second source p in front of x along D; p starts P_DELTA
    # elements from x_ptr; C_IN counts the C_IN - C_A channels of the second source q after x's C_A along C, q
    # starting Q_DELTA elements from x_ptr)
    M, C_IN, D_IN, H_IN, W_IN, C_OUT, D_OUT, H_OUT, W_OUT, P_FRAMES, P_DELTA, C_A, Q_DELTA, SPLIT_ROWS,
    # with RING, M counts the voxels of each output frame's border ring, RING_TOP / BOTTOM rows and RING_LEFT /
    # RIGHT columns wide (utils.ring_voxel)
    RING_TOP, RING_BOTTOM, RING_LEFT, RING_RIGHT,
    # strides, in elements: go and x in logical (N, C, D, H, W) order, p and q as (N, D, H, W) (their channels are
    # unit-stride as x's); out is [split, Cout, tap, Cin]
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_pn, stride_pd, stride_ph, stride_pw,
    stride_qn, stride_qd, stride_qh, stride_qw,
    stride_os, stride_oo, stride_ot, stride_oi,
    # convolution geometry (front padding; PAD_MODE_D/H/W say what each dimension's border reads)
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # meta-parameters
    GO_DENSE: tl.constexpr, PACK_TAPS: tl.constexpr, RUN: tl.constexpr, GO_RUN: tl.constexpr,
    HAS_PREFIX: tl.constexpr, HAS_AFTER: tl.constexpr, RING: tl.constexpr, DIAG_CI: tl.constexpr, DIAG_CO: tl.constexpr,
    WIDE_ROWS: tl.constexpr, PAD_MODE_D: tl.constexpr, PAD_MODE_H: tl.constexpr, PAD_MODE_W: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """gw[co, tap, ci] = sum over output voxels m of go[m, co] * x[voxel(m) + tap, ci].

    GEMM view, one per tap: M = Cout rows, N = Cin columns, K = N*Do*Ho*Wo output voxels. K is huge and the
    output small, so grid axis 1 splits K into SPLIT_ROWS-long slices, each writing its own fp32 partial sum;
    a second pass adds them in a fixed order, so the result is the same bit for bit on every run. With
    PACK_TAPS (fewer input channels than one MMA step: it is that count, C_IN, a constexpr) there is one GEMM whose
    N = taps x Cin (tap, channel) pairs: the Cin = 3 stem's 81 columns fill one 128-wide tile instead of 27 tiles
    3/16 full; where x's strides are multiples of RUN (the forward's), each tap's channels of a voxel load as a
    vector, and so do a plain loop's channels of x (RUN) and go (GO_RUN) where Triton cannot see their alignment
    itself (utils.unseen_run: 24 or 40 channels). A second source along C (HAS_AFTER, a channel concatenation
    read in place) adds its own column tiles after x's: a program's
    columns lie in one source, whose base and strides it takes once (utils.select). With RING the reduction runs
    over the output voxels of each frame's border ring alone (where a box kernel reduced over the interior), their
    coordinates from the ring's index each step. With DIAG_CI (groups of few channels run side by side,
    kernels/grouped.py) a tile stores only its elements in the diagonal blocks of DIAG_CO output and DIAG_CI input
    channels, column ci at channel ci % DIAG_CI: out holds the grouped weight's gradient, DIAG_CI channels a row.
    """
    tl.static_assert(not DIAG_CI or not (PACK_TAPS or HAS_AFTER), "DIAG_CI: a tap's channels, one source")
    taps: tl.constexpr = KD * KH * KW
    # Zeros borders and one source: a mask suffices (else kernel_utils.border_gather remaps each load).
    MASK_ONLY: tl.constexpr = PAD_MODE_D == 0 and PAD_MODE_H == 0 and PAD_MODE_W == 0 and not HAS_PREFIX
    if RUN > 1:  # x's strides and a group's channels multiples of RUN, as the compiler can see (the forward's)
        C_IN = run_aligned(C_IN, RUN)
        stride_xn, stride_xd, stride_xh, stride_xw = runs_aligned(stride_xn, stride_xd, stride_xh, stride_xw, RUN)
        stride_pn, stride_pd, stride_ph, stride_pw = runs_aligned(stride_pn, stride_pd, stride_ph, stride_pw, RUN)
    if GO_RUN > 1:  # go's strides and a group's output channels, likewise
        C_OUT = run_aligned(C_OUT, GO_RUN)
        stride_gn, stride_gd, stride_gh, stride_gw = runs_aligned(stride_gn, stride_gd, stride_gh, stride_gw, GO_RUN)
    group = tl.program_id(2)  # grouped convolution: shifted base pointers, as in the forward
    go_ptr += group * C_OUT * stride_gc
    x_ptr += group * C_IN * stride_xc
    out_ptr += group * C_OUT * stride_oo
    pid = tl.program_id(0)
    if PACK_TAPS:  # few input channels: the columns are (tap, channel) pairs, several taps per program
        cols: tl.constexpr = taps * PACK_TAPS
        num_n: tl.constexpr = (cols + BLOCK_N - 1) // BLOCK_N
        pid_m = pid // num_n
        pid_n = pid % num_n
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] (tap, channel) pairs
        tap = offs_n // PACK_TAPS  # [BLOCK_N]
        offs_c = offs_n - tap * PACK_TAPS
        mask_n = offs_n < cols
    else:  # one tap per program, its columns the input channels
        tap = pid % taps  # neighbouring programs share go and x rows: keep taps innermost
        tile = pid // taps
        a_tiles = tl.cdiv(C_A, BLOCK_N) if HAS_AFTER else 0
        num_n = a_tiles + tl.cdiv(C_IN - C_A, BLOCK_N) if HAS_AFTER else tl.cdiv(C_IN, BLOCK_N)
        pid_m = tile // num_n
        pid_n = tile % num_n
    kw = tap % KW
    kh = (tap // KW) % KH
    kd = tap // (KW * KH)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] output channels
    if HAS_AFTER:  # the program's columns: x's channels or q's, counted in their source (out_n: in the weight)
        tl.static_assert(not PACK_TAPS and not HAS_PREFIX, "channels_after: unpacked columns, one source along D")
        second = (pid_n >= a_tiles).to(tl.int32)
        offs_n = (pid_n - second * a_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        mask_n = offs_n < select(second, C_A, C_IN - C_A)
        out_n = offs_n + second * C_A
        x_ptr += second * Q_DELTA
        stride_xn, stride_xd = select(second, stride_xn, stride_qn), select(second, stride_xd, stride_qd)
        stride_xh, stride_xw = select(second, stride_xh, stride_qh), select(second, stride_xw, stride_qw)
    elif not PACK_TAPS:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] input channels
        mask_n = offs_n < C_IN
        out_n = offs_n
    mask_m = offs_m < C_OUT
    row_start = tl.program_id(1).to(tl.int64) * SPLIT_ROWS
    row_end = tl.minimum(row_start + SPLIT_ROWS, M)

    # This step's BLOCK_K output voxels, advanced in mixed radix each step (the ring's: from its index)
    n, od, oh, ow, digits = voxel_steps(row_start, D_OUT, H_OUT, W_OUT, BLOCK_K)
    tl.static_assert(not (RING and (PACK_TAPS or GO_DENSE)), "RING: one tap a program, grad_out's rows by voxel")

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(row_start, row_end, BLOCK_K):
        mask_k = tl.arange(0, BLOCK_K) < (row_end - k0).to(tl.int32)  # [BLOCK_K] output voxels
        if RING:  # the ring's voxels split from their index each step: in int32 unless M nears 2^31 (WIDE_ROWS)
            ring_index = k0 + tl.arange(0, BLOCK_K)
            n, od, oh, ow = ring_voxel(ring_index if WIDE_ROWS else ring_index.to(tl.int32), D_OUT, H_OUT, W_OUT,
                                       RING_TOP, RING_BOTTOM, RING_LEFT, RING_RIGHT)  # fmt: skip
            n, od, oh, ow = n.to(tl.int32), od.to(tl.int32), oh.to(tl.int32), ow.to(tl.int32)
        if not PACK_TAPS:  # one tap: its input voxels, one per output voxel
            id_ = od * STRIDE_D - PAD_D + kd * DIL_D
            ih = oh * STRIDE_H - PAD_H + kh * DIL_H
            iw = ow * STRIDE_W - PAD_W + kw * DIL_W
            if MASK_ONLY:
                mask_x = mask_k & (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
        # Coordinates are int32; offsets from them need int64.
        if GO_DENSE:  # channels_last_3d grad_out: the voxel's row is its linear index
            g_rows = (k0 + tl.arange(0, BLOCK_K)) * stride_gw  # all groups' channels (launcher: ndhwc_strides)
        else:
            g_rows = (n.to(tl.int64) * stride_gn + od.to(tl.int64) * stride_gd + oh.to(tl.int64) * stride_gh
                      + ow.to(tl.int64) * stride_gw)  # [BLOCK_K]  # fmt: skip
        g_ptrs = go_ptr + g_rows[None, :] + offs_m[:, None] * stride_gc  # [BLOCK_M, BLOCK_K]
        a = tl.load(g_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if PACK_TAPS:  # the tap varies along the columns: bounds and offsets per (voxel, pair)
            d0 = od * STRIDE_D - PAD_D
            h0 = oh * STRIDE_H - PAD_H
            w0 = ow * STRIDE_W - PAD_W
            id_ = d0[:, None] + (kd * DIL_D)[None, :]  # [BLOCK_K, BLOCK_N]
            ih = h0[:, None] + (kh * DIL_H)[None, :]
            iw = w0[:, None] + (kw * DIL_W)[None, :]
            if MASK_ONLY:
                inside = (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
                mask_b = inside & mask_k[:, None] & mask_n[None, :]
                x_rows = (n.to(tl.int64) * stride_xn + d0.to(tl.int64) * stride_xd + h0.to(tl.int64) * stride_xh
                          + w0.to(tl.int64) * stride_xw)  # [BLOCK_K]  # fmt: skip
                x_cols = ((kd * DIL_D).to(tl.int64) * stride_xd + (kh * DIL_H).to(tl.int64) * stride_xh
                          + (kw * DIL_W).to(tl.int64) * stride_xw + offs_c * stride_xc)  # [BLOCK_N]  # fmt: skip
                x_ptrs = x_ptr + x_rows[:, None] + x_cols[None, :]  # [BLOCK_K, BLOCK_N]
            else:
                x_voxels, inside = border_gather(
                    n[:, None], id_, ih, iw, D_IN, H_IN, W_IN, P_FRAMES, P_DELTA,
                    stride_xn, stride_xd, stride_xh, stride_xw, stride_pn, stride_pd, stride_ph, stride_pw,
                    PAD_MODE_D, PAD_MODE_H, PAD_MODE_W, HAS_PREFIX,
                )  # fmt: skip
                mask_b = inside & mask_k[:, None] & mask_n[None, :]
                x_ptrs = x_ptr + x_voxels + (offs_c * stride_xc)[None, :]
            b = gather_tile(x_ptrs, mask_b, THREADS_ALONG_ROWS=False)  # each thread few voxels, many pairs
        else:
            if MASK_ONLY:
                x_rows = (n.to(tl.int64) * stride_xn + id_.to(tl.int64) * stride_xd + ih.to(tl.int64) * stride_xh
                          + iw.to(tl.int64) * stride_xw)  # [BLOCK_K]  # fmt: skip
            else:
                x_rows, inside = border_gather(
                    n, id_, ih, iw, D_IN, H_IN, W_IN, P_FRAMES, P_DELTA,
                    stride_xn, stride_xd, stride_xh, stride_xw, stride_pn, stride_pd, stride_ph, stride_pw,
                    PAD_MODE_D, PAD_MODE_H, PAD_MODE_W, HAS_PREFIX,
                )  # fmt: skip
                mask_x = mask_k & inside
            x_ptrs = x_ptr + x_rows[:, None] + offs_n[None, :] * stride_xc  # [BLOCK_K, BLOCK_N]
            b = tl.load(x_ptrs, mask=mask_x[:, None] & mask_n[None, :], other=0.0)
        acc = mma(acc, a, b, UPCAST_DOT, INPUT_PRECISION)
        if not RING:
            n, od, oh, ow = next_voxels(n, od, oh, ow, digits, D_OUT, H_OUT, W_OUT)

    mask_out = mask_m[:, None] & mask_n[None, :]
    if PACK_TAPS:
        out_cols = tap * stride_ot + offs_c * stride_oi  # [BLOCK_N]
        out_ptrs = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None] * stride_oo + out_cols[None, :]
    else:
        if DIAG_CI:  # the diagonal blocks alone, each at its group's channels
            mask_out &= (offs_m // DIAG_CO)[:, None] == (out_n // DIAG_CI)[None, :]
            out_n = out_n % DIAG_CI
        out_ptrs = (out_ptr + tl.program_id(1) * stride_os + tap * stride_ot
                    + offs_m[:, None] * stride_oo + out_n[None, :] * stride_oi)  # [BLOCK_M, BLOCK_N]  # fmt: skip
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_out)


@triton.jit
def _conv3d_wgrad_out_pairs_kernel(
    # pointers
    go_ptr, x_ptr, out_ptr,
    # sizes (M: input voxels N*D*H*W; C_IN and x's strides are one group's)
    M, C_IN, D_IN, H_IN, W_IN, D_OUT, H_OUT, W_OUT, SPLIT_ROWS,
    # strides, in elements: go and x in logical (N, C, D, H, W) order; out is [split, Cout, tap, Cin]
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_os, stride_oo, stride_ot, stride_oi,
    # convolution geometry (unit stride, zeros borders; front padding)
    PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # meta-parameters
    C_OUT: tl.constexpr, RUN: tl.constexpr, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """gw[co, tap, ci] = sum over input voxels v of go[v + pad - tap * dil, co] * x[v, ci], at unit stride, for
    fewer output channels than one MMA's rows (a decoder's conv to 3 channels, a UNet's to its classes).

    GEMM view: M = taps x Cout (tap, output channel) rows, N = Cin columns, K = N*D*H*W input voxels. The one-tap
    form (_conv3d_wgrad_kernel) puts Cout = 3 on 64 MMA rows, a program a tap, and gathers x 27 times over; here
    27 x 3 = 81 pairs fill 128 rows, x's rows load once, whole, and go is gathered per (pair, voxel), its bounds a
    bit a tap (utils.tap_bits, once a step for the step's voxels). The pairs' offsets and bit indices are the
    program's, found before the loop. C_OUT (the group's output channels) is a constexpr: constant divisions.
    Where go's strides are multiples of RUN (the forward's), a voxel's run of a tap's channels loads as a vector.
    Split-K over the voxels as the one-tap form, into the same fp32 partials.
    """
    TAPS: tl.constexpr = KD * KH * KW
    tl.static_assert(TAPS < 64, "tap bits: at most 63 taps")
    if RUN > 1:  # go's strides multiples of RUN, as the compiler can see
        stride_gn, stride_gd, stride_gh, stride_gw = runs_aligned(stride_gn, stride_gd, stride_gh, stride_gw, RUN)
    group = tl.program_id(2)  # grouped convolution: shifted base pointers, as in the forward
    go_ptr += group * C_OUT * stride_gc
    x_ptr += group * C_IN * stride_xc
    out_ptr += group * C_OUT * stride_oo
    num_n = tl.cdiv(C_IN, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] (tap, output channel) pairs
    tap, kd, kh, kw, offs_co, mask_m = tap_pairs(offs_m, C_OUT, KD, KH, KW)
    # Tap (kd, kh, kw) of input voxel v reads go at v + pad - k * dil: the pair's part of that offset.
    g_pairs = (offs_co * stride_gc - (kd * DIL_D).to(tl.int64) * stride_gd - (kh * DIL_H).to(tl.int64) * stride_gh
               - (kw * DIL_W).to(tl.int64) * stride_gw)  # [BLOCK_M]  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] input channels
    mask_n = offs_n < C_IN

    row_start = tl.program_id(1).to(tl.int64) * SPLIT_ROWS
    row_end = tl.minimum(row_start + SPLIT_ROWS, M)
    n, vd, vh, vw, digits = voxel_steps(row_start, D_IN, H_IN, W_IN, BLOCK_K)  # the step's input voxels
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(row_start, row_end, BLOCK_K):
        mask_k = tl.arange(0, BLOCK_K) < (row_end - k0).to(tl.int32)  # [BLOCK_K] input voxels
        # go's voxel under tap (0, 0, 0), and which taps of each voxel read inside go
        gd, gh, gw = vd + PAD_D, vh + PAD_H, vw + PAD_W
        inside_taps = tap_bits(gd, gh, gw, mask_k, D_OUT, H_OUT, W_OUT, -DIL_D, -DIL_H, -DIL_W, KD, KH, KW)
        g_rows = (n.to(tl.int64) * stride_gn + gd.to(tl.int64) * stride_gd + gh.to(tl.int64) * stride_gh
                  + gw.to(tl.int64) * stride_gw)  # [BLOCK_K]  # fmt: skip
        # A warp's threads along the voxels: each thread one voxel's tap bits a step and several pairs (along the
        # pairs, each thread 8 voxels' bits a step: sm_90, triton 3.6, 1883 instructions a 16-voxel step, not 325).
        g_ptrs = go_ptr + g_rows[:, None] + g_pairs[None, :]  # [BLOCK_K, BLOCK_M]
        a = tl.trans(gather_tile(g_ptrs, tap_inside(inside_taps, tap, mask_m, TAPS), THREADS_ALONG_ROWS=True))
        x_rows = (n.to(tl.int64) * stride_xn + vd.to(tl.int64) * stride_xd + vh.to(tl.int64) * stride_xh
                  + vw.to(tl.int64) * stride_xw)  # [BLOCK_K]  # fmt: skip
        x_ptrs = x_ptr + x_rows[:, None] + offs_n[None, :] * stride_xc  # [BLOCK_K, BLOCK_N]
        b = tl.load(x_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = mma(acc, a, b, UPCAST_DOT, INPUT_PRECISION)
        n, vd, vh, vw = next_voxels(n, vd, vh, vw, digits, D_IN, H_IN, W_IN)

    out_rows = offs_co * stride_oo + tap * stride_ot  # [BLOCK_M]
    out_ptrs = out_ptr + tl.program_id(1) * stride_os + out_rows[:, None] + offs_n[None, :] * stride_oi
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


# The fewest reduction steps a split of the border ring's launch takes (where the interior's splits would leave
# fewer, the ring takes fewer splits): LTX-2's 512-channel layer at 5 x 16 x 16 has a ring of 4 steps a frame.
RING_SPLIT_STEPS = 8


def conv3d_wgrad(
    grad_out, x, frames_before, geom: ConvGeometry, config: KernelConfig, channels_after=None, diagonal=1
) -> torch.Tensor:
    """Weight gradient of checked arguments, in x's dtype, laid out channels_last_3d: (Cout, kd, kh, kw, Cin).
    The tiling, split-K included, is `config`. channels_after follows x's channels (geom.after_channels), read in
    place where the config's kernel can (config.reads_channels_after), else concatenated first. `diagonal` > 1:
    the gradient of the weight of groups `diagonal` times as many as geom's, run side by side (kernels/grouped.py):
    the diagonal blocks of geom's, stored alone by the pointer kernel (grouped.in_place), else copied out."""
    diag = (0, 0)
    if diagonal > 1:
        if channels_after is not None or not grouped.in_place("wgrad", geom, config):
            whole = conv3d_wgrad(grad_out, x, frames_before, geom, config, channels_after)
            return grouped.diagonal_blocks(whole, geom, diagonal)
        diag = grouped.diagonal_channels(geom, diagonal)
    c_out, c_in, taps = geom.out_channels, diag[0] or geom.group_in_channels, geom.taps
    # (Cout, taps, Cin) storage viewed as the logical (Cout, Cin, kd, kh, kw) weight is its channels_last_3d form.
    grad_w = torch.empty((c_out, taps, c_in), dtype=x.dtype, device=x.device)
    grad_w_logical = grad_w.view(c_out, *geom.kernel, c_in).permute(0, 4, 1, 2, 3)
    rows = geom.output_voxels
    if rows == 0:
        return grad_w_logical.zero_()
    grad_out, x = ndhwc(grad_out), ndhwc(x)
    frames_before = ndhwc(frames_before) if geom.prefix_frames else None
    x, channels_after, geom = channel_sources("wgrad", x, channels_after, geom, config)
    # The parts of the reduction over output voxels: all of them, or, where a box kernel runs a layer whose border
    # in H or W reads input voxels, the interior on it (conv_fwd.interior_part) and the border ring around it on the
    # pointer kernel in one launch, each part's fp32 partial sums in splits of their own: the ring's as many as the
    # interior's (its programs, tiled alike, fill the SMs alike), as far as they keep RING_SPLIT_STEPS steps each.
    if leaves_border_ring(geom, config):
        interior, view = interior_part(geom, grad_out)
        plan = _split_plan(interior, config)
        ring = pointer_tiles(config, "wgrad", geom, x.element_size())
        ring_rows = geom.batch * geom.out_size[0] * ring_voxels(geom)
        ring_splits = min(plan[2], max(1, cdiv(ring_rows, ring.block_k) // RING_SPLIT_STEPS))
        ring_split = split_rows(ring_rows, ring_splits, ring.block_k)
        parts = [
            (interior, view, config, plan, False),
            (geom, grad_out, ring, (ring_rows, ring_split, cdiv(ring_rows, ring_split)), True),
        ]
    else:
        parts = [(geom, grad_out, config, _split_plan(geom, config), False)]
    splits = sum(plan[2] for *_, plan, _ in parts)
    # One split writes the result directly; several write fp32 partial sums that split_k.sum_splits adds.
    if splits == 1:
        out = grad_w[None]
    else:
        out = torch.empty((splits, c_out, taps, c_in), dtype=torch.float32, device=x.device)
    first = 0
    for part, view, part_config, (reduced, per_split, count), ring in parts:
        # One part writes out whole (a slice of it would be a view that Inductor's tracing copies back).
        part_out = out if len(parts) == 1 else out[first : first + count]
        _launch(view, x, frames_before, channels_after, part_out, part, part_config, reduced, per_split, ring, diag)
        first += count
    if splits > 1:
        sum_splits(out, grad_w)
    return grad_w_logical


def _split_plan(geom: ConvGeometry, config: KernelConfig) -> tuple[int, int, int]:
    """(reduction, reduction per split, splits) of a weight-gradient launch: output patches (the box kernels) or
    voxels."""
    if config.tma_box_w:
        reduced, step = wgrad_tma_patches(geom, config), 1
    else:  # voxels (input voxels for out pairs: gemm_view); the direct kernels step block_m, the pointer ones block_k
        reduced, step = gemm_view("wgrad", geom).reduction, config.block_m if config.direct else config.block_k
    per_split = split_rows(reduced, config.split_k, step)
    return reduced, per_split, cdiv(reduced, per_split)


def _launch(grad_out, x, frames_before, channels_after, out, geom, config, reduced, per_split, ring=False, diag=(0, 0)):
    """One part's launch(es) into `out`, its `reduced` patches (box kernels) or voxels `per_split` a split; with
    `ring`, the pointer kernel's over the border ring's voxels (border_widths) alone; `diag`, the pointer kernel's
    (DIAG_CI, DIAG_CO)."""
    if config.tma_box_w:
        box_launch = conv3d_wgrad_gluon if config.gluon else conv3d_wgrad_tma
        patches = reduced
        if channels_after is None:
            box_launch(grad_out, x, out, geom, config, patches, per_split, frames_before)
        else:  # each source its own launch, into its columns of out: the box kernels' loops stay one-source
            first, after = geom.channel_sources
            for source, columns, channels in ((x, slice(0, first), first), (channels_after, slice(first, None), after)):
                part = replace(geom, in_channels=channels, after_channels=0)
                box_launch(grad_out, source, out[..., columns], part, config, patches, per_split, None)
    elif config.direct:
        depthwise_wgrad(grad_out, x, out, geom, config, per_split)
    else:
        upcast, precision = dot_flags(x.dtype)
        _launch_pointer_kernel(
            grad_out, x, frames_before, channels_after, out, geom, config, reduced, per_split, upcast, precision, ring,
            diag
        )  # fmt: skip


def _launch_pointer_kernel(
    grad_out, x, frames_before, channels_after, out, geom, config, rows, rows_per_split, upcast, precision, ring=False,
    diag=(0, 0)
):  # fmt: skip
    """The pointer kernels' launch reducing over `rows` voxels (gemm_view's reduction; with `ring`, the border
    ring's), `rows_per_split` a split."""
    c_out, c_in = geom.group_out_channels, geom.group_in_channels
    # tile rows: Cout, or (tap, output channel) pairs (packs_out_taps); the ring's one tap a program whatever they pack
    view = gemm_view("wgrad", geom)
    tile_rows, cols, grid_taps = (c_out, c_in, geom.taps) if ring else (view.rows, view.cols, view.grid_taps)
    col_tiles = channel_blocks(geom, config.block_n) if channels_after is not None else cdiv(cols, config.block_n)
    grid = (cdiv(tile_rows, config.block_m) * col_tiles * grid_taps, out.shape[0], geom.groups)
    if packs_out_taps(geom) and not ring:  # one source, zeros borders, unit stride
        launch(
            _conv3d_wgrad_out_pairs_kernel, grid,
            grad_out, x, out,
            rows, c_in, *geom.in_size, *geom.out_size, rows_per_split,
            *ndhwc_strides(grad_out), *x.stride(), *out.stride(),
            *geom.front_padding, *geom.dilation,
            *geom.kernel,
            C_OUT=c_out, RUN=channel_run(c_out, grad_out), UPCAST_DOT=upcast, INPUT_PRECISION=precision,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )  # fmt: skip
        return
    p_delta, *p_strides = second_source_arguments(frames_before, x)
    q_delta, *q_strides = second_source_arguments(channels_after, x)
    go_strides = ndhwc_strides(grad_out)
    packed = not ring and packs_taps("wgrad", geom)
    # x's run: the packed loop's pairs'; a plain loop's where Triton cannot see it (24 or 40 channels); none for
    # channels_after, whose second source's strides the kernel does not rewrite
    if packed:
        x_run = channel_run(c_in, x, frames_before)
    else:
        x_run = 1 if channels_after is not None else unseen_run(c_in, x, frames_before)
    launch(
        _conv3d_wgrad_kernel, grid,
        grad_out, x, out,
        rows, c_in, *geom.in_size, c_out, *geom.out_size, geom.prefix_frames, p_delta, geom.channel_sources[0],
        q_delta, rows_per_split, *(border_widths(geom) if ring else (0, 0, 0, 0)),
        *go_strides, *x.stride(), *p_strides, *q_strides, *out.stride(),
        *geom.stride, *geom.front_padding, *geom.dilation,
        *geom.kernel,
        GO_DENSE=not ring and go_strides == dense_ndhwc_strides(grad_out), PACK_TAPS=c_in if packed else 0,
        RUN=x_run,
        GO_RUN=unseen_run(c_out, grad_out),
        HAS_PREFIX=frames_before is not None, HAS_AFTER=channels_after is not None, RING=ring, DIAG_CI=diag[0],
        WIDE_ROWS=wide_rows(rows, config.block_k),
        _distances=frames_before is not None or channels_after is not None,  # second_source_arguments'
        DIAG_CO=diag[1],
        PAD_MODE_D=geom.pad_mode_indices[0], PAD_MODE_H=geom.pad_mode_indices[1], PAD_MODE_W=geom.pad_mode_indices[2],
        UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
