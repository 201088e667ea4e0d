"""The Gluon kernels run on CPU through tests/gluon_emulator.py: Triton's interpreter cannot run Gluon, so without
this they would only be compile-checked until a GPU runs them. Every TMA case of the suite (borders, strides 2 and
their phase views, dilation, asymmetric and causal padding, odd kernels, input-gradient phases no tap reaches),
the 3- and 5-channel forwards stored from registers, and split-K, through the software-pipelined and the
persistent warp-specialized kernels at the tiles an H100 would launch, all three directions against float64; the
emulator also checks the barriers, the TMA byte counts and the shared-memory hazards as it goes. And the tests
that show it can fail: kernels with one thing broken (a wgmma not waited for, the wrong stage read, a box not
loaded, a fence left out, a ring one stage short) must be caught.

On a GPU the compiled kernels run instead (tests/test_gluon.py): these tests are CPU-only."""

import dataclasses

import pytest
import torch
from gluon_emulator import KernelFault, emulating
from helpers import (
    HALF_TAIL_TILES,
    case_reference,
    conv_and_reference,
    grouped_taps,
    half_tail_conv,
    hw_bordered_reference,
    second_source_split,
    swapped_tiles,
    swapped_weight_grad_params,
    swapped_weight_grad_tiles,
)
from test_tma import (
    DECODER_WEIGHT_GRAD_IDS,
    DECODER_WEIGHT_GRADS,
    RING_BORDERS,
    TMA_CASES,
    UNALIGNED_OUTPUT,
    bordered_forward,
    conv_with_border_along_d,
    decoder_geometry,
)

import tconv3d
from tconv3d import settings
from tconv3d.geometry import check_conv3d
from tconv3d.kernels import config as kernel_config
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_gluon, conv_wgrad
from tconv3d.kernels.config import KernelConfig
from tconv3d.testing import TF32_TOLERANCE, TOLERANCE, rel_l2, tolerance
from tconv3d.tune import choice, configs

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU runs the compiled Gluon kernels (test_gluon.py)"
)
if conv_gluon.UNAVAILABLE is not None:  # the module reads the kernels' helpers below, which such a Triton lacks
    pytest.skip(str(conv_gluon.UNAVAILABLE), allow_module_level=True)

CL = torch.channels_last_3d
MODES = {"pipelined": 1, "warp_specialized": 2}
PERSISTENT_SMS = 2


@pytest.fixture
def emulator(monkeypatch):
    """TCONV3D_KERNELS=gluon on the emulator, at the heuristic's H100 tiles (132 SMs) forced to the Gluon kernel
    as the GPU would force them; `emulator.mode` picks pipelined (1) or warp-specialized (2), `emulator.swap` the
    forward's and input gradient's operands swapped (swapped_tiles), `emulator.tap_group` the weight gradient's taps
    grouped (grouped_taps), `emulator.wgrad_split` the weight gradient's split_k. Records the configs launched in
    `emulator.configs`. The persistent kernels get 2 SMs
    (at most 4 programs), so that each program walks several tiles (the ring's position and phases carried from
    one tile to the next, the epilogue's buffer reused)."""
    monkeypatch.setattr(settings, "KERNELS", "gluon")
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        emu.mode, emu.swap, emu.tap_group, emu.swap_wgrad, emu.wgrad_split, emu.configs = 1, False, 0, None, 0, []

        def select(direction, geom, dtype, device, run):
            # The heuristic's transposed weight gradient (swapped_wgrad_tiles; not with timed_only) is warp-specialized
            # and its own tiles: a test that sets the pipelined kernel or tiles of its own starts from the plain ones.
            plain = direction == "wgrad" and (emu.mode == 1 or emu.tap_group or emu.swap_wgrad)
            config = configs.heuristic_config(direction, geom, dtype, 132, configs.GLUON_CAPABILITY, plain)
            config = choice.force_variant(direction, geom, dtype, config, "gluon", True)
            if config.gluon:
                config = dataclasses.replace(config, gluon=emu.mode)
                if emu.swap and direction != "wgrad":
                    config = swapped_tiles(config)
                    assert configs.gluon_takes(config), config
                if emu.tap_group and direction == "wgrad":
                    config = grouped_taps(config, emu.tap_group)
                if emu.swap_wgrad and direction == "wgrad":
                    config = swapped_weight_grad_tiles(config, *emu.swap_wgrad)
                    assert configs.gluon_takes(config), config
                if emu.wgrad_split and direction == "wgrad":
                    config = dataclasses.replace(config, split_k=emu.wgrad_split)
            emu.configs.append((direction, config))
            return config

        monkeypatch.setattr(choice, "_select", select)
        yield emu


def _check(case, dtype, emu):
    ours, expected = conv_and_reference(case, dtype, "cpu")
    for got, want in zip(ours, expected, strict=True):  # output, input, weight and bias gradients
        assert rel_l2(got, want) < tolerance(dtype)
    assert ours[0].is_contiguous(memory_format=CL) and ours[1].is_contiguous(memory_format=CL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_emulated_gluon_kernels_match_float64(case, mode, emulator):
    emulator.mode = MODES[mode]
    _check(case, torch.bfloat16, emulator)
    assert [(d, c.gluon) for d, c in emulator.configs] == [(d, MODES[mode]) for d in ("fwd", "dgrad", "wgrad")]
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}
    if mode == "warp_specialized":
        _check_persistent_grids(emulator)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_emulated_gluon_swapped_operands_match_float64(case, mode, emulator):
    """The forward and input gradient computing each tile transposed (swap_ab: the weight box as wgmma's A, the
    voxel box as its B, the accumulator stored through a transposed view, the bias along its rows) on every TMA
    case; the weight gradient as chosen."""
    emulator.mode, emulator.swap = MODES[mode], True
    _check(case, torch.bfloat16, emulator)
    m = MODES[mode]
    assert [(d, c.gluon, c.swap_ab) for d, c in emulator.configs][:2] == [("fwd", m, 1), ("dgrad", m, 1)]
    assert emulator.configs[2][0] == "wgrad" and emulator.configs[2][1].gluon == m
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_emulated_gluon_grouped_taps_match_float64(case, group, emulator):
    """The warp-specialized weight gradient with `group` taps a tile (tap_group: their input boxes side by side in
    one stage, one wgmma across them, grad_out's box loaded once for all), a last group past the kernel's taps
    where they do not divide (27 by 2 or 4; 7x2x5 = 70 by 4), on every TMA case (strides through the phase views,
    one tap's view a box, borders, dilation), against float64."""
    emulator.mode, emulator.tap_group = 2, group
    _check(case, torch.bfloat16, emulator)
    assert [(d, c.tap_group) for d, c in emulator.configs] == [("fwd", 0), ("dgrad", 0), ("wgrad", group)]
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}


@pytest.mark.parametrize(
    "index, group, per_tap",
    [pytest.param(i, g, c, id=f"{TMA_CASES[i].name}-{g}x{c}") for i, g, c in swapped_weight_grad_params(TMA_CASES)],
)
def test_emulated_gluon_swapped_weight_gradient_matches_float64(index, group, per_tap, emulator):
    """The warp-specialized weight gradient computing each tile transposed (swap_ab: the taps' input boxes as
    wgmma's A read M-major, `group` of them side by side on its rows, `per_tap` channels each where there are 2 or
    4; the grad_out box as its B; the accumulator stored through a transposed view) against float64: 4 taps of 32
    channels a tile on every TMA case; 1, 2, and 4 of 16 channels (32-byte swizzle rows) on a few."""
    case = TMA_CASES[index]
    emulator.mode, emulator.swap_wgrad = 2, (group, per_tap)
    _check(case, torch.bfloat16, emulator)
    expected = [("fwd", 0, 0), ("dgrad", 0, 0), ("wgrad", 1, group if group > 1 else 0)]
    assert [(d, c.swap_ab, c.tap_group) for d, c in emulator.configs] == expected
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}
    _check_persistent_grids(emulator)


def _check_persistent_grids(emu):
    """Each persistent launch runs at most two programs an SM (of PERSISTENT_SMS), and its maxnreg lets
    that many fit an SM's registers beside their producers' warpgroups."""
    for name, grid, warps, options in emu.grids:
        per_sm = -(-grid[0] // PERSISTENT_SMS)
        assert len(grid) == 1 and per_sm <= 2, (name, grid)
        assert options["maxnreg"] * 32 * (warps + 4) * per_sm <= 65536, (name, grid, warps, options)


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("padding", "live"), [((1, 1, 1, 1, 1, 1), 10), ((2, 0, 1, 1, 1, 1), 9)], ids=["same", "causal"]
)
@pytest.mark.parametrize("batch", [1, 3])
def test_emulated_gluon_tiles_skip_the_taps_along_d_in_the_padding(
    batch, padding, live, mode, direction, emulator, monkeypatch
):
    """A tile reduces only the (frame, tap along D) pairs that read inside the source (conv_gluon.live_d_eligible): at
    D = 4 and 3 taps along D, `live` of the 12 read inside it (10 padded (1, 1), 9 causal (2, 0)), so the forward
    and input gradient issue live/12 of the wgmmas they issue with every tap; the weight gradient skips a tile's
    patches in frames none of its taps along D reads inside (with taps grouped, a group spanning two kd keeps the
    frames either reads), in each batch entry, its splits cut across the entries (split_k 5 over 3 x 4 frames). All
    match float64."""
    from gluon_emulator import _OPERATIONS

    emulator.mode, emulator.wgrad_split = MODES[mode], 5
    wgmmas = []
    mma = _OPERATIONS["warpgroup_mma"]
    monkeypatch.setitem(_OPERATIONS, "warpgroup_mma", lambda *args, **kwargs: wgmmas.append(1) or mma(*args, **kwargs))
    torch.manual_seed(0)
    x = torch.randn(batch, 32, 4, 8, 16).to(dtype=torch.bfloat16, memory_format=CL)
    w = torch.randn(32, 32, 3, 3, 3).to(dtype=torch.bfloat16, memory_format=CL)
    g = torch.randn(batch, 32, 4, 8, 16).to(dtype=torch.bfloat16, memory_format=CL)
    pads = [padding[4], padding[5], padding[2], padding[3], padding[0], padding[1]]
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    y = torch.nn.functional.conv3d(torch.nn.functional.pad(xd, pads), wd)
    ints = ([1] * 3, list(padding), [1] * 3)
    runs = {
        "fwd": (lambda: tconv3d.conv3d(x, w, None, 1, padding), y),
        "dgrad": (lambda: torch.ops.tconv3d.conv3d_input_grad(g, w, list(x.shape), *ints), None),
        "wgrad": (lambda: torch.ops.tconv3d.conv3d_weight_grad(g, x, list(w.shape), *ints), None),
    }
    run, want = runs[direction]
    if want is None:
        want = torch.autograd.grad(y, xd if direction == "dgrad" else wd, g.double())[0]
    counts, eligible = [], conv_gluon.live_d_eligible
    for skip in (True, False):
        monkeypatch.setattr(conv_gluon, "live_d_eligible", lambda *args, skip=skip: skip)
        del wgmmas[:]
        got = run()
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
        counts.append(len(wgmmas))
    config = emulator.configs[-1][1]
    if direction == "wgrad":
        assert emulator.launches == {"_conv3d_wgrad_gluon_kernel": 2}
        group, front = max(config.tap_group, 1), padding[0]
        kept = 0  # frames a group of taps along D reads inside the source at: od - front + kd in [0, 4)
        for first in range(0, 27, group):
            kd_first, kd_last = first // 9, min(first + group - 1, 26) // 9
            kept += min(4 + front - kd_first, 4) - max(front - kd_last, 0)
        live, total = kept, 4 * -(-27 // group)
        assert config.split_k == 5
    else:
        assert emulator.launches == {"_conv3d_gluon_kernel": 2}
        total = 12
    assert counts[0] * total == counts[1] * live, (counts, live, total)
    geom = check_conv3d(x, w, None, 1, padding, 1, 1)
    assert eligible(geom, config, direction == "dgrad")  # as the launcher decides it


@pytest.mark.parametrize("mode", [*MODES, "grouped_taps"])
@pytest.mark.parametrize("before", [0, 2], ids=["one_source", "frames_before"])
@pytest.mark.parametrize("stride", [1, (2, 1, 1)], ids=["stride1", "stride211"])
@pytest.mark.parametrize("mode_d", ["replicate", "reflect"])
def test_emulated_gluon_border_modes_and_cached_frames_along_d(mode_d, stride, before, mode, emulator):
    """The video VAEs' causal convs: a border mode along D and frames_before (copies from frames_before's
    descriptor or x's, the other predicated off) through the Gluon forward and weight gradient too (and the weight
    gradient with two taps a tile: each tap's copy from its own source)."""
    emulator.mode, emulator.tap_group = MODES.get(mode, 2), 2 if mode == "grouped_taps" else 0
    ours, expected = conv_with_border_along_d(mode_d, stride, before, torch.bfloat16, "cpu")
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    assert [(d, c.gluon) for d, c in emulator.configs] == [(d, emulator.mode) for d in ("fwd", "dgrad", "wgrad")]
    assert emulator.configs[-1][1].tap_group == emulator.tap_group


@pytest.mark.parametrize(("channels", "modes", "before", "swapped"), DECODER_WEIGHT_GRADS, ids=DECODER_WEIGHT_GRAD_IDS)
def test_emulated_gluon_decoder_weight_gradients_as_chosen(channels, modes, before, swapped, emulator):
    """A video VAE decoder's fine-tuning step: the weight gradient of a layer reading cached frames or bordered in
    H and W on the Gluon kernel as the sm_90 heuristic now chooses it (configs.heuristic_config's untimed rule;
    with timed_only the pointer kernel): its interior there, transposed where Cout <= 32 (swapped_wgrad_tiles), the
    border strips on the pointer kernel, each step's box from frames_before's descriptor or x's; against float64 of
    the concatenated, padded input."""
    emulator.mode = 2
    mode_d, *modes_hw = modes
    ours, expected = conv_with_border_along_d(mode_d, 1, before, torch.bfloat16, "cpu", tuple(modes_hw), channels)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    geom = decoder_geometry(channels, modes, before)
    chosen = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, configs.GLUON_CAPABILITY)
    timed = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, configs.GLUON_CAPABILITY, timed_only=True)
    assert (chosen.gluon, chosen.tap_group if chosen.swap_ab else 0, timed.variant) == (2, swapped, "pointer")
    assert emulator.configs[-1] == ("wgrad", chosen)
    assert emulator.launches["_conv3d_wgrad_gluon_kernel"] == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["unet_skip", "residual_1x1"])  # 16-byte rows: 24 + 8 straddles a block
def test_emulated_gluon_channels_after(case, mode, emulator):
    """A UNet decoder's skip connection read in place (channels_after): the forward's channel blocks each from x's
    descriptor or channels_after's (the other copy predicated off, the weight box at the block's channel), the
    weight gradient one launch per source into its columns; against float64 of the concatenation."""
    from test_channels_after import CASES as AFTER_CASES
    from test_channels_after import conv_and_reference as after_conv_and_reference

    emulator.mode = MODES[mode]
    emulator.tap_group = 2 if mode == "warp_specialized" else 0  # and the weight gradient's taps two a tile
    ours, expected = after_conv_and_reference(next(c for c in AFTER_CASES if c[0] == case), torch.bfloat16, "cpu")
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    assert [(d, c.gluon) for d, c in emulator.configs] == [(d, MODES[mode]) for d in ("fwd", "dgrad", "wgrad")]
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 2}


@pytest.mark.parametrize(
    ("case", "per_tap"),
    [
        (("skip_16", (1, 16, 3, 4, 5), 16, (16, 32, 3, 3, 3), 1, 1, 1, 1, "zeros"), 16),  # 16 + 16 channels
        (("skip_32_16", (1, 32, 2, 4, 5), 16, (24, 48, 3, 3, 3), 1, 1, 1, 1, "zeros"), 32),  # the wider source's
    ],
    ids=lambda value: value[0] if isinstance(value, tuple) else None,
)
def test_emulated_gluon_channels_after_weight_gradient_as_chosen(case, per_tap, emulator):
    """The sm_90 heuristic's weight gradient reading channels_after (configs.heuristic_config: a plain one's Gluon
    tiles for the wider source, here transposed: 16-24 output channels, 4 taps of its input channels on the wgmma's
    rows), one launch a source into its columns, warp-specialized, against float64 of the concatenation."""
    from test_channels_after import conv_and_reference as after_conv_and_reference

    emulator.mode = 2
    ours, expected = after_conv_and_reference(case, torch.bfloat16, "cpu")
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    wgrad = [c for d, c in emulator.configs if d == "wgrad"]
    assert [(c.gluon, c.swap_ab, c.tap_group, c.block_n) for c in wgrad] == [(2, 1, 4, 4 * per_tap)], wgrad
    assert emulator.launches["_conv3d_wgrad_gluon_kernel"] == 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["unet_up", "kernel_2_stride_2"])  # bf16: 16 + 16 and 24 + 8 channels
def test_emulated_gluon_transposed_channels_after(case, mode, emulator, monkeypatch):
    """MONAI UNet's up conv, the transposed conv of a skip connection's concatenation: the input gradient's channel
    blocks each from grad_output's descriptor or channels_after's (the other copy predicated off, the weight box at
    the block's row), through the stride-2 phase views of grad_in; no concatenation; against float64."""
    from test_channels_after_transposed import CASES as TRANSPOSED_CASES
    from test_channels_after_transposed import transposed_and_reference

    from tconv3d.kernels import config as kernel_config
    from tconv3d.kernels import tensors

    concatenated = []
    monkeypatch.setattr(kernel_config, "cat_channels", lambda *a: concatenated.append(1) or tensors.cat_channels(*a))
    emulator.mode = MODES[mode]
    problem = next(c for c in TRANSPOSED_CASES if c[0] == case)
    ours, expected = transposed_and_reference(problem, torch.bfloat16, "cpu")
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    assert ("dgrad", MODES[mode]) in [(d, c.gluon) for d, c in emulator.configs]
    # the transposed conv and, in its backward, the forward conv; the weight gradient once per source
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 2}
    assert not concatenated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("before", [0, 2], ids=["one_source", "frames_before"])
@pytest.mark.parametrize("modes_hw", [("replicate", "replicate"), ("reflect", "zeros")], ids=lambda m: "_".join(m))
def test_emulated_gluon_forward_interior_with_border_modes_in_h_and_w(modes_hw, before, mode, emulator):
    """HunyuanVideo's and Mochi's convs (replicate in all three dimensions): the forward's interior on the Gluon
    kernel over a view of the output, the border ring on the pointer kernel (conv_fwd.interior_part); the weight
    gradient reduces over the same parts."""
    emulator.mode = MODES[mode]
    ours, expected = conv_with_border_along_d("replicate", 1, before, torch.bfloat16, "cpu", modes_hw)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    assert emulator.launches["_conv3d_gluon_kernel"] == 2  # the forward's interior and the input gradient
    assert emulator.launches["_conv3d_wgrad_gluon_kernel"] == 1  # the weight gradient's interior


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("kernel", "padding", "modes"), RING_BORDERS)
def test_emulated_gluon_forward_splits_its_interior_beside_the_border_ring(kernel, padding, modes, mode, monkeypatch):
    """Reflect-bordered layers of few tiles on small_grid_twin's tiles (LTX-2's decoder's, as the sm_90 heuristic ran
    them until H200 run 5): the interior on the Gluon kernel's one-warpgroup 64-row tiles, its reduction split three
    ways into fp32 partial sums over a view of them, the border ring in the same splits on the pointer kernel
    (conv_fwd.conv3d_fwd), against float64."""
    config = KernelConfig(64, 32, 16, 4, 3, split_k=3)
    with emulating(monkeypatch):
        y, want, launched = bordered_forward(
            kernel, padding, modes, lambda geom: dataclasses.replace(
                configs.with_gluon(config, geom, "fwd", specialized=True), gluon=MODES[mode]), monkeypatch,
            torch.bfloat16,
        )  # fmt: skip
    assert rel_l2(y, want) < tolerance(torch.bfloat16)
    assert [(name, ring) for name, _, ring in launched] == [
        ("_conv3d_gluon_kernel", None),
        ("_conv3d_fwd_kernel", True),
    ]
    assert launched[1][1][-1] == 3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("source", "split"), [("frames_before", 3), ("channels_after", 5), ("out_after", 6)])
def test_emulated_gluon_split_reads_a_second_source(source, split, mode, monkeypatch):
    """Wan's cached-frame layers of few tiles, a UNet decoder's small convs of a concatenation and MONAI UNet's deep
    up conv (configs.small_grid_twin): the Gluon kernel's one-warpgroup tiles, the reduction split over taps x
    channel blocks of both sources (27 taps x 1 block in 3 splits of 9, taps 0-8 reading frames_before in part;
    27 x 2 blocks in 5 of 11, the later splits starting in the second source's block; a stride-2 phase's 8 live taps
    x 2 blocks in 6 of 3, likewise), against float64."""
    with emulating(monkeypatch) as emulator:
        config = dataclasses.replace(KernelConfig(64, 16, 16, 4, 3, split_k=split), gluon=MODES[mode])
        got, want, launched = second_source_split(source, config)
        assert launched.gluon == MODES[mode] and launched.split_k == split
        assert emulator.launches == {"_conv3d_gluon_kernel": 1}
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("seed", range(1, 5))
def test_emulated_warp_specialized_interleavings(seed, emulator):
    """The producer and the consumers in other orders (the emulator hands the turn on at random, seeded): a
    stride-2 case, several tiles a program, split-K on the weight gradient."""
    emulator.seed, emulator.mode = seed, 2
    _check(TMA_CASES[2], torch.bfloat16, emulator)
    _check_persistent_grids(emulator)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [TMA_CASES[0], TMA_CASES[2]], ids=lambda c: c.name)
def test_emulated_gluon_kernels_in_fp16(case, mode, emulator):
    emulator.mode = MODES[mode]
    _check(case, torch.float16, emulator)
    assert sum(emulator.launches.values()) == 3


@pytest.mark.parametrize("swap", [False, True], ids=["as_is", "swapped"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [TMA_CASES[0], TMA_CASES[2], UNALIGNED_OUTPUT[0]], ids=lambda c: c.name)
def test_emulated_gluon_fp32_as_tf32(case, mode, swap, emulator, monkeypatch):
    """fp32 with TF32 allowed (cuDNN's default): the forward and the input gradient on the Gluon kernel, operands
    read as TF32 (the emulator drops the low 13 mantissa bits, as wgmma does), the input gradient over the weight
    transposed to [Cin, taps, Cout] (wgmma reads fp32 only K-major; swapped, both operands are K-major too); the
    weight gradient on the TMA kernel. Within the TF32 bound, and far from exact fp32: TF32 is what ran. At 3 output
    channels only the forward is TMA-describable."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    emulator.mode, emulator.swap = MODES[mode], swap
    _check(case, torch.float32, emulator)
    on_gluon = ["fwd"] if case.cout == 3 else ["fwd", "dgrad"]
    assert [(d, c.swap_ab) for d, c in emulator.configs if c.gluon] == [(d, int(swap)) for d in on_gluon]
    assert emulator.launches == {"_conv3d_gluon_kernel": len(on_gluon)}
    x, w = case.input(torch.float32, "cpu", CL), case.weight(torch.float32, "cpu")
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding, case.dilation)  # on the emulator, as above
    y64 = case_reference(x.double(), w.double(), None, case)
    assert TOLERANCE[torch.float32] < rel_l2(y, y64) < TF32_TOLERANCE


def test_exact_fp32_keeps_the_forward_off_the_gluon_kernel(emulator):
    """TF32 off (the tests' default): no Gluon launch in fp32, and the TMA kernel's products are exact."""
    assert not settings.tf32_allowed()
    _check(TMA_CASES[0], torch.float32, emulator)
    assert [c.variant for _, c in emulator.configs] == ["tma"] * 3 and not emulator.launches


def _fp32_problem(direction):
    x = torch.randn(1, 16, 2, 4, 16).contiguous(memory_format=CL)
    w = torch.randn(16, 16, 3, 3, 3).contiguous(memory_format=CL)
    grad_out = torch.randn(1, 16, 2, 4, 16).contiguous(memory_format=CL)
    geom = check_conv3d(x, w, None, [1] * 3, [1] * 6, [1] * 3, 1)
    return x, w, grad_out, geom, configs.with_gluon(KernelConfig(64, 16, 16, 4, 3), geom, direction)


def test_emulator_refuses_fp32_operands_that_are_not_k_major(monkeypatch):
    """Why the fp32 weight gradient stays off the Gluon kernel: forced there, its grad_out box reaches wgmma
    M-major, which it reads only in 16-bit dtypes."""
    x, _, grad_out, geom, config = _fp32_problem("wgrad")
    with emulating(monkeypatch), pytest.raises(KernelFault, match="K-major"):
        conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, config)


def test_fp32_input_gradient_needs_the_transposed_weight(monkeypatch):
    """The fp32 input gradient on the Gluon kernel with the weight box as stored (N-major, as the 16-bit kernels
    read it) instead of the transposed copy: refused, as wgmma would refuse it; with the copy it matches float64."""
    x, w, grad_out, geom, config = _fp32_problem("dgrad")
    want = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), padding=1)
    with emulating(monkeypatch):
        got = conv_dgrad.conv3d_dgrad(grad_out, w, geom, config)
        assert rel_l2(got, want) < TF32_TOLERANCE
        real_descriptors, real_launch = conv_gluon.patch_descriptors, conv_gluon.launch
        monkeypatch.setattr(
            conv_gluon, "patch_descriptors", lambda *a, weight_transposed, **k: real_descriptors(*a, **k)
        )
        monkeypatch.setattr(conv_gluon, "launch", lambda *a, **k: real_launch(*a, **{**k, "W_TRANSPOSED": False}))
        with pytest.raises(KernelFault, match="K-major"):
            conv_dgrad.conv3d_dgrad(grad_out, w, geom, config)


@pytest.mark.parametrize("swap", [False, True], ids=["as_is", "swapped"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", UNALIGNED_OUTPUT, ids=lambda c: c.name)
def test_emulated_gluon_forward_stores_unaligned_rows(case, mode, swap, emulator):
    """3 and 5 output channels: the forward on the Gluon kernel, stored from registers (DST_PTR; from the
    transposed accumulator where swapped); the gradients on the pointer kernels (their rows are not
    TMA-describable)."""
    emulator.mode, emulator.swap = MODES[mode], swap
    _check(case, torch.bfloat16, emulator)
    assert [(d, c.swap_ab) for d, c in emulator.configs if c.gluon] == [("fwd", int(swap))]
    assert emulator.launches == {"_conv3d_gluon_kernel": 1}


@pytest.mark.parametrize("swap", [False, True], ids=["as_is", "swapped"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("direction", ["fwd", "dgrad"])
@pytest.mark.parametrize("cout", [3, 16])
def test_emulated_gluon_split_k(cout, direction, mode, swap, monkeypatch):
    """Split-K partials (fp32 boxes, the bias in split 0's), 3 splits over 27 taps x 2 channel blocks, summed by
    split_k.py; at 3 output channels from registers; the tiles also swapped (swap_ab)."""
    if direction == "dgrad" and cout == 3:
        pytest.skip("an input gradient from 3 channels is not TMA-describable")
    x = torch.randn(2, 32, 3, 4, 20, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.randn(cout, 32, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=CL)
    b = torch.randn(cout, dtype=torch.bfloat16)
    geom = check_conv3d(x, w, b, [1] * 3, [1] * 6, [1] * 3, 1)
    config = configs.with_gluon(KernelConfig(64, 16, 16, 4, 3, split_k=3), geom, direction, MODES[mode] == 2)
    if swap:
        config = swapped_tiles(config)
        assert configs.gluon_takes(config), config
    got, want = _forward_or_input_gradient(direction, x, w, b, geom, config, monkeypatch)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


def _forward_or_input_gradient(direction, x, w, b, geom, config, monkeypatch):
    """(ours on the emulator at `config`, float64) of the forward of x (with bias b) or the input gradient of a
    random grad_out (with a bias per input channel: a transposed convolution's), padding 1: one Gluon launch."""
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        if direction == "fwd":
            got = conv_fwd.conv3d_fwd(x, w, b, None, geom, config)
            want = torch.nn.functional.conv3d(x.double(), w.double(), b.double(), padding=1)
        else:
            grad_out = torch.randn(geom.output_shape(), dtype=torch.bfloat16).contiguous(memory_format=CL)
            b = torch.randn(x.shape[1], dtype=torch.bfloat16)
            got = conv_dgrad.conv3d_dgrad(grad_out, w, geom, config, bias=b)
            want = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), padding=1)
            want += b.double().view(1, -1, 1, 1, 1)
    assert emu.launches == {"_conv3d_gluon_kernel": 1}
    return got, want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "tile", [(128, 256, 64, 8, 4), (256, 128, 64, 8, 3), (256, 128, 64, 8, 3, 1)],
    ids=["128x256x64", "256x128x64", "256x128x64_swapped"],
)  # fmt: skip
def test_emulated_gluon_large_tiles(tile, mode, monkeypatch):
    """The tiles the large layers tune to (issue 28: 128 x 256 and 256 x 128 on two consumer warpgroups, 3-4
    stages; 256 x 128 also swapped, m64n256 in the forward and input gradient) at 256 channels, all three
    directions, a (1, 3, 3) kernel over a volume of a few patches."""
    x = torch.randn(1, 256, 2, 9, 21, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = (torch.randn(256, 256, 1, 3, 3, dtype=torch.bfloat16) / 48).contiguous(memory_format=CL)
    b = torch.randn(256, dtype=torch.bfloat16)
    geom = check_conv3d(x, w, b, [1] * 3, [0, 0, 1, 1, 1, 1], [1] * 3, 1)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    want = torch.nn.functional.conv3d(x64, w64, b.double(), padding=(0, 1, 1))
    grad_out = torch.randn(want.shape, dtype=torch.bfloat16).contiguous(memory_format=CL)
    want.backward(grad_out.double())
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        got = []
        for direction in ("fwd", "dgrad", "wgrad"):
            config = configs.with_gluon(KernelConfig(*tile[:5]), geom, direction, MODES[mode] == 2)
            if tile[5:] and direction != "wgrad":
                config = configs.swapped_twin(config, direction)
            assert config.gluon == MODES[mode] and config.block_m * config.block_n == 128 * 256
            if direction == "fwd":
                got.append(conv_fwd.conv3d_fwd(x, w, b, None, geom, config))
            elif direction == "dgrad":
                got.append(conv_dgrad.conv3d_dgrad(grad_out, w, geom, config))
            else:
                got.append(conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, config))
    assert emu.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}
    for ours, expected in zip(got, (want, x64.grad, w64.grad), strict=True):
        assert rel_l2(ours, expected) < tolerance(torch.bfloat16)


def _half_tail_conv(tile, mode, monkeypatch, dtype=torch.bfloat16):
    """(ours on the emulator, float64) of helpers.half_tail_conv's problem."""
    run, want = half_tail_conv(tile, MODES[mode], "cpu", dtype)
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        got = run()
    assert emu.launches == {"_conv3d_wgrad_gluon_kernel" if tile[0] == "wgrad" else "_conv3d_gluon_kernel": 1}
    return got, want


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tile", HALF_TAIL_TILES)
def test_emulated_gluon_half_tail(tile, mode, monkeypatch):
    """192 channels in 128-column blocks: the last block's tiles compute its first 64 columns only (HALF_TAIL),
    from the first half of each weight box (a slice of its N-major view in the input gradient, of its K-major rows
    in the forward), stored from a half accumulator into the first half of the epilogue's buffer; swapped, on one
    warpgroup of the two (or the one) along M, the voxels split between them; into split-K partials too. The
    warp-specialized weight gradient (either mode) in 128 x 128 tiles: a tap's tiles are full, half the rows (the
    last Cout block), half the columns (the last Cin block) and a quarter (both), each its own accumulator and loop
    (HALF_M_TAIL, HALF_N_TAIL)."""
    got, want = _half_tail_conv(HALF_TAIL_TILES[tile], mode, monkeypatch)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("direction", ["fwd", "dgrad"])
@pytest.mark.parametrize("swap", [0, 1], ids=["as_is", "swapped"])
def test_emulated_gluon_half_tail_in_tf32(swap, direction, monkeypatch):
    """The half tiles over fp32 operands read as TF32: 32-deep steps, the input gradient's weight transposed
    (K-major, its half a slice of rows), fp32 epilogue buffers."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    tile = (direction, 128, 128, 32, 8, 3, swap, 1)
    got, want = _half_tail_conv(tile, "warp_specialized", monkeypatch, torch.float32)
    assert rel_l2(got, want) < TF32_TOLERANCE


# Kernels with one thing broken: the emulator must catch each, by a fault or a wrong result. They replace one
# @gluon.jit helper of conv_gluon.py (the emulator reads the module's globals at each launch).

gluon = conv_gluon.gluon
gl = conv_gluon.gl
warpgroup_mma, warpgroup_mma_wait = conv_gluon.warpgroup_mma, conv_gluon.warpgroup_mma_wait
mbarrier = conv_gluon.mbarrier
# The real helpers the broken ones call, bound here before any test replaces them in conv_gluon.
_real_stage_operands = conv_gluon._stage_operands
_real_store_tile = conv_gluon._store_tile


@gluon.jit
def _stage_operands_second_half(a_ring, b_ring, index, W_KN: gl.constexpr, WEIGHT_GRAD: gl.constexpr,
                                SWAP_AB: gl.constexpr = False, HALF: gl.constexpr = False,
                                HALF_M: gl.constexpr = False):  # fmt: skip
    """A half tile reading the weight box's second half: the channels past C_COLS, zeros from the TMA unit."""
    if HALF and not WEIGHT_GRAD and not W_KN:
        BLOCK_K: gl.constexpr = a_ring.type.shape[5]
        ROWS: gl.constexpr = b_ring.type.shape[1]
        a = a_ring.index(index).reshape([a_ring.type.shape[3] * a_ring.type.shape[4], BLOCK_K])
        b = b_ring.index(index).reshape([ROWS, BLOCK_K]).slice(ROWS // 2, ROWS // 2, dim=0).permute((1, 0))
        if SWAP_AB:
            a, b = b.permute((1, 0)), a.permute((1, 0))
    else:
        a, b = _real_stage_operands(a_ring, b_ring, index, W_KN, WEIGHT_GRAD, SWAP_AB, HALF, HALF_M)
    return a, b


@pytest.mark.parametrize("tile", ["fwd_128x128", "fwd_256x128_swapped"])
def test_emulated_half_tail_is_checked(tile, monkeypatch):
    """The half tiles run and are compared: reading the weight box's other half loses the last 64 channels."""
    monkeypatch.setattr(conv_gluon, "_stage_operands", _stage_operands_second_half)
    got, want = _half_tail_conv(HALF_TAIL_TILES[tile], "warp_specialized", monkeypatch)
    assert rel_l2(got[:, :128], want[:, :128]) < tolerance(torch.bfloat16)
    assert rel_l2(got[:, 128:], want[:, 128:]) > 0.5


@gluon.jit
def _mma_never_waited(a, b, acc):
    """wgmma left in flight: the stage it reads is refilled under it."""
    return warpgroup_mma(a, b, acc, is_async=True)


@gluon.jit
def _mma_two_in_flight(a, b, acc):
    """Two groups in flight: the stage the older reads is refilled under it (the ring is one stage short)."""
    acc = warpgroup_mma(a, b, acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
    return acc


@gluon.jit
def _next_stage_operands(a_ring, b_ring, index, INPUT_GRAD: gl.constexpr, WEIGHT_GRAD: gl.constexpr,
                         SWAP_AB: gl.constexpr = False, HALF: gl.constexpr = False,
                         HALF_M: gl.constexpr = False):  # fmt: skip
    """The operands of the stage after the one waited for: read before its loads were seen."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    return _real_stage_operands(a_ring, b_ring, (index + 1) % STAGES, INPUT_GRAD, WEIGHT_GRAD, SWAP_AB, HALF, HALF_M)


@gluon.jit
def _source_box_skipped(views, coords, bar, buf, phase, pred, PHASES: gl.constexpr, frames,
                        PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr):  # fmt: skip
    """The source box never loaded: its bytes never arrive at the barrier."""
    pass


@gluon.jit
def _no_fence():
    pass


@gluon.jit
def _consume_steps_early_release(a_ring, b_ring, ready, empty, it, steps, acc, INPUT_GRAD: gl.constexpr,
                                 WEIGHT_GRAD: gl.constexpr, SWAP_AB: gl.constexpr,
                                 HALF: gl.constexpr = False, HALF_M: gl.constexpr = False):  # fmt: skip
    """The warp-specialized consumer handing a stage back as soon as its wgmma is issued, not once it finished."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    for _ in range(steps):
        index = it % STAGES
        mbarrier.wait(ready.index(index), (it // STAGES) & 1)
        a, b = _real_stage_operands(a_ring, b_ring, index, INPUT_GRAD, WEIGHT_GRAD, SWAP_AB, HALF, HALF_M)
        acc = warpgroup_mma(a, b, acc, is_async=True)
        mbarrier.arrive(empty.index(index), count=1)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
        it += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return acc, it


@gluon.jit
def _store_tile_one_column_off(acc, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase, BATCH, C_COLS,
                               H_DST, W_DST, dst_strides, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr,
                               STRIDE_W: gl.constexpr, INPUT_GRAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                               DST_PTR: gl.constexpr, BOX_W: gl.constexpr, mma_layout: gl.constexpr,
                               SWAP_AB: gl.constexpr):  # fmt: skip
    """A tile stored one column to the right of where it belongs (a wrong w0 in the epilogue alone)."""
    _real_store_tile(
        acc, c_smem, dst_views, bias_ptr, n, d, h0, w0 + 1, n0, split, phase, BATCH, C_COLS, H_DST, W_DST,
        dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HAS_BIAS, DST_PTR, BOX_W, mma_layout, SWAP_AB,
    )  # fmt: skip


@gluon.jit
def _store_tile_frames_swapped(acc, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase, BATCH, C_COLS,
                               H_DST, W_DST, dst_strides, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr,
                               STRIDE_W: gl.constexpr, INPUT_GRAD: gl.constexpr, HAS_BIAS: gl.constexpr,
                               DST_PTR: gl.constexpr, BOX_W: gl.constexpr, mma_layout: gl.constexpr,
                               SWAP_AB: gl.constexpr):  # fmt: skip
    """A halo tile's two frames stored each where the other belongs (its tiles start at even frames)."""
    _real_store_tile(
        acc, c_smem, dst_views, bias_ptr, n, d + 1 - 2 * (d % 2), h0, w0, n0, split, phase, BATCH, C_COLS, H_DST,
        W_DST, dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HAS_BIAS, DST_PTR, BOX_W, mma_layout, SWAP_AB,
    )  # fmt: skip


@gluon.jit
def _halo_step_two_in_flight(a_ring, b_ring, index, acc0, acc1, INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr,
                             SWAP_AB: gl.constexpr):  # fmt: skip
    """A halo step leaving the step before's groups in flight too: its stage is handed back while they read it."""
    STAGES: gl.constexpr = a_ring.type.shape[0]
    KD: gl.constexpr = b_ring.type.shape[0] // STAGES
    frames = a_ring.index(index).reshape([a_ring.type.shape[2] * a_ring.type.shape[3] * a_ring.type.shape[4],
                                          a_ring.type.shape[5]])  # fmt: skip
    BLOCK_M: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
    for kd in gl.static_range(KD):
        b = b_ring.index(index * KD + kd).reshape([b_ring.type.shape[1], b_ring.type.shape[3]]).permute((1, 0))
        acc0 = warpgroup_mma(frames.slice(kd * BLOCK_M, BLOCK_M, dim=0), b, acc0, is_async=True)
        acc1 = warpgroup_mma(frames.slice((kd + 1) * BLOCK_M, BLOCK_M, dim=0), b, acc1, is_async=True)
    acc0, acc1, _ = warpgroup_mma_wait(num_outstanding=4 * KD, deps=(acc0, acc1, frames))
    return acc0, acc1


BROKEN = {
    "mma_never_waited": ("_mma_one_in_flight", _mma_never_waited, "pipelined", "unretired wgmma"),
    "mma_two_in_flight": ("_mma_one_in_flight", _mma_two_in_flight, "pipelined", "unretired wgmma"),
    "next_stage_read": ("_stage_operands", _next_stage_operands, "pipelined", "no mbarrier wait has seen"),
    "box_never_loaded": ("_copy_source_box", _source_box_skipped, "pipelined", "deadlock"),
    "no_fence_before_tma_store": ("fence_async_shared", _no_fence, "pipelined", "no fence_async_shared"),
    "stage_released_early": ("_consume_steps", _consume_steps_early_release, "warp_specialized", "unretired wgmma"),
    "box_never_loaded_specialized": ("_copy_source_box", _source_box_skipped, "warp_specialized", "deadlock"),
}


@pytest.mark.parametrize("broken", BROKEN)
def test_emulator_catches_broken_kernels(broken, emulator, monkeypatch):
    name, replacement, mode, fault = BROKEN[broken]
    monkeypatch.setattr(conv_gluon, name, replacement)
    emulator.mode = MODES[mode]
    with pytest.raises(KernelFault, match=fault):
        conv_and_reference(TMA_CASES[0], torch.bfloat16, "cpu")


def test_emulator_catches_a_wrong_coordinate(emulator, monkeypatch):
    """A patch stored one column off (a wrong w0 in the epilogue) is no hazard: the comparison with float64 must
    catch it. Not the tile's origin: the producer and the consumers both walk it, so a shifted origin computes
    right values a column further on and leaves one column unwritten, which held the right values where the
    output's memory was a freed buffer of the same conv's (the flaky failure of CI at d9c0783)."""
    monkeypatch.setattr(conv_gluon, "_store_tile", _store_tile_one_column_off)
    emulator.mode = 2
    ours, expected = conv_and_reference(TMA_CASES[0], torch.bfloat16, "cpu")
    assert emulator.launches == {"_conv3d_gluon_kernel": 2, "_conv3d_wgrad_gluon_kernel": 1}
    assert rel_l2(ours[0], expected[0]) > 0.1 and rel_l2(ours[1], expected[1]) > 0.1


HALO_CASES = {  # (frames, split_k, channels_after, H and W modes): an even and an odd D (a tile's second frame
    # past the end); borders that read input voxels in H or W (the interior on the halo tiles, the ring on the
    # pointer kernel, whose steps are one tap along D each where the halo tiles' take all three)
    "d4": (4, 1, 0), "d5": (5, 1, 0), "d6_split3": (6, 3, 0), "d5_after": (5, 1, 16),
    "d5_replicate_w": (5, 1, 0, ("zeros", "replicate")),
    "d6_split3_reflect_h_after": (6, 3, 16, ("reflect", "zeros")),
}  # fmt: skip


def _halo_conv(frames, split, after, modes=("zeros", "zeros"), monkeypatch=None, seed=0):
    """(ours on the emulator with halo tiles, float64, the config) of a 3x3x3 forward of 32 (+ `after`
    channels_after) -> 16 channels over 2 x frames x 4 x 16 voxels, bias, padding 1: zeros along D, `modes` in H
    and W."""
    x = torch.randn(2, 32, frames, 4, 16, dtype=torch.bfloat16).contiguous(memory_format=CL)
    skip = torch.randn(2, after, frames, 4, 16, dtype=torch.bfloat16).contiguous(memory_format=CL) if after else None
    w = torch.randn(16, 32 + after, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=CL)
    b = torch.randn(16, dtype=torch.bfloat16)
    geom = check_conv3d(x, w, b, [1] * 3, [1] * 6, [1] * 3, 1, ",".join(("zeros", *modes)), channels_after=skip)
    tile = configs.with_gluon(KernelConfig(64, 16, 32, 4, 2, split_k=split), geom, "fwd", specialized=True)
    config = configs.halo_twin("fwd", geom, tile, 2)
    assert config is not None and config.halo_d == 2 and config.split_k == split, config
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch, seed) as emu:
        got = conv_fwd.conv3d_fwd(x, w, b, None, geom, config, skip)
    assert emu.launches == {"_conv3d_gluon_kernel": 1}
    want = hw_bordered_reference(x if skip is None else torch.cat([x, skip], dim=1), w, b, modes)
    return got, want


HALO_INPUT_GRADS = {  # (frames, split_k, D padding front and back): the taps flipped, asymmetric padding too
    "d5": (5, 1, (1, 1)), "d6_split3": (6, 3, (1, 1)), "d4_causal": (4, 1, (2, 0)), "d5_back": (5, 1, (0, 2)),
}  # fmt: skip


@pytest.mark.parametrize("case", HALO_INPUT_GRADS)
def test_emulated_gluon_halo_input_gradients_match_float64(case, monkeypatch):
    """The stride-1 input gradient's halo tiles: grad_out's four frames a box, output frame f reading frame
    f + 2 - kd at tap kd (the taps flipped), D padded either way."""
    frames, split, (front, back) = HALO_INPUT_GRADS[case]
    x = torch.randn(2, 16, frames, 4, 16, dtype=torch.float64)
    w = torch.randn(32, 16, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=CL)
    padding = [front, back, 1, 1, 1, 1]
    geom = check_conv3d(x.to(torch.bfloat16), w, None, [1] * 3, padding, [1] * 3, 1)
    grad_out = torch.randn(geom.output_shape(), dtype=torch.bfloat16).contiguous(memory_format=CL)
    tile = configs.with_gluon(KernelConfig(64, 16, 32, 4, 2, split_k=split), geom, "dgrad", specialized=True)
    config = configs.halo_twin("dgrad", geom, tile, 2)
    assert config is not None and config.halo_d == 2 and config.split_k == split, config
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        got = conv_dgrad.conv3d_dgrad(grad_out, w, geom, config)
    assert emu.launches == {"_conv3d_gluon_kernel": 1}
    x.requires_grad_()
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1, front, back))
    torch.nn.functional.conv3d(padded, w.double()).backward(grad_out.double())
    assert rel_l2(got, x.grad) < tolerance(torch.bfloat16)


def test_emulated_gluon_halo_input_gradient_reads_grad_outs_second_source(monkeypatch):
    """A stride-1 transposed conv of a concatenation (grad_out's 16 channels, then channels_after's 16), its halo
    boxes from both sources' descriptors at the same shifted frames."""
    from tconv3d.geometry import check_input_grad

    def bf16(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16).contiguous(memory_format=CL)

    x, other, w = bf16(2, 16, 5, 4, 16), bf16(2, 16, 5, 4, 16), bf16(32, 24, 3, 3, 3)
    geom = check_input_grad(x, w, (2, 24, 5, 4, 16), [1] * 3, [1] * 6, [1] * 3, channels_after=other)
    tile = configs.with_gluon(KernelConfig(64, 16, 16, 4, 2), geom, "dgrad", specialized=True)
    config = configs.halo_twin("dgrad", geom, tile, 2)
    assert config is not None and config.halo_d == 2, config
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: PERSISTENT_SMS)
    with emulating(monkeypatch) as emu:
        got = conv_dgrad.conv3d_dgrad(x, w, geom, config, channels_after=other)
    assert emu.launches == {"_conv3d_gluon_kernel": 1}
    want = torch.nn.functional.conv_transpose3d(torch.cat([x, other], 1).double(), w.double(), padding=1)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("case", HALO_CASES)
def test_emulated_gluon_halo_tiles_match_float64(case, monkeypatch):
    """Halo tiles (configs.halo_twin): two output frames a tile, each step one box of the four input frames they
    read and the three weight boxes along D, every (frame, kd) wgmma reading its frame of the box as a slice; an
    odd D's last tile stores one frame (the TMA store drops the other); split-K partials over the (kh, kw) steps;
    channels_after's blocks read in place beside x's."""
    got, want = _halo_conv(*HALO_CASES[case], monkeypatch=monkeypatch)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


def test_halo_splits_share_the_kh_kw_steps():
    """A halo tile's reduction is its (kh, kw) taps' channel blocks, each step all three taps along D: split-K
    divides those, every split a share (counted as 27 taps, the splits past the first third would run nothing)."""
    x = torch.randn(2, 32, 6, 4, 16, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.randn(16, 32, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=CL)
    geom = check_conv3d(x, w, None, [1] * 3, [1] * 6, [1] * 3, 1)
    tile = configs.with_gluon(KernelConfig(64, 16, 32, 4, 2, split_k=3), geom, "fwd", specialized=True)
    halo = configs.halo_twin("fwd", geom, tile, 2)
    blocks = 32 // halo.block_k
    assert kernel_config.reduction_steps("fwd", geom, halo) == 9 * blocks
    assert kernel_config.k_splits("fwd", geom, halo) == (3 * blocks, 3)
    assert kernel_config.reduction_steps("fwd", geom, tile) == 27 * 32 // tile.block_k


@pytest.mark.parametrize(("direction", "split"), [("fwd", 1), ("fwd", 3), ("dgrad", 1), ("dgrad", 2)])
def test_emulated_gluon_swapped_halo_tiles_match_float64(direction, split, monkeypatch):
    """Halo tiles swapped (swap_ab): each frame's tile transposed, the weight box wgmma's A and the frame's slice of
    the box its B (m64n128 at 128 voxels x 64 columns), forward and input gradient, split-K."""
    x = torch.randn(2, 32, 5, 8, 16, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.randn(64, 32, 3, 3, 3, dtype=torch.bfloat16).contiguous(memory_format=CL)
    b = torch.randn(64, dtype=torch.bfloat16)
    geom = check_conv3d(x, w, b, [1] * 3, [1] * 6, [1] * 3, 1)
    tile = configs.with_gluon(KernelConfig(128, 64, 32, 4, 2, split_k=split), geom, direction, specialized=True)
    config = configs.swapped_twin(configs.halo_twin(direction, geom, tile, 2), direction)
    assert config.halo_d == 2 and config.swap_ab and config.mma_tile == (64, 128), config
    got, want = _forward_or_input_gradient(direction, x, w, b, geom, config, monkeypatch)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


def test_emulated_halo_tiles_store_each_frame_where_it_belongs(monkeypatch):
    """A halo tile's two frames stored each in the other's place must fail the comparison with float64."""
    monkeypatch.setattr(conv_gluon, "_store_tile", _store_tile_frames_swapped)
    got, want = _halo_conv(4, 1, 0, monkeypatch=monkeypatch)
    assert rel_l2(got, want) > 0.5


def test_emulator_catches_a_halo_stage_released_early(monkeypatch):
    """A halo tile handing a stage back while the step before's wgmmas still read it: the emulator must fault."""
    monkeypatch.setattr(conv_gluon, "_halo_step", _halo_step_two_in_flight)
    with pytest.raises(KernelFault, match="unretired wgmma"):
        _halo_conv(6, 1, 0, monkeypatch=monkeypatch)


@pytest.mark.parametrize("seed", range(1, 4))
def test_emulated_halo_tiles_in_other_interleavings(seed, monkeypatch):
    """Halo tiles with the producer and the consumers taking turns in other orders (seeded), split-K."""
    got, want = _halo_conv(6, 3, 0, monkeypatch=monkeypatch, seed=seed)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)
