"""GroupNorm on NDHWC tensors (InstanceNorm is its groups == channels case), with an optional fused SiLU: two
Triton kernels and their launchers.

Viewed as (N, S = D*H*W voxels, C), a channels_last_3d tensor has each voxel's channels contiguous, so every
kernel works on tiles of BLOCK_S voxels x BLOCK_C channels, loads vectorised along C:
- `_channel_reduce_kernel`: per (batch, voxel split, channel) the partial moments the forward needs (mean and
  squared deviations, combined block by block with Chan's formula: no cancellation), or the two sums the
  backward needs. The host folds channels into groups and splits into totals in a fixed order, so both
  directions are bitwise deterministic, with no atomics.
- `_affine_kernel`: y = act(x * a + b) with per-(batch, channel) a and b that fold mean, rstd, weight and bias;
  backward dx = dy' * k1 + x * k2 + k3 with dy' = dy * act'(x * a + b), recomputed, not stored.
Statistics and coefficients are fp32 whatever the tensor dtype; nothing NCDHW is ever made.
"""

import torch
import triton
import triton.language as tl

from .launch import launch
from .utils import cdiv, dense_voxels, empty_ndhwc, silu_grad

ACTIVATIONS = ("none", "silu")
BLOCK_S, BLOCK_C = 64, 32  # a tile of 2048 elements; C is the contiguous axis
SPLIT_BLOCKS = 16  # voxel blocks per reduction program


@triton.jit
def _channel_reduce_kernel(
    x_ptr, dy_ptr, a_ptr, b_ptr, out_ptr,
    S, C, SPLIT_S,
    stride_xn, stride_dn, stride_on, stride_os, stride_oq,
    BACKWARD: tl.constexpr, SILU: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Per (n, split, channel): forward, out[.., 0] = mean and out[.., 1] = sum of squared deviations of x over
    the split's voxels; backward, out[.., 0] = sum of dy' and out[.., 1] = sum of dy' * x, where dy' is dy through
    the activation (SILU) at x * a + b. Grid (N, channel blocks, splits)."""
    n = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    s_start = tl.program_id(2) * SPLIT_S
    s_end = tl.minimum(s_start + SPLIT_S, S)
    x_base = x_ptr + n.to(tl.int64) * stride_xn
    if BACKWARD:
        dy_base = dy_ptr + n.to(tl.int64) * stride_dn
        if SILU:
            a = tl.load(a_ptr + n * C + offs_c, mask=mask_c, other=0.0)
            b = tl.load(b_ptr + n * C + offs_c, mask=mask_c, other=0.0)
    first = tl.zeros((BLOCK_C,), dtype=tl.float32)  # forward: running mean; backward: sum of dy'
    second = tl.zeros((BLOCK_C,), dtype=tl.float32)  # forward: running M2; backward: sum of dy' * x
    count = 0.0
    for s0 in range(s_start, s_end, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        mask = (offs_s < s_end)[:, None] & mask_c[None, :]
        offsets = offs_s.to(tl.int64)[:, None] * C + offs_c[None, :]
        x = tl.load(x_base + offsets, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            dy = tl.load(dy_base + offsets, mask=mask, other=0.0).to(tl.float32)
            if SILU:
                dy = dy * silu_grad(x * a[None, :] + b[None, :])
            first += tl.sum(dy, axis=0)
            second += tl.sum(dy * x, axis=0)
        else:
            rows = tl.minimum(s_end - s0, BLOCK_S).to(tl.float32)
            block_mean = tl.sum(x, axis=0) / rows
            deviation = tl.where(mask, x - block_mean[None, :], 0.0)
            block_m2 = tl.sum(deviation * deviation, axis=0)
            total = count + rows
            delta = block_mean - first
            first += delta * (rows / total)
            second += block_m2 + delta * delta * (count * rows / total)
            count = total
    out = out_ptr + n * stride_on + tl.program_id(2) * stride_os + offs_c
    tl.store(out, first, mask=mask_c)
    tl.store(out + stride_oq, second, mask=mask_c)


@triton.jit
def _affine_kernel(
    x_ptr, dy_ptr, out_ptr, a_ptr, b_ptr, k1_ptr, k2_ptr, k3_ptr,
    S, C,
    stride_xn, stride_dn, stride_on,
    BACKWARD: tl.constexpr, SILU: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Forward: out = act(x * a + b). Backward: out = dy' * k1 + x * k2 + k3, dy' = dy * act'(x * a + b).
    a, b, k1, k2, k3 are fp32 (N, C). Grid (voxel blocks, channel blocks, N)."""
    n = tl.program_id(2)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    mask = (offs_s < S)[:, None] & mask_c[None, :]
    offsets = offs_s.to(tl.int64)[:, None] * C + offs_c[None, :]
    x = tl.load(x_ptr + n.to(tl.int64) * stride_xn + offsets, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + n * C + offs_c, mask=mask_c, other=0.0)[None, :]
    b = tl.load(b_ptr + n * C + offs_c, mask=mask_c, other=0.0)[None, :]
    z = x * a + b
    if BACKWARD:
        dy = tl.load(dy_ptr + n.to(tl.int64) * stride_dn + offsets, mask=mask, other=0.0).to(tl.float32)
        if SILU:
            dy = dy * silu_grad(z)
        k1 = tl.load(k1_ptr + n * C + offs_c, mask=mask_c, other=0.0)[None, :]
        k2 = tl.load(k2_ptr + n * C + offs_c, mask=mask_c, other=0.0)[None, :]
        k3 = tl.load(k3_ptr + n * C + offs_c, mask=mask_c, other=0.0)[None, :]
        result = dy * k1 + x * k2 + k3
    else:
        result = z * tl.sigmoid(z) if SILU else z
    out = out_ptr + n.to(tl.int64) * stride_on + offsets
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=mask)


def _splits(voxels: int) -> tuple[int, int]:
    """(voxels per split, splits): each reduction program walks SPLIT_BLOCKS voxel blocks."""
    per_split = max(BLOCK_S * SPLIT_BLOCKS, 1)
    return per_split, max(cdiv(voxels, per_split), 1)


def _channel_reduce(x, dy, a, b, silu: bool, backward: bool) -> torch.Tensor:
    """fp32 [N, splits, 2, C] partials (see _channel_reduce_kernel)."""
    n, c = x.shape[:2]
    voxels = x[0, 0].numel()
    per_split, splits = _splits(voxels)
    out = torch.empty((n, splits, 2, c), dtype=torch.float32, device=x.device)
    grid = (n, cdiv(c, BLOCK_C), splits)
    launch(
        _channel_reduce_kernel, grid,
        x, dy if dy is not None else x, a if a is not None else out, b if b is not None else out, out,
        voxels, c, per_split,
        x.stride(0), (dy if dy is not None else x).stride(0), *out.stride()[:3],
        BACKWARD=backward, SILU=silu, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out


def _affine(x, dy, a, b, k1=None, k2=None, k3=None, silu=False) -> torch.Tensor:
    n, c = x.shape[:2]
    voxels = x[0, 0].numel()
    out = empty_ndhwc(x.shape, like=x)
    if out.numel() == 0:
        return out
    backward = dy is not None
    grid = (cdiv(voxels, BLOCK_S), cdiv(c, BLOCK_C), n)
    launch(
        _affine_kernel, grid,
        x, dy if backward else x, out, a, b, k1 if backward else a, k2 if backward else a, k3 if backward else a,
        voxels, c,
        x.stride(0), (dy if backward else x).stride(0), out.stride(0),
        BACKWARD=backward, SILU=silu, BLOCK_S=BLOCK_S, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out


def group_statistics(partials: torch.Tensor, voxels: int, groups: int, eps: float):
    """Per (n, group) mean and rstd (fp32 [N, groups]) from the forward partials, combined in a fixed order."""
    n, splits, _, c = partials.shape
    per_split, _ = _splits(voxels)
    # made on the device (the last split's count is the rest): nothing copied from the host, which a CUDA-graph
    # capture refuses
    counts = (voxels - per_split * torch.arange(splits, device=partials.device)).clamp_(max=per_split).float()
    means = partials[:, :, 0].view(n, splits, groups, c // groups)
    m2 = partials[:, :, 1].view(n, splits, groups, c // groups)
    weights = counts.view(1, splits, 1, 1)
    total = voxels * (c // groups)
    mean = (means * weights).sum(dim=(1, 3)) / total
    spread = m2.sum(dim=(1, 3)) + ((means - mean[:, None, :, None]).square() * weights).sum(dim=(1, 3))
    return mean, torch.rsqrt(spread / total + eps)


def scale_shift(mean, rstd, weight, bias, channels: int):
    """Per (n, channel) a, b with normalised-and-affine x = x * a + b (fp32 [N, C])."""
    groups = mean.shape[1]
    a = rstd.repeat_interleave(channels // groups, dim=1)
    b = -mean.repeat_interleave(channels // groups, dim=1) * a
    if weight is not None:
        a = a * weight.float()
        b = b * weight.float()
    if bias is not None:
        b = b + bias.float()
    return a.contiguous(), b.contiguous()


def group_norm_fwd(x, weight, bias, groups: int, eps: float, activation: str):
    """(y channels_last_3d, mean, rstd); mean and rstd fp32 [N, groups]."""
    x = dense_voxels(x)
    n, c = x.shape[:2]
    voxels = x[0, 0].numel() if x.numel() else 0
    if x.numel() == 0:
        stats = torch.full((n, groups), float("nan"), device=x.device)
        return empty_ndhwc(x.shape, like=x), stats, stats.clone()
    mean, rstd = group_statistics(_channel_reduce(x, None, None, None, False, False), voxels, groups, eps)
    a, b = scale_shift(mean, rstd, weight, bias, c)
    return _affine(x, None, a, b, silu=activation == "silu"), mean, rstd


def group_norm_bwd(grad_out, x, mean, rstd, weight, bias, groups: int, activation: str):
    """(grad_input channels_last_3d, grad_weight, grad_bias), the last two fp32 [C]."""
    x, grad_out = dense_voxels(x), dense_voxels(grad_out)
    c = x.shape[1]
    if x.numel() == 0:
        zeros = torch.zeros(c, device=x.device)
        return empty_ndhwc(x.shape, like=x), zeros, zeros.clone()
    silu = activation == "silu"
    a, b = scale_shift(mean, rstd, weight, bias, c)
    sums = _channel_reduce(x, grad_out, a, b, silu, True).sum(dim=1)  # [N, 2, C]: sum dy', sum dy' * x
    k1, k2, k3, grad_weight, grad_bias = backward_coefficients(sums, x[0, 0].numel(), mean, rstd, weight, groups)
    return _affine(x, grad_out, a, b, k1, k2, k3, silu), grad_weight, grad_bias


def backward_coefficients(sums, voxels: int, mean, rstd, weight, groups: int):
    """From per (n, channel) sums of dy' and dy' * x: the coefficients of dx = dy' * k1 + x * k2 + k3 (fp32
    [N, C] each) and the weight and bias gradients (fp32 [C]). Also the aten path's backward."""
    n, _, c = sums.shape
    per_group = c // groups
    expand = lambda t: t.repeat_interleave(per_group, dim=1)  # noqa: E731  [N, groups] -> [N, C]
    gamma = weight.float()[None, :] if weight is not None else torch.ones(1, c, device=sums.device)
    dy_sum, dyx_sum = sums[:, 0], sums[:, 1]
    dy_xhat = expand(rstd) * (dyx_sum - expand(mean) * dy_sum)  # sum over voxels of dy' * xhat, [N, C]
    grad_bias = dy_sum.sum(dim=0)
    grad_weight = dy_xhat.sum(dim=0)
    group_a = (gamma * dy_sum).view(n, groups, per_group).sum(dim=2)  # sum over the group of gamma * dy'
    group_b = (gamma * dy_xhat).view(n, groups, per_group).sum(dim=2)  # ... of gamma * dy' * xhat
    total = voxels * per_group
    k1 = expand(rstd) * gamma
    k2 = expand(-rstd.square() * group_b / total)
    k3 = expand(-rstd * group_a / total + rstd.square() * mean * group_b / total)
    return k1.contiguous(), k2.contiguous(), k3.contiguous(), grad_weight, grad_bias
