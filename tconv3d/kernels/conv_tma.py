"""The TMA implicit GEMMs (sm_90+) of the forward, the input gradient and the weight gradient: tensor-descriptor
boxes with zero-filled borders feeding wgmma, and their launchers; and the patch arithmetic the Gluon kernels
(conv_gluon.py) share (patch_origin, next_patch, tap_box, step_of, next_step, step_box, dst_box, patch_phase).
The pointer kernels (conv_fwd.py, conv_dgrad.py, conv_wgrad.py) run every other problem; the variant is picked
above the kernels (configs.tma_eligible, KernelConfig.tma_box_w).

At stride s in H or W the input a tap reads for a patch of outputs is every s-th row or column: no box of x. It is
a box of a phase view `x[..., ph::s_h, pw::s_w]` (which phase depends on the tap), one descriptor per phase, at
most MAX_PHASES of them; the kernels pick the tap's. The strided input gradient turns this round: a program
computes a patch of one phase of grad_in, over that phase's live taps, and stores it through grad_in's phase
view. Along D a box is one frame deep, so a stride there is only a coordinate, and so is a border mode there or
a second source in front of the input (frames_before, P frames): every voxel of a box reads the same source frame,
which source_frame maps, and the box comes from frames_before's descriptor or x's. A second source along C
(channels_after, a channel concatenation) is likewise one of two descriptors per channel block: the blocks of x's
channels, then those of channels_after's (channel_block). Borders in H and W read zeros (the TMA
unit's); their other modes run on the pointer kernels."""

import functools
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..geometry import ConvGeometry
from .config import HALO_BOX_FRAMES, KernelConfig, live_taps
from .launch import launch, tracing
from .tensors import cdiv
from .utils import dot_flags, mma, ndhwc_descriptor, padded_coord, tensor_descriptor, tma_aligned

# Phase views (descriptors) a strided operand may take: stride 2 in both H and W.
MAX_PHASES = 4


@triton.jit
def patch_origin(index, D, H, W, BOX_H: tl.constexpr, BOX_W: tl.constexpr):
    """Patch `index` of a (N, D, H, W) volume cut in BOX_H x BOX_W patches per (n, d), W fastest -> (n, d, h0, w0),
    its first voxel."""
    tiles_w = tl.cdiv(W, BOX_W)
    tiles_h = tl.cdiv(H, BOX_H)
    w0 = (index % tiles_w) * BOX_W
    rest = index // tiles_w
    h0 = (rest % tiles_h) * BOX_H
    rest = rest // tiles_h
    return rest // D, rest % D, h0, w0


@triton.jit
def next_patch(n, d, h0, w0, D, H, W, BOX_H: tl.constexpr, BOX_W: tl.constexpr):
    """The patch after (n, d, h0, w0) in patch_origin's order, without its divisions: a loop over consecutive
    patches (the Gluon kernels' loads) carries the origin, where patch_origin costs three runtime divisions a
    patch, each a dependent chain of a dozen instructions on the loading warp."""
    w0 += BOX_W
    wrap = (w0 >= W).to(tl.int32)
    w0 *= 1 - wrap
    h0 += wrap * BOX_H
    wrap = (h0 >= H).to(tl.int32)
    h0 *= 1 - wrap
    d += wrap
    wrap = (d >= D).to(tl.int32)
    d *= 1 - wrap
    return n + wrap, d, h0, w0


@triton.jit
def step_of(step, k_blocks):
    """K step `step` of a patch program -> (its tap among the steps' taps, its channel block): k_blocks channel
    blocks a tap, taps outermost."""
    index = step // k_blocks
    return index, step - index * k_blocks


@triton.jit
def next_step(index, block, k_blocks):
    """The K step after (index, block) (step_of's), without step_of's division: a loop over consecutive steps
    carries it."""
    block += 1
    wrap = (block == k_blocks).to(tl.int32)
    return index + wrap, block - wrap * k_blocks


@triton.jit
def tap_shift(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH: tl.constexpr, KW: tl.constexpr):
    """Tap `tap`'s input offset, tap * dil - pad in each dimension."""
    return tap // (KW * KH) * DIL_D - PAD_D, tap // KW % KH * DIL_H - PAD_H, tap % KW * DIL_W - PAD_W


@triton.jit
def tap_box(d, h0, w0, shift_d, shift_h, shift_w, STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr,
            STRIDE_W: tl.constexpr):  # fmt: skip
    """Where the source box of a tap lies for the patch of outputs at (d, h0, w0): the input at
    (d, h0, w0) * stride + shift is, in the phase view x[..., ph::STRIDE_H, pw::STRIDE_W], a box at (frame,
    row, column) -> (frame, phase = ph * STRIDE_W + pw, row, column). At stride 1: (d, h0, w0) + shift, phase 0."""
    ph = (shift_h % STRIDE_H + STRIDE_H) % STRIDE_H  # the remainder's sign is C's compiled, Python's interpreted
    pw = (shift_w % STRIDE_W + STRIDE_W) % STRIDE_W
    row = h0 + (shift_h - ph) // STRIDE_H  # exact divisions: the same either way
    col = w0 + (shift_w - pw) // STRIDE_W
    return d * STRIDE_D + shift_d, ph * STRIDE_W + pw, row, col


@triton.jit
def source_frame(frame, D_IN, P_FRAMES, PAD_MODE_D: tl.constexpr, HAS_PREFIX: tl.constexpr):
    """The source of input frame `frame`, a coordinate along the D_IN frames the forward and the weight gradient
    read (frames_before's P_FRAMES, then x's), which may lie in the border -> (frame, whether of frames_before):
    the frame its border mode along D maps it to (utils.padded_coord; a zeros border stays out of range, where the
    TMA unit reads zeros), counted in frames_before where it lies there (HAS_PREFIX), else in x."""
    frame = padded_coord(frame, D_IN, PAD_MODE_D)
    if HAS_PREFIX:
        in_prefix = frame < P_FRAMES
        return tl.where(in_prefix, frame, frame - P_FRAMES), in_prefix
    else:
        return frame, False


@triton.jit
def channel_block(c0, a_blocks, C_A, BLOCK_K: tl.constexpr):
    """The channel block at c0 (a multiple of BLOCK_K over x's a_blocks blocks, then channels_after's) -> (whether
    it is channels_after's, its first channel there, its first channel in the weight)."""
    second = c0 >= a_blocks * BLOCK_K
    c_src = tl.where(second, c0 - a_blocks * BLOCK_K, c0)
    return second, c_src, tl.where(second, C_A + c_src, c0)


@triton.jit
def phase_view(views, phase: tl.constexpr):
    """views[phase] of (phase 0's descriptor, phase 1's, ...): a static pick, the absent ones None."""
    return views[phase]


@triton.jit
def load_live_taps(live_ptr, phase):
    """Phase `phase`'s row of the strided input gradient's live-tap table (config.live_taps, int32 [phases, 9]):
    (first, step, count) of its live taps along d, h and w."""
    row = live_ptr + phase * 9
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4),
            tl.load(row + 5), tl.load(row + 6), tl.load(row + 7), tl.load(row + 8))  # fmt: skip


@triton.jit
def step_box(
    index, block, d, h0, w0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    INPUT_GRAD: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The K step (index, block) (step_of's) of a patch program at (d, h0, w0) -> (tap, first reduced channel,
    and the source box: frame, phase view, row, column). Forward: the tap's box of its phase view at a stride
    (tap_box). Input gradient: a convolution of grad_out with the taps flipped; at a stride, the program's `phase`
    (rd, rh, rw) of grad_in reads only its live taps (`live`, load_live_taps), `index` counting them, and live tap
    k lands on grad_out voxel j + (r + pad - k * dil) / stride (an exact division) for the phase's voxel j."""
    c0 = block * BLOCK_K
    if INPUT_GRAD and STRIDE_D * STRIDE_H * STRIDE_W > 1:
        first_d, step_d, _, first_h, step_h, count_h, first_w, step_w, count_w = live
        # A phase no tap reaches has no steps, but a pipelined prologue still computes (predicated-off) loads.
        count_h = tl.maximum(count_h, 1)
        count_w = tl.maximum(count_w, 1)
        kd = first_d + index // (count_w * count_h) * step_d
        kh = first_h + index // count_w % count_h * step_h
        kw = first_w + index % count_w * step_w
        rd = phase // (STRIDE_H * STRIDE_W)
        rh = phase // STRIDE_W % STRIDE_H
        rw = phase % STRIDE_W
        tap = (kd * KH + kh) * KW + kw
        src_d = d + (rd + PAD_D - kd * DIL_D) // STRIDE_D
        view = 0
        row = h0 + (rh + PAD_H - kh * DIL_H) // STRIDE_H
        col = w0 + (rw + PAD_W - kw * DIL_W) // STRIDE_W
    else:
        tap = index
        shift_d, shift_h, shift_w = tap_shift(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
        if INPUT_GRAD:  # stride 1
            src_d, view, row, col = d - shift_d, 0, h0 - shift_h, w0 - shift_w
        else:
            src_d, view, row, col = tap_box(d, h0, w0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W)
    return tap, c0, src_d, view, row, col


@triton.jit
def patch_phase(n, BATCH, STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
                INPUT_GRAD: tl.constexpr):  # fmt: skip
    """(batch entry, phase) of a patch program whose patch_origin gave batch entry `n`: a strided input gradient
    walks its grad_in phases as BATCH x phases batch entries, phase-major; everything else has one phase."""
    if INPUT_GRAD and STRIDE_D * STRIDE_H * STRIDE_W > 1:
        return n % BATCH, n // BATCH
    else:
        return n, 0


@triton.jit
def dst_box(d, phase, STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
            INPUT_GRAD: tl.constexpr):  # fmt: skip
    """(frame, phase view) a patch program at frame d of its `phase` stores to: a strided input gradient's patch
    lies in grad_in's phase view (rh, rw), at frame d * STRIDE_D + rd; everything else stores to dst at d."""
    if INPUT_GRAD:
        return d * STRIDE_D + phase // (STRIDE_H * STRIDE_W), phase % (STRIDE_H * STRIDE_W)
    else:
        return d, 0


@triton.jit
def _conv3d_tma_kernel(
    # TMA descriptors: src as [N, D, H, W, C_RED] (boxes [1, 1, BOX_H, BOX_W, BLOCK_K]), the weight as
    # [Cout, taps, Cin], dst as [splits x N, D, H, W, C_COLS] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N]). At a stride
    # in H or W the strided operand (src forward, dst input gradient) comes as its phase views, in tap_box's
    # order: src_desc or dst_desc the first, view1..3 the others (None past the last). live_ptr: the input
    # gradient's live-tap table at a stride (config.live_taps), else None.
    # DST_PTR (a forward whose output rows are not whole 16-byte units, e.g. 3 channels): dst_desc is the output
    # tensor itself, its (N, D, H, W) strides stride_d*, and the epilogue stores from registers.
    # The forward's input along D: D_IN frames, the first P_FRAMES of them frames_before's (second_desc, with
    # HAS_PREFIX; stride 1 in H and W), bordered in PAD_MODE_D (source_frame). Along C (HAS_AFTER; the forward at
    # stride 1 in H and W, the input gradient at any): x's (grad_out's) C_A channels, then channels_after's
    # C_RED - C_A (second_desc).
    src_desc, w_desc, dst_desc, view1, view2, view3, second_desc, bias_ptr, live_ptr,
    C_RED, C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, stride_dn, stride_dd, stride_dh, stride_dw,
    D_IN, P_FRAMES, C_A, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    INPUT_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DST_PTR: tl.constexpr,
    PAD_MODE_D: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_AFTER: tl.constexpr,
):  # fmt: skip
    """dst[v, col] = sum over (tap, red) of src[v + shift(tap), red] * w[tap][red, col], for a BOX_H x BOX_W
    patch of dst voxels at one (n, d) per program and BLOCK_N columns.

    Forward (src = x, dst = y, red = Cin, col = Cout): src[v * stride + tap * dil - pad], from the tap's phase
    view at a stride in H or W (tap_box), and the weight box [BLOCK_N, 1, BLOCK_K] of (Cout, taps, Cin) is used
    transposed. Input gradient (src = grad_out, dst = grad_in, red = Cout, col = Cin): a convolution of grad_out
    with the taps flipped and the weight box [BLOCK_K, 1, BLOCK_N] as it is; at a stride, program by program a
    patch of one phase of grad_in (a phase view, D_DST x H_DST x W_DST its largest), over that phase's live taps
    only (step_box), stored through its phase view. Either way each step's source box may lie partly in the
    padding or past an edge, where the TMA unit reads zeros: no address arithmetic, no masks. Split-K (grid axis
    2): program s reduces steps [s * SPLIT_STEPS, (s + 1) * SPLIT_STEPS) into split s of an fp32 dst (batch
    entries s * BATCH on), the bias in split 0's.
    """
    BLOCK_M: tl.constexpr = BOX_H * BOX_W
    VIEWS: tl.constexpr = STRIDE_H * STRIDE_W  # phase views of the strided operand
    views = (dst_desc if INPUT_GRAD else src_desc, view1, view2, view3)
    n, d, h0, w0 = patch_origin(tl.program_id(0), D_DST, H_DST, W_DST, BOX_H, BOX_W)
    n, phase = patch_phase(n, BATCH, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)

    if HAS_AFTER:
        a_blocks = tl.cdiv(C_A, BLOCK_K)
        k_blocks = a_blocks + tl.cdiv(C_RED - C_A, BLOCK_K)
    else:
        k_blocks = tl.cdiv(C_RED, BLOCK_K)
    live = 0
    if INPUT_GRAD and STRIDE_D * VIEWS > 1:
        live = load_live_taps(live_ptr, phase)
        total = live[2] * live[5] * live[8] * k_blocks
    else:
        total = KD * KH * KW * k_blocks
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * SPLIT_STEPS
    for step in range(first, tl.minimum(first + SPLIT_STEPS, total)):
        index, block = step_of(step, k_blocks)
        tap, c0, src_d, view, row, col = step_box(
            index, block, d, h0, w0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW,
            STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, BLOCK_K,
        )  # fmt: skip
        c_w = c0
        if HAS_AFTER:  # the weight's channels past x's are channels_after's
            second, c0, c_w = channel_block(c0, a_blocks, C_A, BLOCK_K)
        if INPUT_GRAD:
            b = w_desc.load([c_w, tap, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = tl.trans(w_desc.load([n0, tap, c_w]).reshape(BLOCK_N, BLOCK_K))
        if not INPUT_GRAD:
            src_d, in_prefix = source_frame(src_d, D_IN, P_FRAMES, PAD_MODE_D, HAS_PREFIX)
        if HAS_PREFIX:  # the forward at stride 1 in H and W (configs.tma_eligible): one of two boxes
            tl.static_assert(VIEWS == 1 and not INPUT_GRAD, "frames_before: the forward at stride 1 in H and W")
            if in_prefix:
                a = second_desc.load([n, src_d, row, col, c0])
                acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)
            else:
                a = src_desc.load([n, src_d, row, col, c0])
                acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)
        elif HAS_AFTER:  # likewise, per channel block
            tl.static_assert(VIEWS == 1 or INPUT_GRAD, "channels_after: the forward at stride 1 in H and W")
            if second:
                a = second_desc.load([n, src_d, row, col, c0])
                acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)
            else:
                a = src_desc.load([n, src_d, row, col, c0])
                acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)
        elif INPUT_GRAD or VIEWS == 1:
            a = src_desc.load([n, src_d, row, col, c0])
            acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)
        else:
            for p in tl.static_range(VIEWS):
                if view == p:
                    a = phase_view(views, p).load([n, src_d, row, col, c0])
                    acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)

    if HAS_BIAS:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        bias_cols = tl.where(split == 0, C_COLS, 0)  # split 0's partial carries the bias
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < bias_cols, other=0.0).to(tl.float32)[None, :]
    if DST_PTR:  # a forward's output rows TMA cannot describe: masked stores from registers
        tl.static_assert(not INPUT_GRAD, "the input gradient's rows are always whole 16-byte units")
        offs_m = tl.arange(0, BLOCK_M)
        h, w = h0 + offs_m // BOX_W, w0 + offs_m % BOX_W
        offs_n = n0 + tl.arange(0, BLOCK_N)
        rows = ((split * BATCH + n).to(tl.int64) * stride_dn + d.to(tl.int64) * stride_dd
                + h.to(tl.int64) * stride_dh + w.to(tl.int64) * stride_dw)  # fmt: skip
        mask = ((h < H_DST) & (w < W_DST))[:, None] & (offs_n < C_COLS)[None, :]
        tl.store(dst_desc + rows[:, None] + offs_n[None, :], acc.to(dst_desc.dtype.element_ty), mask=mask)
    else:  # stores past the patch's edges are dropped by the TMA unit
        tile = acc.to(dst_desc.dtype).reshape(1, 1, BOX_H, BOX_W, BLOCK_N)
        frame, view = dst_box(d, phase, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD)
        if INPUT_GRAD and VIEWS > 1:  # the phase's view of grad_in
            for p in tl.static_range(VIEWS):
                if view == p:
                    phase_view(views, p).store([split * BATCH + n, frame, h0, w0, n0], tile)
        else:
            dst_desc.store([split * BATCH + n, frame, h0, w0, n0], tile)


def phase_descriptors(t, stride, block, make=TensorDescriptor) -> tuple:
    """Descriptors of t's phase views t[..., ph::stride_h, pw::stride_w] (t itself at stride 1 in H and W) in
    tap_box's order, None after the last up to MAX_PHASES: the strided operand of a kernel at `stride`."""
    _, s_h, s_w = stride
    if s_h * s_w > MAX_PHASES:
        raise ValueError(f"a TMA operand takes at most {MAX_PHASES} phase views, not stride {tuple(stride)}'s")
    if s_h * s_w == 1:
        return (ndhwc_descriptor(t, block, make),) + (None,) * (MAX_PHASES - 1)
    n, c, d, h, w = t.shape
    if h < s_h or w < s_w:
        raise ValueError(f"a {tuple(t.shape)} tensor has an empty phase view at stride {tuple(stride)}")
    sn, sc, sd, sh, sw = t.stride()
    offset, strides = t.storage_offset(), (sn, sc, sd, sh * s_h, sw * s_w)
    # as_strided: one op a view where slicing takes four (~2.4 against ~3.9 us on CPU)
    views = [
        t.as_strided((n, c, d, -(-(h - ph) // s_h), -(-(w - pw) // s_w)), strides, offset + ph * sh + pw * sw)
        for ph in range(s_h)
        for pw in range(s_w)
    ]
    return tuple(ndhwc_descriptor(v, block, make) for v in views) + (None,) * (MAX_PHASES - len(views))


def prefix_descriptor(second, block, make=TensorDescriptor):
    """The descriptor of the forward's and weight gradient's second source (frames_before along D, channels_after
    along C), boxes as x's; None without one."""
    return None if second is None else ndhwc_descriptor(second, block, make)


def live_tap_table(kernel, stride, front_padding, dilation, device) -> torch.Tensor:
    """config.live_taps as int32 [phases, 3 dims, 3] on the device, as the input-gradient kernels read it
    (load_live_taps, conv_dgrad's pointer kernel); cached, except while traced for Inductor, where it is a
    constant of the graph (and a cached one would be a fake tensor)."""
    key = tuple(kernel), tuple(stride), tuple(front_padding), tuple(dilation), device
    return _live_tap_table.__wrapped__(*key) if tracing() else _live_tap_table(*key)


@functools.lru_cache(maxsize=256)
def _live_tap_table(kernel, stride, front_padding, dilation, device) -> torch.Tensor:
    table = torch.tensor(live_taps(kernel, stride, front_padding, dilation), dtype=torch.int32, device=device)
    table.plan_constant = True  # a call plan (tconv3d/plans.py) may keep it: never written, a function of its key
    return table


def patch_descriptors(
    src, weight, dst, geom: ConvGeometry, config: KernelConfig, input_grad: bool, make, weight_transposed=False,
    frames_before=None, channels_after=None,
):  # fmt: skip
    """What the patch kernels (this TMA one, conv_gluon's) launch with, the descriptors built by `make`: the
    descriptors (src, w, dst, the strided operand's other phase views, the forward's frames_before or
    channels_after or None), the
    input gradient's live-tap table at a stride (else None), the grid (patches, column blocks, splits: dst holds
    src's batch once per split), the (reduced, columns) channel counts, the extent of the patches' volume (dst's,
    or a strided input gradient's largest phase) and the stride. `weight_transposed` (the input gradient): the
    weight copied to [Cin, taps, Cout] and described in [BLOCK_N, 1, BLOCK_K] boxes, reduction innermost, as wgmma
    takes fp32 operands."""
    box_h, box_w = config.tma_box(config.block_m)
    c_out, c_in, taps = geom.out_channels, geom.in_channels, geom.taps
    if weight_transposed:  # (Cin, taps, Cout) in memory: one copy of the weight a launch
        weight = weight.transpose(0, 1).contiguous(memory_format=torch.channels_last_3d)
        w_shape, w_box = (c_in, taps, c_out), (config.block_n, 1, config.block_k)
    else:
        weight = weight.contiguous(memory_format=torch.channels_last_3d)  # (Cout, taps, Cin) in memory
        w_shape = (c_out, taps, c_in)
        w_box = (config.block_k, 1, config.block_n) if input_grad else (config.block_n, 1, config.block_k)
    w_desc = tensor_descriptor(weight, w_shape, (taps * w_shape[2], w_shape[2], 1), w_box, make)
    stride = tuple(geom.stride)
    # A halo tile (config.halo_d, the Gluon kernel's) reads the source frames of its halo_d output frames in one box.
    box_d, frames = (HALO_BOX_FRAMES, config.halo_d) if config.halo_d else (1, 1)
    src_box, dst_box = (1, box_d, box_h, box_w, config.block_k), (1, 1, box_h, box_w, config.block_n)
    batch = src.shape[0]
    volume = dst.shape[2:]
    live = None
    if input_grad:
        src_desc = ndhwc_descriptor(src, src_box, make)
        dst_desc, *views = phase_descriptors(dst, stride, dst_box, make)
        if math.prod(stride) > 1:  # patches of grad_in's phases, each phase its own batch entries
            live = live_tap_table(geom.kernel, stride, geom.front_padding, geom.dilation, dst.device)
            volume = [cdiv(size, s) for size, s in zip(volume, stride, strict=True)]
            batch *= math.prod(stride)
    else:
        src_desc, *views = phase_descriptors(src, stride, src_box, make)
        # Output rows that are not whole 16-byte units (3 channels): the kernels store them from registers.
        dst_desc = ndhwc_descriptor(dst, dst_box, make) if tma_aligned(dst) else dst
    second = prefix_descriptor(frames_before if frames_before is not None else channels_after, src_box, make)
    channels = (c_out, c_in) if input_grad else (c_in, c_out)
    d, h, w = volume
    grid = (
        batch * cdiv(d, frames) * cdiv(h, box_h) * cdiv(w, box_w),
        cdiv(channels[1], config.block_n),
        dst.shape[0] // src.shape[0],
    )
    return (src_desc, w_desc, dst_desc, *views, second), live, grid, channels, volume, stride


def conv3d_tma(
    src, weight, bias, dst, geom: ConvGeometry, config: KernelConfig, input_grad: bool, split_steps: int,
    frames_before=None, channels_after=None,
) -> None:  # fmt: skip
    """Run the TMA kernel: the forward (src = x, dst = y; frames_before in front of x along D or channels_after
    after its channels, at stride 1 in H and W) or the input gradient (src = grad_out, dst = grad_in; channels_after
    after grad_out's channels), at strides
    of at most MAX_PHASES phase views, or with dst holding several splits (split_k.ndhwc_partials) their fp32
    partial sums of `split_steps` K steps each. The tensors have unit-stride channels and TMA-aligned strides; dst
    is written whole."""
    descriptors, live, grid, (reduced, columns), volume, stride = patch_descriptors(
        src, weight, dst, geom, config, input_grad, TensorDescriptor, frames_before=frames_before,
        channels_after=channels_after,
    )  # fmt: skip
    box_h, box_w = config.tma_box(config.block_m)
    upcast, precision = dot_flags(src.dtype)
    dst_ptr = descriptors[2] is dst
    launch(
        _conv3d_tma_kernel, grid,
        *descriptors, bias if bias is not None else dst, live,
        reduced, columns, src.shape[0], *volume, split_steps, *dst_row_strides(dst, dst_ptr),
        *source_frames(geom, input_grad), first_channels(geom, input_grad), *geom.front_padding, *geom.dilation,
        *geom.kernel, *stride,
        INPUT_GRAD=input_grad, HAS_BIAS=bias is not None, UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BOX_H=box_h, BOX_W=box_w, BLOCK_N=config.block_n, BLOCK_K=config.block_k, DST_PTR=dst_ptr,
        PAD_MODE_D=0 if input_grad else geom.pad_mode_indices[0], HAS_PREFIX=frames_before is not None,
        HAS_AFTER=channels_after is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def first_channels(geom: ConvGeometry, input_grad: bool = False) -> int:
    """C_A of channel_block: the first source's channels of the reduction, the input's (forward) or grad_out's
    (input gradient), the rest channels_after's."""
    return geom.out_channel_sources[0] if input_grad else geom.channel_sources[0]


def source_frames(geom: ConvGeometry, input_grad: bool = False) -> tuple[int, int]:
    """(D_IN, P_FRAMES) of source_frame: the frames along D the forward and the weight gradient read, the first
    P_FRAMES of them frames_before's; zeros for the input gradient, which reads grad_out (one compiled kernel)."""
    return (0, 0) if input_grad else (geom.in_size[0], geom.prefix_frames)


def dst_row_strides(dst: torch.Tensor, dst_ptr: bool) -> tuple:
    """The (N, D, H, W) strides of an output stored from registers (DST_PTR), zeros where a descriptor stores it
    (the kernel ignores them then, and zeros keep one compiled kernel for every such launch)."""
    if not dst_ptr:
        return (0, 0, 0, 0)
    sn, _, sd, sh, sw = dst.stride()
    return sn, sd, sh, sw


@triton.jit
def _wgrad_patches(
    go_desc, x_view, second_desc, first, last, D_OUT, H_OUT, W_OUT, co0, ci0, shift_d, shift_h, shift_w,
    D_IN, P_FRAMES, STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAD_MODE_D: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    """One tap's weight-gradient tile summed over output patches [first, last): grad_out's patch against the input
    box the tap reads for it from `x_view`, its phase view (tap_box), or from frames_before (source_frame)."""
    BLOCK_K: tl.constexpr = BOX_H * BOX_W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for patch in range(first, last):
        n, od, h0, w0 = patch_origin(patch, D_OUT, H_OUT, W_OUT, BOX_H, BOX_W)
        a = go_desc.load([n, od, h0, w0, co0]).reshape(BLOCK_K, BLOCK_M)
        src_d, _, row, col = tap_box(od, h0, w0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W)
        src_d, in_prefix = source_frame(src_d, D_IN, P_FRAMES, PAD_MODE_D, HAS_PREFIX)
        if HAS_PREFIX:
            if in_prefix:
                b = second_desc.load([n, src_d, row, col, ci0]).reshape(BLOCK_K, BLOCK_N)
            else:
                b = x_view.load([n, src_d, row, col, ci0]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = x_view.load([n, src_d, row, col, ci0]).reshape(BLOCK_K, BLOCK_N)
        acc = mma(acc, tl.trans(a), b, UPCAST_DOT, INPUT_PRECISION)
    return acc


@triton.jit
def _conv3d_wgrad_tma_kernel(
    # TMA descriptors: grad_out as [N, Do, Ho, Wo, Cout] (boxes [1, 1, BOX_H, BOX_W, BLOCK_M]), x as
    # [N, D, H, W, Cin] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N]; at a stride in H or W, x_desc and x_phase1..3 are
    # its phase views, in tap_box's order, None past the last); out is [split, Cout, tap, Cin]. Along D the input
    # is D_IN frames, the first P_FRAMES of them frames_before's (second_desc, with HAS_PREFIX: stride 1 in H and
    # W), bordered in PAD_MODE_D (source_frame).
    go_desc, x_desc, x_phase1, x_phase2, x_phase3, second_desc, out_ptr,
    C_IN, C_OUT, D_OUT, H_OUT, W_OUT, PATCHES, SPLIT_PATCHES,
    stride_os, stride_oo, stride_ot, stride_oi,
    D_IN, P_FRAMES, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    STRIDE_D: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAD_MODE_D: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    """gw[co, tap, ci] = sum over output voxels v of go[v, co] * x[v * stride + tap * dil - pad, ci].

    Per program one tap's BLOCK_M x BLOCK_N tile, reduced over a split of the output patches (BOX_H x BOX_W
    voxels at one (n, od)): each step is two boxes, grad_out's patch and the input's box the tap reads for it
    (tap_box: from one phase view, the program's, at a stride; zeros in the padding); patch rows past the
    output's edges read zeros from grad_out and add nothing. The splits' fp32 partials are summed in a fixed
    order by conv_wgrad's reduction, as on the pointer path.
    """
    PHASES: tl.constexpr = STRIDE_H * STRIDE_W
    views = (x_desc, x_phase1, x_phase2, x_phase3)
    taps: tl.constexpr = KD * KH * KW
    pid = tl.program_id(0)
    tap = pid % taps  # neighbouring programs share the same boxes in L2: keep taps innermost
    tile = pid // taps
    num_n = tl.cdiv(C_IN, BLOCK_N)
    co0 = (tile // num_n) * BLOCK_M
    ci0 = (tile % num_n) * BLOCK_N
    shift_d, shift_h, shift_w = tap_shift(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
    first = tl.program_id(1) * SPLIT_PATCHES
    last = tl.minimum(first + SPLIT_PATCHES, PATCHES)

    if PHASES == 1:
        acc = _wgrad_patches(
            go_desc, x_desc, second_desc, first, last, D_OUT, H_OUT, W_OUT, co0, ci0, shift_d, shift_h, shift_w,
            D_IN, P_FRAMES, STRIDE_D, STRIDE_H, STRIDE_W, UPCAST_DOT, INPUT_PRECISION, BOX_H, BOX_W, BLOCK_M,
            BLOCK_N, PAD_MODE_D, HAS_PREFIX,
        )  # fmt: skip
    else:  # the program's tap reads one phase view throughout: a loop compiled per view, the program runs its own
        phase = tap_box(0, 0, 0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W)[1]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(PHASES):
            if phase == p:
                acc = _wgrad_patches(
                    go_desc, phase_view(views, p), None, first, last, D_OUT, H_OUT, W_OUT, co0, ci0,
                    shift_d, shift_h, shift_w, D_IN, P_FRAMES, STRIDE_D, STRIDE_H, STRIDE_W, UPCAST_DOT,
                    INPUT_PRECISION, BOX_H, BOX_W, BLOCK_M, BLOCK_N, PAD_MODE_D, False,
                )  # fmt: skip

    offs_m = co0 + tl.arange(0, BLOCK_M)
    offs_n = ci0 + tl.arange(0, BLOCK_N)
    out_ptrs = (out_ptr + tl.program_id(1) * stride_os + tap * stride_ot
                + offs_m[:, None] * stride_oo + offs_n[None, :] * stride_oi)  # fmt: skip
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < C_OUT)[:, None] & (offs_n < C_IN)[None, :])


def wgrad_tma_patches(geom: ConvGeometry, config: KernelConfig) -> int:
    """How many output patches the TMA weight gradient reduces over (its split-K runs over these)."""
    box_h, box_w = config.tma_box(config.block_k)
    d_out, h_out, w_out = geom.out_size
    return geom.batch * d_out * cdiv(h_out, box_h) * cdiv(w_out, box_w)


def conv3d_wgrad_tma(
    grad_out, x, out, geom: ConvGeometry, config: KernelConfig, patches: int, patches_per_split: int,
    frames_before=None,
) -> None:  # fmt: skip
    """The TMA weight gradient into `out` ([splits, Cout, taps, Cin]), frames_before in front of x along D (at
    stride 1 in H and W); the tensors have unit-stride channels and TMA-aligned strides."""
    box_h, box_w = config.tma_box(config.block_k)
    go_desc = ndhwc_descriptor(grad_out, (1, 1, box_h, box_w, config.block_m))
    x_views = phase_descriptors(x, geom.stride, (1, 1, box_h, box_w, config.block_n))
    prefix = prefix_descriptor(frames_before, (1, 1, box_h, box_w, config.block_n))
    upcast, precision = dot_flags(x.dtype)
    c_out, c_in = geom.out_channels, geom.in_channels
    grid = (cdiv(c_out, config.block_m) * cdiv(c_in, config.block_n) * geom.taps, out.shape[0])
    launch(
        _conv3d_wgrad_tma_kernel, grid,
        go_desc, *x_views, prefix, out,
        c_in, c_out, *geom.out_size, patches, patches_per_split,
        *out.stride(),
        *source_frames(geom), *geom.front_padding, *geom.dilation,
        *geom.kernel, *geom.stride,
        UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BOX_H=box_h, BOX_W=box_w, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        PAD_MODE_D=geom.pad_mode_indices[0], HAS_PREFIX=prefix is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
