"""Grouped convolutions of few channels a group, run as block-diagonal convolutions of more.

A group of 8 input channels (ResNeXt-3D's 32 groups of 256 channels) gives each group's implicit GEMM 8 output
columns and a reduction of 8 channels a tap: no tile loads a row of it at width, and the GEMM kernels fall back to
gathering 16-bit elements (on the H100, resnext3d_g32_256 ran at 0.4% of the matmul peak, 0.12x cuDNN). Here
`factor` neighbouring groups run as one group of `factor` times the channels, whose weight holds each group's
block on its diagonal and zeros elsewhere: the same convolution, since a group's output reads only its own block.
The kernels then load 128-byte rows (64 channels of 16 bits a voxel) and multiply `factor` times the FLOPs of the
grouped problem, the zeros included, on tensor cores that are far more than `factor` times faster than the gather.

The forward and the input gradient on the pointer kernels read the weight's diagonal blocks where they lie (a
column's channels of its own group, zeros off its block: `in_place`, the kernels' DIAG_CI and DIAG_CO), so a
call transforms no weight; the box kernels (TMA, Gluon) and the small-channel forms take the block-diagonal weight
(`block_diagonal`: one zero fill and one strided copy of a weight `factor` times larger, 884 KB for
resnext3d_g32_256 in bf16). The pointer weight gradient computes the coarse problem's tiles and stores their
diagonal blocks alone, at the grouped weight's channels (its DIAG_CI and DIAG_CO): its fp32 split partials are
`factor` times smaller than the coarse gradient's (resnext3d_g32_256 at the H100's 11 splits: 2.4 MB, not 19.5),
and nothing is copied after. The box kernels' weight gradient computes the coarse problem's whole gradient and
keeps its diagonal blocks (one strided copy, `diagonal_blocks`). `on_coarse` runs a launch either way.
`choice.launch` applies it to every launch (bench.variants to the kernels it times), the tuner and
`python -m tconv3d.inspect` to the problems they tune and compile, so a tuning key is the problem the kernels run
and a candidate's time counts what its variant pays for the grouped weight (tuner.job_problem).
Depthwise problems (one input channel a group) keep their direct kernels.
"""

from __future__ import annotations

import dataclasses

import torch

from ..geometry import ConvGeometry
from .config import KernelConfig, packs_out_taps, packs_taps, reads_channels_after, w_tap_columns
from .tensors import empty_ndhwc

# A coarse group's input channels, at least where the groups allow: one 128-byte row of 16-bit channels a voxel,
# the row a TMA box or a 16-byte cp.async per thread fills.
COARSE_CHANNELS = 64
# Groups of at least this many input channels keep their own GEMMs: 16 channels a tap load 32-byte rows, and
# coarsening to 64 would multiply the FLOPs by 4 for rows 4 times as wide.
COARSEN_BELOW = 16
# At most this many groups side by side (it multiplies the FLOPs by as much).
MAX_FACTOR = 16

_coarse: dict = {}


def factor(geom: ConvGeometry) -> int:
    """How many neighbouring groups of `geom` run as one: the fewest whose input channels reach COARSE_CHANNELS
    (a divisor of the groups), else the most within MAX_FACTOR; 1 for dense, depthwise and wide groups."""
    groups, channels = geom.groups, geom.group_in_channels
    if groups == 1 or channels == 1 or channels >= COARSEN_BELOW:
        return 1
    divisors = [d for d in range(2, min(groups, MAX_FACTOR) + 1) if groups % d == 0]
    enough = [d for d in divisors if d * channels >= COARSE_CHANNELS]
    return enough[0] if enough else max(divisors, default=1)


def coarsened(geom: ConvGeometry) -> ConvGeometry:
    """The geometry the kernels run for `geom`: `geom` itself, or its groups `factor` at a time (see the module's
    docstring). Memoised per geometry."""
    if geom.groups == 1:
        return geom
    coarse = _coarse.get(geom)  # False: not coarsened (an equal geometry's memo must not stand for `geom` itself)
    if coarse is None:
        f = factor(geom)
        coarse = dataclasses.replace(geom, groups=geom.groups // f) if f > 1 else False
        if len(_coarse) < 4096:
            _coarse[geom] = coarse
    return coarse or geom


def _blocks(coarse: ConvGeometry, factor: int) -> tuple[int, int, int, int, int]:
    """(coarse groups, factor, output channels a group, taps, input channels a group) of the problem whose groups
    run `factor` at a time as `coarse`."""
    return coarse.groups, factor, coarse.group_out_channels // factor, coarse.taps, coarse.group_in_channels // factor


def block_diagonal(weight: torch.Tensor, coarse: ConvGeometry, factor: int) -> torch.Tensor:
    """`coarse`'s weight, channels_last_3d: `weight`'s groups (`factor` to a coarse one) on the diagonal, zeros
    elsewhere."""
    groups, f, c_out, taps, c_in = _blocks(coarse, factor)
    dense = weight.new_zeros(groups, f, c_out, taps, f, c_in)
    blocks = weight.permute(0, 2, 3, 4, 1).reshape(groups, f, c_out, taps, c_in)
    dense.diagonal(0, 1, 4).copy_(blocks.permute(0, 2, 3, 4, 1))  # the diagonal's dims: (groups, c_out, taps, c_in, f)
    return dense.view(coarse.out_channels, *coarse.kernel, f * c_in).permute(0, 4, 1, 2, 3)


def diagonal_blocks(grad: torch.Tensor, coarse: ConvGeometry, factor: int) -> torch.Tensor:
    """The weight gradient (channels_last_3d) of the problem whose groups run `factor` at a time as `coarse`, from
    `coarse`'s: its diagonal blocks."""
    groups, f, c_out, taps, c_in = _blocks(coarse, factor)
    dense = grad.permute(0, 2, 3, 4, 1).reshape(groups, f, c_out, taps, f, c_in)
    out = empty_ndhwc((coarse.out_channels, c_in, *coarse.kernel), like=grad)
    out.permute(0, 2, 3, 4, 1).view(groups, f, c_out, taps, c_in).copy_(dense.diagonal(0, 1, 4).permute(0, 4, 1, 2, 3))
    return out


def in_place(direction: str, coarse: ConvGeometry, config: KernelConfig) -> bool:
    """Whether `config`'s kernel for `direction` of `coarse` takes the diagonal blocks of a grouped weight where
    they lie: reads them (the forward and input gradient) or stores them (the weight gradient), the pointer
    kernels' tiles of one tap (DIAG_CI, DIAG_CO); not their small-channel forms, whose weight loads are gathers of
    their own, nor the weight gradient's packed rows or columns, nor a launch reading a second channel source in
    place (a coarse group of the concatenation [x, channels_after] spans both: its kernels take one source's
    blocks, and its tiles are of one source, reads_channels_after)."""
    if config.variant != "pointer" or packs_taps(direction, coarse) or reads_channels_after(direction, coarse, config):
        return False
    if direction == "wgrad":
        return not packs_out_taps(coarse)
    return not w_tap_columns(direction, coarse)


def diagonal_weight(
    direction: str, weight: torch.Tensor, coarse: ConvGeometry, config: KernelConfig, factor: int
) -> tuple[torch.Tensor, tuple[int, int]]:
    """(weight, (DIAG_CI, DIAG_CO)) for a `direction` launch of `coarse` handed a weight of `factor` groups to a
    coarse one (1: `coarse`'s own): the weight as it is, with its groups' channels, where the kernel reads its
    diagonal blocks in place (in_place), else the block-diagonal weight and (0, 0)."""
    if factor == 1:
        return weight, (0, 0)
    if in_place(direction, coarse, config):
        return weight, diagonal_channels(coarse, factor)
    return block_diagonal(weight, coarse, factor), (0, 0)


def diagonal_channels(coarse: ConvGeometry, factor: int) -> tuple[int, int]:
    """(input, output) channels of a diagonal block of `coarse`'s weight, its groups `factor` to a coarse one: the
    kernels' (DIAG_CI, DIAG_CO)."""
    return coarse.group_in_channels // factor, coarse.group_out_channels // factor


def on_coarse(geom: ConvGeometry, coarse: ConvGeometry, run, *tensors: torch.Tensor):
    """`run(*tensors)`, a launch of `coarse` (coarsened(geom)), as `geom`'s: `run(*tensors, diagonal=factor)`,
    whose launcher takes the weight (the forward's and input gradient's second tensor) through `diagonal_weight`,
    or returns the weight gradient's diagonal blocks (stored in place, or `diagonal_blocks`); `run(*tensors)`
    itself where `coarse` is `geom`."""
    if coarse is geom:
        return run(*tensors)
    return run(*tensors, diagonal=geom.groups // coarse.groups)
