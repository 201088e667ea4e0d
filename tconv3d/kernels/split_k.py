"""Split-K for every direction: the fp32 buffer the splits write their partial sums into, and the pass that adds
them in a fixed order (deterministic, no atomics) into the result; and a tensor's per-channel sums (a conv's bias
gradient) the same way: each program's fp32 sums of its voxels, then that pass.

The weight gradient splits its huge reduction (the output voxels) so that its few output tiles fill the machine;
the forward and input gradient split theirs (taps x channels) where a small volume leaves most SMs idle (issue 28:
unet_320's forward is 48 programs on 132 SMs). Each split writes its whole tile, zeros included, so the sum reads
every split everywhere."""

import torch
import triton
import triton.language as tl

from .config import CHANNEL_SUM_PROGRAMS, CHANNEL_SUM_TILE, SPLIT_SUM_BLOCK
from .launch import launch
from .tensors import cdiv, dense_voxels, next_power_of_2


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, second_ptr, NUMEL, SPLITS, SECOND: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = sum over s of partial[s, i], always in the order s = 0, 1, ...: deterministic, no atomics. With
    SECOND, a split holds 2 * NUMEL elements, out's then second's, and the programs of grid axis 1 = 1 sum second's:
    second[i] = sum over s of partial[s, NUMEL + i]. Each program sums one output's block under one mask: with both
    outputs' bounds in one program, triton 3.8's ptxas spilled their predicates (8 bytes on sm_90)."""
    width = 2 * NUMEL if SECOND else NUMEL
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    ptrs = partial_ptr + tl.program_id(1).to(tl.int64) * NUMEL + offs  # split 0's block of this program's output
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for _ in range(SPLITS):
        total += tl.load(ptrs, mask=mask, other=0.0)
        ptrs += width
    if SECOND and tl.program_id(1) == 1:
        tl.store(second_ptr + offs, total.to(second_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def ndhwc_partials(dst: torch.Tensor, splits: int) -> torch.Tensor:
    """The fp32 buffer of `splits` partial results of the dense channels_last_3d `dst` (N, C, D, H, W): a
    (splits * N, C, D, H, W) channels_last_3d tensor, split s at batch entries [s * N, (s + 1) * N), each laid out
    as `dst` is (a TMA descriptor covers all of it; a pointer kernel adds s * its stride(0) * N)."""
    n, c, d, h, w = dst.shape
    return torch.empty((splits * n, c, d, h, w), dtype=torch.float32, device=dst.device,
                       memory_format=torch.channels_last_3d)  # fmt: skip


def sum_splits(partials: torch.Tensor, out: torch.Tensor, second: torch.Tensor | None = None) -> torch.Tensor:
    """out = the sum of the splits in `partials`, in split order: `out` is dense and each split of `partials`
    holds its elements in out's memory order, back to back. With `second` (dense, as many elements as out), each
    split holds out's elements then second's, and second = the sum of those: two sums in one launch."""
    numel = out.numel()
    width = 2 * numel if second is not None else numel
    splits = partials.numel() // max(width, 1)
    grid = (cdiv(numel, SPLIT_SUM_BLOCK), 1 if second is None else 2)
    launch(
        _sum_splits_kernel, grid, partials, out, second if second is not None else out, numel, splits,
        SECOND=second is not None, BLOCK=SPLIT_SUM_BLOCK,
    )  # fmt: skip
    return out


@triton.jit
def _channel_sums_kernel(x_ptr, partial_ptr, ROWS, C, ROWS_PER_PROGRAM, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """partial[p, c] = the fp32 sum over program p's voxels (rows [p * ROWS_PER_PROGRAM, ...) of the dense
    channels_last_3d x, C channels a row) of x[row, c], its BLOCK_C channels from program_id(1)'s on, in row order."""
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    start = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM
    end = tl.minimum(start + ROWS_PER_PROGRAM, ROWS)
    total = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for first in range(start, end, BLOCK_R):
        rows = first + tl.arange(0, BLOCK_R)
        mask = (rows < end)[:, None] & mask_c[None, :]
        total += tl.load(x_ptr + rows[:, None] * C + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + tl.program_id(0) * C + offs_c, tl.sum(total, axis=0), mask=mask_c)


def channel_sums(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (N, C, D, H, W) summed over all but C, in fp32 and a fixed order, as `dtype`: a conv's bias gradient from
    its output's, in two launches (each program's partial sums, then sum_splits), where torch's sum and cast are two
    aten calls outside the backward's plan."""
    x = dense_voxels(x)
    channels = x.shape[1]
    out = torch.empty(channels, dtype=dtype, device=x.device)
    rows = x.numel() // channels if channels else 0
    if rows == 0:
        return out.zero_()
    block_c = min(next_power_of_2(channels), 128)
    block_r = max(1, CHANNEL_SUM_TILE // block_c)
    per_program = cdiv(cdiv(rows, CHANNEL_SUM_PROGRAMS), block_r) * block_r  # whole BLOCK_R steps
    programs = cdiv(rows, per_program)
    partials = torch.empty((programs, channels), dtype=torch.float32, device=x.device)
    grid = (programs, cdiv(channels, block_c))
    launch(_channel_sums_kernel, grid, x, partials, rows, channels, per_program, BLOCK_R=block_r, BLOCK_C=block_c)
    return sum_splits(partials, out)
