"""GroupNorm on NDHWC tensors (InstanceNorm is its groups == channels case), with an optional fused activation
(SiLU, ReLU, leaky ReLU or PReLU: geometry.NORM_ACTIVATIONS): its Triton kernels and their launchers.

Viewed as (N, S = D*H*W voxels, C), a channels_last_3d tensor has each voxel's channels contiguous, so every
kernel works on tiles of BLOCK_S voxels x BLOCK_C channels, loads vectorised along C:
- `_channel_reduce_kernel`: per (batch, voxel split, channel) the partial moments the forward needs (mean and
  squared deviations, combined block by block with Chan's formula: no cancellation), or the two sums the
  backward needs (of dy' and of dy' times x less its group's mean: no cancellation either; a PReLU's a third, of
  dy times its input where that is not positive: its weights' gradient). The host folds channels into groups and
  splits into totals in a fixed order, so both directions are bitwise deterministic, with no atomics.
- `_fold_kernel`: a program a few groups (FOLD_CHANNELS) folds the partials into what the other two take, splits
  and channels in a fixed order: the forward's mean and rstd per (batch, group); the backward's k1, k2, k3 per
  (batch, channel) and the weight and bias gradients (summed over the batch in order). One launch where the same
  arithmetic in torch ops was some 25 tiny kernels and their host calls a norm (kernels/aten.py's scale_shift and
  backward_coefficients keep it in torch for the aten path).
- `_affine_kernel`: y = act((x - mean) * a + b) with per-(batch, channel) a = rstd * weight and b = bias;
  backward dx = dy' * k1 + (x - mean) * k2 + k3 with dy' = dy * act'((x - mean) * a + b), recomputed, not stored;
  with one channel a group (InstanceNorm, BatchNorm) dx = (dy' + k3) * k1 + (x - mean) * k2, k3 = -mean(dy'): dy'
  centered before it is scaled by rstd, so a gradient constant over a channel (y.sum()'s) answers exactly 0 there
  where dy' * k1 + k3 would round two terms rstd times dy's size (1e-4 of it at a constant channel's rstd).
  x is centered before it is scaled: the folded form x * a + (b - mean * a) subtracts two products of the mean's
  size, whose difference is |mean| / std times less precise (torch's group_norm folds, and drifts from float64
  by 1e-3 where the mean is 100 standard deviations; its instance_norm centers, as here).
A norm is three launches each way; a = rstd * weight and b = bias are taken where they are read (_scale_shift), and a
backward's k1, k2, k3 are one fp32 table. Statistics and coefficients are fp32 whatever the tensor dtype; nothing
NCDHW is ever made.
"""

import torch
import triton
import triton.language as tl

from .. import settings
from ..geometry import NORM_ACTIVATIONS
from .launch import MAX_GRID, launch
from .split_k import sum_splits
from .tensors import cdiv, dense_voxels, empty_ndhwc, next_power_of_2, parameter_grad_dtype
from .utils import activated, activation_backward

BLOCK_S, BLOCK_C = 64, 32  # a tile of 2048 elements; C is the contiguous axis
# The affine kernel's voxels a tile. Each element's value is its own formula's, whatever the tile, so the interpreter,
# which runs a program at a time in Python, takes 16x fewer, larger ones (a converted DenseNet121's 120 BatchNorms
# spent most of a CPU training step's norm time in this kernel's programs).
AFFINE_BLOCK_S = BLOCK_S * 16 if settings.INTERPRET else BLOCK_S
SPLIT_BLOCKS = 16  # voxel blocks per reduction program
# The most voxel splits of a sample and batch entries a launch takes: CUDA's limit on a grid's third axis (MAX_GRID),
# along which the reduction's splits and the affine kernel's batch entries lie. Past 65,535 splits of SPLIT_BLOCKS
# blocks (67.1M voxels a sample: a whole CT volume, an untiled video decoder's last frames, BatchNorm3d's batch
# folded into its voxels) a split walks more blocks; past 65,535 entries the affine kernel is launched again from
# the next one (N0).
MAX_SPLITS = AFFINE_BATCH = MAX_GRID[2]
INT32_VOXELS = 2**31  # voxel indices from here on are int64 (WIDE), as fold.py's
# The rows of a backward's fp32 [3, N, C] table of per-(batch, channel) coefficients (one allocation): k1, k2, k3
# (see _affine_kernel)
COEF_K1: tl.constexpr = tl.constexpr(0)
COEF_K2: tl.constexpr = tl.constexpr(1)
COEF_K3: tl.constexpr = tl.constexpr(2)


@triton.jit
def _scale_shift(rstd_ptr, weight_ptr, bias_ptr, n, GROUPS, PER_GROUP, channels, mask, HAS_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr):  # fmt: skip
    """a = rstd * weight and b = bias (fp32) of batch entry n's `channels` (the concatenation's; rstd [N, GROUPS],
    PER_GROUP channels a group): y = act((x - mean) * a + b)."""
    a = tl.load(rstd_ptr + n * GROUPS + channels // PER_GROUP, mask=mask, other=0.0)
    if HAS_WEIGHT:
        a = a * tl.load(weight_ptr + channels, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + channels, mask=mask, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros_like(a)
    return a, b


@triton.jit
def _slopes(slope, slopes_ptr, slope_stride, channels, mask, HAS_SLOPES: tl.constexpr):
    """The leaky ReLU's slope of `channels` (the concatenation's): `slope` itself, or with HAS_SLOPES a PReLU's
    weights, fp32 [1, channels] (slope_stride 0: one weight for all, 1: one a channel)."""
    if HAS_SLOPES:
        slope = tl.load(slopes_ptr + channels * slope_stride, mask=mask, other=0.0).to(tl.float32)[None, :]
    return slope


@triton.jit
def _channel_reduce_kernel(
    x_ptr, dy_ptr, mean_ptr, rstd_ptr, weight_ptr, bias_ptr, slopes_ptr, out_ptr,
    S, C, C0, SPLIT_S, GROUPS, PER_GROUP, slope, slope_stride,
    stride_xn, stride_xv, stride_dn, stride_dv, stride_on, stride_os, stride_oq,
    BACKWARD: tl.constexpr, ACTIVATION: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOPES: tl.constexpr, SLOPE_GRAD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    WIDE: tl.constexpr,
):  # fmt: skip
    """Per (n, split, channel): forward, out[.., 0] = mean and out[.., 1] = sum of squared deviations of x over the
    split's voxels; backward, out[.., 0] = sum of dy' and out[.., 1] = sum of dy' * (x - mean), where dy' is dy
    through the activation (ACTIVATION, a code of geometry.NORM_ACTIVATIONS) at z = (x - mean) * a + b
    (_scale_shift: a = rstd * weight, b = bias; a leaky ReLU's slope `slope` or, HAS_SLOPES, a PReLU's weights:
    _slopes), and with SLOPE_GRAD out[.., 2] = sum of dy * z where z <= 0 (the PReLU weights' gradient); mean and
    rstd are [N, GROUPS], PER_GROUP channels a group. x holds C channels, the concatenation's C0 .. C0 + C (a
    source of a concatenation along C; C0 = 0 and C all of them without one): dy, weight, bias, the slopes and out
    are the concatenation's, their channels from C0 on. x's and dy's voxels are stride_xv and stride_dv apart. Grid
    (N, channel blocks, splits); WIDE: voxel indices in int64 (a sample of 2^31 voxels or more)."""
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    wide_c = C0 + offs_c  # the channels in the concatenation
    s_start = tl.program_id(2).to(tl.int64 if WIDE else tl.int32) * SPLIT_S
    s_end = tl.minimum(s_start + SPLIT_S, S)
    x_base = x_ptr + n.to(tl.int64) * stride_xn
    if BACKWARD:
        dy_base = dy_ptr + n.to(tl.int64) * stride_dn
        center = tl.load(mean_ptr + n * GROUPS + wide_c // PER_GROUP, mask=mask_c, other=0.0)
        if ACTIVATION != 0:
            a, b = _scale_shift(rstd_ptr, weight_ptr, bias_ptr, n, GROUPS, PER_GROUP, wide_c, mask_c, HAS_WEIGHT,
                                HAS_BIAS)  # fmt: skip
            slope = _slopes(slope, slopes_ptr, slope_stride, wide_c, mask_c, HAS_SLOPES)
    first = tl.zeros((BLOCK_C,), dtype=tl.float32)  # forward: running mean; backward: sum of dy'
    second = tl.zeros((BLOCK_C,), dtype=tl.float32)  # forward: running M2; backward: sum of dy' * (x - mean)
    third = tl.zeros((BLOCK_C,), dtype=tl.float32)  # SLOPE_GRAD: sum of dy * z where z <= 0
    count = 0.0
    for s0 in range(s_start, s_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = (offs_s < s_end)[:, None] & mask_c[None, :]
        voxels = offs_s.to(tl.int64)[:, None]
        x = tl.load(x_base + voxels * stride_xv + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            dy = tl.load(dy_base + voxels * stride_dv + wide_c[None, :], mask=mask, other=0.0).to(tl.float32)
            centered = x - center[None, :]  # outside the mask dy is 0
            if ACTIVATION != 0:
                z = centered * a[None, :] + b[None, :]
                if SLOPE_GRAD:
                    third += tl.sum(tl.where(z > 0.0, 0.0, dy * z), axis=0)
                dy = activation_backward(dy, z, ACTIVATION, slope)
            first += tl.sum(dy, axis=0)
            second += tl.sum(dy * centered, axis=0)
        else:
            rows = tl.minimum(s_end - s0, BLOCK_S).to(tl.float32)
            block_mean = tl.sum(x, axis=0) / rows
            # corrected by the mean of the deviations, which are small: the block's sum of values of the mean's
            # size rounds by an ulp of the sum, some of the mean's ulps
            block_mean += tl.sum(tl.where(mask, x - block_mean[None, :], 0.0), axis=0) / rows
            deviation = tl.where(mask, x - block_mean[None, :], 0.0)
            block_m2 = tl.sum(deviation * deviation, axis=0)
            total = count + rows
            delta = block_mean - first
            first += delta * (rows / total)
            second += block_m2 + delta * delta * (count * rows / total)
            count = total
    out = out_ptr + n * stride_on + tl.program_id(2) * stride_os + wide_c
    tl.store(out, first, mask=mask_c)
    tl.store(out + stride_oq, second, mask=mask_c)
    if SLOPE_GRAD:
        tl.store(out + 2 * stride_oq, third, mask=mask_c)


@triton.jit
def _affine_kernel(
    x_ptr, dy_ptr, out_ptr, mean_ptr, rstd_ptr, weight_ptr, bias_ptr, coef_ptr, slopes_ptr,
    S, C, C0, N0, GROUPS, PER_GROUP, slope, slope_stride,
    stride_xn, stride_xv, stride_dn, stride_dv, stride_on, stride_ov, stride_an, stride_ak,
    BACKWARD: tl.constexpr, ACTIVATION: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOPES: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Forward: out = act((x - mean) * a + b). Backward: out = dy' * k1 + (x - mean) * k2 + k3, dy' = dy *
    act'((x - mean) * a + b); with one channel a group (PER_GROUP 1), out = (dy' + k3) * k1 + (x - mean) * k2.
    a = rstd * weight and b = bias (_scale_shift; the backward reads them only through an ACTIVATION, a leaky
    ReLU's slope `slope` or, HAS_SLOPES, a PReLU's weights: _slopes); k1, k2, k3 are coef's fp32 rows (COEF_K1
    ... COEF_K3, stride_ak apart; its batch entries stride_an apart); mean and rstd are [N, GROUPS], PER_GROUP
    channels a group. x holds the concatenation's channels C0 .. C0 + C, the others are the concatenation's (see
    _channel_reduce_kernel). x's, dy's and out's voxels are stride_xv, stride_dv and stride_ov apart. Grid (voxel
    blocks, channel blocks, batch entries from N0 on); WIDE: voxel indices in int64 (2^31 voxels a sample or more)."""
    n = N0 + tl.program_id(2)
    offs_s = tl.program_id(0).to(tl.int64 if WIDE else tl.int32) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    mask = (offs_s < S)[:, None] & mask_c[None, :]
    voxels = offs_s.to(tl.int64)[:, None]
    wide_c = (C0 + offs_c)[None, :]  # the channels in the concatenation
    x = tl.load(x_ptr + n.to(tl.int64) * stride_xn + voxels * stride_xv + offs_c[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32) - tl.load(mean_ptr + n * GROUPS + (C0 + offs_c) // PER_GROUP, mask=mask_c, other=0.0)[None, :]
    if ACTIVATION != 0 or not BACKWARD:
        a, b = _scale_shift(rstd_ptr, weight_ptr, bias_ptr, n, GROUPS, PER_GROUP, C0 + offs_c, mask_c, HAS_WEIGHT,
                            HAS_BIAS)  # fmt: skip
        z = x * a[None, :] + b[None, :]
        slope = _slopes(slope, slopes_ptr, slope_stride, C0 + offs_c, mask_c, HAS_SLOPES)
    if BACKWARD:
        coefficients = coef_ptr + n * stride_an + C0 + offs_c
        dy = tl.load(dy_ptr + n.to(tl.int64) * stride_dn + voxels * stride_dv + wide_c, mask=mask, other=0.0)
        dy = dy.to(tl.float32)
        if ACTIVATION != 0:
            dy = activation_backward(dy, z, ACTIVATION, slope)
        k1 = tl.load(coefficients + COEF_K1 * stride_ak, mask=mask_c, other=0.0)[None, :]
        k2 = tl.load(coefficients + COEF_K2 * stride_ak, mask=mask_c, other=0.0)[None, :]
        k3 = tl.load(coefficients + COEF_K3 * stride_ak, mask=mask_c, other=0.0)[None, :]
        if PER_GROUP == 1:  # noqa: SIM108  k3 is -mean(dy'): centered first (see the module's docstring)
            result = (dy + k3) * k1 + x * k2
        else:
            result = dy * k1 + x * k2 + k3
    else:
        result = activated(z, ACTIVATION, slope)
    out = out_ptr + n.to(tl.int64) * stride_on + voxels * stride_ov + wide_c
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=mask)


# _fold_kernel's modes (the host passes their .value)
FOLD_STATISTICS: tl.constexpr = tl.constexpr(0)
FOLD_BACKWARD: tl.constexpr = tl.constexpr(1)


@triton.jit
def _fold_kernel(
    partial_ptr, mean_ptr, rstd_ptr, weight_ptr, coef_ptr, dw_ptr, db_ptr, ds_ptr,
    N, C, SPLITS, VOXELS, PER_SPLIT, eps,
    MODE: tl.constexpr, HAS_WEIGHT: tl.constexpr, PER_GROUP: tl.constexpr, MOMENTS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """BLOCK_GROUPS groups' channels (program_id(0)'s) for every batch entry, in order, their splits BLOCK_S at a
    time (a large volume has thousands): tiles [BLOCK_S splits, BLOCK_GROUPS groups, BLOCK_G channels a group].
    partial is [N, SPLITS, MOMENTS, C] fp32 (_channel_reduce_kernel's); mean and rstd [N, groups]; coef [3, N, C]
    (rows COEF_K1 ... COEF_K3); dw, db, ds [C] (ds with a third moment: the PReLU weights' gradient, the sums of
    dy * z where z <= 0 over the batch). FOLD_STATISTICS: the split moments -> mean and rstd (Chan's formula over the
    splits' counts: the last split holds the rest of the VOXELS). FOLD_BACKWARD: the split sums of dy' and dy' *
    (x - mean) -> dx = dy' * k1 + (x - mean) * k2 + k3 (with one channel a group, k3 = -mean(dy') and dx = (dy' +
    k3) * k1 + (x - mean) * k2) and the weight and bias gradients. Each group's sums run over its own splits and
    channels in the same order whatever BLOCK_GROUPS is. WIDE: the splits' voxel counts taken in int64 (2^31 voxels
    a sample or more)."""
    groups = C // PER_GROUP
    group = tl.program_id(0) * BLOCK_GROUPS + tl.arange(0, BLOCK_GROUPS)
    offs = tl.arange(0, BLOCK_G)
    in_group = group < groups
    mask = in_group[:, None] & (offs < PER_GROUP)[None, :]
    channels = group[:, None] * PER_GROUP + offs[None, :]  # [BLOCK_GROUPS, BLOCK_G]
    gamma = tl.load(weight_ptr + channels, mask=mask, other=0.0).to(tl.float32) if HAS_WEIGHT else 1.0
    total = VOXELS * 1.0 * PER_GROUP  # fp32: the count may pass int32
    zeros = tl.zeros((BLOCK_GROUPS, BLOCK_G), dtype=tl.float32)
    dw = zeros
    db = zeros
    ds = zeros
    for n in range(N):
        base = partial_ptr + (tl.zeros((), dtype=tl.int64) + n) * SPLITS * MOMENTS * C
        if MODE == FOLD_STATISTICS:
            first = tl.zeros((BLOCK_GROUPS,), dtype=tl.float32)
            for s0 in range(0, SPLITS, BLOCK_S):
                means, counts, _ = _split_tile(base, s0, SPLITS, C, 2, channels, mask, VOXELS, PER_SPLIT, BLOCK_S, 0,
                                               WIDE)  # fmt: skip
                first += tl.sum(tl.sum(means, axis=2) * counts[:, None], axis=0)
            mean = first / total
            spread = tl.zeros((BLOCK_GROUPS,), dtype=tl.float32)
            shift = tl.zeros((BLOCK_GROUPS,), dtype=tl.float32)  # the sum of the deviations, small: mean's fix
            for s0 in range(0, SPLITS, BLOCK_S):
                means, counts, tile = _split_tile(base, s0, SPLITS, C, 2, channels, mask, VOXELS, PER_SPLIT, BLOCK_S,
                                                  0, WIDE)  # fmt: skip
                m2, _, _ = _split_tile(base, s0, SPLITS, C, 2, channels, mask, VOXELS, PER_SPLIT, BLOCK_S, 1, WIDE)
                deviation = tl.where(tile, means - mean[None, :, None], 0.0)
                spread += tl.sum(tl.sum(m2, axis=2) + tl.sum(deviation * deviation, axis=2) * counts[:, None], axis=0)
                shift += tl.sum(tl.sum(deviation, axis=2) * counts[:, None], axis=0)
            # first's sum of values of the mean's size rounded by an ulp of the sum: the mean corrected by the
            # deviations' mean, and the spread taken about the corrected mean (less total * correction^2)
            correction = shift / total
            mean += correction
            spread = tl.maximum(spread - total * correction * correction, 0.0)
            rstd = 1.0 / tl.sqrt(spread / total + eps)
            tl.store(mean_ptr + n * groups + group, mean, mask=in_group)
            tl.store(rstd_ptr + n * groups + group, rstd, mask=in_group)
        else:  # FOLD_BACKWARD: the coefficients of x - mean need no mean
            rstd = tl.load(rstd_ptr + n * groups + group, mask=in_group, other=0.0)
            dy_sum = zeros
            dyx_sum = zeros
            for s0 in range(0, SPLITS, BLOCK_S):
                dy_sum += tl.sum(_split_tile(base, s0, SPLITS, C, MOMENTS, channels, mask, VOXELS, PER_SPLIT, BLOCK_S,
                                             0, WIDE)[0], 0)  # fmt: skip
                dyx_sum += tl.sum(_split_tile(base, s0, SPLITS, C, MOMENTS, channels, mask, VOXELS, PER_SPLIT, BLOCK_S,
                                              1, WIDE)[0], 0)  # fmt: skip
            if MOMENTS == 3:  # a loop of its own: in the one above, triton 3.6 spilled (96 registers, 8 bytes)
                for s0 in range(0, SPLITS, BLOCK_S):
                    ds += tl.sum(_split_tile(base, s0, SPLITS, C, MOMENTS, channels, mask, VOXELS, PER_SPLIT, BLOCK_S,
                                             2, WIDE)[0], 0)  # fmt: skip
            dy_xhat = rstd[:, None] * dyx_sum  # sum over the voxels of dy' * xhat
            db += dy_sum
            dw += dy_xhat
            group_a = tl.sum(gamma * dy_sum, axis=1)  # over each group, of gamma * dy'
            group_b = tl.sum(gamma * dy_xhat, axis=1)  # ... of gamma * dy' * xhat
            k2 = -rstd * rstd * group_b / total
            k3 = -rstd * group_a / total
            if PER_GROUP == 1:  # dy' centered before the affine kernel scales it
                k3 = -tl.sum(dy_sum, axis=1) / total
            # A group of one value normalizes to 0 whatever it is: dx is 0, not dy' * k1 + k3's rounding of two
            # terms rstd times dy's size (1e-4 of dy at eps 1e-6). 0 * rstd, not 0: NaN where rstd is not finite
            # (eps <= 0: the output NaN too), as torch's gradient is
            single = total == 1.0
            none = rstd[:, None] * 0.0 + zeros
            out = coef_ptr + n * C + channels
            rows = N * C  # coef's rows apart
            tl.store(out + COEF_K1 * rows, tl.where(single, none, rstd[:, None] * gamma + zeros), mask=mask)
            tl.store(out + COEF_K2 * rows, tl.where(single, none, k2[:, None] + zeros), mask=mask)
            tl.store(out + COEF_K3 * rows, tl.where(single, none, k3[:, None] + zeros), mask=mask)
    if MODE == FOLD_BACKWARD:  # in the parameters' dtype (parameter_grad_dtype)
        tl.store(dw_ptr + channels, dw.to(dw_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + channels, db.to(db_ptr.dtype.element_ty), mask=mask)
        if MOMENTS == 3:
            tl.store(ds_ptr + channels, ds.to(ds_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_tile(base, s0, SPLITS, C, MOMENTS: tl.constexpr, channels, mask, VOXELS, PER_SPLIT, BLOCK_S: tl.constexpr,
                MOMENT: tl.constexpr, WIDE: tl.constexpr):  # fmt: skip
    """Splits s0 .. s0 + BLOCK_S of one batch entry's partials (base: its split 0; MOMENTS rows of C a split),
    moment MOMENT of `channels` ([groups, channels a group], `mask`): ([BLOCK_S, groups, channels] values, zeros
    outside; [BLOCK_S] voxel counts, 0 past the last split; the tile's mask). WIDE: the counts taken in int64."""
    splits = s0 + tl.arange(0, BLOCK_S)
    inside = splits < SPLITS
    tile = inside[:, None, None] & mask[None, :, :]
    rows = (splits * MOMENTS * C + MOMENT * C)[:, None, None]
    values = tl.load(base + rows + channels[None, :, :], mask=tile, other=0.0)
    before = splits.to(tl.int64 if WIDE else tl.int32) * PER_SPLIT  # the voxels of the splits before
    counts = tl.where(inside, tl.minimum(PER_SPLIT, VOXELS - before), 0) * 1.0
    return values, counts, tile


@triton.jit
def _running_statistics_kernel(
    mean_ptr, rstd_ptr, running_mean_ptr, running_var_ptr, count_ptr, C, momentum, eps, unbias,
    COUNTED: tl.constexpr, CUMULATIVE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """A BatchNorm's running statistics moved towards the batch's, as torch moves them: running = lerp(running,
    batch statistic, factor), the variance unbiased (`unbias` = values / (values - 1)) and taken back from rstd
    (1 / rstd^2 - eps, at least 0; divisions rounded to nearest, as torch's), each statistic rounded to the
    buffers' dtype (fp32, fp16 or bf16) first and lerped in fp32. COUNTED: num_batches_tracked (count_ptr,
    int64) is incremented first; CUMULATIVE: the factor is 1 / that count (momentum None: a cumulative average),
    else `momentum`. One program: it reads and writes the count once, with no host read of it."""
    factor = momentum
    if COUNTED:
        count = tl.load(count_ptr) + 1
        tl.store(count_ptr, count)
        if CUMULATIVE:
            factor = tl.math.div_rn(1.0, count.to(tl.float32))
    for c0 in range(0, C, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        mask = offs < C
        rstd = tl.load(rstd_ptr + offs, mask=mask, other=1.0)
        variance = tl.maximum(tl.math.div_rn(1.0 + tl.zeros_like(rstd), rstd * rstd) - eps, 0.0) * unbias
        _lerp_into(running_mean_ptr + offs, tl.load(mean_ptr + offs, mask=mask), factor, mask)
        _lerp_into(running_var_ptr + offs, variance, factor, mask)


@triton.jit
def _lerp_into(running_ptrs, value, factor, mask):
    """running = lerp(running, value, factor) as torch's lerp_ computes it: value first rounded to running's
    dtype, then both in fp32, each branch's product and sum fused (torch's CPU kernel's fmadd; CUDA's, contracted
    by nvcc)."""
    running = tl.load(running_ptrs, mask=mask)
    end = value.to(running.dtype).to(tl.float32)
    start = running.to(tl.float32)
    difference = end - start
    moved = tl.where(factor < 0.5, tl.fma(difference, factor, start), tl.fma(-difference, 1.0 - factor, end))
    tl.store(running_ptrs, moved.to(running.dtype), mask=mask)


# The running statistics' dtypes the launch moves (a Python float factor is an fp32 argument: fp64 buffers lerp by
# the float64 factor in torch's ops)
RUNNING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def update_running_statistics(mean, rstd, running_mean, running_var, num_batches_tracked, momentum, eps, values):
    """_running_statistics_kernel's launch on a BatchNorm's fp32 batch mean and rstd (C contiguous values each;
    `values` values a channel): running_mean and running_var moved in place, num_batches_tracked (None: not
    counted) incremented first, the factor `momentum` or (None) 1 / num_batches_tracked; their version counters
    moved as an in-place op's."""
    c = mean.numel()
    counted = num_batches_tracked is not None
    if momentum is None and not counted:
        raise ValueError("a cumulative average (momentum None) needs num_batches_tracked")
    if running_mean.dtype not in RUNNING_DTYPES or running_var.dtype != running_mean.dtype:
        raise ValueError(
            f"running statistics of {running_mean.dtype} and {running_var.dtype}: not one of {RUNNING_DTYPES}"
        )
    launch(
        _running_statistics_kernel, (1,),
        mean, rstd, running_mean, running_var, num_batches_tracked if counted else mean, c,
        0.0 if momentum is None else float(momentum), eps, values / (values - 1),
        COUNTED=counted, CUMULATIVE=momentum is None, BLOCK=min(next_power_of_2(c), 1024),
    )  # fmt: skip
    # Written in place as torch's in-place ops write: a graph that saved one of them sees the change
    written = (running_mean, running_var, num_batches_tracked)
    torch.autograd.graph.increment_version([t for t in written if t is not None and not t.is_inference()])


# The fold's tiles: at most FOLD_ELEMENTS splits x channels, up to FOLD_SPLITS splits a step. A program folds the
# groups of up to FOLD_CHANNELS channels (at least one group): a row of 32 fp32 channels is a 128-byte load, and a
# group a program keeps the grid wide. The interpreter runs a program at a time, in Python: there, one program
# takes as many groups as a tile holds (57 GroupNorms of a KVAE test took 19 s at a group a program).
FOLD_ELEMENTS, FOLD_SPLITS = 4096, 64
FOLD_CHANNELS = FOLD_ELEMENTS if settings.INTERPRET else 32


def _fold(
    mode: tl.constexpr, partials, mean, rstd, weight, groups: int, voxels: int, n: int, c: int, eps: float = 0.0,
    slopes=None,
):  # fmt: skip
    """_fold_kernel's launch on the [N, splits, moments, C] partials: FOLD_STATISTICS's (mean, rstd), fp32 [N,
    groups]; FOLD_BACKWARD's (the coefficient table, fp32 [3, N, C]: k1, k2, k3; grad_weight, grad_bias [C] in
    parameter_grad_dtype(weight); with a third moment, the PReLU weights' gradient: [C] in the dtype of `slopes`
    if they are one a channel, else fp32, to be summed; None without)."""
    device = partials.device
    per_split, splits = _splits(voxels)
    moments = partials.shape[2]
    if mode == FOLD_STATISTICS:
        mean = torch.empty((n, groups), dtype=torch.float32, device=device)
        rstd = torch.empty_like(mean)
        coef = dw = db = ds = mean
    else:
        coef = torch.empty((3, n, c), dtype=torch.float32, device=device)
        dw, db = (torch.empty(c, dtype=parameter_grad_dtype(weight), device=device) for _ in range(2))
        ds = coef
        if moments == 3:
            ds = torch.empty(c, dtype=slopes.dtype if slopes.numel() > 1 else torch.float32, device=device)
    per_group = c // groups
    block_g = next_power_of_2(per_group)
    block_groups = min(next_power_of_2(groups), max(1, FOLD_CHANNELS // block_g))
    block_s = min(FOLD_SPLITS, next_power_of_2(splits), max(1, FOLD_ELEMENTS // (block_groups * block_g)))
    launch(
        _fold_kernel, (cdiv(groups, block_groups),),
        partials, mean, rstd, weight if weight is not None else mean, coef, dw, db, ds,
        n, c, splits, voxels, per_split, eps,
        MODE=mode.value, HAS_WEIGHT=weight is not None, PER_GROUP=per_group, MOMENTS=moments,
        BLOCK_S=block_s, BLOCK_GROUPS=block_groups, BLOCK_G=block_g, WIDE=_wide(voxels, per_split),
    )  # fmt: skip
    return (mean, rstd) if mode == FOLD_STATISTICS else (coef, dw, db, ds if moments == 3 else None)


def _splits(voxels: int) -> tuple[int, int]:
    """(voxels per split, splits): each reduction program walks SPLIT_BLOCKS voxel blocks, or as many more as keep
    the splits within MAX_SPLITS."""
    per_split = BLOCK_S * max(SPLIT_BLOCKS, cdiv(cdiv(voxels, BLOCK_S), MAX_SPLITS), 1)
    return per_split, max(cdiv(voxels, per_split), 1)


def _wide(voxels: int, per_split: int) -> bool:
    """Whether the kernels' voxel indices of a sample of `voxels` may pass int32 (WIDE): a split's or a block's
    indices reach past the last voxel."""
    return voxels + max(per_split, AFFINE_BLOCK_S) >= INT32_VOXELS


def _channel_reduce(
    sources, dy=None, mean=None, rstd=None, weight=None, bias=None, activation=0, slope=0.0
) -> torch.Tensor:  # fmt: skip
    """fp32 [N, splits, moments, C] partials (see _channel_reduce_kernel) of the concatenation along C of
    `sources` (dense channels_last_3d tensors of the same N, D, H, W: a voxel's channels are the next voxel's
    distance), a launch each: the forward's, or given dy the backward's; dy, mean and rstd ([N, groups]), weight and
    bias (read through the activation, a code of NORM_ACTIVATIONS; `slope` a leaky ReLU's number or a PReLU's
    weights, whose gradient is the backward's third moment) are the concatenation's."""
    n = sources[0].shape[0]
    c = sum(x.shape[1] for x in sources)
    voxels = sources[0][0, 0].numel()
    per_split, splits = _splits(voxels)
    wide = _wide(voxels, per_split)
    slope, slopes, slope_stride = _slope_arguments(slope)
    slope_grad = dy is not None and slopes is not None  # the backward of a PReLU: its weights' gradient too
    out = torch.empty((n, splits, 3 if slope_grad else 2, c), dtype=torch.float32, device=sources[0].device)
    for x, first in _channel_slices(sources):
        width = x.shape[1]
        grads = dy if dy is not None else x
        center, scale, w, b = (t if t is not None else out for t in (mean, rstd, weight, bias))
        groups = mean.shape[1] if mean is not None else 1
        launch(
            _channel_reduce_kernel, (n, cdiv(width, BLOCK_C), splits),
            x, grads, center, scale, w, b, slopes if slopes is not None else out, out,
            voxels, width, first, per_split, groups, c // groups, slope, slope_stride,
            x.stride(0), width, grads.stride(0), grads.shape[1], *out.stride()[:3],
            BACKWARD=dy is not None, ACTIVATION=activation, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
            HAS_SLOPES=slopes is not None, SLOPE_GRAD=slope_grad, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C, WIDE=wide,
        )  # fmt: skip
    return out


def _slope_arguments(slope) -> tuple:
    """A leaky ReLU's slope (a number) or a PReLU's weights (a tensor of one, or one a channel) as the kernels take
    them: (the number, fp32; the weights or None; their stride, 0 for one weight, 1 for one a channel)."""
    if isinstance(slope, torch.Tensor):
        return 0.0, slope.contiguous(), int(slope.numel() > 1)
    return float(slope), None, 0


def _activation_code(activation: str) -> int:
    """The kernels' ACTIVATION code of an op's `activation`: its index in NORM_ACTIVATIONS, a PReLU's the leaky
    ReLU's (whose slopes the kernels then load: HAS_SLOPES)."""
    return NORM_ACTIVATIONS.index("leaky_relu" if activation == "prelu" else activation)


def _channel_slices(sources):
    """(source, its first channel in the concatenation along C) for each source."""
    first = 0
    for x in sources:
        yield x, first
        first += x.shape[1]


def _affine(sources, dy, mean, rstd, weight, bias, coef=None, activation=0, slope=0.0) -> torch.Tensor:
    """The forward's act((x - mean) * a + b) or, given dy and the backward's coefficient table, its input gradient
    (see _affine_kernel) of the concatenation along C of `sources`, in one channels_last_3d tensor, a launch a
    source; `activation` a code of NORM_ACTIVATIONS, `slope` a leaky ReLU's number or a PReLU's weights."""
    slope, slopes, slope_stride = _slope_arguments(slope)
    x = sources[0]
    n = x.shape[0]
    c = sum(source.shape[1] for source in sources)
    voxels = x[0, 0].numel()
    out = empty_ndhwc((n, c, *x.shape[2:]), like=x)
    if out.numel() == 0:
        return out
    backward = dy is not None
    groups = mean.shape[1]
    wide = _wide(voxels, 0)
    for x, first in _channel_slices(sources):
        grads = dy if backward else x
        for n0 in range(0, n, AFFINE_BATCH):  # one launch but past the grid's third axis
            launch(
                _affine_kernel, (cdiv(voxels, AFFINE_BLOCK_S), cdiv(x.shape[1], BLOCK_C), min(n - n0, AFFINE_BATCH)),
                x, grads, out, mean, rstd, *(t if t is not None else mean for t in (weight, bias, coef, slopes)),
                voxels, x.shape[1], first, n0, groups, c // groups, slope, slope_stride,
                x.stride(0), x.shape[1], grads.stride(0), grads.shape[1], out.stride(0), c, c, n * c,
                BACKWARD=backward, ACTIVATION=activation, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                HAS_SLOPES=slopes is not None, BLOCK_S=AFFINE_BLOCK_S, BLOCK_C=BLOCK_C, WIDE=wide,
            )  # fmt: skip
    return out


def _sources(x, channels_after) -> list:
    """The norm's input, and channels_after where given: the tensors whose concatenation along C it normalizes,
    each dense channels_last_3d."""
    return [dense_voxels(x)] + ([dense_voxels(channels_after)] if channels_after is not None else [])


def group_norm_fwd(x, weight, bias, groups: int, eps: float, activation: str, channels_after=None, slope=0.01):
    """(y channels_last_3d, mean, rstd); mean and rstd fp32 [N, groups]. With channels_after, of
    torch.cat([x, channels_after], dim=1), each source read in place. `slope`: a leaky ReLU's number, or a PReLU's
    weights (one, or one a channel)."""
    sources = _sources(x, channels_after)
    x = sources[0]
    n, c = x.shape[0], sum(source.shape[1] for source in sources)
    voxels = x[0, 0].numel() if x.numel() else 0
    if x.numel() == 0:
        stats = torch.full((n, groups), float("nan"), device=x.device)
        return empty_ndhwc((n, c, *x.shape[2:]), like=x), stats, stats.clone()
    partials = _channel_reduce(sources)
    mean, rstd = _fold(FOLD_STATISTICS, partials, None, None, None, groups, voxels, n, c, eps)
    return _affine(sources, None, mean, rstd, weight, bias, None, _activation_code(activation), slope), mean, rstd


def group_norm_bwd(
    grad_out, x, mean, rstd, weight, bias, groups: int, activation: str, channels_after=None, slope=0.01
):
    """(grad_input channels_last_3d, grad_weight, grad_bias, grad_slope): grad_weight and grad_bias [C] in
    parameter_grad_dtype(weight); grad_slope the PReLU weights' (`slope` a tensor: its shape and dtype), else None
    (aten.prelu_grad). With channels_after, grad_input is the gradient of the concatenation (both
    sources' channels)."""
    sources, grad_out = _sources(x, channels_after), dense_voxels(grad_out)
    x = sources[0]
    c = grad_out.shape[1]
    prelu = isinstance(slope, torch.Tensor)
    if x.numel() == 0:
        zeros = torch.zeros(c, device=x.device, dtype=parameter_grad_dtype(weight))
        slope_grad = torch.zeros_like(slope) if prelu else None
        return empty_ndhwc(grad_out.shape, like=x), zeros, zeros.clone(), slope_grad
    code, voxels, mean = _activation_code(activation), x[0, 0].numel(), mean.contiguous()
    # dy', dy' (x - mean) and a PReLU's dy * z where z <= 0
    partials = _channel_reduce(sources, grad_out, mean, rstd, weight, bias, code, slope)
    coef, grad_weight, grad_bias, slope_grad = _fold(
        FOLD_BACKWARD, partials, mean, rstd, weight, groups, voxels, x.shape[0], c, slopes=slope if prelu else None
    )  # fmt: skip
    if prelu and slope.numel() == 1:  # one weight for every channel: the channels' sums summed, in order
        slope_grad = sum_splits(slope_grad, torch.empty(1, dtype=slope.dtype, device=x.device))
    grad_input = _affine(sources, grad_out, mean, rstd, weight, bias, coef, code, slope)
    return grad_input, grad_weight, grad_bias, slope_grad
