"""Conv3d forward: an implicit-GEMM Triton kernel on NDHWC tensors, and its launcher."""

import dataclasses

import torch
import triton
import triton.language as tl

from ..geometry import ConvGeometry, check_padding_mode
from . import grouped
from .config import (
    KernelConfig,
    channel_sources,
    gemm_view,
    k_splits,
    packs_taps,
    pointer_tiles,
    w_tap_columns,
    w_tap_tiles,
)
from .conv_depthwise import depthwise_fwd
from .conv_gluon import conv3d_gluon
from .conv_tma import conv3d_tma
from .launch import launch
from .split_k import ndhwc_partials, sum_splits
from .tensors import cdiv, empty_ndhwc, ndhwc
from .utils import (
    block_channels,
    border_gather,
    channel_run,
    dot_flags,
    flat_rows,
    gather_tile,
    grouped_tile,
    mma,
    ring_voxel,
    run_aligned,
    runs_aligned,
    second_source_arguments,
    select,
    source_blocks,
    split_voxel,
    split_w_tap_columns,
    strides_seen,
    sum_w_taps,
    tap_bits,
    tap_inside,
    tap_pairs,
    unseen_run,
    wide_rows,
)


@triton.jit
def _conv3d_fwd_kernel(
    # pointers
    x_ptr, w_ptr, bias_ptr, y_ptr,
    # sizes (D_IN counts the P_FRAMES frames of the second source p in front of x along D; p starts P_DELTA
    # elements from x_ptr; C_IN counts the C_IN - C_A channels of the second source q after x's C_A along C, q
    # starting Q_DELTA elements from x_ptr; a split-K program reduces SPLIT_STEPS of the K steps; with RING, M
    # counts the voxels of each frame's ring, RING_TOP / BOTTOM rows and RING_LEFT / RIGHT columns wide)
    M, C_IN, D_IN, H_IN, W_IN, C_OUT, D_OUT, H_OUT, W_OUT, P_FRAMES, P_DELTA, C_A, Q_DELTA, SPLIT_STEPS,
    RING_TOP, RING_BOTTOM, RING_LEFT, RING_RIGHT,
    # strides, in elements, in logical (N, C, D, H, W) order (p, q: N, D, H, W; their channels are unit-stride
    # as x's; y's splits lie stride_ys apart)
    stride_xn, stride_xc, stride_xd, stride_xh, stride_xw,
    stride_pn, stride_pd, stride_ph, stride_pw,
    stride_qn, stride_qd, stride_qh, stride_qw,
    stride_wo, stride_wi, stride_wd, stride_wh, stride_ww,
    stride_ys, stride_yn, stride_yc, stride_yd, stride_yh, stride_yw,
    # convolution geometry (front padding only: the back padding just sets the output size; PAD_MODE_D/H/W say
    # what each dimension's border reads, geometry.PADDING_MODES[PAD_MODE_*])
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # meta-parameters
    HAS_BIAS: tl.constexpr, PACK_TAPS: tl.constexpr, RUN: tl.constexpr, W_TAPS: tl.constexpr,
    DIAG_CI: tl.constexpr, DIAG_CO: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_AFTER: tl.constexpr,
    RING: tl.constexpr, WIDE_ROWS: tl.constexpr, FLAT_Y: tl.constexpr,
    PAD_MODE_D: tl.constexpr, PAD_MODE_H: tl.constexpr, PAD_MODE_W: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y[m, co] = sum over (tap, ci) of x[voxel(m) + tap, ci] * w[co, tap, ci] (+ bias[co]).

    GEMM view: M = N*Do*Ho*Wo rows (output voxels), N = Cout columns, K = kd*kh*kw*Cin. The reduction runs as
    one flat loop over taps x channel blocks so the compiler pipelines it whatever Cin is; zeros padding is a
    mask, other modes and a second source along D (HAS_PREFIX) remap each row's load (kernel_utils.border_gather).
    A second source along C (HAS_AFTER: a channel concatenation read in place) adds its own channel blocks after
    x's: each step's block lies in one source, whose rows the step selects (utils.select, no branch).
    With PACK_TAPS (fewer channels than one MMA step: it is that count, C_IN, a constexpr) the loop runs over (tap,
    channel) pairs instead: the Cin = 3 stem's 27 x 3 = 81 fill three 32-wide steps, where one tap per step took 27
    steps 3/16 full. Each pair then has its own tap, so each element of a step's tile its own bounds: with zeros
    borders and at most 63 taps, which of a row's taps lie inside the input is found once a tile, a bit a tap
    (TAP_BITS), and a step tests one bit an element instead of six bounds. Where every stride of x (p) and the
    weight but the channels' is a multiple of RUN elements (utils.channel_run: 8 in 16 bits at 8 channels), each
    tap's channels of a voxel are one aligned run, loaded as a vector (and so are DIAG_CI's weight rows, below);
    so are a plain loop's where Triton cannot see that itself (utils.unseen_run: 24 or 40 channels).
    With W_TAPS (fewer output channels than one MMA step: a decoder's conv to 3 channels) the columns are (output
    channel, W tap) pairs, W_TAPS of them a channel, and the loop runs over the (kd, kh) taps only: a row is a
    voxel of an output row extended by the W taps' reach (HALO), M counts them, and each (kd, kh) step reads its
    input row once for every W tap, Q[r, (co, kw)] = sum over (kd, kh, ci) of x[voxel(r) + (kd, kh, 0), ci] *
    w[co, kd, kh, kw, ci]. Output voxel r then adds Q[r + kw * DIL_W, (co, kw)] over kw (a gather along the tile's
    rows): a tile computes BLOCK_M rows and writes the BLOCK_M - HALO whose last tap lies in it, tiles overlapping
    by HALO rows.
    With DIAG_CI (groups of few channels run side by side, kernels/grouped.py) a group's weight is block-diagonal
    and only its blocks are stored: the weight's rows hold DIAG_CI channels, and column co reads channel ci as
    channel ci % DIAG_CI of its row where ci and co lie in the same block of DIAG_CI input and DIAG_CO output
    channels, zeros elsewhere.
    Split-K (grid axis 2): program s reduces steps [s * SPLIT_STEPS, (s + 1) * SPLIT_STEPS) into split s of an fp32
    y, the bias in split 0's; split_k.sum_splits adds the splits.
    With RING the rows are the voxels of each output frame's border ring only (utils.ring_voxel): where a box kernel
    computes the interior of a forward whose border in H or W reads input voxels, this one launch computes the
    rest (conv_fwd.conv3d_fwd).
    """
    # A pointwise weight's tap strides can be anything, and a contiguous 1x1x1 weight's are 1 (torch counts it
    # channels_last_3d as it is), which Triton specializes: kd * stride_wd then hides the alignment of every weight
    # row, and the weight loaded element by element (sm_80, 128 x 128 x 64: 16 LDG.U16 and STS.U16 a step, 40
    # bytes spilled). Its tap index is always 0: zero them, as the compiler can see. (Zeroing the unit dimensions
    # of other kernels, whose strides torch makes channels-last ones, only moved their instruction counts both
    # ways: bench/NOTES.md, thirty-third session.)
    if KD * KH * KW == 1:
        stride_wd, stride_wh, stride_ww = 0, 0, 0
    if RUN > 1:  # multiples of RUN, as the compiler can see (utils.run_aligned)
        C_IN = run_aligned(C_IN, RUN)  # a group's channels (its first one's offset)
        stride_xn, stride_xd, stride_xh, stride_xw = runs_aligned(stride_xn, stride_xd, stride_xh, stride_xw, RUN)
        stride_pn, stride_pd, stride_ph, stride_pw = runs_aligned(stride_pn, stride_pd, stride_ph, stride_pw, RUN)
        stride_wo, stride_wd, stride_wh, stride_ww = runs_aligned(stride_wo, stride_wd, stride_wh, stride_ww, RUN)
    # Zeros borders and one source: a mask suffices and each tap's offset is one constant added to every row.
    MASK_ONLY: tl.constexpr = PAD_MODE_D == 0 and PAD_MODE_H == 0 and PAD_MODE_W == 0 and not HAS_PREFIX
    # Grouped convolution (grid axis 1): a group's channels are a contiguous run of every voxel's and its output
    # channels a run of the weight's rows, so each group is this GEMM from shifted base pointers (C_IN and C_OUT
    # count one group's channels).
    tl.static_assert(not DIAG_CI or not (PACK_TAPS or W_TAPS or HAS_AFTER), "DIAG_CI: a tap's channels, one source")
    group = tl.program_id(1)
    x_ptr += group * C_IN * stride_xc
    w_ptr += group * C_OUT * stride_wo
    y_ptr += group * C_OUT * stride_yc
    bias_ptr += group * C_OUT
    split = tl.program_id(2)
    y_ptr += split * stride_ys
    if W_TAPS:  # BLOCK_M rows a tile, BLOCK_M - HALO of them outputs; W_TAPS columns an output channel
        tl.static_assert(not PACK_TAPS and W_TAPS >= KW and BLOCK_N % W_TAPS == 0, "W_TAPS: KW <= W_TAPS | BLOCK_N")
        HALO = (KW - 1) * DIL_W
        ROW = W_OUT + HALO  # an output row extended by the taps' reach
        OUT_COLS: tl.constexpr = BLOCK_N // W_TAPS
        tile_rows = BLOCK_M - HALO
    else:
        ROW = W_OUT
        OUT_COLS: tl.constexpr = BLOCK_N
        tile_rows = BLOCK_M
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, tile_rows), tl.cdiv(C_OUT, OUT_COLS), GROUP_M)

    # Row indices and the coordinates split from them in int32 unless M nears 2^31 (WIDE_ROWS): an int64
    # division is a subroutine call, and the epilogue redoes the split in its store's layout (FLAT_Y aside), each
    # thread for each of its rows (r30_56_54's bf16 forward at 64 x 64 x 16 on sm_90, in int64: 5 calls before
    # the loop, 186 after it, 255 registers and 368 bytes spilled; in int32 with FLAT_Y: 70 registers).
    offs_m = pid_m.to(tl.int64 if WIDE_ROWS else tl.int32) * tile_rows + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    mask_m = offs_m < M
    offs_o = pid_n * OUT_COLS + tl.arange(0, OUT_COLS)  # [OUT_COLS] the tile's output channels
    if W_TAPS:  # column j: output channel j // W_TAPS, W tap j % W_TAPS
        offs_n, col_tap, mask_n = split_w_tap_columns(pid_n, C_OUT, KW, W_TAPS, BLOCK_N)  # [BLOCK_N]
    else:
        offs_n = offs_o
        mask_n = offs_n < C_OUT

    if RING:
        tl.static_assert(not W_TAPS, "RING: one output voxel a row")
        n, od, oh, ow = ring_voxel(offs_m, D_OUT, H_OUT, W_OUT, RING_TOP, RING_BOTTOM, RING_LEFT, RING_RIGHT)
    else:
        n, od, oh, ow = split_voxel(offs_m, D_OUT, H_OUT, ROW)
    # The input voxel under tap (0, 0, 0); coordinates fit int32, offsets from them need int64.
    n = n.to(tl.int64)
    d0 = (od * STRIDE_D - PAD_D).to(tl.int32)
    h0 = (oh * STRIDE_H - PAD_H).to(tl.int32)
    w0 = (ow * STRIDE_W - PAD_W).to(tl.int32)
    x_offsets = (n * stride_xn + d0.to(tl.int64) * stride_xd + h0.to(tl.int64) * stride_xh
                 + w0.to(tl.int64) * stride_xw)  # fmt: skip
    x_rows = x_ptr + x_offsets  # [BLOCK_M] pointers
    w_cols = w_ptr + offs_n * stride_wo  # [BLOCK_N] pointers
    if W_TAPS:
        w_cols += col_tap * stride_ww

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_blocks, k_blocks = source_blocks(C_A, C_IN, BLOCK_K, HAS_AFTER)  # x's channel blocks, then q's
    if HAS_AFTER:
        tl.static_assert(not PACK_TAPS and not HAS_PREFIX, "channels_after: unpacked channels, one source along D")
        # q's rows under tap (0, 0, 0), as offsets from x's
        q_rows = (Q_DELTA + n * stride_qn + d0.to(tl.int64) * stride_qd + h0.to(tl.int64) * stride_qh
                  + w0.to(tl.int64) * stride_qw) - x_offsets  # [BLOCK_M]  # fmt: skip
    TAPS: tl.constexpr = KD * KH * KW
    STEP_KW: tl.constexpr = 1 if W_TAPS else KW  # the W taps a step walks: one (kw = 0) where they are columns
    TAP_BITS: tl.constexpr = PACK_TAPS and MASK_ONLY and TAPS < 64
    if TAP_BITS:  # bit t of a row: tap t reads inside the input (and the row is one)
        inside_taps = tap_bits(d0, h0, w0, mask_m, D_IN, H_IN, W_IN, DIL_D, DIL_H, DIL_W, KD, KH, KW)
    steps = tl.cdiv(TAPS * C_IN, BLOCK_K) if PACK_TAPS else KD * KH * STEP_KW * k_blocks
    first = split * SPLIT_STEPS
    for step in range(first, tl.minimum(first + SPLIT_STEPS, steps)):
        if PACK_TAPS:  # few channels: BLOCK_K (tap, channel) pairs a step, each with its own tap
            offs_r = step * BLOCK_K + offs_k  # [BLOCK_K] = tap * C_IN + channel
            tap, kd, kh, kw, offs_c, mask_c = tap_pairs(offs_r, PACK_TAPS, KD, KH, KW)
            if not TAP_BITS:  # bounds per (voxel, pair)
                id_ = d0[:, None] + (kd * DIL_D)[None, :]  # [BLOCK_M, BLOCK_K]
                ih = h0[:, None] + (kh * DIL_H)[None, :]
                iw = w0[:, None] + (kw * DIL_W)[None, :]
            if MASK_ONLY:
                x_tap = ((kd * DIL_D).to(tl.int64) * stride_xd + (kh * DIL_H).to(tl.int64) * stride_xh
                         + (kw * DIL_W).to(tl.int64) * stride_xw)  # fmt: skip
                x_ptrs = x_rows[:, None] + (x_tap + offs_c * stride_xc)[None, :]
                if TAP_BITS:
                    mask_a = tap_inside(inside_taps, tap, mask_c, TAPS)
                else:  # more than 63 taps
                    inside = (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
                    mask_a = inside & mask_m[:, None] & mask_c[None, :]
            else:
                x_voxels, inside = border_gather(
                    n[:, None], id_, ih, iw, D_IN, H_IN, W_IN, P_FRAMES, P_DELTA,
                    stride_xn, stride_xd, stride_xh, stride_xw, stride_pn, stride_pd, stride_ph, stride_pw,
                    PAD_MODE_D, PAD_MODE_H, PAD_MODE_W, HAS_PREFIX,
                )  # fmt: skip
                x_ptrs = x_ptr + x_voxels + (offs_c * stride_xc)[None, :]
                mask_a = inside & mask_m[:, None] & mask_c[None, :]
            a = gather_tile(x_ptrs, mask_a, THREADS_ALONG_ROWS=False)  # each thread few pairs, many voxels
            w_ptrs = w_cols[None, :] + (kd * stride_wd + kh * stride_wh + kw * stride_ww + offs_c * stride_wi)[:, None]
            b = gather_tile(w_ptrs, mask_c[:, None] & mask_n[None, :], THREADS_ALONG_ROWS=True)
        else:  # one tap, BLOCK_K of its channels (of one source)
            tap = step // k_blocks
            block = step - tap * k_blocks
            second, offs_c, mask_c, w_c = block_channels(block, a_blocks, C_A, C_IN, offs_k, BLOCK_K, HAS_AFTER)
            kw = tap % STEP_KW
            kh = (tap // STEP_KW) % KH
            kd = tap // (STEP_KW * KH)
            id_ = d0 + kd * DIL_D
            ih = h0 + kh * DIL_H
            iw = w0 + kw * DIL_W
            # the step's source's strides
            s_n, s_d, s_h, s_w = stride_xn, stride_xd, stride_xh, stride_xw
            if HAS_AFTER:
                s_n, s_d = select(second, stride_xn, stride_qn), select(second, stride_xd, stride_qd)
                s_h, s_w = select(second, stride_xh, stride_qh), select(second, stride_xw, stride_qw)
            if MASK_ONLY:
                mask_x = mask_m & (id_ >= 0) & (id_ < D_IN) & (ih >= 0) & (ih < H_IN) & (iw >= 0) & (iw < W_IN)
                x_tap = ((kd * DIL_D).to(tl.int64) * s_d + (kh * DIL_H).to(tl.int64) * s_h
                         + (kw * DIL_W).to(tl.int64) * s_w)  # fmt: skip
                rows = x_rows + second * q_rows if HAS_AFTER else x_rows
                x_ptrs = rows[:, None] + x_tap + offs_c[None, :] * stride_xc  # [BLOCK_M, BLOCK_K]
            else:
                x_voxels, inside = border_gather(
                    n, id_, ih, iw, D_IN, H_IN, W_IN, P_FRAMES, P_DELTA,
                    s_n, s_d, s_h, s_w, stride_pn, stride_pd, stride_ph, stride_pw,
                    PAD_MODE_D, PAD_MODE_H, PAD_MODE_W, HAS_PREFIX,
                )  # fmt: skip
                if HAS_AFTER:
                    x_voxels += second * Q_DELTA
                mask_x = mask_m & inside
                x_ptrs = x_ptr + x_voxels[:, None] + offs_c[None, :] * stride_xc
            a = tl.load(x_ptrs, mask=mask_x[:, None] & mask_c[None, :], other=0.0)
            mask_b = mask_c[:, None] & mask_n[None, :]
            if DIAG_CI:  # the weight's diagonal blocks where they lie (each block's channels one aligned run)
                mask_b &= (w_c // DIAG_CI)[:, None] == (offs_n // DIAG_CO)[None, :]
                w_c = w_c % DIAG_CI
            w_ptrs = (
                w_cols[None, :] + (kd * stride_wd + kh * stride_wh + kw * stride_ww) + w_c[:, None] * stride_wi
            )  # [BLOCK_K, BLOCK_N]
            b = tl.load(w_ptrs, mask=mask_b, other=0.0)
        acc = mma(acc, a, b, UPCAST_DOT, INPUT_PRECISION)

    if W_TAPS:  # output voxel r adds W tap kw's column from row r + kw * DIL_W
        acc = sum_w_taps(acc, col_tap * DIL_W, W_TAPS)  # [BLOCK_M, OUT_COLS]
        mask_m &= (tl.arange(0, BLOCK_M) < tile_rows) & (ow < W_OUT)
    if HAS_BIAS:
        bias_cols = tl.where(split == 0, C_OUT, 0)  # split 0's partial carries the bias
        acc += tl.load(bias_ptr + offs_o, mask=offs_o < bias_cols, other=0.0).to(tl.float32)[None, :]
    if FLAT_Y:  # row m's voxel lies m rows of y in: no coordinates to find again in the store's layout
        y_rows = offs_m.to(tl.int64) * stride_yw  # [BLOCK_M]
    else:
        y_rows = n * stride_yn + od.to(tl.int64) * stride_yd + oh.to(tl.int64) * stride_yh + ow.to(tl.int64) * stride_yw
    y_ptrs = y_ptr + y_rows[:, None] + offs_o[None, :] * stride_yc  # [BLOCK_M, OUT_COLS]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_o < C_OUT)[None, :])


def conv3d_fwd(
    x, weight, bias, frames_before, geom: ConvGeometry, config: KernelConfig, channels_after=None, diagonal=1
) -> torch.Tensor:
    """Forward convolution of checked arguments with the tiling `config`, split-K included; the output is
    channels_last_3d. channels_after follows x's channels (geom.after_channels), read in place where the config's
    kernel can (config.reads_channels_after), else concatenated first. `diagonal` > 1: `weight` is that of groups
    `diagonal` times as many as geom's, run side by side (kernels/grouped.py)."""
    y = empty_ndhwc(geom.output_shape(), like=x)
    if y.numel() == 0:
        return y
    x, weight = ndhwc(x), ndhwc(weight)
    weight, diag = grouped.diagonal_weight("fwd", weight, geom, config, diagonal)
    frames_before = ndhwc(frames_before) if geom.prefix_frames else None
    x, channels_after, geom = channel_sources("fwd", x, channels_after, geom, config)
    bias = bias.contiguous() if bias is not None else None  # the epilogue reads it with unit stride
    if config.direct:  # depthwise, zeros padding, one source (configs.direct_eligible; channels concatenated)
        return depthwise_fwd(x, weight, bias, y, geom, config)
    per_split, splits = k_splits("fwd", geom, config)
    # One split writes y; several write fp32 partial sums of it, which split_k.sum_splits adds.
    out = y if splits == 1 else ndhwc_partials(y, splits)
    if leaves_border_ring(geom, config):
        # The box kernels read zeros past H and W: they compute the interior, and one pointer launch the ring of
        # border voxels around it, with the modes, in the same splits (its steps are the box kernels': one tap's
        # channel block each, the same BLOCK_K; a halo tile's step is KD of them, every tap along D).
        interior, view = interior_part(geom, out)
        _launch(x, weight, bias, frames_before, channels_after, view, interior, config, per_split, diag)
        ring = pointer_tiles(config, "fwd", geom, x.element_size())
        ring_split = per_split * (geom.kernel[0] if config.halo_d else 1)
        _launch_pointer_kernel(x, weight, bias, frames_before, channels_after, out, geom, ring, ring_split, diag, True)
    else:
        _launch(x, weight, bias, frames_before, channels_after, out, geom, config, per_split, diag)
    return y if splits == 1 else sum_splits(out, y)


def _launch(x, weight, bias, frames_before, channels_after, out, geom, config, per_split, diag):
    if config.gluon:  # the tuning layer checked the problem, the device and the tensors
        conv3d_gluon(x, weight, bias, out, geom, config, False, per_split, frames_before, channels_after)
    elif config.tma_box_w:  # the caller checked that the problem and the tensors are eligible
        conv3d_tma(x, weight, bias, out, geom, config, False, per_split, frames_before, channels_after)
    else:
        _launch_pointer_kernel(x, weight, bias, frames_before, channels_after, out, geom, config, per_split, diag)


def border_widths(geom: ConvGeometry) -> tuple[int, int, int, int]:
    """(top, bottom, left, right): the output rows and columns within the padding of a dimension whose border reads
    input voxels (another mode than zeros; 0 in a zeros dimension), at stride 1 in H and W."""
    _, mode_h, mode_w = geom.dim_modes
    top, bottom = (geom.padding[2], geom.padding[3]) if mode_h != "zeros" else (0, 0)
    left, right = (geom.padding[4], geom.padding[5]) if mode_w != "zeros" else (0, 0)
    return top, bottom, left, right


def leaves_border_ring(geom: ConvGeometry, config: KernelConfig) -> bool:
    """Whether `config`, a box kernel's, leaves the border of `geom` to the pointer kernel: the border in H or W
    reads input voxels (another mode than zeros), which a box's rows past the edge read as the TMA unit's zeros."""
    return bool(config.tma_box_w) and geom.dim_modes[1:] != ("zeros", "zeros")


def ring_voxels(geom: ConvGeometry) -> int:
    """The voxels of one output frame within the border widths (border_widths): those of its border ring."""
    _, h_out, w_out = geom.out_size
    top, bottom, left, right = border_widths(geom)
    return (top + bottom) * w_out + (h_out - top - bottom) * (left + right)


def interior_part(geom: ConvGeometry, y: torch.Tensor) -> tuple[ConvGeometry, torch.Tensor]:
    """The interior of a stride-1 forward (in H and W) whose border in H or W reads input voxels (replicate,
    reflect, circular): (its geometry, its view of `y`, or of any tensor laid out as y in H and W: the fp32 partial
    sums of y, grad_out). Its taps all stay inside the input in those dimensions, so it reads no border there: the
    box kernels' zeros (none is read) serve, and its geometry has no padding and zeros modes in them, its front
    padding moved by its first row and column. configs.tma_eligible asks for a non-empty interior."""
    d_out, h_out, w_out = geom.out_size
    top, bottom, left, right = border_widths(geom)
    padding = list(geom.padding)
    padding[2:] = padding[2] - top, padding[3] - bottom, padding[4] - left, padding[5] - right
    modes = check_padding_mode((geom.dim_modes[0], "zeros", "zeros"))
    size = (d_out, h_out - top - bottom, w_out - left - right)
    part = dataclasses.replace(geom, out_size=size, padding=tuple(padding), padding_mode=modes)
    return part, y[:, :, :, top : h_out - bottom, left : w_out - right]


def _launch_pointer_kernel(
    x, weight, bias, frames_before, channels_after, out, geom, config, per_split, diag=(0, 0), ring=False
):
    """The pointer kernel over the whole output, or with `ring` over the border voxels alone (border_widths), one
    tap's channel block a step (neither packed taps nor W-tap columns: the box kernels' steps, which the ring's
    splits share)."""
    p_delta, *p_strides = second_source_arguments(frames_before, x)
    q_delta, *q_strides = second_source_arguments(channels_after, x)
    upcast, precision = dot_flags(x.dtype)
    c_in, c_out = geom.group_in_channels, geom.group_out_channels
    w_taps = 0 if ring else w_tap_columns("fwd", geom)
    packed = not ring and packs_taps("fwd", geom)
    splits = out.shape[0] // geom.batch
    widths = border_widths(geom) if ring else (0, 0, 0, 0)
    # the ring's voxels, or the output voxels, or W-extended output rows (w_tap_columns)
    rows = geom.batch * geom.out_size[0] * ring_voxels(geom) if ring else gemm_view("fwd", geom).rows
    tiles = w_tap_tiles("fwd", geom, config) if w_taps else (cdiv(rows, config.block_m), cdiv(c_out, config.block_n))
    grid = (tiles[0] * tiles[1], geom.groups, splits)
    launch(
        _conv3d_fwd_kernel, grid,
        x, weight, bias if bias is not None else x, out,
        rows, c_in, *geom.in_size, c_out, *geom.out_size, geom.prefix_frames, p_delta, geom.channel_sources[0],
        q_delta, per_split, *widths,
        *x.stride(), *p_strides, *q_strides, *weight.stride(),
        geom.batch * out.stride(0) if splits > 1 else 0, *out.stride(),
        *geom.stride, *geom.front_padding, *geom.dilation,
        *geom.kernel,
        HAS_BIAS=bias is not None, PACK_TAPS=c_in if packed else 0,
        RUN=_run(c_in, x, frames_before, channels_after, weight, packed, diag),
        W_TAPS=w_taps, DIAG_CI=diag[0], DIAG_CO=diag[1],
        HAS_PREFIX=frames_before is not None,
        HAS_AFTER=channels_after is not None, RING=ring,
        WIDE_ROWS=wide_rows(rows, config.block_m), FLAT_Y=not ring and not w_taps and _flat_y(out),
        _distances=frames_before is not None or channels_after is not None,  # second_source_arguments'
        PAD_MODE_D=geom.pad_mode_indices[0], PAD_MODE_H=geom.pad_mode_indices[1], PAD_MODE_W=geom.pad_mode_indices[2],
        UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _flat_y(y: torch.Tensor) -> bool:
    """FLAT_Y of a launch (not the ring's, whose rows are no voxels in order): y's voxels one W stride apart
    (utils.flat_rows) and a stride of them not 16-divisible, so that Triton stores y element by element, each thread
    many rows (16 of 64 at 64 x 64 on 4 warps), for each of which the epilogue would split its index again. Where
    the strides are 16-divisible the vector store's threads hold few rows, and splitting them is cheaper than
    what ptxas does to keep the row block's start across the loop: fp32 128-row forwards on sm_80 (wan_dec_384a's
    128 x 64 x 32 on 8 warps, and nine more of the fixture) held to 128 registers and spilled it, 8 bytes."""
    return not strides_seen(y) and flat_rows(y)


def _run(c_in, x, frames_before, channels_after, weight, packed: bool, diag) -> int:
    """RUN of a launch (utils.channel_run): the packed loop's (tap, channel) pairs'; a grouped weight's diagonal
    blocks' (DIAG_CI channels a weight row); a plain loop's where Triton cannot see it (utils.unseen_run: 24
    channels, or a view's strides); 1 for a second source along C, whose strides the kernel does not rewrite."""
    if packed:
        return channel_run(c_in, x, frames_before, weight)
    if diag[0]:
        return channel_run(diag[0], x, frames_before, weight)
    return 1 if channels_after is not None else unseen_run(c_in, x, frames_before, weight)
