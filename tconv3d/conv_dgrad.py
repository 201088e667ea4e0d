"""Conv3d input gradient: an implicit-GEMM Triton kernel on NDHWC tensors, split by stride phase, and its launcher."""

import functools
import itertools

import torch
import triton
import triton.language as tl

from .configs import KernelConfig, pick_config
from .geometry import ConvGeometry
from .kernel_utils import dot_flags, empty_ndhwc, grouped_tile, mma, ndhwc, split_voxel


@triton.jit
def _conv3d_dgrad_kernel(
    # pointers
    go_ptr, w_ptr, gi_ptr, live_taps_ptr, live_counts_ptr,
    # sizes (a phase holds every STRIDE-th input voxel: D_PHASE = ceil(D_IN / STRIDE_D), and so on)
    M_PHASE, C_IN, D_IN, H_IN, W_IN, C_OUT, D_OUT, H_OUT, W_OUT, D_PHASE, H_PHASE, W_PHASE,
    # strides, in elements, in logical (N, C, D, H, W) order
    stride_gn, stride_gc, stride_gd, stride_gh, stride_gw,
    stride_wo, stride_wi, stride_wd, stride_wh, stride_ww,
    stride_in, stride_ic, stride_id, stride_ih, stride_iw,
    # convolution geometry (front padding)
    STRIDE_D, STRIDE_H, STRIDE_W, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    # meta-parameters
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """gi[i, ci] = sum over (tap, co) of go[(i + pad - tap * dil) / stride, co] * w[co, tap, ci], over the taps
    for which that division is exact.

    GEMM view: M = N*D*H*W input voxels, taken one stride phase at a time (the phase is the input coordinate
    modulo the stride in d, h and w; programs run phase after phase), N = Cin columns, K = live taps x Cout.
    Within a phase the same taps land on whole output voxels for every row, so the host lists those live taps
    and the dead ones, most of a strided transposed convolution, cost nothing.
    """
    num_m = tl.cdiv(M_PHASE, BLOCK_M)
    num_n = tl.cdiv(C_IN, BLOCK_N)
    phase = tl.program_id(0) // (num_m * num_n)
    rw = phase % STRIDE_W
    rh = (phase // STRIDE_W) % STRIDE_H
    rd = phase // (STRIDE_W * STRIDE_H)
    pid_m, pid_n = grouped_tile(tl.program_id(0) % (num_m * num_n), num_m, num_n, GROUP_M)

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] voxels of this phase
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] input channels
    offs_k = tl.arange(0, BLOCK_K)  # [BLOCK_K] output channels
    mask_n = offs_n < C_IN

    n, jd, jh, jw = split_voxel(offs_m, D_PHASE, H_PHASE, W_PHASE)
    id_ = rd + jd * STRIDE_D
    ih = rh + jh * STRIDE_H
    iw = rw + jw * STRIDE_W
    mask_m = (offs_m < M_PHASE) & (id_ < D_IN) & (ih < H_IN) & (iw < W_IN)
    # For a live tap, output voxel = (jd, jh, jw) + a per-tap shift, so rows are addressed from (jd, jh, jw).
    jd32 = jd.to(tl.int32)
    jh32 = jh.to(tl.int32)
    jw32 = jw.to(tl.int32)
    go_rows = go_ptr + (n * stride_gn + jd * stride_gd + jh * stride_gh + jw * stride_gw)  # [BLOCK_M] pointers
    w_cols = w_ptr + offs_n * stride_wi  # [BLOCK_N] pointers

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(C_OUT, BLOCK_K)
    live = tl.load(live_counts_ptr + phase)
    for step in range(live * k_blocks):
        j = step // k_blocks
        offs_c = (step - j * k_blocks) * BLOCK_K + offs_k  # [BLOCK_K]
        tap = tl.load(live_taps_ptr + phase * (KD * KH * KW) + j)
        kw = tap % KW
        kh = (tap // KW) % KH
        kd = tap // (KW * KH)
        # Exact divisions: the host listed only taps for which they are.
        shift_d = (rd + PAD_D - kd * DIL_D) // STRIDE_D
        shift_h = (rh + PAD_H - kh * DIL_H) // STRIDE_H
        shift_w = (rw + PAD_W - kw * DIL_W) // STRIDE_W
        od = jd32 + shift_d
        oh = jh32 + shift_h
        ow = jw32 + shift_w
        mask_g = mask_m & (od >= 0) & (od < D_OUT) & (oh >= 0) & (oh < H_OUT) & (ow >= 0) & (ow < W_OUT)
        mask_c = offs_c < C_OUT
        g_tap = (shift_d.to(tl.int64) * stride_gd + shift_h.to(tl.int64) * stride_gh
                 + shift_w.to(tl.int64) * stride_gw)  # fmt: skip
        g_ptrs = go_rows[:, None] + g_tap + offs_c[None, :] * stride_gc  # [BLOCK_M, BLOCK_K]
        a = tl.load(g_ptrs, mask=mask_g[:, None] & mask_c[None, :], other=0.0)
        w_ptrs = (
            w_cols[None, :] + (kd * stride_wd + kh * stride_wh + kw * stride_ww) + offs_c[:, None] * stride_wo
        )  # [BLOCK_K, BLOCK_N]
        b = tl.load(w_ptrs, mask=mask_c[:, None] & mask_n[None, :], other=0.0)
        acc = mma(acc, a, b, UPCAST_DOT, INPUT_PRECISION)

    gi_rows = n * stride_in + id_ * stride_id + ih * stride_ih + iw * stride_iw  # [BLOCK_M]
    gi_ptrs = gi_ptr + gi_rows[:, None] + offs_n[None, :] * stride_ic  # [BLOCK_M, BLOCK_N]
    tl.store(gi_ptrs, acc.to(gi_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=256)
def _live_taps(kernel, stride, front_padding, dilation, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per stride phase, the flat indices of the taps that land on whole output voxels, and their count.
    Returns (taps [phases, kd*kh*kw] int32 padded with 0, counts [phases] int32), cached on the device."""
    per_dim = [
        [[t for t in range(k) if (r + p - t * d) % s == 0] for r in range(s)]
        for k, s, p, d in zip(kernel, stride, front_padding, dilation, strict=True)
    ]
    kd, kh, kw = kernel
    taps, counts = [], []
    for rd, rh, rw in itertools.product(*(range(s) for s in stride)):
        live = [(a * kh + b) * kw + c for a in per_dim[0][rd] for b in per_dim[1][rh] for c in per_dim[2][rw]]
        counts.append(len(live))
        taps.append(live + [0] * (kd * kh * kw - len(live)))
    as_tensor = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    return as_tensor(taps), as_tensor(counts)


def conv3d_dgrad(grad_out, weight, geom: ConvGeometry, config: KernelConfig | None = None) -> torch.Tensor:
    """Input gradient of checked arguments; the result is channels_last_3d, in grad_out's dtype. `config`
    overrides the tiling; otherwise pick_config chooses it."""
    grad_in = empty_ndhwc(geom.input_shape(), like=grad_out)
    if grad_in.numel() == 0:
        return grad_in
    grad_out, weight = ndhwc(grad_out), ndhwc(weight)
    cfg = config or pick_config(
        "dgrad", geom, grad_out.dtype, grad_out.device, run=lambda c: conv3d_dgrad(grad_out, weight, geom, c)
    )
    upcast, precision = dot_flags(grad_out.dtype)
    taps, counts = _live_taps(geom.kernel, geom.stride, geom.front_padding, geom.dilation, grad_out.device)
    phase_size = [triton.cdiv(size, s) for size, s in zip(geom.in_size, geom.stride, strict=True)]
    rows = geom.batch * phase_size[0] * phase_size[1] * phase_size[2]
    phases = geom.stride[0] * geom.stride[1] * geom.stride[2]
    grid = (triton.cdiv(rows, cfg.block_m) * triton.cdiv(geom.in_channels, cfg.block_n) * phases,)
    _conv3d_dgrad_kernel[grid](
        grad_out, weight, grad_in, taps, counts,
        rows, geom.in_channels, *geom.in_size, geom.out_channels, *geom.out_size, *phase_size,
        *grad_out.stride(), *weight.stride(), *grad_in.stride(),
        *geom.stride, *geom.front_padding, *geom.dilation,
        *geom.kernel,
        UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return grad_in
