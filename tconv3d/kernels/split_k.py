"""Split-K for every direction: the fp32 buffer the splits write their partial sums into, and the pass that adds
them in a fixed order (deterministic, no atomics) into the result.

The weight gradient splits its huge reduction (the output voxels) so that its few output tiles fill the machine;
the forward and input gradient split theirs (taps x channels) where a small volume leaves most SMs idle (issue 28:
unet_320's forward is 48 programs on 132 SMs). Each split writes its whole tile, zeros included, so the sum reads
every split everywhere."""

import torch
import triton
import triton.language as tl

from .config import SPLIT_SUM_BLOCK
from .launch import launch
from .utils import cdiv


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, NUMEL, SPLITS, BLOCK: tl.constexpr):
    """out[i] = sum over s of partial[s, i], always in the order s = 0, 1, ...: deterministic, no atomics."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < NUMEL
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        total += tl.load(partial_ptr + s * NUMEL + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def ndhwc_partials(dst: torch.Tensor, splits: int) -> torch.Tensor:
    """The fp32 buffer of `splits` partial results of the dense channels_last_3d `dst` (N, C, D, H, W): a
    (splits * N, C, D, H, W) channels_last_3d tensor, split s at batch entries [s * N, (s + 1) * N), each laid out
    as `dst` is (a TMA descriptor covers all of it; a pointer kernel adds s * its stride(0) * N)."""
    n, c, d, h, w = dst.shape
    return torch.empty((splits * n, c, d, h, w), dtype=torch.float32, device=dst.device,
                       memory_format=torch.channels_last_3d)  # fmt: skip


def sum_splits(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = the sum of the splits in `partials`, in split order: `out` is dense and each split of `partials`
    holds its elements in out's memory order, back to back."""
    numel = out.numel()
    splits = partials.numel() // max(numel, 1)
    launch(_sum_splits_kernel, (cdiv(numel, SPLIT_SUM_BLOCK),), partials, out, numel, splits, BLOCK=SPLIT_SUM_BLOCK)
    return out
