"""Conv3d input gradient: an implicit-GEMM Triton kernel on NDHWC tensors, split by stride phase, and its launcher."""

import math

import torch
import triton
import triton.language as tl

from ..geometry import ConvGeometry
from . import grouped
from .config import (
    KernelConfig,
    channel_sources,
    destination_dtype,
    k_splits,
    packs_taps,
    w_tap_columns,
    w_tap_halo,
    w_tap_tiles,
)
from .conv_depthwise import depthwise_dgrad
from .conv_gluon import conv3d_gluon
from .conv_tma import conv3d_tma, live_tap_table
from .fold import fold_bordered
from .launch import launch
from .split_k import ndhwc_partials, sum_splits
from .tensors import cdiv, empty_ndhwc, ndhwc
from .utils import (
    block_channels,
    channel_run,
    dot_flags,
    flat_rows,
    gather_tile,
    grouped_tile,
    mma,
    run_aligned,
    runs_aligned,
    second_source_arguments,
    select,
    source_blocks,
    split_voxel,
    split_w_tap_columns,
    sum_w_taps,
    tap_bits,
    tap_inside,
    tap_pairs,
    unseen_run,
    wide_rows,
)


@triton.jit
def _conv3d_dgrad_kernel(
    # pointers
    go_ptr, w_ptr, bias_ptr, gi_ptr, live_taps_ptr,
    # sizes (a phase holds every STRIDE-th input voxel: D_PHASE = ceil(D_IN / STRIDE_D), and so on; C_OUT counts
    # the C_OUT - C_A channels of the second source q after go's C_A along C, q starting Q_DELTA elements from
    # go_ptr; a split-K program reduces SPLIT_STEPS of the K steps)
    M_PHASE, C_IN, D_IN, H_IN, W_IN, C_OUT, D_OUT, H_OUT, W_OUT, D_PHASE, H_PHASE, W_PHASE, C_A, Q_DELTA, SPLIT_STEPS,
    # strides, in elements, in logical (N, C, D, H, W) order (q: N, D, H, W, its channels unit-stride as go's;
    # gi's splits lie stride_is apart)
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_qn, stride_qd, stride_qh, stride_qw,
    stride_wo, stride_wi, stride_wd, stride_wh, stride_ww,
    stride_is, stride_in, stride_ic, stride_id, stride_ih, stride_iw,
    # convolution geometry (front padding)
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # meta-parameters
    PACK_TAPS: tl.constexpr, RUN: tl.constexpr, W_TAPS: tl.constexpr, W_CIN: tl.constexpr,
    DIAG_CI: tl.constexpr, DIAG_CO: tl.constexpr, HAS_AFTER: tl.constexpr, HAS_BIAS: tl.constexpr,
    WIDE_ROWS: tl.constexpr, FLAT_GI: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """gi[i, ci] = sum over (tap, co) of go[(i + pad - tap * dil) / stride, co] * w[co, tap, ci], over the taps
    for which that division is exact (+ bias[ci]: a transposed convolution's).

    GEMM view: M = N*D*H*W input voxels, taken one stride phase at a time (the phase is the input coordinate
    modulo the stride in d, h and w; programs run phase after phase), N = Cin columns, K = live taps x Cout.
    Within a phase the same taps land on whole output voxels for every row, so the host lists those live taps
    and the dead ones, most of a strided transposed convolution, cost nothing. Per dimension the live taps of a
    phase are an arithmetic progression (first, step, count), read once per program: the reduction loop loads
    nothing but its two operands. With PACK_TAPS (fewer output channels than one MMA step: it is that count,
    C_OUT, a constexpr) K runs over (live tap, channel) pairs, as in the forward, and at unit stride with at most
    63 taps its bounds are a bit a tap, found once a tile (utils.tap_bits), and go's channel runs load as vectors
    where its strides allow (RUN), as there; so do a plain loop's rows of go and the weight where Triton cannot see
    their alignment itself (utils.unseen_run: 24 or 40 channels). A second source along K
    (HAS_AFTER: grad_output is a channel concatenation read in place, a transposed convolution's input) adds its
    channel blocks after go's, as the forward's HAS_AFTER adds the input's. With W_TAPS (fewer input channels than
    one MMA step, unit stride) the columns are (input channel, W tap) pairs, as the forward's W_TAPS: a row is an
    input voxel of a row extended by the W taps' reach (W_PHASE counts them), each step reads go under the row's
    last W tap (kw = KW - 1) for all of them, and input voxel r adds W tap kw's column from row r + (KW - 1 - kw) *
    DIL_W; at a power of two channels a group (W_CIN) the columns are tap-major, each tap's channels one aligned
    run of the weight's row. With DIAG_CI (groups of few channels side by side) the weight holds only the diagonal
    blocks of a group's block-diagonal weight, as in the forward: column ci reads output channel co's row at channel
    ci % DIAG_CI where both lie in one block of DIAG_CI input and DIAG_CO output channels, zeros elsewhere.
    Split-K (grid axis 2), as in the forward: program s reduces steps [s * SPLIT_STEPS, (s + 1) * SPLIT_STEPS) of
    its phase into split s of an fp32 gi, the bias in split 0's.
    """
    tl.static_assert(not DIAG_CI or not (PACK_TAPS or W_TAPS or HAS_AFTER), "DIAG_CI: a tap's channels, one source")
    if W_CIN:  # W_TAPS at a power of two channels a group, the weight channels-last and dense (the launcher
        # checks): its strides from the constexpr channels, so that the compiler sees each tap's channels as one
        # aligned run (8 in 16 bits: one 16-byte copy) where it gathered them element by element
        stride_wi = 1
        stride_ww = W_CIN
        stride_wh = KW * W_CIN
        stride_wd = KH * KW * W_CIN
        stride_wo = KD * KH * KW * W_CIN
    if KD * KH * KW == 1:  # a pointwise weight's tap strides: zero, as the forward's (a contiguous one's are 1)
        stride_wd, stride_wh, stride_ww = 0, 0, 0
    if RUN > 1:  # go's strides and a group's channels multiples of RUN, as the compiler can see (the forward's)
        C_OUT = run_aligned(C_OUT, RUN)
        stride_gn, stride_gd, stride_gh, stride_gw = runs_aligned(stride_gn, stride_gd, stride_gh, stride_gw, RUN)
        if DIAG_CI or not PACK_TAPS:  # and the weight's (DIAG_CI: rows of DIAG_CI channels, a block's one run)
            stride_wo, stride_wd, stride_wh, stride_ww = runs_aligned(stride_wo, stride_wd, stride_wh, stride_ww, RUN)
    group = tl.program_id(1)  # grouped convolution: shifted base pointers, as in the forward
    go_ptr += group * C_OUT * stride_gc
    w_ptr += group * C_OUT * stride_wo
    gi_ptr += group * C_IN * stride_ic
    bias_ptr += group * C_IN
    split = tl.program_id(2)
    gi_ptr += split * stride_is
    if W_TAPS:  # BLOCK_M rows a tile, BLOCK_M - HALO of them written; W_TAPS columns an input channel
        tl.static_assert(not PACK_TAPS and W_TAPS >= KW and BLOCK_N % W_TAPS == 0, "W_TAPS: KW <= W_TAPS | BLOCK_N")
        OUT_COLS: tl.constexpr = BLOCK_N // W_TAPS
        tile_rows = BLOCK_M - (KW - 1) * DIL_W
    else:
        OUT_COLS: tl.constexpr = BLOCK_N
        tile_rows = BLOCK_M
    num_m = tl.cdiv(M_PHASE, tile_rows)
    num_n = tl.cdiv(C_IN, OUT_COLS)
    phase = tl.program_id(0) // (num_m * num_n)
    rw = phase % STRIDE_W
    rh = (phase // STRIDE_W) % STRIDE_H
    rd = phase // (STRIDE_W * STRIDE_H)
    pid_m, pid_n = grouped_tile(tl.program_id(0) % (num_m * num_n), num_m, num_n, GROUP_M)

    # in int32 unless M_PHASE nears 2^31 (WIDE_ROWS), as the forward's
    offs_m = pid_m.to(tl.int64 if WIDE_ROWS else tl.int32) * tile_rows + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_o = pid_n * OUT_COLS + tl.arange(0, OUT_COLS)  # [OUT_COLS] the input channels the tile writes
    if W_TAPS:
        if W_CIN:  # each tap's channels side by side: one run of a weight row
            offs_n, col_tap, mask_n = split_w_tap_columns(pid_n, W_CIN, KW, W_TAPS, BLOCK_N, TAP_MAJOR=True)
        else:
            offs_n, col_tap, mask_n = split_w_tap_columns(pid_n, C_IN, KW, W_TAPS, BLOCK_N)  # [BLOCK_N]
    else:
        offs_n = offs_o  # [BLOCK_N] input channels
        mask_n = offs_n < C_IN
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K] output channels

    n, jd, jh, jw = split_voxel(offs_m, D_PHASE, H_PHASE, W_PHASE)
    id_ = rd + jd * STRIDE_D
    ih = rh + jh * STRIDE_H
    iw = rw + jw * STRIDE_W
    if FLAT_GI:  # unit stride: the phase is the input
        mask_m = offs_m < M_PHASE
    else:
        mask_m = (offs_m < M_PHASE) & (id_ < D_IN) & (ih < H_IN)
        if not W_TAPS:  # (a W_TAPS tile's rows past W_IN hold its last voxels' taps)
            mask_m &= iw < W_IN
    # For a live tap, output voxel = (jd, jh, jw) + a per-tap shift, so rows are addressed from (jd, jh, jw).
    jd32 = jd.to(tl.int32)
    jh32 = jh.to(tl.int32)
    jw32 = jw.to(tl.int32)
    n = n.to(tl.int64)
    go_offsets = n * stride_gn + jd.to(tl.int64) * stride_gd + jh.to(tl.int64) * stride_gh + jw.to(tl.int64) * stride_gw
    go_rows = go_ptr + go_offsets  # [BLOCK_M] pointers
    # [BLOCK_N] pointers (a column's channel within its block, DIAG_CI)
    w_cols = w_ptr + (offs_n % DIAG_CI if DIAG_CI else offs_n) * stride_wi
    if W_TAPS:  # each column's W tap, from the loop's (KW - 1)
        w_cols += (col_tap - (KW - 1)) * stride_ww

    # This phase's live taps: [d, h, w] x (first, step, count); at unit stride (no table) every tap.
    if live_taps_ptr is None:
        first_d, step_d, count_d = 0, 1, KD
        first_h, step_h, count_h = 0, 1, KH
        first_w, step_w, count_w = 0, 1, KW
    else:
        live_ptr = live_taps_ptr + phase * 9
        first_d, step_d, count_d = tl.load(live_ptr), tl.load(live_ptr + 1), tl.load(live_ptr + 2)
        first_h, step_h, count_h = tl.load(live_ptr + 3), tl.load(live_ptr + 4), tl.load(live_ptr + 5)
        first_w, step_w, count_w = tl.load(live_ptr + 6), tl.load(live_ptr + 7), tl.load(live_ptr + 8)
    if W_TAPS:  # the W taps are columns: a step reads go under the last one
        first_w, step_w, count_w = KW - 1, 1, 1

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    live = count_d * count_h * count_w
    a_blocks, k_blocks = source_blocks(C_A, C_OUT, BLOCK_K, HAS_AFTER)  # go's channel blocks, then q's
    if HAS_AFTER:
        tl.static_assert(not PACK_TAPS, "channels_after: unpacked channels")
        q_rows = (Q_DELTA + n * stride_qn + jd.to(tl.int64) * stride_qd + jh.to(tl.int64) * stride_qh
                  + jw.to(tl.int64) * stride_qw) - go_offsets  # [BLOCK_M]  # fmt: skip
    TAPS: tl.constexpr = KD * KH * KW
    TAP_BITS: tl.constexpr = PACK_TAPS and TAPS < 64
    if PACK_TAPS and live_taps_ptr is None:  # unit stride: go under tap (0, 0, 0), past the row's front padding
        padded_rows = go_rows + (PAD_D * stride_gd + PAD_H * stride_gh + PAD_W * stride_gw)
    if live_taps_ptr is None and TAP_BITS:  # unit stride: tap (kd, kh, kw) of row (jd, jh, jw) reads go at
        # (jd + PAD_D - kd * DIL_D, ..)
        inside_taps = tap_bits(jd32 + PAD_D, jh32 + PAD_H, jw32 + PAD_W, mask_m, D_OUT, H_OUT, W_OUT,
                               -DIL_D, -DIL_H, -DIL_W, KD, KH, KW)  # fmt: skip
    steps = tl.cdiv(live * C_OUT, BLOCK_K) if PACK_TAPS else live * k_blocks
    first = split * SPLIT_STEPS
    for step in range(first, tl.minimum(first + SPLIT_STEPS, steps)):
        if PACK_TAPS and live_taps_ptr is None:  # unit stride: every tap live, the forward's pairs
            offs_r = step * BLOCK_K + offs_k  # [BLOCK_K] = tap * C_OUT + channel
            j, kd, kh, kw, offs_c, mask_c = tap_pairs(offs_r, PACK_TAPS, KD, KH, KW)
        else:
            if PACK_TAPS:  # few output channels: BLOCK_K (live tap, channel) pairs a step, each with its own tap
                offs_r = step * BLOCK_K + offs_k  # [BLOCK_K] = j * C_OUT + channel
                j = offs_r // PACK_TAPS
                offs_c = offs_r - j * PACK_TAPS
                mask_c = offs_r < live * PACK_TAPS
            else:  # the j-th live tap, BLOCK_K of its channels (of one source)
                j = step // k_blocks
                block = step - j * k_blocks
                second, offs_c, mask_c, w_c = block_channels(block, a_blocks, C_A, C_OUT, offs_k, BLOCK_K, HAS_AFTER)
            kw = first_w + (j % count_w) * step_w  # d slowest
            kh = first_h + ((j // count_w) % count_h) * step_h
            kd = first_d + (j // (count_w * count_h)) * step_d
        # Exact divisions: the host listed only taps for which they are.
        shift_d = (rd + PAD_D - kd * DIL_D) // STRIDE_D
        shift_h = (rh + PAD_H - kh * DIL_H) // STRIDE_H
        shift_w = (rw + PAD_W - kw * DIL_W) // STRIDE_W
        if PACK_TAPS:  # the tap varies along K: bounds and offsets per (voxel, pair)
            if live_taps_ptr is None:  # unit stride: each pair's offset from the rows' padded origin, as the
                # forward's (one phase: rd = rh = rw = 0)
                g_tap = -((kd * DIL_D).to(tl.int64) * stride_gd + (kh * DIL_H).to(tl.int64) * stride_gh
                          + (kw * DIL_W).to(tl.int64) * stride_gw)  # fmt: skip
                g_ptrs = padded_rows[:, None] + (g_tap + offs_c * stride_gc)[None, :]  # [BLOCK_M, BLOCK_K]
            else:
                g_tap = (shift_d.to(tl.int64) * stride_gd + shift_h.to(tl.int64) * stride_gh
                         + shift_w.to(tl.int64) * stride_gw)  # fmt: skip
                g_ptrs = go_rows[:, None] + (g_tap + offs_c * stride_gc)[None, :]  # [BLOCK_M, BLOCK_K]
            if live_taps_ptr is None and TAP_BITS:  # j is the tap
                mask_a = tap_inside(inside_taps, j, mask_c, TAPS)
            else:
                od = jd32[:, None] + shift_d[None, :]
                oh = jh32[:, None] + shift_h[None, :]
                ow = jw32[:, None] + shift_w[None, :]
                inside = (od >= 0) & (od < D_OUT) & (oh >= 0) & (oh < H_OUT) & (ow >= 0) & (ow < W_OUT)
                mask_a = inside & mask_m[:, None] & mask_c[None, :]
            a = gather_tile(g_ptrs, mask_a, THREADS_ALONG_ROWS=False)  # each thread few pairs, many voxels
            w_ptrs = w_cols[None, :] + (kd * stride_wd + kh * stride_wh + kw * stride_ww + offs_c * stride_wo)[:, None]
        else:
            od = jd32 + shift_d
            oh = jh32 + shift_h
            ow = jw32 + shift_w
            mask_g = mask_m & (od >= 0) & (od < D_OUT) & (oh >= 0) & (oh < H_OUT) & (ow >= 0) & (ow < W_OUT)
            s_d, s_h, s_w = stride_gd, stride_gh, stride_gw  # the step's source's strides
            rows = go_rows
            if HAS_AFTER:
                s_d, s_h = select(second, s_d, stride_qd), select(second, s_h, stride_qh)
                s_w = select(second, s_w, stride_qw)
                rows = go_rows + second * q_rows
            g_tap = shift_d.to(tl.int64) * s_d + shift_h.to(tl.int64) * s_h + shift_w.to(tl.int64) * s_w
            g_ptrs = rows[:, None] + g_tap + offs_c[None, :] * stride_gc  # [BLOCK_M, BLOCK_K]
            a = tl.load(g_ptrs, mask=mask_g[:, None] & mask_c[None, :], other=0.0)
            w_ptrs = (
                w_cols[None, :] + (kd * stride_wd + kh * stride_wh + kw * stride_ww) + w_c[:, None] * stride_wo
            )  # [BLOCK_K, BLOCK_N]
        mask_b = mask_c[:, None] & mask_n[None, :]
        if DIAG_CI:  # zeros off the diagonal blocks
            mask_b &= (w_c // DIAG_CO)[:, None] == (offs_n // DIAG_CI)[None, :]
        b = tl.load(w_ptrs, mask=mask_b, other=0.0)
        acc = mma(acc, a, b, UPCAST_DOT, INPUT_PRECISION)

    if W_TAPS:  # input voxel r adds W tap kw's column from row r + (KW - 1 - kw) * DIL_W
        acc = sum_w_taps(acc, tl.where(col_tap < KW, KW - 1 - col_tap, 0) * DIL_W, W_TAPS, TAP_MAJOR=W_CIN > 0)
        mask_m &= (tl.arange(0, BLOCK_M) < tile_rows) & (iw < W_IN)
    if HAS_BIAS:
        bias_cols = tl.where(split == 0, C_IN, 0)  # split 0's partial carries the bias
        acc += tl.load(bias_ptr + offs_o, mask=offs_o < bias_cols, other=0.0).to(tl.float32)[None, :]
    if FLAT_GI:  # row m's voxel lies m rows of gi in: no coordinates to find again in the store's layout
        gi_rows = offs_m.to(tl.int64) * stride_iw  # [BLOCK_M]
    else:
        gi_rows = (n * stride_in + id_.to(tl.int64) * stride_id + ih.to(tl.int64) * stride_ih
                   + iw.to(tl.int64) * stride_iw)  # fmt: skip
    gi_ptrs = gi_ptr + gi_rows[:, None] + offs_o[None, :] * stride_ic  # [BLOCK_M, OUT_COLS]
    tl.store(gi_ptrs, acc.to(gi_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_o < C_IN)[None, :])


def conv3d_dgrad(
    grad_out, weight, geom: ConvGeometry, config: KernelConfig, channels_after=None, diagonal=1, bias=None,
    dtype=None,
) -> torch.Tensor:  # fmt: skip
    """Input gradient of checked arguments with the tiling `config`, split-K included; the result is
    channels_last_3d, in `dtype` (default grad_out's). With a second source along D (geom.prefix_frames) or C
    (geom.after_channels) it is the gradient of the concatenation, which the op splits. channels_after follows
    grad_out's channels (geom.out_after_channels), read in place where the config's kernel can
    (config.reads_channels_after), else concatenated first. `diagonal` > 1: `weight` is that of groups `diagonal`
    times as many as geom's, run side by side (kernels/grouped.py). `bias` (one per input channel: a transposed
    convolution's) is added in every kernel's epilogue, rounded once with the sum."""
    if geom.reads_border:
        # The gradient of the input with its non-zeros borders, each border then folded onto the voxel it read:
        # this direction alone allocates a bordered buffer (the forward and weight gradient remap their loads),
        # in float32 (destination_dtype), so the fold rounds each voxel's sum once, in one launch that reads the
        # buffer and writes the result (fold.fold_bordered). The bias in the kernels' epilogue, at every voxel of
        # it; the fold takes the borders' copies of it off.
        wide = destination_dtype("dgrad", geom, grad_out.dtype)
        bordered = conv3d_dgrad(grad_out, weight, geom.border_geometry(), config, channels_after, diagonal, bias, wide)
        return fold_bordered(bordered, geom, bias, dtype or grad_out.dtype)
    grad_in = empty_ndhwc(geom.input_shape(), like=grad_out, dtype=dtype)
    if grad_in.numel() == 0:
        return grad_in
    grad_out, weight = ndhwc(grad_out), ndhwc(weight)
    weight, diag = grouped.diagonal_weight("dgrad", weight, geom, config, diagonal)
    grad_out, channels_after, geom = channel_sources("dgrad", grad_out, channels_after, geom, config)
    bias = bias.contiguous() if bias is not None else None  # the epilogues read it with unit stride
    if config.direct:  # depthwise
        return depthwise_dgrad(grad_out, weight, bias, grad_in, geom, config)
    per_split, splits = k_splits("dgrad", geom, config)
    # One split writes grad_in; several write fp32 partial sums of it, which split_k.sum_splits adds.
    out = grad_in if splits == 1 else ndhwc_partials(grad_in, splits)
    if config.gluon:  # the tuning layer checked the problem, the device and the tensors
        conv3d_gluon(grad_out, weight, bias, out, geom, config, True, per_split, channels_after=channels_after)
    elif config.tma_box_w:  # the caller checked that the problem and the tensors are eligible
        conv3d_tma(grad_out, weight, bias, out, geom, config, True, per_split, channels_after=channels_after)
    else:
        _launch_pointer_kernel(grad_out, channels_after, weight, bias, out, geom, config, per_split, diag)
    return grad_in if splits == 1 else sum_splits(out, grad_in)


def _launch_pointer_kernel(grad_out, channels_after, weight, bias, out, geom, config, per_split, diag=(0, 0)):
    upcast, precision = dot_flags(grad_out.dtype)
    phases = geom.stride[0] * geom.stride[1] * geom.stride[2]
    # At unit stride every tap is live: in 16-bit the kernel takes that as constants (sm_90: a main loop 15%
    # shorter; a traced graph needs no table). fp32 keeps reading the table: with the constants ptxas holds the
    # sm_80 fp32 tile to 128 registers and spills (138 with the table).
    constant_taps = phases == 1 and grad_out.dtype != torch.float32
    live = (
        None
        if constant_taps
        else live_tap_table(geom.kernel, geom.stride, geom.front_padding, geom.dilation, grad_out.device)
    )
    phase_size = [cdiv(size, s) for size, s in zip(geom.in_size, geom.stride, strict=True)]
    c_in, c_out, w_taps = geom.group_in_channels, geom.group_out_channels, w_tap_columns("dgrad", geom)
    packed = packs_taps("dgrad", geom)
    if w_taps:  # unit stride: one phase, its rows extended by the W taps' reach
        phase_size[2] += w_tap_halo(geom)
    rows = geom.batch * phase_size[0] * phase_size[1] * phase_size[2]
    tiles = w_tap_tiles("dgrad", geom, config) if w_taps else (cdiv(rows, config.block_m), cdiv(c_in, config.block_n))
    splits = out.shape[0] // geom.batch
    grid = (tiles[0] * tiles[1] * phases, geom.groups, splits)
    q_delta, *q_strides = second_source_arguments(channels_after, grad_out)
    launch(
        _conv3d_dgrad_kernel, grid,
        grad_out, weight, bias if bias is not None else out, out, live,
        rows, c_in, *geom.in_size, c_out, *geom.out_size, *phase_size, geom.out_channel_sources[0], q_delta,
        per_split,
        *grad_out.stride(), *q_strides, *weight.stride(), geom.batch * out.stride(0) if splits > 1 else 0,
        *out.stride(),
        *geom.stride, *geom.front_padding, *geom.dilation,
        *geom.kernel,
        PACK_TAPS=c_out if packed else 0, W_TAPS=w_taps,
        RUN=_run(c_out, grad_out, channels_after, weight, packed, diag),
        W_CIN=dense_channels_last(weight) if w_taps and c_in & (c_in - 1) == 0 else 0, DIAG_CI=diag[0],
        DIAG_CO=diag[1],
        HAS_AFTER=channels_after is not None, HAS_BIAS=bias is not None, UPCAST_DOT=upcast,
        WIDE_ROWS=wide_rows(rows, config.block_m), FLAT_GI=phases == 1 and not w_taps and flat_rows(out),
        _distances=channels_after is not None,  # second_source_arguments'
        INPUT_PRECISION=precision,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def _run(c_out, grad_out, channels_after, weight, packed: bool, diag) -> int:
    """RUN of a launch (utils.channel_run): the packed loop's, go's (tap, channel) pairs; reading a grouped
    weight's diagonal blocks in place, a block's input channels are one run of a weight row, and the kernel takes
    its groups' output channels (go's group offset) as a multiple of RUN too, so RUN divides both (27 output
    channels a group in a view of 28-channel rows: 1, not 2); a plain loop's where Triton cannot see it
    (utils.unseen_run: go's and the weight's), over stride phases too since the rows are split in int32
    (WIDE_ROWS: with int64 divisions the sm_90 fp32 tiles kept an 8-byte stack frame; now 74 strided launches of
    the random, awkward and bench problems fit, 38 loops shorter, down to 0.47x); 1 for a second source along K,
    whose strides it does not rewrite."""
    if packed:
        return channel_run(c_out, grad_out)
    if diag[0]:
        return channel_run(math.gcd(diag[0], c_out), grad_out, weight)
    return 1 if channels_after is not None else unseen_run(c_out, grad_out, weight)


def dense_channels_last(weight: torch.Tensor) -> int:
    """The input channels of a weight [Cout, Cin, KD, KH, KW] stored channels-last and dense (as ndhwc leaves it),
    whose strides a W_TAPS input gradient of a power of two input channels takes from them (W_CIN: 3 channels
    gather element by element either way, and under triton 3.6 their constant strides cost 88 instructions a step);
    ValueError for any other layout."""
    _, c_in, kd, kh, kw = weight.shape
    dense = (kd * kh * kw * c_in, 1, kh * kw * c_in, kw * c_in, c_in)
    if any(s != d for s, d, n in zip(weight.stride(), dense, weight.shape, strict=True) if n > 1):
        raise ValueError(f"a W_TAPS input gradient reads a dense channels-last weight, got strides {weight.stride()}")
    return c_in
