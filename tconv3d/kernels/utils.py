"""Pieces the kernel families share: small @triton.jit helpers and the launch-side layout, descriptors and dot
flags (those on torch tensors alone, which the paths without Triton share too, are in tensors.py)."""

import itertools
import math

import torch
import triton
import triton.language as tl
from packaging.version import Version
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import settings
from ..geometry import NORM_ACTIVATIONS
from . import launch

# Where Triton's coalescing pass proves no dimension of a load's pointers more contiguous than another (a gather),
# 3.6 lays a warp's threads along the first dimension and 3.9 along the last (sm_90 TTGIR of the packed loops: the
# same code, opposite layouts). gather_tile corrects for it. Releases between are taken as 3.9: either is right.
_TIES_TO_FIRST: tl.constexpr = tl.constexpr(Version(triton.__version__).release[:2] < (3, 7))


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Map a linear program id to a (row tile, column tile) pair, walking GROUP_M row tiles per column sweep so
    neighbouring programs share input rows and weight columns in L2."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


# The kernels' ACTIVATION codes: the indices of geometry.NORM_ACTIVATIONS ("none" is 0)
SILU: tl.constexpr = tl.constexpr(NORM_ACTIVATIONS.index("silu"))
RELU: tl.constexpr = tl.constexpr(NORM_ACTIVATIONS.index("relu"))
LEAKY_RELU: tl.constexpr = tl.constexpr(NORM_ACTIVATIONS.index("leaky_relu"))


@triton.jit
def activated(z, ACTIVATION: tl.constexpr, slope):
    """act(z) of the code ACTIVATION (geometry.NORM_ACTIVATIONS' index): z, z * sigmoid(z), max(z, 0) with NaN
    kept (torch's relu; PTX's max would answer 0), or z where z > 0 and z * slope elsewhere (torch's leaky_relu,
    `slope` its fp32 negative_slope, or a PReLU's, `slope` its weights as a [1, channels] row; read by no other
    code)."""
    if ACTIVATION == SILU:
        z = z * tl.sigmoid(z)
    elif ACTIVATION == RELU:
        z = tl.where(z < 0.0, 0.0, z)
    elif ACTIVATION == LEAKY_RELU:
        z = tl.where(z > 0.0, z, z * slope)
    return z


@triton.jit
def activation_backward(dy, z, ACTIVATION: tl.constexpr, slope):
    """dy * act'(z) (ACTIVATION a code of geometry.NORM_ACTIVATIONS, not 0): SiLU's derivative; dy where z > 0
    and 0 elsewhere, NaN and infinite dy included (torch's relu backward, a select); dy where z > 0 and dy * slope
    elsewhere (torch's leaky_relu backward)."""
    if ACTIVATION == SILU:
        sig = tl.sigmoid(z)
        dy = dy * (sig * (1.0 + z * (1.0 - sig)))
    elif ACTIVATION == RELU:
        dy = tl.where(z > 0.0, dy, 0.0)
    elif ACTIVATION == LEAKY_RELU:
        dy = tl.where(z > 0.0, dy, dy * slope)
    return dy


@triton.jit
def split_voxel(offs, D, H, W):
    """Linear voxel index over (N, D, H, W) -> its four coordinates."""
    w = offs % W
    rest = offs // W
    h = rest % H
    rest = rest // H
    d = rest % D
    n = rest // D
    return n, d, h, w


@triton.jit
def ring_voxel(offs, D, H, W, TOP, BOTTOM, LEFT, RIGHT):
    """Linear index over (N, D, ring) -> its four coordinates (n, d, h, w), a frame's ring being its voxels within
    TOP rows of its top edge or BOTTOM of its bottom one (whole rows, in order), then those of the rows between
    within LEFT columns of its left edge or RIGHT of its right one (row by row, left columns first). The rows
    between are not empty (H > TOP + BOTTOM, W > LEFT + RIGHT: the interior a box kernel computes)."""
    full = (TOP + BOTTOM) * W  # the whole rows' voxels
    sides = LEFT + RIGHT
    ring = full + (H - TOP - BOTTOM) * sides
    r = offs % ring
    rest = offs // ring
    d = rest % D
    n = rest // D
    row = r // W  # among the whole rows, TOP of them above
    row_h = tl.where(row < TOP, row, H - BOTTOM - TOP + row)
    s = tl.maximum(r - full, 0)  # among the side columns
    col = s % tl.maximum(sides, 1)
    side_h = TOP + s // tl.maximum(sides, 1)
    side_w = tl.where(col < LEFT, col, W - sides + col)
    in_rows = r < full
    return n, d, tl.where(in_rows, row_h, side_h), tl.where(in_rows, r % W, side_w)


@triton.jit
def voxel_steps(start, D, H, W, BLOCK: tl.constexpr):
    """The int32 coordinates (n, d, h, w) of voxels start .. start + BLOCK - 1 over (N, D, H, W), divided out once,
    and BLOCK's digits in that radix, for next_voxels: a loop over voxels then advances them without dividing
    (per-step int64 division cost ~6x the MMA time, first H100 run)."""
    n, d, h, w = split_voxel(start + tl.arange(0, BLOCK), D, H, W)
    # BLOCK's digits, divided step by step so that no product of sizes can overflow int32.
    step_w = BLOCK % W
    step_h = (BLOCK // W) % H
    step_d = (BLOCK // W // H) % D
    step_n = BLOCK // W // H // D
    digits = (step_n, step_d, step_h, step_w)
    return n.to(tl.int32), d.to(tl.int32), h.to(tl.int32), w.to(tl.int32), digits


@triton.jit
def next_voxels(n, d, h, w, digits, D, H, W):
    """The coordinates BLOCK voxels on (voxel_steps' digits): each digit stays below twice its radix, so one
    conditional subtraction carries it."""
    step_n, step_d, step_h, step_w = digits
    w += step_w
    carry = w >= W
    w = tl.where(carry, w - W, w)
    h += step_h + carry.to(tl.int32)
    carry = h >= H
    h = tl.where(carry, h - H, h)
    d += step_d + carry.to(tl.int32)
    carry = d >= D
    d = tl.where(carry, d - D, d)
    n += step_n + carry.to(tl.int32)
    return n, d, h, w


@triton.jit
def tap_pairs(offs, CHANNELS, KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr):
    """The packed loops' (tap, channel) pairs, numbered tap * CHANNELS + channel: each one's tap, its kernel
    coordinates (kd, kh, kw), its channel, and whether it is one of the kernel's. The pairs count from 0: unsigned
    divisions (a multiply-high and a shift each, without the signed ones' rounding fix-ups), int32 results."""
    pair = offs.to(tl.uint32)
    tap = pair // CHANNELS
    channel = pair - tap * CHANNELS
    kw = tap % KW
    kh = (tap // KW) % KH
    kd = tap // (KW * KH)
    return (tap.to(tl.int32), kd.to(tl.int32), kh.to(tl.int32), kw.to(tl.int32), channel.to(tl.int32),
            offs < KD * KH * KW * CHANNELS)  # fmt: skip


@triton.jit
def tap_bits(d0, h0, w0, rows, D, H, W, DIL_D, DIL_H, DIL_W, KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr):
    """Which taps of a row read inside a D x H x W input with zeros borders, for a loop whose steps mix taps
    (PACK_TAPS, the out-pairs weight gradient): bit (kd * KH + kh) * KW + kw is set where tap (kd, kh, kw) of the
    row whose tap (0, 0, 0) reads (d0, h0, w0) lies inside, and the row is one (rows). int32 for at most 31 taps,
    else int64 (at most 63): the top bit is never set (tap_inside's "no tap"). The bounds are separable: the taps
    inside along D, along H and along W, each a constant mask a kernel coordinate, and together (KD + KH + KW
    bounds a row, not KD * KH * KW)."""
    if KD * KH * KW < 32:
        zero = tl.zeros(d0.shape, tl.int32)
    else:
        tl.static_assert(KD * KH * KW < 64, "tap_bits: at most 63 taps")
        zero = tl.zeros(d0.shape, tl.int64)
    bits = _taps_inside_along(d0, D, DIL_D, zero, KD, KH * KW, 1)
    bits &= _taps_inside_along(h0, H, DIL_H, zero, KH, KW, KD)
    bits &= _taps_inside_along(w0, W, DIL_W, zero, KW, 1, KD * KH)
    return tl.where(rows, bits, zero)


@triton.jit
def _taps_inside_along(c0, size, DIL, zero, K: tl.constexpr, INNER: tl.constexpr, OUTER: tl.constexpr):
    """tap_bits along one dimension: the taps whose coordinate there, c0 + k * DIL, lies in [0, size). Taps number
    (outer * K + k) * INNER + inner, so kernel coordinate k owns INNER bits in each of OUTER runs."""
    REPEAT: tl.constexpr = ((1 << (OUTER * K * INNER)) - 1) // ((1 << (K * INNER)) - 1)  # bit 0 of each run
    bits = zero
    for k in tl.static_range(K):
        c = c0 + k * DIL
        bits |= tl.where((c >= 0) & (c < size), (((1 << INNER) - 1) << (k * INNER)) * REPEAT, 0).to(zero.dtype)
    return bits


@triton.jit
def tap_inside(bits, tap, valid, TAPS: tl.constexpr):
    """[rows, pairs]: whether pair k (tap[k], valid[k]: whether it is one of the reduction's) reads inside for row m,
    from tap_bits' bits (one shift and one test an element, where six bounds took twelve instructions)."""
    NONE: tl.constexpr = 31 if TAPS < 32 else 63  # a bit never set
    shift = tl.where(valid, tap, NONE)
    return ((bits[:, None] >> shift.to(bits.dtype)[None, :]) & 1) != 0


@triton.jit
def run_aligned(stride, RUN: tl.constexpr):
    """`stride`, which the launcher checked is a multiple of RUN (utils.channel_run), in a form the compiler
    knows is one: Triton proves alignment only of integer arguments divisible by 16, and a packed loop's strides
    are multiples of its few channels (8: the W stride of an 8-channel NDHWC tensor), so without this each
    (tap, channel) run of a row is gathered element by element."""
    if RUN > 1:
        return stride // RUN * RUN
    return stride


@triton.jit
def runs_aligned(stride_n, stride_d, stride_h, stride_w, RUN: tl.constexpr):
    """run_aligned of a tensor's four strides besides its channels' (N, D, H, W; or a weight's Cout, KD, KH, KW)."""
    return (run_aligned(stride_n, RUN), run_aligned(stride_d, RUN), run_aligned(stride_h, RUN),
            run_aligned(stride_w, RUN))  # fmt: skip


@triton.jit
def gather_tile(ptrs, mask, THREADS_ALONG_ROWS: tl.constexpr):
    """tl.load of a gathered 2-D tile (zeros where masked) with a warp's threads laid along its rows
    (THREADS_ALONG_ROWS) or its columns, whichever way this Triton breaks the tie (_TIES_TO_FIRST): each thread
    then holds few of that dimension's indices and many of the other's. Lay them along the dimension whose
    addresses and bounds a step computes afresh: the packed forward's and input gradient's (tap, channel) pairs
    (their rows' addresses are the program's) were 8 a thread under 3.6 and 1 under 3.9 before it, and the input
    gradient took 467 instructions a step there, now 154 (sm_90)."""
    if THREADS_ALONG_ROWS == _TIES_TO_FIRST:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.trans(tl.load(tl.trans(ptrs), mask=tl.trans(mask), other=0.0))


@triton.jit
def split_w_tap_columns(
    pid_n, CHANNELS, KW: tl.constexpr, W_TAPS: tl.constexpr, BLOCK_N: tl.constexpr, TAP_MAJOR: tl.constexpr = False
):
    """A W_TAPS tile's columns (config.w_tap_columns), BLOCK_N // W_TAPS channels from pid_n * (BLOCK_N // W_TAPS):
    column j is channel j // W_TAPS and W tap j % W_TAPS, or with TAP_MAJOR W tap j // (BLOCK_N // W_TAPS) and
    channel j % (BLOCK_N // W_TAPS), each tap's channels side by side (one contiguous run of a channels-last weight
    row where the tile holds all its channels). Its channels, taps, and whether each is one (a channel below
    CHANNELS, a tap below KW)."""
    CHANNELS_A_TILE: tl.constexpr = BLOCK_N // W_TAPS
    if TAP_MAJOR:
        channel = pid_n * CHANNELS_A_TILE + tl.arange(0, BLOCK_N) % CHANNELS_A_TILE
        tap = tl.arange(0, BLOCK_N) // CHANNELS_A_TILE
    else:
        channel = pid_n * CHANNELS_A_TILE + tl.arange(0, BLOCK_N) // W_TAPS
        tap = tl.arange(0, BLOCK_N) % W_TAPS
    return channel, tap, (channel < CHANNELS) & (tap < KW)


@triton.jit
def sum_w_taps(acc, tap_rows, W_TAPS: tl.constexpr, TAP_MAJOR: tl.constexpr = False):
    """A W_TAPS tile's accumulator [rows, channels x W_TAPS] (split_w_tap_columns' order) -> [rows, channels]: row r
    adds column j's value from row r + tap_rows[j] (a gather along the tile's rows; rows whose taps reach past the
    tile read its last row, and their sums are not written)."""
    BLOCK_M: tl.constexpr = acc.shape[0]
    rows = tl.arange(0, BLOCK_M)
    source = tl.minimum(rows[:, None] + tap_rows[None, :], BLOCK_M - 1)
    gathered = tl.gather(acc, source, axis=0)
    if TAP_MAJOR:
        return tl.sum(tl.reshape(gathered, [BLOCK_M, W_TAPS, acc.shape[1] // W_TAPS]), axis=1)
    return tl.sum(tl.reshape(gathered, [BLOCK_M, acc.shape[1] // W_TAPS, W_TAPS]), axis=2)


@triton.jit
def padded_coord(i, size, PAD_MODE: tl.constexpr):
    """The input coordinate that padded coordinate `i` (which may lie in the border) reads under its dimension's
    padding mode (PAD_MODE indexes geometry.PADDING_MODES); zeros mode leaves it as it is, for a mask. The
    geometry keeps every border within what its mode allows, so one clamp, mirror or wrap suffices."""
    if PAD_MODE == 1:  # replicate
        i = tl.minimum(tl.maximum(i, 0), size - 1)
    elif PAD_MODE == 2:  # reflect (border < size)
        i = tl.where(i < 0, -i, i)
        i = tl.where(i >= size, 2 * size - 2 - i, i)
    elif PAD_MODE == 3:  # circular (border <= size)
        i = tl.where(i < 0, i + size, i)
        i = tl.where(i >= size, i - size, i)
    return i


@triton.jit
def border_gather(
    n, id_, ih, iw, D, H, W, P, P_DELTA,
    stride_xn, stride_xd, stride_xh, stride_xw, stride_pn, stride_pd, stride_ph, stride_pw,
    PAD_MODE_D: tl.constexpr, PAD_MODE_H: tl.constexpr, PAD_MODE_W: tl.constexpr, HAS_PREFIX: tl.constexpr,
):  # fmt: skip
    """int64 offsets, from the input's base pointer, of the voxels that (possibly border) coordinates read, and a
    mask of those that read anything: a zeros-mode border reads nothing (masked), the other modes the voxel they
    map it to. Along D the first P coordinates are the frames of a second source (HAS_PREFIX), which starts
    P_DELTA elements from the input: one offset from one base either way keeps the channel loads contiguous and
    vectorised (a select between two pointers does not)."""
    id_ = padded_coord(id_, D, PAD_MODE_D)
    ih = padded_coord(ih, H, PAD_MODE_H)
    iw = padded_coord(iw, W, PAD_MODE_W)
    inside = (id_ >= 0) & (id_ < D) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    n, ih, iw = n.to(tl.int64), ih.to(tl.int64), iw.to(tl.int64)
    offsets = n * stride_xn + (id_ - P).to(tl.int64) * stride_xd + ih * stride_xh + iw * stride_xw
    if HAS_PREFIX:
        p_offsets = P_DELTA + n * stride_pn + id_.to(tl.int64) * stride_pd + ih * stride_ph + iw * stride_pw
        # A select, not tl.where: triton 3.9 loses the offsets' divisibility through tl.where and falls back
        # to 2-byte loads (226 registers instead of 98, static compile of the Wan decoder layer).
        offsets += (id_ < P).to(tl.int64) * (p_offsets - offsets)
    return offsets, inside


@triton.jit
def select(second, first_value, second_value):
    """first_value where `second` (a 0/1 int scalar) is 0, else second_value, in arithmetic: unlike tl.where it
    keeps what the compiler knows of the values' divisibility (strides, offsets), and so vectorised loads."""
    return first_value + second * (second_value - first_value)


@triton.jit
def source_blocks(C_A, C_ALL, BLOCK_K: tl.constexpr, HAS_AFTER: tl.constexpr):
    """(the first source's blocks, all blocks) of a pointer kernel's reduction over C_ALL channels in BLOCK_K
    steps, each block within one source (config.channel_blocks): with HAS_AFTER the first C_A channels are one
    source's (x's; grad_out's) and the rest channels_after's."""
    if HAS_AFTER:
        a_blocks = tl.cdiv(C_A, BLOCK_K)
        k_blocks = a_blocks + tl.cdiv(C_ALL - C_A, BLOCK_K)
    else:
        a_blocks = 0
        k_blocks = tl.cdiv(C_ALL, BLOCK_K)
    return a_blocks, k_blocks


@triton.jit
def block_channels(block, a_blocks, C_A, C_ALL, offs_k, BLOCK_K: tl.constexpr, HAS_AFTER: tl.constexpr):
    """Channel block `block` of source_blocks' count: (second, 1 where the block is channels_after's; its
    channels in its source's own numbering, [BLOCK_K]; their mask; the weight's channels for them, which count
    the first source's C_A before channels_after's). `second` is chosen by arithmetic (select), not a branch."""
    if HAS_AFTER:
        second = (block >= a_blocks).to(tl.int32)
        offs_c = (block - second * a_blocks) * BLOCK_K + offs_k
        mask_c = offs_c < select(second, C_A, C_ALL - C_A)
        w_c = offs_c + second * C_A
    else:
        second = 0
        offs_c = block * BLOCK_K + offs_k
        mask_c = offs_c < C_ALL
        w_c = offs_c
    return second, offs_c, mask_c, w_c


@triton.jit
def mma(acc, a, b, UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """acc += a @ b in fp32. UPCAST is set only under the Triton interpreter, whose tl.dot multiplies the raw
    bit patterns of bf16 operands."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=INPUT_PRECISION)


def dot_flags(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST, INPUT_PRECISION) for tl.dot on operands of `dtype`. fp32 uses TF32 exactly when cuDNN would;
    16-bit operands ignore the precision, so they get Triton's default and never risk an IEEE (non-MMA) path."""
    upcast = settings.INTERPRET and dtype == torch.bfloat16
    return upcast, "ieee" if exact_products(dtype) else "tf32"


def exact_products(dtype: torch.dtype) -> bool:
    """Whether products of `dtype` must be exact fp32: fp32 while cuDNN's convolutions may not use TF32
    (settings.tf32_allowed). Read at every launch, as cuDNN reads it."""
    return dtype == torch.float32 and not settings.tf32_allowed()


# Row indices of the GEMM kernels (voxels, or a stride phase's) and the coordinates split from them are int32 where
# every row index a launch forms, up to two tiles past its last row, stays under this (wide_rows).
INT32_ROWS = 2**31


def wide_rows(rows: int, block_m: int) -> bool:
    """Whether a launch of `rows` GEMM rows in tiles of `block_m` needs int64 row indices (WIDE_ROWS)."""
    return rows + 2 * block_m >= INT32_ROWS


def flat_rows(t: torch.Tensor) -> bool:
    """Whether t's voxels lie in (n, d, h, w) order one W stride apart, whatever the channels' stride: voxel m of
    the volume at offset m * stride_w (a dense channels_last_3d tensor, or a channel slice of one, as a
    concatenation's part). Size-1 dims, whose index is 0, aside."""
    n, _, d, h, w = t.shape
    sn, _, sd, sh, sw = t.stride()
    pitch = sw
    for size, stride in ((w, sw), (h, sh), (d, sd), (n, sn)):
        if size > 1 and stride != pitch:
            return False
        pitch *= size
    return True


def dense_ndhwc_strides(t: torch.Tensor) -> tuple[int, ...]:
    _, c, d, h, w = t.shape
    return (d * h * w * c, 1, h * w * c, w * c, c)


def ndhwc_strides(t: torch.Tensor) -> tuple[int, ...]:
    """t's strides with those of its size-1 dims (which torch leaves arbitrary, and no index ever multiplies)
    set to a dense channels_last_3d tensor's: a kernel may then take stride_w as the row pitch of a dense
    tensor whatever its width."""
    n, c, d, h, w = t.shape
    sn, sc, sd, sh, sw = t.stride()
    if n > 1 and c > 1 and d > 1 and h > 1 and w > 1:
        return sn, sc, sd, sh, sw
    return (
        sn if n > 1 else d * h * w * c, sc if c > 1 else 1, sd if d > 1 else h * w * c, sh if h > 1 else w * c,
        sw if w > 1 else c,
    )  # fmt: skip


def channel_run(channels: int, *tensors: torch.Tensor | None) -> int:
    """RUN of a packed loop (its reduction (tap, channel) pairs, `channels` a tap): the largest power of two
    elements, at most 16 bytes, that divides `channels` and every stride but the channels' of each tensor given
    (channels unit-stride: ndhwc's; size-1 dims, whose index is 0, aside), so that each tap's run of channels of
    a voxel starts 16-byte aligned when the tensor does (which Triton checks itself) and loads as vectors; 1
    where no power of two does."""
    present = [t for t in tensors if t is not None]
    common = channels
    for t in present:
        shape, strides = t.shape, t.stride()
        if shape[1] > 1 and strides[1] != 1:
            return 1
        for dim in (0, 2, 3, 4):
            if shape[dim] > 1:
                common = math.gcd(common, strides[dim])
    return min(16 // present[0].element_size(), common & -common)  # the largest power of two dividing them all


def unseen_run(channels: int, *tensors: torch.Tensor | None) -> int:
    """RUN of a plain (unpacked) loop: channel_run where Triton cannot see the alignment itself, that is where
    `channels` or a stride channel_run covers is not a multiple of 16 (Triton proves divisibility of integer
    arguments by 16 alone): 24 bf16 channels, whose 48-byte rows are 16-byte runs, loaded element by element
    without it. 1 where every one is a multiple of 16, so such launches compile as they did."""
    seen = channels % 16 == 0
    for t in tensors:  # (a loop, not all() over a generator: 0.53 us a call against 0.80)
        if seen and t is not None:
            seen = strides_seen(t)
    return 1 if seen else channel_run(channels, *tensors)


def strides_seen(t: torch.Tensor) -> bool:
    """Whether every stride of t but the channels' is a multiple of 16, which Triton proves of integer arguments
    itself (and of no other divisor)."""
    sn, _, sd, sh, sw = t.stride()
    return (sn | sd | sh | sw) % 16 == 0  # every low bit clear: all multiples of 16 (per launch, so cheap)


def dense_ndhwc(t: torch.Tensor) -> bool:
    """Whether t's element (n, c, d, h, w) sits at (((n*D + d)*H + h)*W + w)*C + c: every dim of size above one
    has the stride of a dense channels_last_3d tensor (size-1 dims may have any stride, as torch allows)."""
    return ndhwc_strides(t) == dense_ndhwc_strides(t)


def ndhwc_descriptor(t: torch.Tensor, block, make=TensorDescriptor):
    """A TMA descriptor over a (N, C, D, H, W) tensor whose channels are unit-stride, in memory order
    [N, D, H, W, C]: boxes at coordinates past any edge, negative ones included, read zeros. `make` builds it
    (Triton's TensorDescriptor, or the Gluon kernels' maker)."""
    n, c, d, h, w = t.shape
    sn, _, sd, sh, sw = t.stride()
    shape = (n, d, h, w, c)
    unit = 16 // t.element_size()  # elements per 16 bytes
    # A dimension of size 1 is only ever read at coordinate 0 (or out of range), so any stride describes it; it
    # gets the packed one (the next inner dimension's extent, rounded up to 16 bytes), so that every stride spans
    # the dimensions inside it (the risks of tensor_map_problems).
    if w == 1:
        sw = -(-c // unit) * unit
    if h == 1:
        sh = -(-sw * w // unit) * unit
    if d == 1:
        sd = -(-sh * h // unit) * unit
    if n == 1:
        sn = -(-sd * d // unit) * unit
    return tensor_descriptor(t, shape, (sn, sd, sh, sw, 1), tuple(block), make)


_descriptors: dict[tuple, TensorDescriptor] = {}
_descriptor_ids = itertools.count()


def tensor_descriptor(t: torch.Tensor, shape: tuple, strides: tuple, block: tuple, make=TensorDescriptor):
    """make(t, shape, strides, block): a TensorDescriptor by default. Its checks (block, strides, shape: ~2 us a
    descriptor, issue 19) are made once per (shape, strides, block, dtype, make), the base's alignment on every
    call."""
    if t.data_ptr() % 16:
        raise ValueError(f"a TMA descriptor needs a 16-byte aligned base; this {tuple(t.shape)} tensor's is not")
    key = (shape, strides, block, t.dtype, make)
    checked = _descriptors.get(key)
    if checked is None:
        if settings.TMA_MAPS == "strict":
            _check_strict(shape, strides, block, t.element_size())
        checked = make(t, list(shape), list(strides), list(block))
        checked.base = None  # the memo must not keep a tensor alive
        # What the direct launch path (launch.py) keys a descriptor argument on: one number per distinct
        # (shape, strides, block, dtype, maker), cheap to hash on every launch.
        checked.launch_signature = next(_descriptor_ids)
        if len(_descriptors) < 4096:
            _descriptors[key] = checked
    return on_base(checked, t)


def on_base(checked, t: torch.Tensor):
    """A copy of a checked descriptor (tensor_descriptor's template) with t as its base: its fields as they are,
    without the constructor's checks (also what a call plan replays, tconv3d/plans.py)."""
    descriptor = object.__new__(type(checked))
    descriptor.__dict__.update(checked.__dict__)
    descriptor.base = t
    return descriptor


class RiskyTensorMap(ValueError):
    """A tensor map among tensor_map_problems' risks, refused under TCONV3D_TMA_MAPS=strict (raised while a
    launcher builds its descriptors, before anything launches: choice.launch runs the pointer kernels instead)."""


def _check_strict(shape, strides, block, element_size: int) -> None:
    """RiskyTensorMap if the map is one of tensor_map_problems' risks, its inner box as the driver gets it (rows
    wider than the 128-byte swizzle span go as several copies of that span)."""
    box = [*block[:-1], min(block[-1], 128 // element_size)]
    _, risks = tensor_map_problems(shape, strides, box, element_size, None)
    if risks:
        raise RiskyTensorMap(f"TMA map {tuple(shape)} box {tuple(box)}: {'; '.join(risks)}")


# CUtensorMapSwizzle (cuda.h) -> the span in bytes the box's inner dimension must fit: none, 32B, 64B, 128B.
SWIZZLE_SPAN = {0: None, 1: 32, 2: 64, 3: 128}


def tensor_map_problems(shape, strides, box, element_size: int, swizzle: int | None = 0) -> tuple[list[str], list[str]]:
    """What cuTensorMapEncodeTiled would make of a tiled tensor map: shape, element strides and box row-major as
    Triton's descriptors hold them (the innermost dimension last), `box` and `swizzle` (CUtensorMapSwizzle) as
    the compiled kernel hands them to the driver (Triton splits a box wider than the swizzle span into several
    copies; None where unknown). Returns (problems, risks). problems: the requirements cuda.h documents, each of
    which fails the encoding: rank 1-5, dimensions 1..2^32, strides multiples of 16 bytes below 2^40, box
    dimensions 1..256, the inner box a multiple of 16 bytes and within the swizzle span. risks: what CCCL's
    cuda::make_tma_descriptor also refuses, which cuda.h does not ask and Triton's own tests break (device-made
    maps with boxes past the tensor's extent load zeros there): a box dimension past the tensor's, a stride
    shorter than the dimensions inside it span. Unknown whether the driver refuses them: tests/gpu/tma_probe.py
    finds out on a GPU."""
    problems, risks = [], []
    rank = len(shape)
    if not 1 <= rank <= 5:
        problems.append(f"rank {rank} is not 1-5")
    for i, (size, stride, extent) in enumerate(zip(shape, strides, box, strict=True)):
        if not 1 <= size <= 2**32:
            problems.append(f"dimension {i} has {size} elements, not 1..2^32")
        if not 1 <= extent <= 256:
            problems.append(f"box dimension {i} is {extent}, not 1..256")
        elif extent > size:
            risks.append(f"box dimension {i} ({extent}) is longer than the tensor's ({size})")
        if i < rank - 1:
            nbytes = stride * element_size
            if nbytes % 16 or not 0 < nbytes < 2**40:
                problems.append(f"stride {i} is {nbytes} bytes, not a multiple of 16 below 2^40")
            if stride < shape[i + 1] * strides[i + 1]:
                risks.append(f"stride {i} ({stride}) is shorter than dimension {i + 1} spans ({shape[i + 1]} x "
                             f"{strides[i + 1]})")  # fmt: skip
        elif stride != 1:
            problems.append(f"the innermost dimension has stride {stride}, not 1")
    inner = box[-1] * element_size
    if inner % 16:
        problems.append(f"the box's inner dimension is {inner} bytes, not a multiple of 16")
    if swizzle is not None:  # None: not known (a Triton that reports none), not checked
        span = SWIZZLE_SPAN.get(swizzle, 0)
        if span == 0:
            problems.append(f"swizzle {swizzle} is not one of {sorted(SWIZZLE_SPAN)}")
        elif span is not None and inner > span:
            problems.append(f"the box's inner dimension is {inner} bytes, past the {span}-byte swizzle")
    return problems, risks


def tma_aligned(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor may cover t as ndhwc_descriptor lays it out: 16-byte aligned base, unit-stride
    channels, the stride of every other dimension longer than 1 a multiple of 16 bytes."""
    size = t.element_size()
    strides = [s for dim, (s, n) in enumerate(zip(t.stride(), t.shape, strict=True)) if dim != 1 and n > 1]
    return address_aligned(t) and t.stride(1) == 1 and all(s * size % 16 == 0 for s in strides)


def address_aligned(t: torch.Tensor) -> bool:
    """Whether t's first element is 16-byte aligned. A tensor being traced for Inductor has no address: there its
    offset into its storage decides, as Inductor assumes of the storage (and checks of its inputs at run time)."""
    try:
        return t.data_ptr() % 16 == 0
    except RuntimeError:  # FakeTensor, FunctionalTensor: "Cannot access data pointer"
        return t.storage_offset() * t.element_size() % 16 == 0


def second_source_arguments(second, x) -> tuple:
    """A second source of the pointer kernels (frames_before along D, channels_after along C): (its distance from x
    in elements, a launch.Distance, its N, D, H, W strides); zeros without one. The kernels address it from x's
    pointer (same dtype, so the distance is whole elements)."""
    if second is None:
        return 0, 0, 0, 0, 0
    n_stride, _, d_stride, h_stride, w_stride = second.stride()
    delta = launch.Distance((second.data_ptr() - x.data_ptr()) // x.element_size(), second, x)
    return delta, n_stride, d_stride, h_stride, w_stride
