"""Few channels: the kernels pack (tap, channel) pairs into the reduction (forward: Cin, input-grad: Cout) or
the columns (weight-grad: Cin) when there are fewer channels than one MMA step. Every direction against float64,
with the interpreter's tiles and with the tiles an H100 would launch, and the one-tap-per-step form kept honest
on the same geometries."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import CASES, Case, conv_and_reference, dtype_id, leaf_copy

import tconv3d
from tconv3d.geometry import check_conv3d, check_padding_mode, resolve_padding, split_padding_mode, triple
from tconv3d.kernels import config as kernel_config
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_wgrad, utils
from tconv3d.kernels.config import KernelConfig
from tconv3d.testing import TOLERANCE, rel_l2
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import load_shape_set

CL = torch.channels_last_3d

# Cin and Cout each take 1, 2, 3, 4 and 7; strides, paddings and dilations vary with them.
SMALL = [
    Case("cin1_cout4", 2, 1, 4, (5, 6, 7), 3, padding=1),
    Case("cin2_cout7_1x3x3_s2", 1, 2, 7, (4, 9, 8), (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1)),
    Case("cin3_cout3_dil2", 1, 3, 3, (7, 7, 8), 3, padding=2, dilation=(2, 1, 2)),
    Case("cin4_cout1_s2", 2, 4, 1, (7, 6, 9), 3, stride=2, padding=1),
    Case("cin7_cout2_causal", 1, 7, 2, (5, 6, 7), (3, 2, 3), padding=(2, 0, 1, 0, 1, 1)),
    Case("cin3_cout20", 1, 3, 20, (4, 6, 5), 3, padding=1),  # the stem: only forward and weight-grad pack
    # 45 taps: the forward's tap bits in int64 (at most 31 in int32); 64 taps: bounds per element again
    Case("cin2_cout5_3x3x5", 1, 2, 5, (4, 5, 7), (3, 3, 5), padding=(1, 1, 2)),
    Case("cin1_cout3_4x4x4", 1, 1, 3, (5, 5, 6), 4, padding=(2, 1, 1, 2, 2, 1)),
]


# Few output channels from many input channels (a decoder's conv to RGB, a UNet's head): the weight gradient's rows
# are (tap, output channel) pairs reduced over input voxels (config.packs_out_taps), their bounds a bit a tap,
# int64 past 31 taps; rows past 128 pairs take several row tiles (5 x 27 = 135), valid convolutions leave border
# voxels fewer taps.
FEW_OUT = [
    Case("cin16_cout3", 2, 16, 3, (4, 6, 5), 3, padding=1),
    Case("cin17_cout1_dil_asym", 1, 17, 1, (5, 7, 6), 3, padding=(1, 2, 0, 1, 2, 0), dilation=(1, 2, 1)),
    Case("cin20_cout5_3x3x5", 1, 20, 5, (4, 5, 7), (3, 3, 5), padding=(1, 1, 2)),
    Case("cin24_cout2_valid", 2, 24, 2, (5, 6, 7), (2, 3, 3)),
    Case("cin33_cout5_3x3x3", 1, 33, 5, (3, 5, 6), 3, padding=1),
    # a video VAE decoder's conv_out: the input gradient's 96 columns in one 128-wide tile (16 bits, GPU tiles)
    Case("cin96_cout3", 1, 96, 3, (3, 4, 6), 3, padding=1),
]


def packed_directions(case: Case, device) -> list[str]:
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    geom = check_conv3d(x, w, None, case.stride, case.padding, case.dilation, 1)
    return [d for d in kernel_config.DIRECTIONS if kernel_config.packs_taps(d, geom)]


@pytest.fixture
def one_tap_per_step(monkeypatch):
    """The kernels' form for many channels, whatever the channel count."""
    monkeypatch.setattr(kernel_config, "PACK_TAPS_BELOW", 1)
    monkeypatch.setattr(choice, "_memo", {})


@pytest.mark.parametrize("tiles", ["chosen", "gpu_heuristic_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_small_channels_match_float64(case, dtype, tiles, device, request):
    if tiles != "chosen":
        request.getfixturevalue(tiles)
    expected_packed = ["fwd", "wgrad"] if case.cout >= 16 else ["fwd", "dgrad", "wgrad"]
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    if kernel_config.packs_out_taps(check_conv3d(x, w, None, case.stride, case.padding, case.dilation, 1)):
        expected_packed.remove("wgrad")  # no more output channels than input ones: its output pairs pack instead
    assert packed_directions(case, device) == expected_packed
    ours, expected = conv_and_reference(case, dtype, device)
    for name, a, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert a.shape == e.shape and a.dtype == dtype, name
        assert rel_l2(a, e) < TOLERANCE[dtype], name


def test_packed_heuristic_tiles_reduce_over_pairs():
    """The stem's 27 x 3 pairs take six full 16-wide steps, not 27 each 3/16 full."""
    x, w = torch.empty(1, 3, 17, 64, 64, device="meta"), torch.empty(128, 3, 3, 3, 3, device="meta")
    geom = check_conv3d(x, w, None, 1, 1, 1, 1)
    fwd = configs.heuristic_config("fwd", geom, torch.bfloat16, 132)
    assert kernel_config.gemm_view("fwd", geom).reduction == 81 and fwd.block_k == 16
    wgrad_view = kernel_config.gemm_view("wgrad", geom)
    assert (wgrad_view.cols, wgrad_view.grid_taps) == (81, 1)
    assert configs.heuristic_config("wgrad", geom, torch.bfloat16, 132).block_n == 128
    one_tap = check_conv3d(x, torch.empty(128, 3, 1, 1, 1, device="meta"), None, 1, 0, 1, 1)
    assert not any(kernel_config.packs_taps(d, one_tap) for d in kernel_config.DIRECTIONS)  # nothing to pack


def test_packed_weight_gradient_splits_for_the_programs_its_registers_allow():
    """The packed columns' loops hold at least 128 registers a thread: their splits fill waves of at most 2 programs
    an SM on 8 warps (4 on 4), not the 8 their shared memory would allow. The stem (first_cin3) took 1786 splits
    of 39 steps and 71 MB of fp32 partial sums for a 41 KB gradient."""
    shapes = {s.name: s for name in ("bench", "stack") for s in load_shape_set(name)}
    for name, most in (("first_cin3", 2), ("stack_in8", 4)):
        geom = shapes[name].launched_geometry()
        config = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
        view = kernel_config.gemm_view("wgrad", geom)
        tiles = math.ceil(view.rows / config.block_m) * math.ceil(view.cols / config.block_n)
        assert kernel_config.packs_taps("wgrad", geom) and config.num_warps * most == 16, (name, config)
        programs = tiles * config.split_k
        assert programs <= 3 * most * 132, (name, config)  # a few waves at most programs an SM, not 13
        assert config.split_k * view.rows * view.cols * 4 < 16 * 2**20, (name, config)


def test_out_pairs_weight_gradient_splits_for_two_programs_an_sm_where_they_fit():
    """The out-pairs weight gradient's 128 x 64 tiles on 8 warps hold 94-128 registers a thread in 16 bits: its
    splits make one wave at two programs an SM (and two at one), where the 128 x 128 tiles (160-230 registers) keep
    one wave at one."""
    shapes = {s.name: s for name in ("bench", "stack") for s in load_shape_set(name)}
    for name, programs in (("stack_out8", 2 * 132), ("last_cout3", 132)):
        geom = shapes[name].launched_geometry()
        config = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
        view = kernel_config.gemm_view("wgrad", geom)
        assert kernel_config.packs_out_taps(geom) and config.num_warps == 8, (name, config)
        tiles = math.ceil(view.rows / config.block_m) * math.ceil(view.cols / config.block_n)
        assert tiles * config.split_k == programs, (name, config)


def test_packed_weight_gradients_stay_packed_on_sm90():
    """An 8-channel input (the stack's first layer) is TMA-aligned, but its weight gradient's packed tiles are the
    pointer kernel's: (tap, channel) pairs as columns, 216 of 2 x 128 for 27 x 8. On a box kernel they would be one
    tap's 8 channels in 128 columns, 27 programs a tile."""
    x, w = torch.empty(4, 8, 64, 256, 256, device="meta"), torch.empty(64, 8, 3, 3, 3, device="meta")
    geom = check_conv3d(x, w, None, 1, 1, 1, 1)
    for dtype in (torch.bfloat16, torch.float32):
        wgrad = configs.heuristic_config("wgrad", geom, dtype, 132, 90)
        view = kernel_config.gemm_view("wgrad", geom)
        assert (wgrad.variant, view.cols, view.grid_taps) == ("pointer", 216, 1)
        assert wgrad.block_n == 128 and wgrad.split_k > 1
    assert configs.tma_eligible("wgrad", geom, torch.bfloat16)  # the box kernels could run it, at 16x the work
    wide = check_conv3d(torch.empty(4, 16, 64, 256, 256, device="meta"), torch.empty(64, 16, 3, 3, 3, device="meta"),
                        None, 1, 1, 1, 1)  # fmt: skip
    assert configs.heuristic_config("wgrad", wide, torch.bfloat16, 132, 90).variant != "pointer"  # one tap: a box


@pytest.mark.parametrize("case", [c for c in SMALL + CASES if min(c.cin, c.cout) < 16], ids=lambda c: c.name)
def test_one_tap_per_step_on_the_same_geometries(case, one_tap_per_step, device):
    assert packed_directions(case, device) == []
    ours, expected = conv_and_reference(case, torch.float32, device)
    for name, a, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("tiles", ["chosen", "gpu_heuristic_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", FEW_OUT, ids=lambda c: c.name)
def test_few_output_channels_match_float64(case, dtype, tiles, device, request, monkeypatch):
    """Every direction against float64, the forward with its W taps as columns, the weight gradient on the
    out-pairs kernel (and nothing else)."""
    if tiles != "chosen":
        request.getfixturevalue(tiles)
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    geom = check_conv3d(x, w, None, case.stride, case.padding, case.dilation, 1)
    assert kernel_config.packs_out_taps(geom) and packed_directions(case, device) == ["dgrad"]
    launched, real_launch = [], conv_wgrad.launch
    monkeypatch.setattr(
        conv_wgrad, "launch", lambda kernel, *a, **k: launched.append(kernel) or real_launch(kernel, *a, **k)
    )
    w_taps = launched_w_taps(monkeypatch, conv_fwd)
    # (a one-channel bias gradient is one sum of rounded values whose cancellation no relative tolerance bounds)
    ours, expected = conv_and_reference(case, dtype, device, bias=case.cout > 1)
    for name, a, e in zip(
        ("output", "input grad", "weight grad", "bias grad")[: len(ours)], ours, expected, strict=True
    ):
        assert a.shape == e.shape and a.dtype == dtype, name
        assert rel_l2(a, e) < TOLERANCE[dtype], name
    assert launched == [conv_wgrad._conv3d_wgrad_out_pairs_kernel], launched
    assert w_taps == [kernel_config.w_tap_columns("fwd", geom)] and w_taps[0] >= triple(case.kernel, "kernel")[2], (
        w_taps
    )


def padded_reference(x, w, b, padding_mode, stride, padding, dilation, groups):
    """F.conv3d of x padded along each dimension by its mode (F.pad), unpadded."""
    stride, dilation = triple(stride, "stride"), triple(dilation, "dilation")
    pads = resolve_padding(padding, w.shape[2:], stride, dilation)
    for dim, mode in enumerate(split_padding_mode(check_padding_mode(padding_mode))):
        six = [0] * 6
        six[4 - 2 * dim : 6 - 2 * dim] = pads[2 * dim : 2 * dim + 2]  # F.pad's pairs run W, H, D
        x = F.pad(x, six, mode="constant" if mode == "zeros" else mode)
    return F.conv3d(x, w, b, stride, 0, dilation, groups)


def launched_w_taps(monkeypatch, module) -> list:
    """The W_TAPS of each pointer forward (module conv_fwd) or input gradient (conv_dgrad) launched from now on (0: one
    tap a step)."""
    seen, real_launch = [], module.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append(kwargs["W_TAPS"])
        return real_launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(module, "launch", spy)
    return seen


# The forward and input gradient with their W taps as columns (config.w_tap_columns) under what else their one-tap
# loops read: border modes (remapped rows, W's included: an extended row's voxels past the edge; the input gradient's
# bordered input, folded), cached frames in front along D, a channel concatenation read in place, groups, strides in
# D and H (the forward), asymmetric padding, a dilated W reaching the most rows (halo 8 of a 16-row tile), and, with
# 16 x 16 x 16 tiles, 4 channels a column tile (two for 5) and three reduction splits. The forward's cases have few
# output channels, the input gradient's few input channels.
W_TAPS = [
    dict(name="replicate", cin=16, cout=3, kernel=3, padding=1, padding_mode="replicate"),
    dict(
        name="reflect_w",
        cin=18,
        cout=2,
        kernel=(3, 3, 5),
        padding=(1, 0, 2),
        padding_mode=("zeros", "zeros", "reflect"),
    ),
    dict(name="circular_hw", cin=16, cout=5, kernel=3, padding=1, padding_mode=("zeros", "circular", "circular")),
    dict(name="frames_before", cin=17, cout=3, kernel=3, padding=(0, 0, 1, 1, 1, 1), frames=2),
    dict(name="channels_after", cin=16, cout=3, kernel=3, padding=1, after=8),
    dict(name="groups2", cin=2 * 17, cout=2 * 3, kernel=3, padding=1, groups=2),
    dict(name="stride_2_2_1", cin=16, cout=5, kernel=3, padding=1, stride=(2, 2, 1)),
    dict(name="dilation_w4", cin=20, cout=1, kernel=(1, 3, 3), padding=(0, 1, 4), dilation=(1, 1, 4)),
]
W_TAPS_DGRAD = [
    dict(name="dgrad_replicate", cin=3, cout=16, kernel=3, padding=1, padding_mode="replicate"),
    dict(
        name="dgrad_reflect_w",
        cin=5,
        cout=17,
        kernel=(3, 3, 5),
        padding=(1, 0, 2),
        padding_mode=("zeros", "zeros", "reflect"),
    ),
    dict(name="dgrad_frames_before", cin=4, cout=16, kernel=3, padding=(0, 0, 1, 1, 1, 1), frames=2),
    dict(name="dgrad_channels_after", cin=6, cout=16, kernel=3, padding=1, after=2),
    dict(name="dgrad_groups2", cin=2 * 3, cout=2 * 16, kernel=3, padding=1, groups=2),
    dict(name="dgrad_same_2x3x4", cin=3, cout=16, kernel=(2, 3, 4), padding="same"),
    dict(name="dgrad_dilation_w4", cin=2, cout=20, kernel=(1, 3, 3), padding=(0, 1, 4), dilation=(1, 1, 4)),
    # a power of two input channels a group: each tap's channels one run of the weight's row (conv_dgrad's W_CIN)
    dict(name="dgrad_cin8", cin=8, cout=16, kernel=3, padding=1),
    dict(name="dgrad_groups2_cin4", cin=2 * 4, cout=2 * 16, kernel=3, padding=1, groups=2),
]


@pytest.mark.parametrize("tiles", ["chosen", "small_tiles", "gpu_heuristic_tiles"])
@pytest.mark.parametrize("spec", W_TAPS + W_TAPS_DGRAD, ids=lambda s: s["name"])
def test_w_taps_match_float64(spec, tiles, device, request, monkeypatch):
    """The output (the forward's cases) or the gradients of every input source (the input gradient's) against
    float64, and the launches with W_TAPS. The tiles are forced on the launch under test only: an input gradient
    case's forward runs on the chosen tiles."""
    torch.manual_seed(7)
    dgrad = spec["name"].startswith("dgrad")
    if tiles != "chosen" and not dgrad:
        request.getfixturevalue(tiles)
    cin, cout, groups = spec["cin"], spec["cout"], spec.get("groups", 1)
    kernel, after, frames = triple(spec["kernel"], "kernel"), spec.get("after", 0), spec.get("frames", 0)

    def activation(channels, depth):
        return torch.randn(2, channels, depth, 6, 19, device=device).contiguous(memory_format=CL)

    sources = {"input": activation(cin - after, 4)}
    if frames:
        sources["frames_before"] = activation(cin, frames)
    if after:
        sources["channels_after"] = activation(after, 4)
    for t in sources.values():
        t.requires_grad_(dgrad)
    w = (torch.randn(cout, cin // groups, *kernel, device=device) / 4).contiguous(memory_format=CL)
    b = torch.randn(cout, device=device)
    args = dict(stride=spec.get("stride", 1), padding=spec["padding"], dilation=spec.get("dilation", 1), groups=groups)
    mode = spec.get("padding_mode", "zeros")
    w_taps = launched_w_taps(monkeypatch, conv_dgrad if dgrad else conv_fwd)
    seconds = {name: t for name, t in sources.items() if name != "input"}
    y = tconv3d.conv3d(sources["input"], w, b, padding_mode=mode, **args, **seconds)
    # float64: the sources concatenated, then padded per dimension by its mode, then an unpadded convolution
    exact = {name: leaf_copy(t.detach().double()) if dgrad else t.double() for name, t in sources.items()}
    whole = exact["input"]
    if frames:
        whole = torch.cat([exact["frames_before"], whole], dim=2)
    if after:
        whole = torch.cat([whole, exact["channels_after"]], dim=1)
    ref = padded_reference(whole, w.double(), b.double(), mode, **args)
    assert y.shape == ref.shape and rel_l2(y, ref) < TOLERANCE[torch.float32]
    if dgrad:
        if tiles != "chosen":
            request.getfixturevalue(tiles)
        grad_out = torch.randn_like(ref)
        ours = torch.autograd.grad(y, list(sources.values()), grad_out.float())
        expected = torch.autograd.grad(ref, list(exact.values()), grad_out)
        for name, a, e in zip(sources, ours, expected, strict=True):
            assert rel_l2(a, e) < TOLERANCE[torch.float32], name
    assert w_taps and all(t >= kernel[2] for t in w_taps), w_taps


def test_few_output_channels_pack_where_the_kernel_can():
    """The out-pairs form takes unit-stride, zeros-bordered, one-source weight gradients of 2-63 taps and fewer than
    16 output channels, where the input channels are not packed; the view it reduces is the input's voxels."""
    x, w = torch.empty(1, 96, 17, 64, 64, device="meta"), torch.empty(3, 96, 3, 3, 3, device="meta")
    geom = check_conv3d(x, w, None, 1, 1, 1, 1)
    view = kernel_config.gemm_view("wgrad", geom)
    assert kernel_config.packs_out_taps(geom) and (view.rows, view.cols, view.grid_taps) == (81, 96, 1)
    assert view.reduction == geom.input_voxels
    assert kernel_config.gemm_view("wgrad", geom, box=True).rows == 3  # the box kernels take one tap a program
    wgrad = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
    assert (wgrad.variant, wgrad.block_m, wgrad.block_k) == ("pointer", 128, 32)
    assert 120 <= wgrad.split_k <= 132  # one 8-warp program an SM (its registers): a wave, as splits round
    assert configs.mma_fill("wgrad", geom, wgrad) > 0.45  # 81 / 128 x 96 / 128; one tap a program: 3 / 64 x 0.75
    not_packed = [
        check_conv3d(x, w, None, 2, 1, 1, 1),  # strided
        check_conv3d(x, torch.empty(16, 96, 3, 3, 3, device="meta"), None, 1, 1, 1, 1),  # 16 output channels
        check_conv3d(x, torch.empty(3, 96, 4, 4, 4, device="meta"), None, 1, 1, 1, 1),  # 64 taps
        check_conv3d(x, torch.empty(3, 96, 1, 1, 1, device="meta"), None, 1, 0, 1, 1),  # one tap
        check_conv3d(x, torch.empty(12, 8, 3, 3, 3, device="meta"), None, 1, 1, 1, 12),  # 8 in a group: columns pack
        dataclasses.replace(geom, padding_mode="replicate"),
    ]
    assert not any(kernel_config.packs_out_taps(g) for g in not_packed)


def test_few_channels_both_ways_pack_the_output_pairs_where_they_are_fewer():
    """A weight gradient of fewer than 16 input and output channels packs its (tap, output channel) pairs on the rows
    (packs_out_taps: x's rows loaded whole, go gathered) where the output channels are no more than the input ones,
    in one group: MONAI UNet's 3 -> 3 conv at 128^3 fills 81 / 128 x 3 / 16 of the MMA (12%) where its packed
    columns filled 3 / 64 x 81 / 128 (3%), on 2.5x fewer instructions a voxel (inspect, sm_90). More output channels
    than input ones (a stem, 1 -> 4), groups, strides: the packed columns as before."""
    x, w = torch.empty(1, 3, 128, 128, 128, device="meta"), torch.empty(3, 3, 3, 3, 3, device="meta")
    geom = check_conv3d(x, w, None, 1, 1, 1, 1)
    assert kernel_config.packs_out_taps(geom) and not kernel_config.packs_taps("wgrad", geom)
    assert kernel_config.packs_taps("fwd", geom) and kernel_config.packs_taps("dgrad", geom)
    wgrad = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
    assert (wgrad.variant, wgrad.block_m, wgrad.block_n) == ("pointer", 128, 16)
    assert configs.mma_fill("wgrad", geom, wgrad) == pytest.approx(81 / 128 * 3 / 16)
    stem = check_conv3d(torch.empty(1, 1, 8, 8, 8, device="meta"), torch.empty(4, 1, 3, 3, 3, device="meta"), None,
                        1, 1, 1, 1)  # fmt: skip
    grouped = check_conv3d(torch.empty(1, 8, 8, 8, 8, device="meta"), torch.empty(4, 4, 3, 3, 3, device="meta"), None,
                           1, 1, 1, 2)  # fmt: skip
    strided = check_conv3d(x, w, None, 2, 1, 1, 1)
    for other in (stem, grouped, strided):
        assert not kernel_config.packs_out_taps(other) and kernel_config.packs_taps("wgrad", other), other


@pytest.mark.parametrize("case", [SMALL[0], SMALL[2], SMALL[6], FEW_OUT[0]], ids=lambda c: c.name)
def test_gathers_either_way_match_float64(case, device, monkeypatch):
    """The packed loops' gathered tiles load transposed or not as the installed Triton lays its threads
    (utils.gather_tile): the other Triton's way, the GPU image's 3.6 under 3.9 and the reverse, computes the same.
    Through the interpreter only: a compiled kernel holds the module global it was compiled with, and Triton refuses
    a call after it changes (H100 run 14); CI runs this under both Tritons."""
    if device == "cuda":
        pytest.skip("compiled kernels keep the global they were compiled with; the interpreter's test covers both ways")
    monkeypatch.setattr(utils, "_TIES_TO_FIRST", not utils._TIES_TO_FIRST)
    monkeypatch.setattr(choice, "_memo", {})
    ours, expected = conv_and_reference(case, torch.float32, device)
    for name, a, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32], name


def test_w_taps_input_gradient_reads_a_dense_channels_last_weight():
    """conv_dgrad's W_CIN: the weight's strides come from its channels, so any other layout is refused, not read
    wrong."""
    weight = torch.randn(16, 8, 3, 3, 3).contiguous(memory_format=CL)
    assert conv_dgrad.dense_channels_last(weight) == 8
    for other in (weight.contiguous(), torch.randn(16, 16, 3, 3, 3).contiguous(memory_format=CL)[:, ::2]):
        with pytest.raises(ValueError, match="dense channels-last weight"):
            conv_dgrad.dense_channels_last(other)


@pytest.mark.parametrize("direction", ["fwd", "dgrad"])
def test_a_w_taps_tile_writes_only_the_outputs_it_holds(direction, monkeypatch, device):
    """A W_TAPS tile computes BLOCK_M rows and writes the BLOCK_M - HALO whose W taps all lie in it; the next tile
    writes the rest. The interpreter runs programs in order, so a tile that wrote more would be overwritten by the
    next (on a GPU, raced): the first program runs alone here, into an output of NaNs (the forward's output, the
    input gradient)."""
    tiles = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=1)
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", lambda *args: tiles)
    module = conv_fwd if direction == "fwd" else conv_dgrad
    real_launch = module.launch

    def first_program(kernel, grid, first, w, third, fourth, *args, **kwargs):
        out = fourth if direction == "fwd" else third  # (x, w, bias, y) or (grad_out, w, grad_in, taps)
        out.fill_(float("nan"))
        return real_launch(kernel, (1, *grid[1:]), first, w, third, fourth, *args, **kwargs)

    monkeypatch.setattr(module, "launch", first_program)
    torch.manual_seed(3)
    cin, cout = (16, 3) if direction == "fwd" else (3, 16)
    x = torch.randn(1, cin, 2, 3, 19, device=device).contiguous(memory_format=CL)
    w = torch.randn(cout, cin, 3, 3, 3, device=device).contiguous(memory_format=CL)
    if direction == "fwd":
        ours, exact = tconv3d.conv3d(x, w, None, padding=1), F.conv3d(x.double(), w.double(), None, padding=1)
    else:
        grad_out = torch.randn(1, cout, 2, 3, 19, device=device).contiguous(memory_format=CL)
        x.requires_grad_()
        (ours,) = torch.autograd.grad(tconv3d.conv3d(x, w, None, padding=1), x, grad_out)
        exact = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), padding=1)
    held = (0, slice(None), 0, 0, slice(0, 16 - 2))  # the first row's first 14 voxels: 16 rows, halo 2
    assert rel_l2(ours[held], exact[held]) < TOLERANCE[torch.float32]
    unwritten = torch.ones_like(ours, dtype=torch.bool)
    unwritten[held] = False
    assert torch.isnan(ours[unwritten]).all()


def test_explain_names_the_small_channel_form(device):
    """tconv3d.explain says which small-channel form each pointer launch runs (config.pointer_form), and nothing
    where one tap a step runs."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    expected = {
        (3, 20): {"fwd": "tap_pairs", "dgrad": "w_tap_columns", "wgrad": "tap_pairs"},  # a stem
        (20, 3): {"fwd": "w_tap_columns", "dgrad": "tap_pairs", "wgrad": "out_tap_rows"},  # a decoder's head
        (20, 24): {},
    }
    for (cin, cout), forms in expected.items():
        x, w = torch.randn(1, cin, 3, 4, 5, device=device), torch.randn(cout, cin, 3, 3, 3, device=device)
        plan = tconv3d.explain(x, w, padding=1)
        assert {d: p["form"] for d, p in plan.items() if "form" in p} == forms, (cin, cout)


def test_channel_run_is_the_alignment_every_stride_shares():
    """utils.channel_run: the packed loops' vector of channels, at most 16 bytes, dividing the channels and every
    stride but the channels' (size-1 dims aside); the kernels take the strides as multiples of it."""
    dense = torch.empty(2, 8, 3, 4, 5, dtype=torch.bfloat16).contiguous(memory_format=CL)
    assert utils.channel_run(8, dense) == 8
    assert utils.channel_run(8, dense.float()) == 4  # 16 bytes of fp32
    assert utils.channel_run(4, dense[:, :4]) == 4  # a slice keeps 8-element strides: 4 channels' run
    sliced = torch.empty(2, 12, 3, 4, 5, dtype=torch.bfloat16).contiguous(memory_format=CL)[:, 2:10]
    assert utils.channel_run(8, sliced) == 4  # strides multiples of 12
    assert utils.channel_run(3, torch.empty(1, 3, 2, 2, 2).contiguous(memory_format=CL)) == 1
    assert utils.channel_run(8, dense, torch.empty(1, 8, 1, 1, 6).contiguous(memory_format=CL)[..., ::3]) == 8
    assert utils.channel_run(8, dense, dense[..., ::3]) == 8  # W stride 24
    assert utils.channel_run(8, dense, dense[:, :, :, ::3]) == 8
    odd = torch.empty(1, 8, 3, 3, 9, dtype=torch.bfloat16).contiguous(memory_format=CL)[..., 1::1]
    assert utils.channel_run(8, odd) == 8  # an offset start: Triton itself checks the pointer's alignment
    assert utils.channel_run(8, torch.empty(2, 8, 3, 4, 5, dtype=torch.bfloat16)) == 1  # NCDHW channels


RUN_CASES = [
    Case("cin8_cout6", 1, 8, 6, (4, 5, 6), 3, padding=1),
    Case("cin4_cout8_dil", 1, 4, 8, (5, 6, 5), 3, padding=(2, 1, 1), dilation=(2, 1, 1)),
    Case("cin16_cout8", 1, 16, 8, (4, 5, 6), 3, padding=1),  # the weight gradient's out-pairs kernel
]


@pytest.mark.parametrize("layout", ["dense", "sliced"])
@pytest.mark.parametrize("case", RUN_CASES, ids=lambda c: c.name)
def test_packed_runs_match_float64(case, layout, gpu_heuristic_tiles, device):
    """The packed forward, input gradient and weight gradients (pairs as columns; the out-pairs kernel) with the
    channels' runs as vectors (RUN: 8 for 8 bf16 channels, dense; 4 for 8 channels sliced from 12, whose strides are
    multiples of 12; 2 for 6 channels), at the tiles an H100 launches (16-byte runs: the forward and input gradient
    16 deep on 8 warps, the weight gradient 32 voxels deep on 4), against float64.
    The sliced tensors start 4 bytes past an allocation's 16-byte alignment, the input and grad_out both."""
    dtype = torch.bfloat16
    extra = 4 if layout == "sliced" else 0  # channels of the whole tensor besides the operand's

    def operand(channels, size):
        whole = torch.randn(case.batch, channels + extra, *size, device=device).to(dtype).contiguous(memory_format=CL)
        return whole[:, 2 : 2 + channels] if extra else whole

    def run(channels):  # the largest power of two up to 8 dividing the channels and the whole tensor's
        return max(p for p in (1, 2, 4, 8) if channels % p == 0 and (channels + extra) % p == 0)

    x = operand(case.cin, case.size)
    w = case.weight(dtype, device)
    stride, padding = triple(case.stride, "stride"), triple(case.padding, "padding")
    dilation = triple(case.dilation, "dilation")
    y = tconv3d.conv3d(x, w, None, stride, padding, dilation)
    ref = F.conv3d(x.double(), w.double(), None, stride, padding, dilation)
    assert rel_l2(y, ref) < TOLERANCE[dtype]
    grad_out = operand(case.cout, ref.shape[2:]) if layout == "sliced" else torch.randn_like(y)
    expected = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), stride, padding, dilation)
    grad_in = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), stride, padding, dilation)
    assert rel_l2(grad_in, expected) < TOLERANCE[dtype]
    expected = torch.nn.grad.conv3d_weight(x.double(), w.shape, grad_out.double(), stride, padding, dilation)
    grad_w = torch.ops.tconv3d.conv3d_weight_grad(grad_out, x, list(w.shape), stride, padding, dilation)
    assert rel_l2(grad_w, expected) < TOLERANCE[dtype]
    # what the kernels took: runs of more than one element, 8 only where every stride allows
    assert utils.channel_run(case.cout, grad_out) == run(case.cout) > 1
    if case.cin < 16:
        assert utils.channel_run(case.cin, x, w) == run(case.cin) > 1


PLAIN_RUN_CASES = [
    Case("cin24_cout40", 1, 24, 40, (4, 5, 6), 3, padding=1),
    Case("cin40_cout24_s2", 2, 40, 24, (5, 6, 7), 3, stride=2, padding=1),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("layout", ["dense", "sliced"])
@pytest.mark.parametrize("case", PLAIN_RUN_CASES, ids=lambda c: c.name)
def test_plain_runs_match_float64(case, layout, dtype, gpu_heuristic_tiles, device):
    """The plain (unpacked) forward, input gradient (at unit stride and over stride phases) and weight gradient of
    channels Triton cannot see are 16-byte runs (24 and 40: utils.unseen_run) take their strides as multiples of
    RUN (8 in bf16 dense, 4 in fp32; 4 in bf16 for channels sliced from 4 more, whose strides are multiples of 28
    and 44), against float64. The sliced tensors start 4 bytes past an allocation's 16-byte alignment; a RUN
    larger than the strides allow reads the wrong rows (8 forced on the sliced tensors: relative error ~1)."""
    extra = 4 if layout == "sliced" else 0

    def operand(channels, size):
        whole = torch.randn(case.batch, channels + extra, *size, device=device).to(dtype).contiguous(memory_format=CL)
        return whole[:, 2 : 2 + channels] if extra else whole

    def run(*channels):  # the largest power of two up to 16 bytes dividing the channels and the whole tensors'
        widest = 16 // torch.empty((), dtype=dtype).element_size()
        return max(
            p for p in (1, 2, 4, 8) if p <= widest and all(c % p == 0 and (c + extra) % p == 0 for c in channels)
        )

    x, w = operand(case.cin, case.size), case.weight(dtype, device)
    stride, padding = triple(case.stride, "stride"), triple(case.padding, "padding")
    y = tconv3d.conv3d(x, w, None, stride, padding)
    ref = F.conv3d(x.double(), w.double(), None, stride, padding)
    assert rel_l2(y, ref) < TOLERANCE[dtype]
    grad_out = operand(case.cout, ref.shape[2:])
    expected = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), stride, padding)
    grad_in = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), stride, padding, (1, 1, 1))
    assert rel_l2(grad_in, expected) < TOLERANCE[dtype]
    expected = torch.nn.grad.conv3d_weight(x.double(), w.shape, grad_out.double(), stride, padding)
    grad_w = torch.ops.tconv3d.conv3d_weight_grad(grad_out, x, list(w.shape), stride, padding, (1, 1, 1))
    assert rel_l2(grad_w, expected) < TOLERANCE[dtype]
    # what the launches took: the forward's (x and the weight), the input gradient's (go and the weight), the
    # weight gradient's (x; go)
    assert utils.unseen_run(case.cin, x, w) == run(case.cin) > 1
    assert utils.unseen_run(case.cout, grad_out, w) == run(case.cout, case.cin) > 1
    assert utils.unseen_run(case.cout, grad_out) == run(case.cout) > 1
