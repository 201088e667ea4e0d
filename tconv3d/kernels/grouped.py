"""Grouped convolutions of few channels a group, run as block-diagonal convolutions of more.

A group of 8 input channels (ResNeXt-3D's 32 groups of 256 channels) gives each group's implicit GEMM 8 output
columns and a reduction of 8 channels a tap: no tile loads a row of it at width, and the GEMM kernels fall back to
gathering 16-bit elements (on the H100, resnext3d_g32_256 ran at 0.4% of the matmul peak, 0.12x cuDNN). Here
`factor` neighbouring groups run as one group of `factor` times the channels, whose weight holds each group's
block on its diagonal and zeros elsewhere: the same convolution, since a group's output reads only its own block.
The kernels then load 128-byte rows (64 channels of 16 bits a voxel) and multiply `factor` times the FLOPs of the
grouped problem, the zeros included, on tensor cores that are far more than `factor` times faster than the gather.

The forward and the input gradient take the block-diagonal weight (one zero fill and one strided copy of a weight
`factor` times larger: 884 KB for resnext3d_g32_256 in bf16); the weight gradient computes the coarse problem's
whole gradient and keeps its diagonal blocks (one strided copy): `on_coarse`. `choice.launch` applies it to every
launch (bench.variants to the kernels it times), the
tuner and `python -m tconv3d.inspect` to the problems they tune and compile, so a tuning key is the problem the
kernels run. Depthwise problems (one input channel a group) keep their direct kernels.
"""

from __future__ import annotations

import dataclasses

import torch

from ..geometry import ConvGeometry
from .utils import empty_ndhwc

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


def _blocks(geom: ConvGeometry, coarse: ConvGeometry) -> tuple[int, int, int, int, int]:
    """(coarse groups, factor, output channels a group, taps, input channels a group) of `geom`."""
    return coarse.groups, geom.groups // coarse.groups, geom.group_out_channels, geom.taps, geom.group_in_channels


def block_diagonal(weight: torch.Tensor, geom: ConvGeometry, coarse: ConvGeometry) -> torch.Tensor:
    """`coarse`'s weight, channels_last_3d: `weight`'s (geom's) groups on the diagonal, zeros elsewhere."""
    groups, f, c_out, taps, c_in = _blocks(geom, coarse)
    dense = weight.new_zeros(groups, f, c_out, taps, f, c_in)
    blocks = weight.permute(0, 2, 3, 4, 1).reshape(groups, f, c_out, taps, c_in)
    dense.diagonal(0, 1, 4).copy_(blocks.permute(0, 2, 3, 4, 1))  # the diagonal's dims: (groups, c_out, taps, c_in, f)
    return dense.view(geom.out_channels, *geom.kernel, f * c_in).permute(0, 4, 1, 2, 3)


def diagonal_blocks(grad: torch.Tensor, geom: ConvGeometry, coarse: ConvGeometry) -> torch.Tensor:
    """`geom`'s weight gradient (channels_last_3d) from `coarse`'s: its diagonal blocks."""
    groups, f, c_out, taps, c_in = _blocks(geom, coarse)
    dense = grad.permute(0, 2, 3, 4, 1).reshape(groups, f, c_out, taps, f, c_in)
    out = empty_ndhwc(geom.weight_shape(), like=grad)
    out.permute(0, 2, 3, 4, 1).view(groups, f, c_out, taps, c_in).copy_(dense.diagonal(0, 1, 4).permute(0, 4, 1, 2, 3))
    return out


def on_coarse(direction: str, geom: ConvGeometry, coarse: ConvGeometry, run, *tensors: torch.Tensor):
    """`run(*tensors)`, a launch of `coarse` (coarsened(geom)), as `geom`'s direction: the forward's and input
    gradient's weight (their second tensor) block-diagonal, the weight gradient's diagonal blocks; `run(*tensors)`
    itself where `coarse` is `geom`."""
    if coarse is geom:
        return run(*tensors)
    if direction == "wgrad":
        return diagonal_blocks(run(*tensors), geom, coarse)
    first, weight, *rest = tensors
    return run(first, block_diagonal(weight, geom, coarse), *rest)
