"""The input gradient's border fold in one launch: a layer bordered by replicate, reflect or circular padding has its
input gradient written over the bordered geometry (float32 for 16-bit operands: config.destination_dtype), and each
border voxel's gradient belongs to the voxel its mode read. `fold_bordered` reads the bordered buffer once and writes
the input gradient once: each voxel its own value plus every border value that reads it, summed in float32 in a
fixed order (deterministic, no atomics) and rounded once, into the destination's dtype.

tensors.fold_padding does the same in torch ops (aten's path, and the reference): a sum per border plane folded and a
copy of the interior, each an op (a launch on a GPU, a host-side op a call plan replays). Here the sources of a voxel
along each dimension come from a small table (`fold_sources`): its own index in the bordered buffer, then those of
the borders that read it, -1 past them. A voxel sums the product of its three dimensions' sources, so a corner
collects its corner borders too, as folding one dimension after another does; terms are added in another order
than the torch ops add them (float32 either way)."""

import functools

import torch
import triton
import triton.language as tl

from .launch import launch, tracing
from .tensors import border_sources, cdiv, next_power_of_2
from .utils import split_voxel

# The fold's tile: voxels x channels, fp32 sums a thread; a row of 32 fp32 channels is a 128-byte load.
FOLD_VOXELS, FOLD_CHANNELS = 32, 64
INT32_VOXELS = 2**31  # voxel indices from here on are int64 (WIDE)


@triton.jit
def _fold_borders_kernel(
    src_ptr, dst_ptr, bias_ptr, sources_ptr, VOXELS, C, D, H, W,
    stride_sn, stride_sd, stride_sh, stride_sw, stride_dn, stride_dd, stride_dh, stride_dw,
    M_D: tl.constexpr, M_H: tl.constexpr, M_W: tl.constexpr, HAS_BIAS: tl.constexpr, WIDE: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """dst[n, c, d, h, w] = sum over the sources (a, b, e) of d, h and w of src[n, c, a, b, e], in the order j, k, l
    of the table's columns: sources_ptr holds D rows of M_D bordered indices along D (the voxel's own first, -1
    past the last), then H rows of M_H, then W rows of M_W. With HAS_BIAS every source carries the bias once (a
    transposed convolution's, added in the kernels' epilogue) and all but one copy is taken off. WIDE: voxel
    indices in int64 (2^31 voxels or more); memory offsets are int64 always."""
    offs_v = tl.program_id(0).to(tl.int64 if WIDE else tl.int32) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_v = offs_v < VOXELS
    mask_c = offs_c < C
    n, d, h, w = split_voxel(offs_v, D, H, W)
    src_rows = n.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_V, BLOCK_C), dtype=tl.float32)
    count = tl.zeros((BLOCK_V,), dtype=tl.int32)
    for j in range(M_D):
        a = tl.load(sources_ptr + d * M_D + j, mask=mask_v, other=-1)
        for k in range(M_H):
            b = tl.load(sources_ptr + D * M_D + h * M_H + k, mask=mask_v, other=-1)
            for m in range(M_W):
                e = tl.load(sources_ptr + D * M_D + H * M_H + w * M_W + m, mask=mask_v, other=-1)
                valid = (a >= 0) & (b >= 0) & (e >= 0)
                rows = (src_rows + a.to(tl.int64) * stride_sd + b.to(tl.int64) * stride_sh
                        + e.to(tl.int64) * stride_sw)  # fmt: skip
                ptrs = src_ptr + rows[:, None] + offs_c[None, :]
                acc += tl.load(ptrs, mask=valid[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                count += valid.to(tl.int32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
        acc -= (count - 1).to(tl.float32)[:, None] * bias[None, :]
    dst_rows = (n.to(tl.int64) * stride_dn + d.to(tl.int64) * stride_dd + h.to(tl.int64) * stride_dh
                + w.to(tl.int64) * stride_dw)  # fmt: skip
    dst_ptrs = dst_ptr + dst_rows[:, None] + offs_c[None, :]
    tl.store(dst_ptrs, acc.to(dst_ptr.dtype.element_ty), mask=mask_v[:, None] & mask_c[None, :])


def fold_sources(in_size, dim_modes, padding) -> tuple[list[list[list[int]]], tuple[int, int, int]]:
    """Per dimension, the bordered indices summed onto each of its voxels (tensors.border_sources: the voxel's own,
    then the borders that read it) and the most of them a voxel has; a dimension without a border that reads input
    voxels (zeros, or no padding) is its own index. Returns (rows per dimension, (M_D, M_H, M_W))."""
    rows = []
    for dim, (size, mode) in enumerate(zip(in_size, dim_modes, strict=True)):
        front, back = padding[2 * dim], padding[2 * dim + 1]
        bordered = mode != "zeros" and (front or back)
        rows.append(border_sources(size, front, back, mode) if bordered else [[i] for i in range(size)])
    return rows, tuple(max(len(r) for r in dim) for dim in rows)


def _sources_table(geom, device) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """fold_sources as the kernel reads it: int32, each dimension's rows padded with -1 to its width, D's then H's
    then W's; cached per geometry and device (a call plan may keep it: never written, a function of its key), except
    while traced for Inductor, where it is a constant of the graph."""
    key = (tuple(geom.in_size), tuple(geom.dim_modes), tuple(geom.padding), device)
    return _table.__wrapped__(*key) if tracing() else _table(*key)


@functools.lru_cache(maxsize=256)
def _table(in_size, dim_modes, padding, device) -> tuple[torch.Tensor, tuple[int, int, int]]:
    rows, widths = fold_sources(in_size, dim_modes, padding)
    flat = [i for dim, width in zip(rows, widths, strict=True) for row in dim for i in row + [-1] * (width - len(row))]
    with torch.inference_mode(False):  # a plain tensor whatever the first caller's mode
        table = torch.tensor(flat, dtype=torch.int32, device=device)
    table.plan_constant = True
    return table, widths


def fold_bordered(bordered: torch.Tensor, geom, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The input gradient of `geom` (N, C, D, H, W), channels_last_3d in `dtype`, from the dense channels_last_3d
    gradient of geom.border_geometry()'s input, `bordered`: tensors.fold_padding's result, in one launch. `bias` (per
    channel): every voxel of `bordered` carries it once; so does each voxel of the result."""
    if bordered.dim() != 5 or bordered.stride(1) != 1:
        raise ValueError(f"fold_bordered reads a channels_last_3d buffer, got strides {bordered.stride()}")
    n, c = bordered.shape[:2]
    d, h, w = geom.in_size
    out = torch.empty((n, c, d, h, w), dtype=dtype, device=bordered.device, memory_format=torch.channels_last_3d)
    voxels = n * d * h * w
    if out.numel() == 0:
        return out
    table, (m_d, m_h, m_w) = _sources_table(geom, bordered.device)
    s_n, _, s_d, s_h, s_w = bordered.stride()
    t_n, _, t_d, t_h, t_w = out.stride()
    block_c = min(FOLD_CHANNELS, next_power_of_2(c))
    launch(
        _fold_borders_kernel, (cdiv(voxels, FOLD_VOXELS), cdiv(c, block_c)),
        bordered, out, bias if bias is not None else out, table, voxels, c, d, h, w,
        s_n, s_d, s_h, s_w, t_n, t_d, t_h, t_w,
        M_D=m_d, M_H=m_h, M_W=m_w, HAS_BIAS=bias is not None, WIDE=voxels + FOLD_VOXELS >= INT32_VOXELS,
        BLOCK_V=FOLD_VOXELS, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out
