"""The TMA implicit GEMM of the stride-1 forward and input gradient (sm_90+): tensor-descriptor boxes with
zero-filled borders feeding wgmma, and its launcher. The pointer kernels (conv_fwd.py, conv_dgrad.py) run every
other problem; the variant is picked above the kernels (configs.tma_eligible, KernelConfig.tma_box_w)."""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..geometry import ConvGeometry
from .config import KernelConfig
from .launch import launch
from .utils import cdiv, dot_flags, mma, ndhwc_descriptor, tensor_descriptor


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
def _conv3d_tma_kernel(
    # TMA descriptors: src as [N, D, H, W, C_RED] (boxes [1, 1, BOX_H, BOX_W, BLOCK_K]), the weight as
    # [Cout, taps, Cin], dst as [splits x N, D, H, W, C_COLS] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N])
    src_desc, w_desc, dst_desc, bias_ptr,
    C_RED, C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS,
    PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    INPUT_GRAD: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """dst[v, col] = sum over (tap, red) of src[v + shift(tap), red] * w[tap][red, col], for a BOX_H x BOX_W
    patch of dst voxels at one (n, d) per program and BLOCK_N columns.

    Forward (src = x, dst = y, red = Cin, col = Cout): shift = tap * dil - pad, and the weight box
    [BLOCK_N, 1, BLOCK_K] of (Cout, taps, Cin) is used transposed. Input gradient at stride 1 (src = grad_out,
    dst = grad_in, red = Cout, col = Cin): a stride-1 convolution with the taps flipped, shift = pad - tap * dil,
    and the weight box [BLOCK_K, 1, BLOCK_N] as it is. Either way each step's source box may lie partly in the
    padding or past an edge, where the TMA unit reads zeros: no address arithmetic, no masks. Split-K (grid axis
    2): program s reduces steps [s * SPLIT_STEPS, (s + 1) * SPLIT_STEPS) into split s of an fp32 dst (batch
    entries s * BATCH on), the bias in split 0's.
    """
    BLOCK_M: tl.constexpr = BOX_H * BOX_W
    n, d, h0, w0 = patch_origin(tl.program_id(0), D_DST, H_DST, W_DST, BOX_H, BOX_W)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_blocks = tl.cdiv(C_RED, BLOCK_K)
    first = split * SPLIT_STEPS
    for step in range(first, tl.minimum(first + SPLIT_STEPS, KD * KH * KW * k_blocks)):
        tap = step // k_blocks
        c0 = (step - tap * k_blocks) * BLOCK_K
        kw = tap % KW
        kh = (tap // KW) % KH
        kd = tap // (KW * KH)
        shift_d = kd * DIL_D - PAD_D
        shift_h = kh * DIL_H - PAD_H
        shift_w = kw * DIL_W - PAD_W
        if INPUT_GRAD:
            a = src_desc.load([n, d - shift_d, h0 - shift_h, w0 - shift_w, c0])
            b = w_desc.load([c0, tap, n0]).reshape(BLOCK_K, BLOCK_N)
        else:
            a = src_desc.load([n, d + shift_d, h0 + shift_h, w0 + shift_w, c0])
            b = tl.trans(w_desc.load([n0, tap, c0]).reshape(BLOCK_N, BLOCK_K))
        acc = mma(acc, a.reshape(BLOCK_M, BLOCK_K), b, UPCAST_DOT, INPUT_PRECISION)

    if HAS_BIAS:
        offs_n = n0 + tl.arange(0, BLOCK_N)
        bias_cols = tl.where(split == 0, C_COLS, 0)  # split 0's partial carries the bias
        acc += tl.load(bias_ptr + offs_n, mask=offs_n < bias_cols, other=0.0).to(tl.float32)[None, :]
    # Stores past the patch's edges are dropped by the TMA unit.
    dst_desc.store([split * BATCH + n, d, h0, w0, n0], acc.to(dst_desc.dtype).reshape(1, 1, BOX_H, BOX_W, BLOCK_N))


def patch_descriptors(src, weight, dst, geom: ConvGeometry, config: KernelConfig, input_grad: bool, make):
    """What the patch kernels (this TMA one, conv_gluon's) launch with, the descriptors built by `make`: (src, w,
    dst) descriptors, the grid (patches, column blocks, splits: dst holds src's batch once per split) and the
    (reduced, columns) channel counts."""
    box_h, box_w = config.tma_box(config.block_m)
    c_out, c_in, taps = geom.out_channels, geom.in_channels, geom.taps
    weight = weight.contiguous(memory_format=torch.channels_last_3d)  # (Cout, taps, Cin) in memory
    w_box = (config.block_k, 1, config.block_n) if input_grad else (config.block_n, 1, config.block_k)
    w_desc = tensor_descriptor(weight, (c_out, taps, c_in), (taps * c_in, c_in, 1), w_box, make)
    src_desc = ndhwc_descriptor(src, (1, 1, box_h, box_w, config.block_k), make)
    dst_desc = ndhwc_descriptor(dst, (1, 1, box_h, box_w, config.block_n), make)
    channels = (c_out, c_in) if input_grad else (c_in, c_out)
    batch = src.shape[0]
    _, _, d, h, w = dst.shape
    grid = (batch * d * cdiv(h, box_h) * cdiv(w, box_w), cdiv(channels[1], config.block_n), dst.shape[0] // batch)
    return (src_desc, w_desc, dst_desc), grid, channels


def conv3d_tma(
    src, weight, bias, dst, geom: ConvGeometry, config: KernelConfig, input_grad: bool, split_steps: int
) -> None:
    """Run the TMA kernel: the forward (src = x, dst = y) or the stride-1 input gradient (src = grad_out,
    dst = grad_in), or with dst holding several splits (split_k.ndhwc_partials) their fp32 partial sums of
    `split_steps` K steps each. Both tensors have unit-stride channels and TMA-aligned strides; dst is written
    whole."""
    descriptors, grid, (reduced, columns) = patch_descriptors(
        src, weight, dst, geom, config, input_grad, TensorDescriptor
    )
    box_h, box_w = config.tma_box(config.block_m)
    _, _, d, h, w = dst.shape
    upcast, precision = dot_flags(src.dtype)
    launch(
        _conv3d_tma_kernel, grid,
        *descriptors, bias if bias is not None else dst,
        reduced, columns, src.shape[0], d, h, w, split_steps,
        *geom.front_padding, *geom.dilation,
        *geom.kernel,
        INPUT_GRAD=input_grad, HAS_BIAS=bias is not None, UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BOX_H=box_h, BOX_W=box_w, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


@triton.jit
def _conv3d_wgrad_tma_kernel(
    # TMA descriptors: grad_out as [N, Do, Ho, Wo, Cout] (boxes [1, 1, BOX_H, BOX_W, BLOCK_M]), x as
    # [N, D, H, W, Cin] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N]); out is [split, Cout, tap, Cin]
    go_desc, x_desc, out_ptr,
    C_IN, C_OUT, D_OUT, H_OUT, W_OUT, PATCHES, SPLIT_PATCHES,
    stride_os, stride_oo, stride_ot, stride_oi,
    PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
    KD: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    UPCAST_DOT: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BOX_H: tl.constexpr, BOX_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """gw[co, tap, ci] = sum over output voxels v of go[v, co] * x[v + tap * dil - pad, ci], at stride 1.

    Per program one tap's BLOCK_M x BLOCK_N tile, reduced over a split of the output patches (BOX_H x BOX_W
    voxels at one (n, od)): each step is two boxes, grad_out's patch and the input's patch shifted by the tap
    (zeros in the padding); patch rows past the output's edges read zeros from grad_out and add nothing. The
    splits' fp32 partials are summed in a fixed order by conv_wgrad's reduction, as on the pointer path.
    """
    BLOCK_K: tl.constexpr = BOX_H * BOX_W
    taps: tl.constexpr = KD * KH * KW
    pid = tl.program_id(0)
    tap = pid % taps  # neighbouring programs share the same boxes in L2: keep taps innermost
    tile = pid // taps
    num_n = tl.cdiv(C_IN, BLOCK_N)
    co0 = (tile // num_n) * BLOCK_M
    ci0 = (tile % num_n) * BLOCK_N
    kw = tap % KW
    kh = (tap // KW) % KH
    kd = tap // (KW * KH)
    first = tl.program_id(1) * SPLIT_PATCHES
    last = tl.minimum(first + SPLIT_PATCHES, PATCHES)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for patch in range(first, last):
        n, od, h0, w0 = patch_origin(patch, D_OUT, H_OUT, W_OUT, BOX_H, BOX_W)
        a = go_desc.load([n, od, h0, w0, co0]).reshape(BLOCK_K, BLOCK_M)
        b = x_desc.load([n, od + kd * DIL_D - PAD_D, h0 + kh * DIL_H - PAD_H, w0 + kw * DIL_W - PAD_W, ci0])
        acc = mma(acc, tl.trans(a), b.reshape(BLOCK_K, BLOCK_N), UPCAST_DOT, INPUT_PRECISION)

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
    grad_out, x, out, geom: ConvGeometry, config: KernelConfig, patches: int, patches_per_split: int
) -> None:
    """The TMA weight gradient at stride 1 into `out` ([splits, Cout, taps, Cin]); both tensors have unit-stride
    channels and TMA-aligned strides."""
    box_h, box_w = config.tma_box(config.block_k)
    go_desc = ndhwc_descriptor(grad_out, (1, 1, box_h, box_w, config.block_m))
    x_desc = ndhwc_descriptor(x, (1, 1, box_h, box_w, config.block_n))
    upcast, precision = dot_flags(x.dtype)
    c_out, c_in = geom.out_channels, geom.in_channels
    grid = (cdiv(c_out, config.block_m) * cdiv(c_in, config.block_n) * geom.taps, out.shape[0])
    launch(
        _conv3d_wgrad_tma_kernel, grid,
        go_desc, x_desc, out,
        c_in, c_out, *geom.out_size, patches, patches_per_split,
        *out.stride(),
        *geom.front_padding, *geom.dilation,
        *geom.kernel,
        UPCAST_DOT=upcast, INPUT_PRECISION=precision,
        BOX_H=box_h, BOX_W=box_w, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
