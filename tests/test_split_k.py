"""Split-K in the forward and input gradient (issue 28: grids that fill the machine): a small-volume layer's
reduction (taps x channels) divided between programs, each writing an fp32 partial that split_k.sum_splits adds in
a fixed order. Every case through the pointer and TMA kernels against float64 (bias, strides whose phases have
different live taps, packed small channels, groups, padding modes), splits that do not divide the steps, more
splits asked for than there are steps, bitwise determinism; and the heuristic splitting only where the tiles
leave SMs idle."""

import dataclasses

import pytest
import torch
from helpers import CASES, Case, conv_and_reference, dtype_id, leaf_copy

import tconv3d
from tconv3d import settings
from tconv3d.kernels import conv_dgrad, conv_fwd, split_k
from tconv3d.kernels.config import KernelConfig, k_splits, live_taps, reduction_steps
from tconv3d.testing import rel_l2, tolerance
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import load_shape_set


def _round8(c: int) -> int:
    return -(-c // 8) * 8


@pytest.fixture
def forced(monkeypatch):
    """force(config, kernels="pointer"): every launch runs `config` (as TCONV3D_KERNELS=kernels would make it);
    returns the list of directions whose launch summed splits."""
    summed = []

    def force(config: KernelConfig, kernels: str = "pointer"):
        monkeypatch.setattr(settings, "KERNELS", kernels)
        monkeypatch.setattr(choice, "_memo", {})
        monkeypatch.setattr(
            choice,
            "_select",
            lambda direction, geom, dtype, device, run: choice.force_variant(direction, geom, dtype, config, kernels),
        )
        for module, name in ((conv_fwd, "fwd"), (conv_dgrad, "dgrad")):
            monkeypatch.setattr(
                module, "sum_splits", lambda p, o, name=name: summed.append(name) or split_k.sum_splits(p, o)
            )
        return summed

    return force


# 16-wide tiles and 16-deep steps, so that even these small problems have several steps to split.
TILES = KernelConfig(32, 16, 16, 4, 2, group_m=2)


def _splits(direction: str, case: Case, config: KernelConfig) -> int:
    geom = tconv3d.geometry.conv_geometry(
        (case.batch, case.cin, *case.size), (case.cout, case.cin, *tconv3d.geometry.triple(case.kernel, "kernel")),
        case.stride, case.padding, case.dilation,
    )  # fmt: skip
    return k_splits(direction, geom, config)[1]


# The Cin = 3 stem case aside: the slowest under the interpreter, and same_even_kernel and kernel_7x2x5 split packed
# (tap, channel) steps of 2-3 channels too.
POINTER_CASES = [case for case in CASES if case.name != "odd_channels_3x3x3"]


@pytest.mark.parametrize("case", POINTER_CASES, ids=lambda c: c.name)
def test_pointer_split_k_matches_float64(case, forced, device):
    config = dataclasses.replace(TILES, split_k=3)
    summed = forced(config)
    ours, expected = conv_and_reference(case, torch.float32, device)
    for got, want in zip(ours, expected, strict=True):  # output (bias in split 0 only), input, weight, bias grads
        assert rel_l2(got, want) < tolerance(torch.float32)
    # Every direction with more than one step split (not 1x1x1 with 9 channels, one step, nor the packed
    # directions with a few taps of a few channels).
    assert summed == [d for d in ("fwd", "dgrad") if _splits(d, case, config) > 1]


def test_most_cases_split():
    config = dataclasses.replace(TILES, split_k=3)
    assert sum(_splits("fwd", case, config) == 3 for case in CASES) >= 10
    assert sum(_splits("dgrad", case, config) == 3 for case in CASES) >= 8


# Dilation, asymmetric padding, and stride 2 (the input gradient's phases have 1 to 8 live taps of 27, so its
# later splits of the idler phases sum nothing) (tests/test_tma.py runs the TMA kernel on every case unsplit).
TMA_CASES = [
    (dataclasses.replace(case, name=case.name + "_c8", cin=_round8(case.cin), cout=_round8(case.cout)), dtype)
    for case in CASES
    for name, dtype in (("dilation2", torch.bfloat16), ("causal_6pad", torch.float32), ("stride2", torch.bfloat16))
    if case.name == name
]


@pytest.mark.parametrize("case, dtype", TMA_CASES, ids=lambda c: getattr(c, "name", str(c)))
def test_tma_split_k_matches_float64(case, dtype, forced, device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    summed = forced(dataclasses.replace(TILES, split_k=3), kernels="tma")
    ours, expected = conv_and_reference(case, dtype, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(dtype)
    assert "fwd" in summed and "dgrad" in summed


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(padding=1, padding_mode="replicate"),
        dict(padding=1, padding_mode="circular", groups=2),
        dict(padding=(2, 0, 1, 1, 1, 1), frames_before=2),
    ],
    ids=["replicate", "circular_groups", "frames_before"],
)
def test_split_k_with_borders_groups_and_cached_frames(kwargs, forced, device):
    kwargs = dict(kwargs)
    summed = forced(dataclasses.replace(TILES, split_k=4))
    groups = kwargs.pop("groups", 1)
    prefix = kwargs.pop("frames_before", 0)
    x = leaf_copy(torch.randn(2, 8, 4, 5, 6, device=device).contiguous(memory_format=torch.channels_last_3d))
    w = leaf_copy(torch.randn(6, 8 // groups, 3, 3, 3, device=device) / 12)
    b = leaf_copy(torch.randn(6, device=device))
    before = torch.randn(2, 8, prefix, 5, 6, device=device) if prefix else None
    y = tconv3d.conv3d(x, w, b, groups=groups, frames_before=before, **kwargs)
    grad = torch.randn_like(y)
    y.backward(grad)
    x64, w64, b64 = (leaf_copy(t.detach().double()) for t in (x, w, b))
    source = torch.cat([before.double(), x64], dim=2) if prefix else x64
    mode = kwargs.get("padding_mode", "zeros")
    pad = kwargs["padding"]
    pad = (pad,) * 6 if isinstance(pad, int) else pad
    # F.pad orders the borders last dimension first.
    padded = torch.nn.functional.pad(source, (pad[4], pad[5], pad[2], pad[3], pad[0], pad[1]),
                                     mode="constant" if mode == "zeros" else mode)  # fmt: skip
    ref = torch.nn.functional.conv3d(padded, w64, b64, groups=groups)
    ref.backward(grad.double())
    for got, want in ((y, ref), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(got, want) < tolerance(torch.float32)
    assert "fwd" in summed and "dgrad" in summed


def test_more_splits_than_steps_and_uneven_splits(forced, device):
    case = Case("few_steps", 1, 16, 17, (3, 4, 5), 3, padding=1)  # 27 steps: a tap of 16 channels each
    geom = tconv3d.geometry.conv_geometry((1, 16, 3, 4, 5), (17, 16, 3, 3, 3), 1, 1, 1)
    many = dataclasses.replace(TILES, split_k=64)
    assert k_splits("fwd", geom, many) == (1, 27)  # one step each: never an empty split
    assert k_splits("fwd", geom, dataclasses.replace(TILES, split_k=4)) == (7, 4)  # 7 + 7 + 7 + 6
    # 5 output channels: the W taps are columns (config.w_tap_columns), 9 (kd, kh) steps
    few_out = tconv3d.geometry.conv_geometry((1, 16, 3, 4, 5), (5, 16, 3, 3, 3), 1, 1, 1)
    assert k_splits("fwd", few_out, many) == (1, 9)
    summed = forced(many)
    ours, expected = conv_and_reference(case, torch.float32, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.float32)
    assert "fwd" in summed


def test_split_k_is_bitwise_deterministic(forced, device):
    forced(dataclasses.replace(TILES, split_k=3))
    case = Case("small", 2, 16, 8, (3, 4, 5), 3, padding=1)
    first, _ = conv_and_reference(case, torch.bfloat16, device)
    torch.manual_seed(0)
    second, _ = conv_and_reference(case, torch.bfloat16, device)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kernel, stride, padding, dilation",
    [((3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)), ((4, 2, 5), (2, 3, 2), (0, 1, 2), (1, 1, 2)),
     ((1, 2, 2), (2, 3, 3), (0, 0, 0), (1, 1, 1))],
)  # fmt: skip
def test_input_gradient_steps_are_the_busiest_phase(kernel, stride, padding, dilation):
    """reduction_steps counts the phase with the most live taps: the splits must cover its whole reduction."""
    geom = tconv3d.geometry.conv_geometry((1, 20, 9, 9, 9), (24, 20, *kernel), stride, padding, dilation)
    brute = 0
    for phase in range(stride[0] * stride[1] * stride[2]):
        residues = (phase // (stride[1] * stride[2]), (phase // stride[2]) % stride[1], phase % stride[2])
        count = 1
        for dim, r in enumerate(residues):
            count *= sum((r + padding[dim] - t * dilation[dim]) % stride[dim] == 0 for t in range(kernel[dim]))
        brute = max(brute, count)
    phases = live_taps(tuple(kernel), tuple(stride), tuple(padding), tuple(dilation))
    assert len(phases) == stride[0] * stride[1] * stride[2]
    assert reduction_steps("dgrad", geom, TILES) == brute * 2  # 24 output channels: two 16-deep blocks per tap


def test_heuristic_splits_only_small_grids(monkeypatch):
    """On 132 SMs: unet_320 (48 tiles of 64x128) splits its forward and input gradient until about two programs
    per SM, each split keeping at least MIN_SPLIT_STEPS steps; the large layers do not split. Where this Triton has
    the Gluon kernel, on its one-warpgroup tiles (configs.small_grid_twin); with timed_only, or without it, the input
    gradient splits on the TMA kernel and the forward runs the pointer kernel (on the H200 the TMA one took 2x its
    time there)."""
    from tconv3d.kernels import conv_gluon

    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    for direction in ("fwd", "dgrad"):
        twin = configs.heuristic_config(direction, shapes["unet_320"].geometry(), torch.bfloat16, 132, 90)
        assert twin.split_k > 1 and (twin.gluon, twin.num_warps) == (2, 4)
        small = configs.heuristic_config(
            direction, shapes["unet_320"].geometry(), torch.bfloat16, 132, 90, timed_only=True
        )  # fmt: skip
        assert small.split_k > 1 and small.variant == ("pointer" if direction == "fwd" else "tma")
        geom = shapes["unet_320"].geometry()
        per_split, splits = k_splits(direction, geom, small)
        assert per_split >= configs.MIN_SPLIT_STEPS and 132 <= splits * 48 <= 4 * 132
        for name in ("wan_dec_384b", "hunyuan_128", "unet_32", "down_s2"):
            config = configs.heuristic_config(direction, shapes[name].geometry(), torch.bfloat16, 132, 90)
            assert config.split_k == 1, name


def test_tuner_offers_splits_only_where_tiles_are_few():
    smem = 227 * 1024
    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    small = configs.candidates("fwd", shapes["unet_320"].geometry(), torch.bfloat16, smem, tma=True)
    assert {c.split_k for c in small} == {1, 2, 4, 8, 16}
    assert {c.split_k for c in small if c.tma_box_w} == {1, 2, 4, 8, 16}
    large = configs.candidates("fwd", shapes["wan_dec_384b"].geometry(), torch.bfloat16, smem, tma=True)
    assert {c.split_k for c in large} == {1}


@pytest.mark.parametrize(
    ("shape", "dtype", "programs"),
    [((2, 8, 3, 4, 5), torch.bfloat16, 512), ((1, 200, 2, 3, 7), torch.float32, 3),
     ((3, 24, 5, 6, 7), torch.float16, 4), ((0, 16, 2, 3, 4), torch.bfloat16, 512)],
    ids=["one_program", "two_channel_blocks", "programs", "empty"],
)  # fmt: skip
@pytest.mark.parametrize("view", [False, True], ids=["dense", "view"])
def test_channel_sums_are_the_bias_gradient(shape, dtype, programs, view, device, monkeypatch):
    """split_k.channel_sums (a conv's bias gradient): the tensor summed over all but C, in fp32 and the given dtype,
    against float64: one program, 200 channels in two blocks of 128, the voxels split between programs (each a
    partial row, then sum_splits: the first program's sums alone fail it), an empty batch (zeros), and a view whose
    rows are not packed (made dense first)."""
    monkeypatch.setattr(split_k, "CHANNEL_SUM_PROGRAMS", programs)
    n, c, d, h, w = shape
    source = torch.randn(n, c + view, d, h, w + view, device=device) * 3 + 1  # a mean away from 0
    x = source.to(dtype).contiguous(memory_format=torch.channels_last_3d)[:, view:, :, :, view:]
    got = split_k.channel_sums(x, dtype)
    want = x.double().sum(dim=(0, 2, 3, 4))
    assert got.dtype == dtype and got.shape == (c,)
    if n == 0:
        assert not got.any()
    else:
        assert rel_l2(got, want) < tolerance(dtype)


@pytest.mark.parametrize("numel", [1, 5, 1023, 1027], ids=lambda n: f"numel_{n}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_sum_splits_with_a_second_output(numel, dtype, device):
    """sum_splits(partials, out, second): each split holds out's elements then second's, each summed over the
    splits in split order in fp32 and rounded once into its output, a block straddling the two where 2 * numel is
    not a multiple of the block: exactly the fp32 sums of a loop in that order, neither output's elements in the
    other's (a kernel that summed one split, or mixed the halves up, misses by far)."""
    partials = torch.randn(3, 2, numel, device=device) * 4 + 1
    out, second = (torch.full((numel,), float("nan"), device=device, dtype=dtype) for _ in range(2))
    split_k.sum_splits(partials, out, second)
    want = partials[0] + partials[1] + partials[2]
    assert torch.equal(out, want[0].to(dtype)) and torch.equal(second, want[1].to(dtype))
