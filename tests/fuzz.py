"""Random convolutions against float64: the public entries `tconv3d.conv3d` and `tconv3d.conv_transpose3d` on
problems drawn at random from everything they take at once (groups and depthwise, any kernel, stride and dilation
per dimension, asymmetric padding in any mode per dimension, cached frames before the clip, a second source of
channels after the input's (a skip connection), output padding, bias, unbatched and non-channels-last inputs,
views whose rows are not packed), each under a tiling drawn as a GPU would get it (the device's default, the H100
heuristic, or any candidate of the tuner's space) and a kernel variant (as chosen, pointer, TMA forced, or Gluon,
with the tuner's Gluon twins: swapped, grouped taps, halo tiles). The output and every gradient (input, cached
frames, weight, bias, channels after; for some problems the second-order ones, grad_output's included; for some
the output's tangent along random tangents of every input, forward-mode AD; for some the output and gradients
again by torch.func.vmap over the batch, a sample a call) are held to the float64 result of torch.cat + F.pad +
F.conv3d (F.conv_transpose3d) by relative L2 error.

The suite's cases are chosen by hand; this finds what they miss: combinations nobody wrote down.

    python tests/fuzz.py --seconds 600 [--seed 0] [--kernels auto,pointer,tma,gluon] [--size small|large]
    python tests/fuzz.py --seconds 600 --focus halo  # Gluon problems that halo tiles take, offered them always
    python tests/fuzz.py --replay '<the JSON line a failure printed>'

On CPU the kernels run on the interpreter and the Gluon ones on the emulator (tests/gluon_emulator.py), over tiny
problems (`--size small`, the default there). On a GPU the compiled kernels run on CUDA tensors, the Gluon ones
natively on sm_90 (elsewhere they fall back as TCONV3D_KERNELS=gluon does), over problems up to a few hundred
channels and tens of voxels a side (`--size large`, the default there), with the float64 reference on the GPU too.
Prints one JSON line per failure, a reproducer; exits 1 if any failed. A result over its bound where stock torch's,
on the same inputs in the same dtype, is over it too and at least 1 / STOCK_SCATTER of ours is ill-conditioned,
not failed: printed and counted apart (run 68's seed 68299: a circular border's two terms cancelling tenfold in an fp16
second-order input gradient, ours and stock's 2.45e-3 where the bound is 2e-3). tests/test_fuzz.py runs seeded draws
in CI."""

import interpreter_without_cuda  # noqa: F401  (first: TRITON_INTERPRET before tconv3d defines its kernels)

# isort: split

import argparse
import collections
import contextlib
import dataclasses
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import interpreter_bounds
import interpreter_fidelity
import interpreter_speedups
import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from helpers import grouped_taps, swapped_tiles
from torch.func import grad, vmap

import tconv3d
from tconv3d import settings
from tconv3d.kernels import conv_gluon
from tconv3d.kernels.config import HALO_BOX_FRAMES, HALO_KD
from tconv3d.ops import varying
from tconv3d.testing import TF32_TOLERANCE, TOLERANCE, exact_fp32, rel_l2
from tconv3d.tune import choice, configs

CL = torch.channels_last_3d
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODES = ("zeros", "replicate", "reflect", "circular")
KERNELS = ("auto", "pointer", "tma", "gluon")
TILINGS = ("default", "heuristic", "candidate")
# The shares of problems drawn with an empty batch, with a forward-mode tangent checked, and run again under vmap.
EMPTY_SHARE = 0.04
TANGENT_SHARE = 0.15
VMAP_SHARE = 0.15
# The share of `--focus halo` draws whose H and W borders read input voxels (replicate, reflect, circular): the halo
# tiles compute the interior and the pointer kernel the ring of border voxels, in the same splits (fuzz run 109's
# failure, which the focus, zeros-padded until then, never drew)
HALO_BORDER_SHARE = 0.4
H100_SMS, H100_SMEM = 132, 232448


@dataclasses.dataclass(frozen=True)
class Scale:
    """How big a draw may be: the interpreter pays per operation, a GPU per launch."""

    channels: tuple  # the channel counts drawn from, repeats weigh
    tma_channels: tuple  # the input channels of problems drawn for the TMA and Gluon variants (16-byte rows)
    size: tuple  # each input dimension's largest extent (D, H, W)
    max_macs: int  # multiply-adds of one direction above which a draw is made again


SCALES = {
    "small": Scale((1, 2, 3, 4, 5, 7, 8, 8, 9, 16, 16, 17, 24, 32, 40), (8, 16, 24, 32, 48), (6, 9, 9), 400_000),
    "large": Scale(
        (1, 3, 4, 8, 16, 17, 32, 40, 64, 64, 96, 128, 128, 192, 256, 320, 384),
        (16, 32, 64, 96, 128, 256, 384),
        (12, 40, 40),
        300_000_000,
    ),
}


@dataclasses.dataclass(frozen=True)
class Problem:
    seed: int
    dtype: str
    batch: int  # 0: an unbatched (C, D, H, W) input
    cin: int  # the input's channels (a transposed conv's too)
    cout: int
    groups: int
    size: tuple  # the input's (D, H, W)
    frames: int  # frames_before's depth; 0: none
    kernel: tuple
    stride: tuple
    dilation: tuple
    padding: tuple  # (d_front, d_back, h_top, h_bottom, w_left, w_right); a transposed conv's pairs are equal
    modes: tuple  # per (d, h, w)
    bias: bool
    layout: str  # "cl": channels_last_3d; "ncdhw": contiguous; "view": a channels_last_3d slice, rows not packed
    weight_cl: bool
    tiling: str
    kernels: str
    transpose: bool = False  # conv_transpose3d: no frames, zeros padding
    output_padding: tuple = (0, 0, 0)
    second_order: bool = False  # the gradients' own gradients (double backward), grad_output's included
    after: int = 0  # channels_after's channels (a skip connection concatenated after the input's); 0: none
    empty: bool = False  # a batch of no entries (N = 0, batched even where `batch` says unbatched)
    tangent: bool = False  # the output's tangent along random tangents of every input (forward_ad's dual tensors)
    vmapped: bool = False  # the output and first-order gradients again by vmap over the batch (batched problems)
    halo: bool = False  # `--focus halo`'s draws: every Gluon forward and input gradient offered halo tiles

    def padded(self, dim: int) -> int:
        size = self.size[dim] + (self.frames if dim == 0 else 0)
        return size + self.padding[2 * dim] + self.padding[2 * dim + 1]

    def out_size(self) -> tuple:
        if self.transpose:
            return tuple(
                (self.size[i] - 1) * self.stride[i] - 2 * self.padding[2 * i]
                + self.dilation[i] * (self.kernel[i] - 1) + self.output_padding[i] + 1
                for i in range(3)
            )  # fmt: skip
        return tuple(
            (self.padded(i) - self.dilation[i] * (self.kernel[i] - 1) - 1) // self.stride[i] + 1 for i in range(3)
        )

    def macs(self) -> int:
        """Multiply-adds of one direction: per output voxel of the convolution (the input voxels of a transposed
        one), its input channels in a group, taps and output channels."""
        voxels = math.prod(self.size if self.transpose else self.out_size())
        channels = (self.cin + self.after) // self.groups
        return max(self.batch, 1) * voxels * self.cout * channels * math.prod(self.kernel)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        data = json.loads(text)
        data = data.get("problem", data)  # a failure's whole line, or its problem
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


def _channel_counts(rng: random.Random, tma_shaped: bool, scale: Scale) -> tuple:
    """(groups, cin, cout): mostly dense, a fifth grouped, the rest depthwise with a channel multiplier; a
    TMA-shaped problem's rows are whole 16-byte units, as the TMA and Gluon variants take them."""
    if tma_shaped:
        return 1, rng.choice(scale.tma_channels), rng.choice((3, *scale.tma_channels))
    kind = rng.random()
    if kind < 0.65:
        return 1, rng.choice(scale.channels), rng.choice(scale.channels)
    if kind < 0.85:
        groups = rng.choice((2, 3, 4))
        per_group = [c for c in scale.channels if c * groups <= scale.channels[-1]]
        return groups, groups * rng.choice(per_group), groups * rng.choice(per_group)
    cin = rng.choice([c for c in scale.channels if c > 1 and c * 2 <= scale.channels[-1]] or [2])
    return cin, cin, cin * rng.choice((1, 1, 2))


def halo_shaped(problem: Problem) -> bool:
    """Whether the problem's forward, or its transposed conv, is one the halo tiles take (configs.halo_eligible, but
    for the tiles): 16-bit, one group, 3 taps along D at stride 1 and no dilation there, zeros along D and no cached
    frames, at least HALO_BOX_FRAMES frames of the input, 16-byte channel rows."""
    return (
        problem.dtype in ("bf16", "fp16")
        and problem.groups == 1
        and problem.kernel[0] == HALO_KD
        and problem.stride == (1, 1, 1)
        and problem.dilation[0] == 1
        and problem.modes[0] == "zeros"
        and not problem.frames
        and problem.size[0] >= HALO_BOX_FRAMES
        and problem.cin % 8 == problem.cout % 8 == 0  # whole 16-byte rows stored in both directions
    )


def draw(seed: int, kernels: tuple = KERNELS, scale: Scale = SCALES["small"], focus: str | None = None) -> Problem:
    """A valid problem: every output dimension at least 1, every padding amount one its mode takes (F.pad's rules,
    dimension by dimension, D counted with the cached frames), at most the scale's multiply-adds a direction. A
    fifth are transposed convolutions. Most problems drawn for the TMA and Gluon variants are ones they run in
    every direction (configs.tma_eligible: 16-byte channel rows, at most two phases in H and W, zeros padding
    and one source; 16-bit dtypes for Gluon's weight gradient), so that the variant is what runs. `focus` "halo":
    only Gluon problems that the halo tiles take (halo_shaped), each offered them wherever a launch may take them
    (the other draws, half the time): the tuner's twins that a random draw reaches a few times in a thousand."""
    rng = random.Random(seed)
    if focus == "halo":
        kernels = ("gluon",)
    while True:
        variant = rng.choice(kernels)
        tma_shaped = variant in ("tma", "gluon") and (focus == "halo" or rng.random() < 0.7)
        groups, cin, cout = _channel_counts(rng, tma_shaped, scale)
        transpose = rng.random() < 0.2
        kernel = tuple(rng.choice((1, 1, 2, 3, 3, 4)) for _ in range(3))
        # A TMA-shaped problem's H and W strides stay within conv_tma.MAX_PHASES phase views; D's may be any.
        stride = tuple(rng.choice((1, 1, 2) if tma_shaped and dim else (1, 1, 1, 2, 3)) for dim in range(3))
        dilation = tuple(rng.choice((1, 1, 2)) if k > 1 else 1 for k in kernel)
        size = tuple(rng.randint(1, largest) for largest in scale.size)
        frames = 0 if transpose or tma_shaped else rng.choice((0, 0, 0, 1, 2, 3))
        per_dim = rng.random() < 0.3 and not tma_shaped
        mode = rng.choice(MODES) if rng.random() < 0.6 and not (transpose or tma_shaped) else "zeros"
        modes = tuple(rng.choice(MODES) for _ in range(3)) if per_dim and not transpose else (mode,) * 3
        padding, output_padding = [], []
        for dim in range(3):
            reach = dilation[dim] * (kernel[dim] - 1)
            if transpose:  # one amount a side, cut from the output; output_padding below max(stride, dilation)
                padding += [rng.randint(0, reach + 1)] * 2
                output_padding.append(rng.randint(0, max(stride[dim], dilation[dim]) - 1))
                continue
            extent = size[dim] + (frames if dim == 0 else 0)
            # F.pad: reflect takes less than the size, circular at most the size.
            cap = {"reflect": extent - 1, "circular": extent}.get(modes[dim], reach + 1)
            padding += [rng.randint(0, max(0, min(reach + 1, cap))) for _ in range(2)]
        problem = Problem(
            seed=seed,
            dtype=rng.choice(("bf16", "fp16") if tma_shaped and variant == "gluon" else tuple(DTYPES)),
            batch=rng.choice((0, 1, 1, 2)),
            cin=cin,
            cout=cout,
            groups=groups,
            size=size,
            frames=frames,
            kernel=kernel,
            stride=stride,
            dilation=dilation,
            padding=tuple(padding),
            modes=modes,
            bias=rng.random() < 0.6,
            layout=rng.choice(("cl", "cl", "ncdhw", "view")),
            weight_cl=rng.random() < 0.85,
            tiling=rng.choice(TILINGS),
            kernels=variant,
            transpose=transpose,
            output_padding=tuple(output_padding) if transpose else (0, 0, 0),
            second_order=rng.random() < 0.15,
        )
        # A skip connection's channels after the input's (drawn last: a seed's other fields stay as they were; a
        # transposed conv's since fuzz run 10; grouped since run 74, as many as the groups divide with the input's:
        # tests/fuzz_args.py found the grouped pointer kernels reading a coarse group's diagonal blocks from two
        # sources, which they cannot)
        if not frames and rng.random() < 0.25:
            after = rng.choice(scale.tma_channels if tma_shaped else scale.channels)
            after = -(-(problem.cin + after) // groups) * groups - problem.cin
            problem = dataclasses.replace(problem, after=after)
        # An empty batch, from a generator of its own (the draws above stay each seed's): every heuristic divided
        # by its zero tiles until fuzz run 33's session (a CUDA call raised ZeroDivisionError).
        if random.Random(f"{seed}-empty").random() < EMPTY_SHARE:
            problem = dataclasses.replace(problem, empty=True)
        if random.Random(f"{seed}-tangent").random() < TANGENT_SHARE:  # since fuzz run 38
            problem = dataclasses.replace(problem, tangent=True)
        if problem.batch and not problem.empty and random.Random(f"{seed}-vmap").random() < VMAP_SHARE:  # run 39
            problem = dataclasses.replace(problem, vmapped=True)
        if focus == "halo":
            if not halo_shaped(problem):
                continue
            problem = _bordered(dataclasses.replace(problem, halo=True), random.Random(f"{seed}-border"))
        if min(problem.out_size()) >= 1 and problem.macs() <= scale.max_macs:
            return problem


def _bordered(problem: Problem, rng: random.Random) -> Problem:
    """`problem` with modes drawn for H and W (HALO_BORDER_SHARE of the time, from a generator of its own: the draws
    before stay each seed's), where the padding drawn for zeros suits them (F.pad's rules) and an interior is left
    that reads no border (configs.interior_left: else no box kernel runs it); otherwise as it is. Not a transposed
    conv's (zeros only)."""
    if problem.transpose or rng.random() >= HALO_BORDER_SHARE:
        return problem
    modes, out = ["zeros"], problem.out_size()
    for dim in (1, 2):
        mode = rng.choice(MODES)
        pads = problem.padding[2 * dim : 2 * dim + 2]
        cap = {"reflect": problem.size[dim] - 1, "circular": problem.size[dim]}.get(mode, max(pads))
        modes.append(mode if max(pads) <= cap and out[dim] > sum(pads) else "zeros")
    return dataclasses.replace(problem, modes=tuple(modes)) if modes != ["zeros"] * 3 else problem


def _tensors(problem: Problem, dtype: torch.dtype):
    """The inputs, in the problem's layouts, on DEVICE: x (N, Cin, D, H, W) or unbatched, frames_before or None,
    the weight ((Cout, (Cin + after) / groups, k...); transposed (Cin, Cout / groups, k...)), the bias or None,
    channels_after (N, after, D, H, W; x's layout, a view's packed) or None."""
    gen = torch.Generator().manual_seed(problem.seed)
    n = 0 if problem.empty else max(problem.batch, 1)
    shape = (n, problem.cin, *problem.size)
    if problem.layout == "view":  # one more channel and one more column: a view with strides of a wider tensor
        wide = torch.randn(n, problem.cin + 1, problem.size[0], problem.size[1], problem.size[2] + 1, generator=gen)
        x = wide.to(DEVICE, dtype).contiguous(memory_format=CL)[:, 1:, :, :, 1:]
    else:
        x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        x = x.contiguous(memory_format=CL) if problem.layout == "cl" else x.contiguous()
    before = None
    if problem.frames:
        before = torch.randn(n, problem.cin, problem.frames, *problem.size[1:], generator=gen).to(DEVICE, dtype)
        before = before.contiguous(memory_format=CL)
    skip = None
    if problem.after:
        skip = torch.randn(n, problem.after, *problem.size, generator=gen).to(DEVICE, dtype)
        skip = skip.contiguous() if problem.layout == "ncdhw" else skip.contiguous(memory_format=CL)
    if problem.transpose:
        w_channels = problem.cin + problem.after, problem.cout // problem.groups
    else:
        w_channels = problem.cout, (problem.cin + problem.after) // problem.groups
    fan_in = w_channels[1] * math.prod(problem.kernel)
    w = (torch.randn(*w_channels, *problem.kernel, generator=gen) / fan_in**0.5).to(DEVICE, dtype)
    w = w.contiguous(memory_format=CL) if problem.weight_cl else w.contiguous()
    b = torch.randn(problem.cout, generator=gen).to(DEVICE, dtype) if problem.bias else None
    if problem.batch == 0 and not problem.empty:
        x = x[0]
        before = None if before is None else before[0]
        skip = None if skip is None else skip[0]
    return x, before, w, b, skip


def reference(problem: Problem, x, before, w, b, skip=None):
    """torch.cat in front along D, F.pad dimension by dimension in each one's mode, then F.conv3d; or
    F.conv_transpose3d."""
    if problem.transpose:
        pads = problem.padding[0::2]
        if skip is not None:
            x = torch.cat([x, skip], dim=-4)
        return F.conv_transpose3d(
            x, w, b, problem.stride, pads, problem.output_padding, problem.groups, problem.dilation
        )
    if before is not None:
        x = torch.cat([before, x], dim=-3)
    if skip is not None:
        x = torch.cat([x, skip], dim=-4)
    unbatched = x.dim() == 4
    if unbatched:
        x = x.unsqueeze(0)
    for dim, mode in enumerate(problem.modes):
        pads = [0] * 6
        pads[4 - 2 * dim : 6 - 2 * dim] = problem.padding[2 * dim : 2 * dim + 2]
        if any(pads):
            x = F.pad(x, pads, mode="constant" if mode == "zeros" else mode)
    y = F.conv3d(x, w, b, problem.stride, 0, problem.dilation, problem.groups)
    return y[0] if unbatched else y


def _mode_argument(problem: Problem, rng: random.Random):
    if len(set(problem.modes)) == 1:
        return problem.modes[0]
    return ",".join(problem.modes) if rng.random() < 0.5 else problem.modes


def _padding_argument(problem: Problem, rng: random.Random):
    pads = problem.padding
    if problem.transpose:  # one amount a dimension
        return pads[0] if len(set(pads)) == 1 and rng.random() < 0.5 else pads[0::2]
    if pads[0::2] == pads[1::2] and rng.random() < 0.5:
        return pads[0::2] if rng.random() < 0.5 or len(set(pads)) > 1 else pads[0]
    return pads


def _select(problem: Problem):
    """choice._select for the problem: its tiling, then its variant as TCONV3D_KERNELS would force it."""

    def select(direction, geom, dtype, device, run):
        rng = random.Random(f"{problem.seed}-{direction}")
        h100 = configs.heuristic_config(direction, geom, dtype, H100_SMS, configs.GLUON_CAPABILITY)
        if problem.tiling == "default":  # the interpreter's large tiles on CPU, the device's heuristic on a GPU
            config = configs.default_config(direction, geom, dtype, device)
        elif problem.tiling == "heuristic":
            config = h100
        else:
            found = configs.candidates(direction, geom, dtype, H100_SMEM, tma=True, gluon=problem.kernels == "gluon")
            # The space prunes tiles past a small problem's size: the tuner then keeps the heuristic's default.
            config = rng.choice(found) if found else h100
        gluon_runs = problem.kernels == "gluon" and choice._gluon_runs(device)  # the emulator's say on CPU
        config = choice.force_variant(direction, geom, dtype, config, problem.kernels, gluon_runs)
        twins = problem.tiling == "heuristic" and config.gluon and configs.own_twins(direction, geom, config, dtype,
                                                                                     H100_SMEM)  # fmt: skip
        # what the tuner times beside the heuristic's tiles (tuner.nearest_candidates); `--focus halo`: halo tiles
        if twins and not problem.halo and rng.random() < 0.5:
            config = rng.choice(twins)
        elif config.gluon:
            config = dataclasses.replace(config, gluon=rng.choice((1, 2)))
            if direction != "wgrad" and not config.swap_ab and rng.random() < 0.3:  # the tile computed transposed
                swapped = swapped_tiles(config)
                config = swapped if configs.gluon_takes(swapped) else config
            transposed = direction == "wgrad" and config.swap_ab  # the taps on the wgmma's rows (swapped_wgrad_tiles)
            if (config.tap_group > 1 or transposed) and config.gluon != 2:  # both warp-specialized only
                config = dataclasses.replace(config, gluon=2)
            if direction == "wgrad" and not (config.tap_group or transposed) and rng.random() < 0.3:  # taps in a tile
                config = grouped_taps(config, rng.choice((2, 4)))  # 64 to 128 channels a tap
            if direction != "wgrad" and (problem.halo or rng.random() < 0.5):  # two frames a tile, as own_twins:
                # on one program an SM with a deeper ring (programs=1) where that fits, else on the programs an SM
                # the tile keeps; swapped or not
                twin = dataclasses.replace(config, gluon=2)
                deep = configs.halo_twin(direction, geom, twin, dtype.itemsize, 1) if rng.random() < 0.3 else None
                config = deep or configs.halo_twin(direction, geom, twin, dtype.itemsize) or config
        select.configs.append((direction, config))
        return config

    select.configs = []
    return select


GRADIENTS = ("input", "frames", "weight", "bias", "after")


def _backward(problem: Problem, y, leaves, grad_out, probes) -> dict:
    """Backward from `y` with `grad_out`; returns {name: gradient} of the leaves (x, frames_before, weight, bias,
    channels_after; None where absent). Second order: the first-order gradients with create_graph, then backward from
    sum(gradient * probe) over them, so every leaf's gradient, grad_output's among them, is a second-order one."""
    if not problem.second_order:
        y.backward(grad_out)
        return {f"grad_{name}": t.grad for name, t in zip(GRADIENTS, leaves, strict=True) if t is not None}
    present = [t for t in leaves if t is not None]
    firsts = torch.autograd.grad(y, present, grad_out, create_graph=True)
    sum((first * probe).sum() for first, probe in zip(firsts, probes, strict=True)).backward()
    named = {f"grad2_{name}": t.grad for name, t in zip(GRADIENTS, leaves, strict=True) if t is not None}
    return {**named, "grad2_output": grad_out.grad}


def _call(problem: Problem, rng: random.Random):
    """tconv3d's call of the problem on (x, frames_before, weight, bias, channels_after), its arguments' forms
    drawn once from `rng`."""
    padding = _padding_argument(problem, rng)
    if problem.transpose:
        return lambda x, before, w, b, skip: tconv3d.conv_transpose3d(
            x, w, b, problem.stride, padding, problem.output_padding, problem.groups, problem.dilation,
            channels_after=skip,
        )  # fmt: skip
    mode = _mode_argument(problem, rng)
    return lambda x, before, w, b, skip: tconv3d.conv3d(
        x, w, b, problem.stride, padding, problem.dilation, problem.groups, padding_mode=mode, frames_before=before,
        channels_after=skip,
    )  # fmt: skip


def _tangents(problem: Problem, call, tensors) -> tuple:
    """The output's tangent along random tangents of every input: tconv3d's by forward_ad's dual tensors (each op's
    jvp, the kernels again), and float64 torch's by torch.func.jvp of the reference."""
    gen = torch.Generator().manual_seed(problem.seed + 3)
    tangents = [None if t is None else torch.randn(t.shape, generator=gen).to(t) for t in tensors]
    present = [i for i, t in enumerate(tensors) if t is not None]
    with fwAD.dual_level():
        duals = [None if t is None else fwAD.make_dual(t.detach(), d) for t, d in zip(tensors, tangents, strict=True)]
        ours = fwAD.unpack_dual(call(*duals)).tangent
    upcast = lambda ts: tuple(ts[i].detach().double() for i in present)  # noqa: E731
    along = varying(lambda *args: reference(problem, *args), tensors, present)
    return ours, torch.func.jvp(along, upcast(tensors), upcast(tangents))[1]


def _per_sample(problem: Problem, call, tensors, grad_out) -> dict:
    """The output and the gradients of sum(output * grad_out) by torch.func.vmap of grad over the batch, a sample a
    call (each op's vmap rule folds the samples back into its batch, or runs them one by one): {name: (tconv3d's,
    float64 torch's of the whole batch)}, the per-sample gradients stacked (the input's, frames_before's,
    channels_after's) or summed (the weight's and the bias's, which every sample shares)."""
    present = [i for i, t in enumerate(tensors) if t is not None]
    per_sample = [i in (0, 1, 4) for i in present]  # x, frames_before, channels_after

    def loss(*args):
        *values, g = args
        full = [None] * len(tensors)
        for i, value, sampled in zip(present, values, per_sample, strict=True):
            full[i] = value[None] if sampled else value
        y = call(*full)
        return (y * g[None]).sum(), y[0]

    values = [tensors[i].detach() for i in present]
    in_dims = (*(0 if sampled else None for sampled in per_sample), 0)
    grads, y = vmap(grad(loss, argnums=tuple(range(len(present))), has_aux=True), in_dims=in_dims)(
        *values, grad_out.detach()
    )
    exact = [value.double().requires_grad_() for value in values]
    full = [None] * len(tensors)
    for i, value in zip(present, exact, strict=True):
        full[i] = value
    expected = reference(problem, *full)
    exact_grads = torch.autograd.grad(expected, exact, grad_out.detach().double())
    results = {"vmap_output": (y, expected)}
    for k, i in enumerate(present):
        results[f"vmap_grad_{GRADIENTS[i]}"] = (grads[k] if per_sample[k] else grads[k].sum(0), exact_grads[k])
    return results


def _error(name: str, got: torch.Tensor, want: torch.Tensor, grad_out: torch.Tensor) -> float:
    """rel_l2 of a result against float64's; the bias's gradient (whole or summed from vmap's samples) against the
    sizes of what it sums. It is the output gradient summed over the batch and the voxels, a channel at a time, and
    a sum of random values can cancel: seed 62222's (fp32, one output channel, 120 voxels) is 415 times smaller than
    the sum of its terms' sizes, so an fp32 sum within rounding of its terms (2.3e-6 off where the bound is 5.5e-6)
    was 1e-5 off the sum. Against the terms' sizes it is 2.4e-8; a voxel left out or counted twice is ~1e-2."""
    if name not in ("grad_bias", "vmap_grad_bias"):
        return rel_l2(got, want)
    terms = grad_out.abs().sum([d for d in range(grad_out.dim()) if d != 1]).norm()
    return rel_l2(got, want) if terms == 0 else ((got.double() - want).norm() / terms).item()


# How much farther from float64 than stock torch's own result (same inputs, same dtype) an over-bound result of an
# ill-conditioned problem may be and still count as its conditioning's (`run`).
STOCK_SCATTER = 1.5


def _stock_errors(problem: Problem, tensors, grad_out, probes, expected, exact_grads, exact_grad_out) -> dict:
    """Stock torch's errors against float64 (torch.cat + F.pad + F.conv3d, `reference`, in the problem's dtype) on
    the same inputs: the output's and each gradient's; {} where stock cannot run it (a dtype its CPU kernels lack)."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
    try:
        with exact_fp32():
            y = reference(problem, *leaves)
            grads = _backward(
                problem, y, leaves, grad_out.detach().clone().requires_grad_(problem.second_order), probes
            )
    except RuntimeError:
        return {}
    errors = {"output": rel_l2(y, expected)}
    for name, want in exact_grads.items():
        if want is not None and grads.get(name) is not None:
            errors[name] = _error(name, grads[name], want, exact_grad_out)
    return errors


def run(problem: Problem, monkeypatch) -> dict:
    """Relative L2 errors of the output and each gradient against float64, and the configs launched. Raises
    AssertionError where one is over the dtype's bound, but where stock torch's result is over it too and within
    STOCK_SCATTER of ours ("ill_conditioned": {name: (ours, stock's)})."""
    dtype = DTYPES[problem.dtype]
    rng = random.Random(problem.seed + 1)
    tensors = _tensors(problem, dtype)
    exact = [None if t is None else t.detach().double().requires_grad_() for t in tensors]
    expected = reference(problem, *exact)
    # The output gradient in the dtype, as autograd hands it over; the reference takes the same values. So do the
    # probes of a second-order problem, one per first-order gradient.
    gen = torch.Generator().manual_seed(problem.seed + 2)
    grad_out = torch.randn(expected.shape, generator=gen).to(DEVICE, dtype).requires_grad_(problem.second_order)
    probes = [torch.randn(t.shape, generator=gen).to(DEVICE, dtype) for t in tensors if t is not None]
    exact_grad_out = grad_out.detach().double().requires_grad_(problem.second_order)
    exact_grads = _backward(problem, expected, exact, exact_grad_out, [p.double() for p in probes])

    ours = [None if t is None else t.detach().requires_grad_() for t in tensors]
    select = _select(problem)
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", select)
    # The Gluon kernel takes fp32 only as TF32: there TF32 is allowed and the bound is TF32's; everywhere else
    # products are exact.
    tf32 = problem.kernels == "gluon" and dtype == torch.float32
    bound = TF32_TOLERANCE if tf32 else TOLERANCE[dtype]
    monkeypatch.setattr(settings, "KERNELS", problem.kernels)
    with exact_fp32(), contextlib.ExitStack() as stack:
        if problem.kernels == "gluon" and DEVICE == "cpu":
            from gluon_emulator import emulating

            monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: 3)
            stack.enter_context(emulating(monkeypatch, seed=problem.seed))
        if tf32:
            torch.backends.cudnn.conv.fp32_precision = "tf32"  # exact_fp32 restores the user's setting
        call = _call(problem, rng)
        y = call(*ours)
        grads = _backward(problem, y, ours, grad_out, probes)
        if problem.tangent:
            tangent, expected_tangent = _tangents(problem, call, tensors)
        vmapped = _per_sample(problem, call, tensors, grad_out) if problem.vmapped else {}
    errors = {"output": rel_l2(y, expected)}
    if problem.tangent:
        errors["tangent"] = rel_l2(tangent, expected_tangent)
    errors.update({name: _error(name, got, want, exact_grad_out) for name, (got, want) in vmapped.items()})
    for name, want in exact_grads.items():
        got = grads[name]
        if want is None and got is not None and problem.empty and not got.any():
            # torch's double backward leaves an empty batch's leaves unreached (None); zeros are their gradient
            errors[name] = 0.0
        elif want is None or got is None:  # a second-order gradient that does not exist (the bias's) on both sides
            errors[name] = 0.0 if want is got else float("inf")
        else:
            errors[name] = _error(name, got, want, exact_grad_out)
    launched = [
        (d, c.variant, c.block_m, c.block_n, c.block_k, c.split_k, c.gluon, c.halo_d, c.tap_group, c.swap_ab)
        for d, c in select.configs
    ]
    bad = {name: error for name, error in errors.items() if not error < bound}
    assert y.shape == expected.shape, f"shape {tuple(y.shape)} != {tuple(expected.shape)}"
    if y.dim() == 5:
        assert y.is_contiguous(memory_format=CL), "output not channels_last_3d"
    result = {"errors": errors, "launched": launched}
    if bad:
        stock = _stock_errors(problem, tensors, grad_out, probes, expected, exact_grads, exact_grad_out)
        scattered = {name: (error, stock.get(name, 0.0)) for name, error in bad.items()}
        if all(not theirs < bound and ours <= STOCK_SCATTER * theirs for ours, theirs in scattered.values()):
            return {**result, "ill_conditioned": scattered}
    assert not bad, f"over {bound:g}: {bad}; launched {launched}"
    return result


def check(problem: Problem) -> dict:
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run(problem, monkeypatch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0, help="first draw's seed; draws take seed, seed + 1, ...")
    parser.add_argument("--kernels", default="auto,pointer,tma,gluon")
    parser.add_argument(
        "--size", choices=tuple(SCALES), default="large" if DEVICE == "cuda" else "small", help="how big a draw may be"
    )
    parser.add_argument("--focus", choices=("halo",), help="draw only problems of this kind (see draw)")
    parser.add_argument("--replay", help="one failure's JSON line")
    args = parser.parse_args()
    if args.replay:
        problems = iter([Problem.from_json(args.replay)])
    else:
        kernels = tuple(args.kernels.split(","))
        if conv_gluon.UNAVAILABLE is not None:  # this Triton has no Gluon (or not the Gluon the kernels are for)
            kernels = tuple(k for k in kernels if k != "gluon") or ("auto",)
            if args.focus == "halo":  # its problems then run as TCONV3D_KERNELS=gluon falls back: no halo tile
                print(f"fuzz: --focus halo runs no halo tile here (Gluon: {conv_gluon.UNAVAILABLE})", file=sys.stderr)
        problems = (draw(seed, kernels, SCALES[args.size], args.focus) for seed in range(args.seed, 2**62))
    # On the interpreter: its speed-ups, its bf16 rounding and its accesses held to the launch's tensors as under
    # pytest, and int32 overflow checked as tests/test_fuzz.py checks it.
    interpreter_speedups.install()
    interpreter_fidelity.install()
    interpreter_bounds.install()
    with interpreter_speedups.overflow_checks(True):
        start, done, failed, scattered = time.perf_counter(), 0, 0, 0
        variants = collections.Counter()  # the variants launched, so a run shows what it exercised
        for problem in problems:
            try:
                result = check(problem)
                variants.update(
                    f"{direction} {variant}{' swapped' if swap else ''}{f' {group} taps' if group else ''}"
                    f"{' halo' if halo else ''}"
                    for direction, variant, *_, halo, group, swap in result["launched"]
                )
            except Exception as error:  # a failure of any kind is a finding, reported as one
                failed += 1
                kind = "wrong" if isinstance(error, AssertionError) else type(error).__name__
                print(json.dumps({"failure": kind, "problem": dataclasses.asdict(problem), "error": str(error)[:2000]}))
                if args.replay:
                    traceback.print_exc()
            else:
                if "ill_conditioned" in result:  # stock torch as far off: the problem's conditioning, counted apart
                    scattered += 1
                    print(
                        json.dumps(
                            {"ill_conditioned": result["ill_conditioned"], "problem": dataclasses.asdict(problem)}
                        )
                    )
                elif args.replay:
                    print(json.dumps(result))
            done += 1
            if time.perf_counter() - start > args.seconds:
                break
    launched = ", ".join(f"{name} {count}" for name, count in sorted(variants.items()))
    print(
        f"fuzz: {done} problems, {failed} failed, {scattered} ill-conditioned (stock as far off), "
        f"{time.perf_counter() - start:.0f} s; launched: {launched}",
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
