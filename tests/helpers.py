"""Shared test pieces: the case matrix and small helpers. The reference and tolerances live in tconv3d.testing."""

import math
from dataclasses import dataclass, replace

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tconv3d
from tconv3d.geometry import check_conv3d, check_input_grad, triple
from tconv3d.kernels import conv_dgrad, conv_fwd
from tconv3d.kernels.config import GROUPED_TAP_COLUMNS, KernelConfig, half_tail, wgrad_half_tails
from tconv3d.testing import reference_conv3d
from tconv3d.tune.configs import with_gluon

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def swapped_tiles(config: KernelConfig) -> KernelConfig:
    """A Gluon forward's or input gradient's `config` with its operands swapped (swap_ab): the columns on the
    wgmma's M, so at least 16 a warp (configs.gluon_takes says whether the kernel takes the result: not past 256
    voxels)."""
    return replace(config, swap_ab=1, block_n=max(config.block_n, 16 * config.num_warps))


def grouped_taps(config: KernelConfig, group: int) -> KernelConfig:
    """A weight gradient's `config` on the warp-specialized Gluon kernel with `group` taps a tile (tap_group), each
    tap's input channels as many as before where the kernel takes that: at least GROUPED_TAP_COLUMNS (whole
    swizzle rows), at most 256 columns in all."""
    per_tap = max(GROUPED_TAP_COLUMNS, min(config.block_n, 256 // group))
    return replace(config, gluon=2, tap_group=group, block_n=per_tap * group)


def swapped_weight_grad_tiles(config: KernelConfig, group: int, per_tap: int = 32) -> KernelConfig:
    """A weight gradient's `config` on the warp-specialized Gluon kernel transposed (swap_ab): `group` taps (1, 2 or
    4) on the wgmma's rows, 64 input channels for one, `per_tap` (32 or 16: whole swizzle rows of 64 or 32 bytes)
    for 2 or 4, on as many warps as the rows take (16 a warp, a warpgroup at least); the output channels as before
    on its columns."""
    per_tap = max(per_tap, 64 // group)
    rows = per_tap * group
    warps = max(rows // 16, 4)
    return replace(config, gluon=2, swap_ab=1, tap_group=group if group > 1 else 0, block_n=rows, num_warps=warps)


# The transposed weight gradient's tests run 4 taps of 32 channels a tile (unet_32's twin) on every TMA case; 1 and
# 2 taps, and 4 of 16 channels (MONAI UNet's 16-channel level: 32-byte swizzle rows) on these: a phase view,
# dilation, 70 taps, a strided and dilated box.
SWAPPED_WGRAD_FEW_TAPS_CASES = ("stride_1_2_2_c8", "dilation2_c8", "kernel_7x2x5_c8", "stride_w_dilated")


def swapped_weight_grad_params(cases: list) -> list[tuple[int, int, int]]:
    """(index into `cases`, taps a tile, channels a tap) for the transposed weight gradient's tests."""
    few = [i for i, case in enumerate(cases) if case.name in SWAPPED_WGRAD_FEW_TAPS_CASES]
    assert len(few) == len(SWAPPED_WGRAD_FEW_TAPS_CASES), "a case named here left the TMA cases"
    return [(i, 4, 32) for i in range(len(cases))] + [(i, g, c) for g, c in ((1, 64), (2, 32), (4, 16)) for i in few]


def leaf_copy(t: torch.Tensor) -> torch.Tensor:
    """A detached copy of `t` that collects its own gradient."""
    return t.detach().clone().requires_grad_()


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    cin: int
    cout: int
    size: tuple
    kernel: object
    stride: object = 1
    padding: object = 0
    dilation: object = 1

    def input(self, dtype, device, memory_format=torch.channels_last_3d):
        x = torch.randn(self.batch, self.cin, *self.size, device=device).to(dtype)
        return x.contiguous(memory_format=memory_format)

    def weight(self, dtype, device):
        kernel = triple(self.kernel, "kernel")
        fan_in = self.cin * kernel[0] * kernel[1] * kernel[2]
        w = torch.randn(self.cout, self.cin, *kernel, device=device) / fan_in**0.5
        return w.to(dtype).contiguous(memory_format=torch.channels_last_3d)

    def bias(self, dtype, device):
        return torch.randn(self.cout, device=device).to(dtype)


# Odd sizes on purpose: channels 3 and 17, spatial sizes that no tile divides.
CASES = [
    Case("odd_channels_3x3x3", 2, 3, 17, (5, 7, 9), 3, padding=1),
    Case("cin17", 1, 17, 5, (5, 6, 7), 3, padding=1),
    Case("stride2", 2, 4, 6, (7, 6, 9), 3, stride=2, padding=1),
    Case("stride_1_2_2", 1, 5, 8, (5, 9, 8), 3, stride=(1, 2, 2), padding=1),
    Case("dilation2", 1, 4, 5, (7, 7, 8), 3, padding=2, dilation=2),
    Case("kernel_1x3x3", 2, 6, 7, (4, 9, 7), (1, 3, 3), padding=(0, 1, 1)),
    Case("kernel_3x1x1", 1, 6, 5, (7, 5, 6), (3, 1, 1), padding=(1, 0, 0)),
    Case("kernel_1x1x1", 2, 9, 12, (3, 5, 7), 1),
    Case("causal_6pad", 1, 5, 6, (5, 6, 7), 3, padding=(2, 0, 1, 1, 1, 1)),
    Case("same_even_kernel", 1, 3, 4, (5, 6, 7), (2, 3, 4), padding="same"),
    Case("valid", 1, 4, 3, (5, 6, 7), 3, padding="valid"),
    Case("kernel_7x2x5", 1, 2, 3, (8, 5, 9), (7, 2, 5), padding=(3, 0, 2)),
    Case("stride_above_kernel", 1, 3, 4, (7, 8, 9), (1, 2, 2), stride=(2, 3, 3)),  # phases no tap reaches
    Case("mixed_stride_dilation_asym", 1, 3, 5, (9, 8, 10), (2, 3, 4), (2, 3, 2), (0, 1, 2, 0, 1, 3), (2, 1, 1)),
]


def case_reference(x, w, b, case: Case) -> torch.Tensor:
    return reference_conv3d(x, w, b, case.stride, case.padding, case.dilation)


def hw_bordered_reference(source, weight, bias, modes) -> torch.Tensor:
    """F.conv3d in float64 of `source` padded by 1 in H and W in `modes` (H's, W's: "zeros", "replicate",
    "reflect", "circular") and by 1 zero along D (the halo tiles' layers)."""
    source = source.double()
    for pad, mode in (((0, 0, 1, 1, 0, 0), modes[0]), ((1, 1, 0, 0, 0, 0), modes[1])):
        source = torch.nn.functional.pad(source, pad, mode="constant" if mode == "zeros" else mode)
    return torch.nn.functional.conv3d(source, weight.double(), bias.double(), padding=(1, 0, 0))


def outputs_and_grads(fn, tensors) -> list:
    """[fn(*leaves), *their gradients] under y.square().sum(), on fresh leaf copies of `tensors`."""
    leaves = [leaf_copy(t) for t in tensors]
    y = fn(*leaves)
    y.square().sum().backward()
    return [y, *(t.grad for t in leaves)]


def second_order_with_two_sources(conv, x, second, w):
    """The second-order gradients of conv(x, second, w) (a convolution reading a second source: frames_before,
    channels_after) in x, second and w: first-order gradients under a fixed upstream gradient, with create_graph,
    then fixed linear functionals of them (the weight's squared), back to the three."""
    y = conv(x, second, w)
    grad_out = torch.ones_like(y).cumsum(-1) / y.shape[-1]  # fixed, so both sides see the same one
    grads = torch.autograd.grad((y * grad_out).sum(), (x, second, w), create_graph=True)
    dots = [(g * torch.linspace(-1, 1, g.numel(), dtype=g.dtype, device=g.device).view_as(g)).sum() for g in grads]
    return torch.autograd.grad(dots[0] + dots[1] + grads[2].square().sum(), (x, second, w))


def poison_aten_convolution(monkeypatch):
    """Make every aten convolution entry (and tconv3d's aten fallback) raise."""

    def poisoned(*args, **kwargs):
        raise AssertionError("aten convolution was called")

    for name in ("conv3d", "convolution"):
        monkeypatch.setattr(torch.nn.functional, name, poisoned, raising=False)
    for name in ("conv3d_input", "conv3d_weight"):
        monkeypatch.setattr(torch.nn.grad, name, poisoned)
    for name in ("conv3d_fwd", "conv3d_dgrad", "conv3d_wgrad"):
        monkeypatch.setattr(tconv3d.kernels.aten, name, poisoned)


def count_launches(monkeypatch, launcher: str) -> list:
    """Wrap one of tconv3d.ops' Triton launchers; the returned list grows by one per launch."""
    launches = []
    real = getattr(tconv3d.ops, launcher)
    monkeypatch.setattr(tconv3d.ops, launcher, lambda *args: launches.append(launcher) or real(*args))
    return launches


def conv_and_reference(case: Case, dtype, device, memory_format=torch.channels_last_3d, bias=True):
    """tconv3d's [y, dx, dw, db] and float64 autograd's, under one random upstream gradient (db left out without
    a bias)."""
    x = leaf_copy(case.input(dtype, device, memory_format))
    w = leaf_copy(case.weight(dtype, device))
    b = leaf_copy(case.bias(dtype, device)) if bias else None
    x64, w64 = leaf_copy(x.double()), leaf_copy(w.double())
    b64 = leaf_copy(b.double()) if bias else None
    ref = case_reference(x64, w64, b64, case)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y = tconv3d.conv3d(x, w, b, case.stride, case.padding, case.dilation)
    y.backward(grad_out.to(dtype))
    ours = [y, x.grad, w.grad] + ([b.grad] if bias else [])
    expected = [ref, x64.grad, w64.grad] + ([b64.grad] if bias else [])
    return ours, expected


class TinyUNet(torch.nn.Module):
    """A 3D UNet in miniature, stock torch modules to convert: conv + GroupNorm + SiLU blocks, a stride-2 down
    conv, a transposed up conv, a skip connection and a 1x1x1 head. `checkpointed` runs the two conv blocks under
    non-reentrant activation checkpointing."""

    def __init__(self, channels: int = 3, width: int = 8, checkpointed: bool = False):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv3d(channels, width, 3, padding=1), nn.GroupNorm(4, width), nn.SiLU())
        self.down = nn.Sequential(
            nn.Conv3d(width, 2 * width, 3, stride=2, padding=1), nn.GroupNorm(4, 2 * width), nn.SiLU()
        )
        self.up = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.head = nn.Conv3d(width, channels, 1)
        self.checkpointed = checkpointed

    def _block(self, block, x):
        if self.checkpointed:
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return block(x)

    def forward(self, x):
        skip = self._block(self.stem, x)
        return self.head(self.up(self._block(self.down, skip)) + skip)


def unet_batch(batch: int, channels: int = 3, size=(4, 6, 6), seed: int = 1):
    """Inputs and targets for TinyUNet: channels_last_3d, from their own generator (the same on every rank)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *size, generator=generator).contiguous(memory_format=torch.channels_last_3d)
    target = torch.randn(batch, channels, *size, generator=generator)
    return x, target


def train_unet(model, x, target, steps: int = 3, lr: float = 0.1, optimizer=None) -> list[float]:
    """`steps` steps of `optimizer` (SGD at `lr` if None) on the mean squared error; the losses."""
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def memory_order(t: torch.Tensor) -> tuple:
    """The strides that order a tensor's elements in memory (those of its dims of more than one element)."""
    return tuple(stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 1)


class OpNames(TorchDispatchMode):
    """The names of the ops dispatched while it is active, in order."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


class OpsMade(OpNames):
    """OpNames, and what each op returned: `made`, (op, shape) for each tensor (an in-place op's too: the tensor
    it was handed)."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.append((func, tuple(t.shape)))
        return out

    @property
    def shapes(self) -> set:
        """The shapes of every tensor the ops returned."""
        return {shape for _, shape in self.made}

    def fresh(self) -> list:
        """The shapes of the tensors ops made (not those in-place ops wrote into)."""
        return [shape for func, shape in self.made if not func._schema.is_mutable]

    def copied(self) -> list:
        """The sizes (elements) of what each aten copy_ wrote."""
        return [math.prod(shape) for func, shape in self.made if func is torch.ops.aten.copy_.default]


# Gluon tiles whose last row or column block is half full over 192 -> 192 channels (half_tail, wgrad_half_tails):
# (direction, block_m, block_n, block_k, warps, stages, swapped, split).
HALF_TAIL_TILES = {
    "fwd_128x128": ("fwd", 128, 128, 64, 8, 3, 0, 1),
    "fwd_256x128_swapped": ("fwd", 256, 128, 64, 8, 3, 1, 1),
    "fwd_256x128_swapped_split3": ("fwd", 256, 128, 64, 8, 2, 1, 3),
    "fwd_128x128_w4_swapped": ("fwd", 128, 128, 64, 4, 3, 1, 1),
    "dgrad_128x128": ("dgrad", 128, 128, 64, 8, 3, 0, 1),
    "dgrad_256x128_swapped": ("dgrad", 256, 128, 64, 8, 3, 1, 1),
    "dgrad_256x128_swapped_split3": ("dgrad", 256, 128, 64, 8, 2, 1, 3),
    "dgrad_128x128_w4_swapped": ("dgrad", 128, 128, 64, 4, 3, 1, 1),
    "wgrad_128x128_split2": ("wgrad", 128, 128, 64, 8, 3, 0, 2),
    "wgrad_128x128_w4": ("wgrad", 128, 128, 64, 4, 3, 0, 1),
}


def half_tail_conv(tile: tuple, gluon: int, device, dtype=torch.bfloat16):
    """(run, expected) of a (1, 3, 3) convolution of 192 -> 192 channels in `tile`'s direction on the Gluon kernel
    (`gluon` 1 pipelined, 2 warp-specialized; the weight gradient warp-specialized always), in 128-row and
    -column blocks whose last is half full: run() launches it and returns the result; expected is float64."""
    from tconv3d.geometry import check_conv3d
    from tconv3d.inspect import compile as static_compile
    from tconv3d.kernels import conv_dgrad, conv_fwd, conv_gluon, conv_wgrad
    from tconv3d.tune import configs

    direction, *dims, swap, split = tile
    cl = dict(device=device, dtype=dtype)
    x = torch.randn(1, 192, 2, 5, 19, **cl).contiguous(memory_format=torch.channels_last_3d)
    w = (torch.randn(192, 192, 1, 3, 3, **cl) / 40).contiguous(memory_format=torch.channels_last_3d)
    b = torch.randn(192, **cl)
    grad_out = torch.randn(x.shape, **cl).contiguous(memory_format=torch.channels_last_3d)
    geom = check_conv3d(x, w, b, [1] * 3, [0, 0, 1, 1, 1, 1], [1] * 3, 1)
    specialized = gluon == 2 or direction == "wgrad"
    config = replace(configs.with_gluon(KernelConfig(*dims, split_k=split), geom, direction, specialized), swap_ab=swap)
    assert configs.gluon_takes(config), config
    size, padding = x.element_size(), (0, 1, 1)
    # within an sm_90 block's shared memory (a split tile's epilogue is fp32: at 3 stages 256 x 128 x 64 asked the
    # H200 for 278,732 bytes of 232,448, run 4)
    shared = conv_gluon.persistent_shared_bytes(config, size, direction == "wgrad")
    assert shared <= static_compile.ARCHS[90].smem_per_block, (config, shared)
    if direction == "wgrad":
        assert wgrad_half_tails(config, 192, 192, size) == (True, True)
        expected = torch.nn.grad.conv3d_weight(x.double(), w.shape, grad_out.double(), padding=padding)
        return (lambda: conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, config)), expected
    assert half_tail(config, 192, size) and not half_tail(config, 256, size) and not half_tail(config, 224, size)
    if direction == "fwd":
        expected = torch.nn.functional.conv3d(x.double(), w.double(), b.double(), padding=padding)
        return (lambda: conv_fwd.conv3d_fwd(x, w, b, None, geom, config)), expected
    expected = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), padding=padding)
    return (lambda: conv_dgrad.conv3d_dgrad(grad_out, w, geom, config)), expected


def second_source_split(source: str, config: KernelConfig, device="cpu"):
    """A forward reading frames_before or channels_after, or an input gradient reading channels_after after
    grad_out's (a stride-2 transposed conv of a concatenation), at `config` (with_gluon'd to the problem) with its
    reduction split: tconv3d's result, float64's, the config launched."""

    def bf16(*shape):
        return torch.randn(*shape, device=device).to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)

    x, other = bf16(1, 16, 3, 5, 6), bf16(1, 16, 2, 5, 6) if source == "frames_before" else bf16(1, 16, 3, 5, 6)
    if source == "out_after":  # the transposed conv's weight, as the conv it transposes holds it: (32, 24, k)
        w = bf16(32, 24, 3, 3, 3)
        geom = check_input_grad(x, w, (1, 24, 6, 10, 12), [2] * 3, [1] * 6, [1] * 3, channels_after=other)
        config = with_gluon(config, geom, "dgrad", specialized=config.gluon == 2)
        got = conv_dgrad.conv3d_dgrad(x, w, geom, config, channels_after=other)
        want = torch.nn.functional.conv_transpose3d(
            torch.cat([x, other], 1).double(), w.double(), stride=2, padding=1, output_padding=1
        )  # fmt: skip
        return got, want, config
    w = bf16(24, 32 if source == "channels_after" else 16, 3, 3, 3)
    sources = {source: other}
    geom = check_conv3d(x, w, None, [1] * 3, (0, 0, 1, 1, 1, 1) if source == "frames_before" else [1] * 6,
                        [1] * 3, 1, **sources)  # fmt: skip
    config = with_gluon(config, geom, "fwd", specialized=config.gluon == 2)
    frames = other if source == "frames_before" else None
    got = conv_fwd.conv3d_fwd(x, w, None, frames, geom, config, channels_after=sources.get("channels_after"))
    if source == "frames_before":
        want = torch.nn.functional.conv3d(torch.cat([other, x], 2).double(), w.double(), padding=(0, 1, 1))
    else:
        want = torch.nn.functional.conv3d(torch.cat([x, other], 1).double(), w.double(), padding=1)
    return got, want, config
