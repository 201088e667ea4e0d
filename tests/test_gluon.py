"""The Gluon kernel (kernels/conv_gluon.py: TMA into swizzled shared memory, an mbarrier ring, async wgmma with one
group in flight) for the three stride-1 implicit GEMMs in 16-bit dtypes on sm_90.

Triton's interpreter cannot run Gluon: on CPU these tests check everything around the kernel (the config field,
which launches may take it, TCONV3D_KERNELS=gluon falling back to the TMA kernel where it cannot run, explain,
the tuner's space, the SASS reader that judges its main loop); tests/test_hopper_main_loops.py compiles it for
sm_90 under triton 3.6 to 3.9. On an sm_90 GPU with any of them the same correctness tests run the kernel itself against
float64, every TMA case of the suite."""

import dataclasses

import pytest
import torch
from helpers import (
    HALF_TAIL_TILES,
    conv_and_reference,
    dtype_id,
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
from tconv3d.geometry import conv_geometry
from tconv3d.inspect.compile import main_loop
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_gluon, conv_wgrad
from tconv3d.kernels.config import DIRECTIONS, KernelConfig
from tconv3d.testing import rel_l2, tolerance
from tconv3d.tune import choice, configs, tuner
from tconv3d.tune.shapes import load_shape_set

CL = torch.channels_last_3d
DTYPES_16 = [torch.bfloat16, torch.float16]


def gluon_runs(device: str) -> bool:
    return choice._gluon_runs(torch.device(device))


@pytest.fixture
def gluon(monkeypatch, device):
    """TCONV3D_KERNELS=gluon, recording each launch as (variant, direction)."""
    monkeypatch.setattr(settings, "KERNELS", "gluon")
    monkeypatch.setattr(choice, "_memo", {})
    launches = []
    for module, direction, launcher, variant in (
        (conv_fwd, "fwd", "conv3d_gluon", "gluon"), (conv_dgrad, "dgrad", "conv3d_gluon", "gluon"),
        (conv_fwd, "fwd", "conv3d_tma", "tma"), (conv_dgrad, "dgrad", "conv3d_tma", "tma"),
        (conv_wgrad, "wgrad", "conv3d_wgrad_gluon", "gluon"), (conv_wgrad, "wgrad", "conv3d_wgrad_tma", "tma"),
    ):  # fmt: skip
        real = getattr(module, launcher)
        record = (variant, direction)
        monkeypatch.setattr(module, launcher, lambda *a, real=real, r=record, **k: launches.append(r) or real(*a, **k))
    return launches


@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
@pytest.mark.parametrize("index", range(len(TMA_CASES)))
def test_gluon_variant_matches_float64(index, dtype, gluon, device):
    if device != "cuda" and (index, dtype) != (0, torch.bfloat16):
        # The interpreter runs the TMA kernel in the Gluon one's place (tests/test_tma.py tests it on every case):
        # one case shows the fallback; a GPU that runs Gluon gets every case in both dtypes.
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    case = TMA_CASES[index]
    ours, expected = conv_and_reference(case, dtype, device)
    for got, want in zip(ours, expected, strict=True):  # output, input, weight and bias gradients
        assert rel_l2(got, want) < tolerance(dtype)
    assert ours[0].is_contiguous(memory_format=CL) and ours[1].is_contiguous(memory_format=CL)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, "fwd"), (first, "dgrad"), (first, "wgrad")]


@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
@pytest.mark.parametrize("index", range(len(TMA_CASES)))
def test_gluon_swapped_operands_match_float64(index, dtype, gluon, monkeypatch, device):
    """The forward and input gradient with their operands swapped (swap_ab: each tile computed transposed, the
    weight box as wgmma's A) on every TMA case, at the chosen tiles with at least 16 columns a warp. On CPU the
    interpreter runs the TMA kernel in the Gluon one's place (one case shows that; tests/test_gluon_emulated.py
    runs the Gluon kernel on the emulator)."""
    if device != "cuda" and (index, dtype) != (0, torch.bfloat16):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    select, chosen = choice._select, []

    def swapped(direction, *args):
        config = select(direction, *args)
        if config.gluon and direction != "wgrad":
            config = swapped_tiles(config)
        chosen.append((direction, config.swap_ab))
        return config

    monkeypatch.setattr(choice, "_select", swapped)
    ours, expected = conv_and_reference(TMA_CASES[index], dtype, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(dtype)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, "fwd"), (first, "dgrad"), (first, "wgrad")]
    swaps = int(gluon_runs(device))
    # the weight gradient as chosen: transposed where it has at most 32 output channels (swapped_wgrad_tiles)
    assert chosen[:2] == [("fwd", swaps), ("dgrad", swaps)] and chosen[2][0] == "wgrad"


def _with_weight_grad_tiles(index, retile, gluon, monkeypatch, device) -> list:
    """TMA case `index` in bf16 against float64 with the Gluon weight gradient's tiles `retile`d, every direction
    forced to Gluon as a GPU forces it (on CPU the TMA kernel runs instead, the tile back to what it takes); returns
    (direction, swap_ab, tap_group) as launched."""
    select, chosen = choice._select, []

    def retiled(direction, *args):
        config = select(direction, *args)
        if config.gluon and direction == "wgrad":
            config = retile(config)
        config = choice.force_variant(direction, args[0], args[1], config, "gluon", gluon_runs(device))
        chosen.append((direction, config.swap_ab, config.tap_group))
        return config

    monkeypatch.setattr(choice, "_select", retiled)
    ours, expected = conv_and_reference(TMA_CASES[index], torch.bfloat16, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, "fwd"), (first, "dgrad"), (first, "wgrad")]
    return chosen


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("index", range(len(TMA_CASES)))
def test_gluon_grouped_taps_match_float64(index, group, gluon, monkeypatch, device):
    """The warp-specialized weight gradient with 2 or 4 taps a tile (tap_group: their input boxes in column slices
    of one stage, one wgmma across them) on every TMA case, bf16. On CPU the interpreter runs the TMA kernel in the
    Gluon one's place, the tile back to one tap (one case shows that; tests/test_gluon_emulated.py runs the Gluon
    kernel on the emulator)."""
    if device != "cuda" and (index, group) != (0, 2):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    chosen = _with_weight_grad_tiles(index, lambda config: grouped_taps(config, group), gluon, monkeypatch, device)
    # swap_ab as chosen: transposed where the weight gradient has at most 32 output channels (swapped_wgrad_tiles)
    assert chosen[:2] == [("fwd", 0, 0), ("dgrad", 0, 0)]
    assert chosen[2][::2] == ("wgrad", group if gluon_runs(device) else 0)


@pytest.mark.parametrize("index, group, per_tap", swapped_weight_grad_params(TMA_CASES))
def test_gluon_swapped_weight_gradient_matches_float64(index, group, per_tap, gluon, monkeypatch, device):
    """The warp-specialized weight gradient computed transposed (swap_ab: the taps' input boxes on the wgmma's rows,
    `group` of them a tile, `per_tap` channels each where there are 2 or 4, in a buffer swizzled 64 or 32 bytes
    wide), bf16: 4 taps of 32 channels a tile on every TMA case; 1, 2, and 4 of 16 channels on a few. On CPU the TMA
    kernel runs in its place, the tile back to one tap, unswapped (one case shows that; tests/test_gluon_emulated.py
    runs the Gluon kernel on the emulator)."""
    if device != "cuda" and (index, group) != (0, 4):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    retile = lambda config: swapped_weight_grad_tiles(config, group, per_tap)  # noqa: E731
    chosen = _with_weight_grad_tiles(index, retile, gluon, monkeypatch, device)
    swapped = (1, group if group > 1 else 0) if gluon_runs(device) else (0, 0)
    assert chosen == [("fwd", 0, 0), ("dgrad", 0, 0), ("wgrad", *swapped)]


CAUSAL_BORDERS = [  # (mode along D, modes in H and W, cached frames), as the video VAEs' causal convs call them
    ("replicate", ("zeros", "zeros"), 0),
    ("zeros", ("zeros", "zeros"), 2),
    ("replicate", ("zeros", "zeros"), 2),
    ("replicate", ("replicate", "replicate"), 0),
    ("replicate", ("reflect", "reflect"), 2),
]


@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
@pytest.mark.parametrize("border", CAUSAL_BORDERS, ids=lambda b: f"{b[0]}_{'_'.join(b[1])}_{b[2]}")
def test_gluon_causal_borders_match_float64(border, dtype, gluon, device):
    """The video VAEs' causal convs through the Gluon kernels: border modes and cached frames along D in the
    forward and weight gradient, and their interior under borders in H and W (the strips on the pointer kernels).
    On CPU the interpreter runs the TMA kernel in its place (one case shows that; tests/test_tma.py runs them
    all)."""
    if device != "cuda" and (border, dtype) != (CAUSAL_BORDERS[0], torch.bfloat16):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    mode_d, modes_hw, before = border
    ours, expected = conv_with_border_along_d(mode_d, 1, before, dtype, device, modes_hw)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(dtype)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, direction) for direction in ("fwd", "dgrad", "wgrad")]


@pytest.mark.parametrize(("channels", "modes", "before", "swapped"), DECODER_WEIGHT_GRADS, ids=DECODER_WEIGHT_GRAD_IDS)
def test_gluon_decoder_weight_gradients_as_chosen(channels, modes, before, swapped, monkeypatch, device):
    """A video VAE decoder's fine-tuning step: the weight gradient of a layer reading cached frames or bordered in
    H and W on the Gluon kernel as the sm_90 heuristic chooses it (transposed where Cout <= 32; the border strips
    on the pointer kernel), against float64. On CPU tests/test_gluon_emulated.py runs the same through the
    emulator."""
    if not gluon_runs(device):
        pytest.skip("compiled Gluon kernels run on an sm_90 GPU (the emulator's test runs this on CPU)")
    sms = configs.multiprocessor_count(torch.device(device))
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", lambda d, g, dtype, dev, run: configs.heuristic_config(d, g, dtype, sms, 90))
    launched = []
    real = conv_wgrad.conv3d_wgrad_gluon
    monkeypatch.setattr(conv_wgrad, "conv3d_wgrad_gluon", lambda *a: launched.append(a[4]) or real(*a))
    mode_d, *modes_hw = modes
    ours, expected = conv_with_border_along_d(mode_d, 1, before, torch.bfloat16, device, tuple(modes_hw), channels)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    chosen = configs.heuristic_config("wgrad", decoder_geometry(channels, modes, before), torch.bfloat16, sms, 90)
    assert launched == [chosen] and chosen.gluon == 2 and (chosen.tap_group if chosen.swap_ab else 0) == swapped


@pytest.mark.parametrize("specialized", [False, True], ids=["pipelined", "warp_specialized"])
@pytest.mark.parametrize(("kernel", "padding", "modes"), RING_BORDERS)
def test_gluon_forward_splits_its_interior_beside_the_border_ring(kernel, padding, modes, specialized, monkeypatch,
                                                                  device):  # fmt: skip
    """Reflect-bordered layers of few tiles on small_grid_twin's tiles (the sm_90 heuristic's for LTX-2's layers until
    H200 run 5 timed the pointer kernel faster): the interior on the Gluon kernel's one-warpgroup 64-row tiles,
    split three ways into fp32 partial sums over a view of them, the border ring in the same splits on the pointer
    kernel, against float64. On CPU tests/test_gluon_emulated.py runs the same through the emulator."""
    if not gluon_runs(device):
        pytest.skip("compiled Gluon kernels run on an sm_90 GPU (the emulator's test runs this on CPU)")
    config = KernelConfig(64, 32, 16, 4, 3, split_k=3)
    y, want, launched = bordered_forward(
        kernel, padding, modes, lambda geom: configs.with_gluon(config, geom, "fwd", specialized=specialized),
        monkeypatch, torch.bfloat16, device,
    )  # fmt: skip
    assert rel_l2(y, want) < tolerance(torch.bfloat16)
    assert [(name, ring) for name, _, ring in launched] == [
        ("_conv3d_gluon_kernel", None),
        ("_conv3d_fwd_kernel", True),
    ]


@pytest.mark.parametrize("specialized", [False, True], ids=["pipelined", "warp_specialized"])
@pytest.mark.parametrize(("source", "split"), [("frames_before", 3), ("channels_after", 5), ("out_after", 6)])
def test_gluon_split_reads_a_second_source(source, split, specialized, device):
    """Wan's cached-frame layers of few tiles, a UNet decoder's small convs of a concatenation and MONAI UNet's deep
    up conv as the sm_90 heuristic runs them (configs.small_grid_twin): the Gluon kernel's one-warpgroup tiles, the
    reduction split over both sources' blocks, against float64. On CPU tests/test_gluon_emulated.py runs the same
    through the emulator."""
    if not gluon_runs(device):
        pytest.skip("compiled Gluon kernels run on an sm_90 GPU (the emulator's test runs this on CPU)")
    config = dataclasses.replace(KernelConfig(64, 16, 16, 4, 3, split_k=split), gluon=2 if specialized else 1)
    got, want, launched = second_source_split(source, config, device)
    assert launched.gluon == (2 if specialized else 1) and launched.split_k == split
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES_16, ids=dtype_id)
@pytest.mark.parametrize("case", ["unet_skip", "residual_1x1"])
def test_gluon_channels_after_match_float64(case, dtype, gluon, device):
    """A UNet decoder's skip connection read in place (channels_after) through the Gluon kernels: the forward's
    channel blocks from two descriptors, the weight gradient one launch per source. On CPU the interpreter runs the
    TMA kernel in its place (one case shows that; tests/test_channels_after.py and the emulator run the rest)."""
    from test_channels_after import CASES as AFTER_CASES
    from test_channels_after import conv_and_reference as after_conv_and_reference

    if device != "cuda" and (case, dtype) != ("unet_skip", torch.bfloat16):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    ours, expected = after_conv_and_reference(next(c for c in AFTER_CASES if c[0] == case), dtype, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(dtype)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, "fwd"), (first, "dgrad"), (first, "wgrad"), (first, "wgrad")]


@pytest.mark.parametrize("specialized", [False, True], ids=["pipelined", "warp_specialized"])
@pytest.mark.parametrize("case", UNALIGNED_OUTPUT, ids=lambda c: c.name)
def test_gluon_forward_stores_unaligned_output_rows(case, specialized, gluon, monkeypatch, device):
    """A forward to 3 or 5 channels (a decoder's conv_out) through the Gluon kernels, which store its rows from
    registers (DST_PTR), software-pipelined and warp-specialized; the gradients stay on the pointer kernels. On
    CPU the interpreter runs the TMA kernel in its place (one case shows that; tests/test_tma.py runs them all)."""
    if device != "cuda" and (case, specialized) != (UNALIGNED_OUTPUT[0], False):
        pytest.skip("the interpreter runs the TMA kernel in the Gluon one's place: one case shows that")
    if specialized:
        select = choice._select

        def warp_specialized(*args):
            config = select(*args)
            return dataclasses.replace(config, gluon=2) if config.gluon else config

        monkeypatch.setattr(choice, "_select", warp_specialized)
    ours, expected = conv_and_reference(case, torch.bfloat16, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)
    assert gluon == [("gluon" if gluon_runs(device) else "tma", "fwd")]


def test_gluon_unavailable_is_explained(gluon, device):
    x = torch.randn(1, 16, 3, 5, 6, device=device, dtype=torch.bfloat16).contiguous(memory_format=CL)
    w = torch.randn(16, 16, 3, 3, 3, device=device, dtype=torch.bfloat16)
    plan = tconv3d.explain(x, w, padding=1)
    # replicate in H and W with no interior in H (two rows, a border row each side): a weight gradient no box
    # kernel reads (with an interior, the box kernels reduce over it and the pointer kernel over the borders)
    rows = torch.randn(1, 16, 3, 2, 6, device=device, dtype=torch.bfloat16).contiguous(memory_format=CL)
    replicate = tconv3d.explain(rows, w, padding=1, padding_mode="replicate")
    assert replicate["wgrad"]["variant"] == "pointer"
    if gluon_runs(device):
        assert {p["variant"] for p in plan.values()} == {"gluon"}
        assert "not this launch" in replicate["wgrad"]["gluon_unavailable"]
    else:
        assert {p["variant"] for p in plan.values()} == {"tma"}  # the TMA kernel where the Gluon one cannot run
        reason = plan["fwd"]["gluon_unavailable"]
        assert "interpreter" in reason or "Triton" in reason or "sm_90" in reason, reason
    assert not gluon  # explain launches nothing


@pytest.mark.parametrize("index", [0, 2])
def test_gluon_fp32_as_tf32(index, gluon, monkeypatch, device):
    """fp32 with TF32 allowed (cuDNN's default): the forward and the input gradient (over a transposed copy of the
    weight) on the Gluon kernel, wgmma reading fp32 as TF32; the weight gradient on the TMA kernel; within the TF32
    bound of float64. On CPU the interpreter runs the TMA kernel in the Gluon one's place
    (tests/test_gluon_emulated.py runs the Gluon kernel on the emulator)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    ours, expected = conv_and_reference(TMA_CASES[index], torch.float32, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.float32)
    first = "gluon" if gluon_runs(device) else "tma"
    assert gluon == [(first, "fwd"), (first, "dgrad"), ("tma", "wgrad")]


def test_fp32_gluon_forward_needs_tf32(monkeypatch):
    """The choice follows torch.backends.cudnn.allow_tf32 at every launch, memoised per setting: a table's fp32
    Gluon entry runs on the TMA kernel (exact products) while TF32 is off, and on the Gluon kernel again once it is
    on; explain says why."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    monkeypatch.setattr(choice, "_memo", {})
    geom = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1)
    entry = configs.with_gluon(KernelConfig(128, 64, 32, 4, 3), geom, "fwd")

    def from_table(direction, geom, dtype, device, run):
        return choice.force_variant(direction, geom, dtype, entry, "auto", True)

    monkeypatch.setattr(choice, "_select", from_table)
    cpu = torch.device("cpu")
    variants = []
    for allowed in (True, False, True):
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", allowed)
        variants.append(choice.pick_config("fwd", geom, torch.float32, cpu).variant)
    assert variants == ["gluon", "tma", "gluon"]
    assert choice.pick_config("fwd", geom, torch.bfloat16, cpu).variant == "gluon"  # 16-bit: whatever the setting
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(settings, "INTERPRET", False)  # what an sm_90 device would be told
    monkeypatch.setattr(configs, "compute_capability", lambda device: configs.GLUON_CAPABILITY)
    assert "may not use TF32" in choice.gluon_unavailable("fwd", geom, torch.float32, torch.device("cuda"))


def test_gluon_config_field_round_trips_and_is_checked():
    config = KernelConfig(128, 256, 64, 8, 3, tma_box_w=16, gluon=1)
    assert KernelConfig.from_dict(config.to_dict()) == config and config.variant == "gluon"
    assert "gluon" not in KernelConfig(128, 128, 64, 8, 3, tma_box_w=16).to_dict()  # old tables read the same
    specialized = dataclasses.replace(config, gluon=2)  # the warp-specialized producer
    assert KernelConfig.from_dict(specialized.to_dict()) == specialized and specialized.variant == "gluon"
    swapped = KernelConfig(256, 128, 64, 8, 3, tma_box_w=16, gluon=2, swap_ab=1)  # m64n256 on 128 columns
    assert KernelConfig.from_dict(swapped.to_dict()) == swapped and "swap_ab" not in specialized.to_dict()
    with pytest.raises(ValueError, match="block_n and block_m with swap_ab"):  # 8 warps: 128 columns swapped
        KernelConfig.from_dict({**swapped.to_dict(), "block_n": 64})
    with pytest.raises(ValueError, match="only a gluon config swaps"):
        KernelConfig.from_dict({**swapped.to_dict(), "gluon": 0})
    grouped = KernelConfig(128, 256, 64, 8, 3, tma_box_w=16, gluon=2, tap_group=2)  # two taps of 128 channels
    assert KernelConfig.from_dict(grouped.to_dict()) == grouped and "tap_group" not in specialized.to_dict()
    transposed = KernelConfig(32, 128, 64, 8, 3, tma_box_w=16, gluon=2, swap_ab=1, tap_group=4)  # 4 x 32 rows
    assert KernelConfig.from_dict(transposed.to_dict()) == transposed and transposed.mma_tile == (128, 32)
    for change, message in (
        ({"tap_group": 3}, "tap_group is 0, 1, 2 or 4"), ({"gluon": 1}, "only a warp-specialized gluon config"),
        ({"block_n": 32, "tap_group": 4, "num_warps": 4}, "16\\+ columns a tap"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            KernelConfig.from_dict({**grouped.to_dict(), **change})
    bad = [
        ({"gluon": 3}, "gluon is 0, 1 or 2"),
        ({"swap_ab": 2}, "swap_ab is 0 or 1"),
        ({"tma_box_w": 0}, "has a TMA box"),
        ({"block_m": 64}, "block_m >= 16 x warps"),  # 8 warps need 128 rows of wgmma atoms
        ({"block_n": 512}, "block_n <= 256"),
        ({"num_stages": 1}, "2\\+ stages"),
    ]
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            KernelConfig.from_dict({**config.to_dict(), **change})


def test_halo_tiles_are_the_narrow_forwards_and_checked(monkeypatch):
    """Halo tiles (configs.halo_twin: two output frames a tile, the three kd taps' input frames one box) for a
    plain stride-1 3x3x3 forward on the persistent Gluon kernel, the ring the deepest that keeps its programs an SM;
    not where its two accumulators would spill; nowhere a box of four frames would be remapped, strided, longer than
    the tensor or stored from registers; a table entry lent to such a layer drops them; the config field round-trips
    and is checked."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)  # the rules as on triton 3.6, whatever runs here
    narrow = conv_geometry((2, 64, 64, 64, 64), (64, 64, 3, 3, 3), 1, 1, 1)  # unet_64
    tile = configs.heuristic_config("fwd", narrow, torch.bfloat16, 132, 90, timed_only=True)  # before its halo tiles
    halo = configs.halo_twin("fwd", narrow, tile, 2)
    assert (halo.halo_d, halo.block_m, halo.block_n, halo.gluon) == (2, 128, 64, 2) and halo.halo_d == 2
    element = 2
    assert conv_gluon.programs_an_sm(halo, element, False) == conv_gluon.programs_an_sm(tile, element, False) == 2
    assert conv_gluon.resident_programs(halo, element, False) == 2  # its ring and epilogue tile fit twice
    # FLOPs a byte of operands from L2: 4 frames of box for the 3 taps along D of 2 frames
    intensity = configs.operand_intensity("fwd", narrow, halo, element)
    assert round(configs.operand_intensity("fwd", narrow, tile, element), 1) == 42.7 and round(intensity, 1) == 69.8
    assert KernelConfig.from_dict(halo.to_dict()) == halo and "halo_d" not in tile.to_dict()
    for change, message in (({"halo_d": 3}, "halo_d is 0 or 2"), ({"gluon": 1}, "only a warp-specialized gluon"),
                            ({"gluon": 0}, "only a warp-specialized gluon")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            KernelConfig.from_dict({**halo.to_dict(), **change})
    deep = configs.halo_twin("fwd", narrow, tile, 2, programs=1)  # one program an SM, a deeper ring
    assert (deep.block_k, deep.num_stages, conv_gluon.programs_an_sm(deep, element, False)) == (32, 4, 1)
    assert configs.heuristic_config("fwd", narrow, torch.bfloat16, 132, 90) == deep  # the heuristic's (H200 run 5)
    assert deep in configs.own_twins("fwd", narrow, tile, torch.bfloat16, 232448)
    swapped = configs.swapped_twin(halo, "fwd")  # each frame's tile transposed: m64n128
    assert swapped.swap_ab and KernelConfig.from_dict(swapped.to_dict()) == swapped
    assert configs.halo_eligible("fwd", narrow, swapped, 2) and swapped in configs.own_twins(
        "fwd", narrow, tile, torch.bfloat16, 232448
    )
    wgrad = configs.heuristic_config("wgrad", narrow, torch.bfloat16, 132, 90)
    assert configs.halo_twin("wgrad", narrow, wgrad, 2) is None and configs.halo_twin("fwd", narrow, tile, 4) is None
    # two accumulators of 256 x 128 on 8 warps (wan_dec_96's swapped tile): 256 registers a thread, spilled
    wide = conv_geometry((1, 96, 16, 60, 104), (96, 96, 3, 3, 3), 1, 1, 1)
    tall = configs.swapped_twin(configs.with_gluon(KernelConfig(256, 128, 32, 8, 3), wide, "fwd", True), "fwd")
    assert configs.halo_eligible("fwd", wide, tall, 2) and configs.halo_twin("fwd", wide, tall, 2) is None
    assert configs.halo_twin("fwd", wide, configs.with_gluon(KernelConfig(128, 128, 32, 8, 3), wide, "fwd", True), 2)
    dgrad = configs.heuristic_config("dgrad", narrow, torch.bfloat16, 132, 90, timed_only=True)
    assert configs.halo_twin("dgrad", narrow, dgrad, 2).halo_d == 2  # a forward of grad_out, its taps flipped
    refused = {
        "causal": conv_geometry((2, 64, 8, 64, 64), (64, 64, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1,
                                padding_mode="replicate,zeros,zeros"),
        "cached_frames": conv_geometry((2, 64, 8, 64, 64), (64, 64, 3, 3, 3), 1, (0, 0, 1, 1, 1, 1), 1,
                                       prefix_frames=2),
        "strided": conv_geometry((2, 64, 64, 64, 64), (64, 64, 3, 3, 3), 2, 1, 1),
        "three_frames": conv_geometry((2, 64, 3, 64, 64), (64, 64, 3, 3, 3), 1, 1, 1),
        "1x3x3": conv_geometry((2, 64, 64, 64, 64), (64, 64, 1, 3, 3), 1, (0, 0, 1, 1, 1, 1), 1),
        "dilated": conv_geometry((2, 64, 64, 64, 64), (64, 64, 3, 3, 3), 1, 2, 2),
        "3_channels": conv_geometry((2, 64, 64, 64, 64), (3, 64, 3, 3, 3), 1, 1, 1),
    }  # fmt: skip
    for name, geom in refused.items():
        for direction in ("fwd", "dgrad"):
            if name == "3_channels" and direction == "dgrad":
                continue  # 64 input channels: its input gradient may (its 3-channel grad_out is not TMA-aligned)
            plain = choice.force_variant(direction, geom, torch.bfloat16, tile, "gluon", True)
            assert configs.halo_twin(direction, geom, dataclasses.replace(plain, gluon=2), 2) is None, name
            # the narrow layer's halo tiles lent to it (a nearest key's) run without the halo
            assert choice.force_variant(direction, geom, torch.bfloat16, halo, "auto", True).halo_d == 0, name
    assert choice.force_variant("fwd", narrow, torch.bfloat16, halo, "auto", True) == halo
    assert choice.force_variant("fwd", narrow, torch.bfloat16, halo, "pointer", True).halo_d == 0
    assert halo in configs.own_twins("fwd", narrow, tile, torch.bfloat16, 232448)  # the tuner times it


@pytest.mark.parametrize("swap", [False, True], ids=["as_is", "swapped"])
@pytest.mark.parametrize(("frames", "split", "front"), [(5, 1, 1), (6, 3, 1), (4, 1, 2)])
def test_gluon_halo_input_gradients_match_float64(frames, split, front, swap, device):
    """The stride-1 input gradient's halo tiles on the GPU, also swapped, with a bias per input channel (a
    transposed convolution's; the emulator's tests run the same on CPU)."""
    if not gluon_runs(device):
        pytest.skip("compiled Gluon kernels run on an sm_90 GPU (the emulator's test runs this on CPU)")
    x = torch.randn(2, 64, frames, 8, 32, device=device, dtype=torch.float64, requires_grad=True)
    w = torch.randn(32, 64, 3, 3, 3, device=device).to(torch.bfloat16).contiguous(memory_format=CL)
    padding = [front, 2 - front, 1, 1, 1, 1]
    geom = tconv3d.geometry.check_conv3d(x.detach().to(torch.bfloat16), w, None, [1] * 3, padding, [1] * 3, 1)
    grad_out = torch.randn(geom.output_shape(), device=device).to(torch.bfloat16).contiguous(memory_format=CL)
    tile = configs.with_gluon(KernelConfig(128, 64, 64, 4, 3, split_k=split), geom, "dgrad", specialized=True)
    config = configs.halo_twin("dgrad", geom, tile, 2)
    config = configs.swapped_twin(config, "dgrad") if swap else config
    assert config.halo_d == 2 and config.split_k == split and config.swap_ab == swap
    b = torch.randn(64, device=device).to(torch.bfloat16)
    got = conv_dgrad.conv3d_dgrad(grad_out, w, geom, config, bias=b)
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1, front, 2 - front))
    torch.nn.functional.conv3d(padded, w.double()).backward(grad_out.double())
    assert rel_l2(got, x.grad + b.double().view(1, -1, 1, 1, 1)) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("swap", [False, True], ids=["as_is", "swapped"])
@pytest.mark.parametrize(
    ("frames", "split", "after", "modes"),
    [(4, 1, 0, ("zeros",) * 2), (5, 1, 0, ("zeros",) * 2), (6, 3, 0, ("zeros",) * 2), (5, 1, 16, ("zeros",) * 2),
     (6, 3, 16, ("reflect", "replicate"))],
)  # fmt: skip
def test_gluon_halo_tiles_match_float64(frames, split, after, modes, swap, device):
    """Halo tiles on the GPU (tests/test_gluon_emulated.py runs the same on CPU): two frames a tile, the four
    input frames of the three kd taps one box, split-K, an odd D's last tile, channels_after; borders in H and W
    that read input voxels (the ring around the halo tiles' interior on the pointer kernel, in their splits)."""
    if not gluon_runs(device):
        pytest.skip("compiled Gluon kernels run on an sm_90 GPU (the emulator's test runs this on CPU)")
    x = torch.randn(2, 32, frames, 8, 32, device=device).to(torch.bfloat16).contiguous(memory_format=CL)
    skip = torch.randn(2, after, frames, 8, 32, device=device).to(torch.bfloat16).contiguous(memory_format=CL)
    w = torch.randn(64, 32 + after, 3, 3, 3, device=device).to(torch.bfloat16).contiguous(memory_format=CL)
    b = torch.randn(64, device=device).to(torch.bfloat16)
    skip = skip if after else None
    geom = tconv3d.geometry.check_conv3d(
        x, w, b, [1] * 3, [1] * 6, [1] * 3, 1, ",".join(("zeros", *modes)), channels_after=skip
    )
    tile = configs.with_gluon(KernelConfig(128, 64, 64, 4, 3, split_k=split), geom, "fwd", specialized=True)
    config = configs.halo_twin("fwd", geom, tile, 2)
    config = configs.swapped_twin(config, "fwd") if swap else config
    assert config.halo_d == 2 and config.split_k == split and config.swap_ab == swap
    got = conv_fwd.conv3d_fwd(x, w, b, None, geom, config, skip)
    want = hw_bordered_reference(x if skip is None else torch.cat([x, skip], dim=1), w, b, modes)
    assert rel_l2(got, want) < tolerance(torch.bfloat16)


def test_force_variant_rules(monkeypatch):
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)  # the rules as on triton 3.6, whatever runs here
    geom = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1)
    pointer = KernelConfig(64, 64, 32, 8, 1)

    def force(direction, dtype, kernels, runs=True, config=pointer):
        return choice.force_variant(direction, geom, dtype, config, kernels, runs)

    for direction in ("fwd", "dgrad", "wgrad"):
        forced = force(direction, torch.bfloat16, "gluon")
        assert forced.variant == "gluon" and configs.gluon_takes(forced) and forced.tma_box_w == 16
        assert force(direction, torch.bfloat16, "gluon", runs=False).variant == "tma"  # no sm_90 / Triton 3.6
        assert force(direction, torch.float32, "gluon").variant == "tma"  # exact fp32 (the tests' default)
        with monkeypatch.context() as tf32:
            tf32.setattr(torch.backends.cudnn, "allow_tf32", True)  # fp32 as TF32: K-major operands, not wgrad's
            assert force(direction, torch.float32, "gluon").variant == ("tma" if direction == "wgrad" else "gluon")
        assert force(direction, torch.bfloat16, "tma", config=forced).variant == "tma"
        assert force(direction, torch.bfloat16, "pointer", config=forced).variant == "pointer"
        swapped = configs.swapped_twin(dataclasses.replace(forced, block_m=128, block_n=64, num_warps=4), direction)
        if direction == "wgrad":
            assert swapped is None  # the weight gradient swaps by its own rule (swapped_wgrad_twin)
        else:  # a swapped table entry on TMA or pointer (no sm_90 / Triton 3.6) drops the swap with the Gluon kernel
            assert swapped.swap_ab and force(direction, torch.bfloat16, "auto", config=swapped) == swapped
            assert not force(direction, torch.bfloat16, "auto", runs=False, config=swapped).swap_ab
            assert not force(direction, torch.bfloat16, "pointer", config=swapped).swap_ab
        grouped = configs.grouped_taps_twin(dataclasses.replace(forced, block_n=128, gluon=2), direction)
        if direction != "wgrad":
            assert grouped is None  # only the weight gradient groups taps
        else:  # off the Gluon kernel, the tile goes back to one tap's 128 columns
            assert (grouped.block_n, grouped.tap_group) == (256, 2)
            assert force(direction, torch.bfloat16, "auto", config=grouped) == grouped
            for fallback in (force(direction, torch.bfloat16, "auto", runs=False, config=grouped),
                             force(direction, torch.bfloat16, "pointer", config=grouped)):  # fmt: skip
                assert (fallback.gluon, fallback.tap_group, fallback.block_n) == (0, 0, 128)
            # 8 channels a tap (16-byte rows, narrower than TMA's narrowest swizzle, 32 bytes: 16 channels a tap are
            # whole swizzle rows since 2026-11-28; 32 channels a tap in a buffer swizzled 128 bytes wide were what the
            # compiler refused on the H100, 2026-11-26): not a tile the kernel takes; forced to Gluon, the taps go
            # back to one
            narrow = dataclasses.replace(grouped, block_n=32, tap_group=4)
            assert not configs.gluon_takes(narrow) and configs.gluon_takes(dataclasses.replace(narrow, tap_group=2))
            refused = force(direction, torch.bfloat16, "gluon", config=narrow)
            assert configs.gluon_takes(refused) and refused.tap_group == 0 and refused.gluon == 1
        assert force(direction, torch.bfloat16, "auto", config=forced) == forced  # a table's Gluon entry stands
        assert force(direction, torch.bfloat16, "auto", runs=False, config=forced).variant == "tma"
    split = KernelConfig(64, 64, 32, 8, 3, split_k=8)
    assert force("wgrad", torch.bfloat16, "gluon", config=split).split_k == 8  # the weight gradient keeps its splits
    # replicate in H and W: the forward's and weight gradient's interior on the Gluon kernel (border strips on the
    # pointer kernel), the input gradient whole; at a stride in H and W no interior of stride-1 boxes is left
    replicate = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1, "replicate")
    for direction in ("fwd", "dgrad", "wgrad"):
        assert choice.force_variant(direction, replicate, torch.bfloat16, pointer, "gluon", True).variant == "gluon"
    replicate_strided = dataclasses.replace(replicate, stride=(1, 2, 2), out_size=(4, 4, 26))
    assert choice.force_variant("wgrad", replicate_strided, torch.bfloat16, pointer, "gluon", True).variant == "pointer"
    strided = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 2, 1, 1)
    table_entry = dataclasses.replace(force("fwd", torch.bfloat16, "gluon"))
    for direction in ("fwd", "dgrad", "wgrad"):  # phase views
        assert choice.force_variant(direction, strided, torch.bfloat16, table_entry, "auto", True).variant == "gluon"
    stride3 = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), (1, 3, 3), 1, 1)  # 9 phase views: too many
    assert choice.force_variant("fwd", stride3, torch.bfloat16, table_entry, "auto", True).variant == "pointer"


def test_tuning_space_holds_gluon_twins_where_they_run(monkeypatch):
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    geom = conv_geometry((1, 128, 4, 16, 64), (256, 128, 3, 3, 3), 1, 1, 1)
    space = configs.candidates("fwd", geom, torch.bfloat16, 227 * 1024, tma=True, gluon=True)
    twins = [c for c in space if c.gluon]
    assert twins and all(configs.gluon_takes(c) and c.tma_box_w for c in twins)
    assert any((c.block_m, c.block_n, c.num_warps) == (128, 256, 8) for c in twins)  # the Hopper GEMM tile
    # and swapped (persistent, wider voxels than columns): 256 voxels x 128 columns as m64n256; not the weight
    # gradient's
    assert any((c.block_m, c.block_n, c.gluon, c.swap_ab) == (256, 128, 2, 1) for c in twins)
    assert all(c.gluon == 2 and c.block_m > c.block_n for c in twins if c.swap_ab)
    assert not any(c.swap_ab for c in configs.candidates("wgrad", geom, torch.bfloat16, 227 * 1024, True, True))
    # the weight gradient's taps grouped to 256 columns (persistent only), not the forward's
    grouped = [c for c in configs.candidates("wgrad", geom, torch.bfloat16, 227 * 1024, True, True) if c.tap_group]
    assert grouped and all(c.gluon == 2 and c.block_n == 256 and c.block_n // c.tap_group >= 64 for c in grouped)
    assert not any(c.tap_group for c in twins)
    # and the tuner times it: among the candidates nearest the heuristic's 128x128 on Wan's largest layer
    wan = next(s for s in load_shape_set("bench") if s.name == "wan_dec_384b").geometry()
    for direction in ("fwd", "dgrad"):
        default = configs.heuristic_config(direction, wan, torch.bfloat16, 132, configs.GLUON_CAPABILITY)
        found = configs.candidates(direction, wan, torch.bfloat16, 227 * 1024, True, True)
        near = tuner.nearest_candidates(found, default, tuner.CANDIDATES_PER_KEY)
        assert any((c.block_m, c.block_n, c.gluon, c.swap_ab) == (256, 128, 2, 1) for c in near), direction
    assert not any(c.gluon for c in configs.candidates("fwd", geom, torch.float32, 227 * 1024, True, True))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    for direction in ("fwd", "dgrad"):
        assert any(c.gluon for c in configs.candidates(direction, geom, torch.float32, 227 * 1024, True, True))
    # the weight gradient's fp32 boxes reach wgmma M- and N-major
    assert not any(c.gluon for c in configs.candidates("wgrad", geom, torch.float32, 227 * 1024, True, True))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    wgrad = [c for c in configs.candidates("wgrad", geom, torch.bfloat16, 227 * 1024, True, True) if c.gluon]
    assert wgrad and any(c.split_k > 1 for c in wgrad) and all(configs.gluon_takes(c) for c in wgrad)
    assert not any(c.gluon for c in configs.candidates("fwd", geom, torch.bfloat16, 227 * 1024, True, False))
    base = KernelConfig(128, 128, 64, 8, 3, tma_box_w=16)
    assert tuner.config_steps(base, dataclasses.replace(base, gluon=1)) == 1


def test_gluon_reports_why_it_is_unavailable_off_its_triton():
    if conv_gluon.UNAVAILABLE is None:
        assert hasattr(conv_gluon, "_conv3d_gluon_kernel")
    else:
        assert "Triton" in conv_gluon.UNAVAILABLE and not hasattr(conv_gluon, "_conv3d_gluon_kernel")
    # Offered on the releases it is compile-checked against (CI: 3.9, and 3.6, 3.7 and 3.8: the Tritons torch 2.11 to
    # 2.14's CUDA builds pin), none other.
    assert all(conv_gluon.unwritten_for(v) is None for v in ("3.6.0", "3.7.1", "3.8.0", "3.9.1"))
    assert "written for Triton 3.6, 3.7, 3.8, 3.9, not 3.5.1" in conv_gluon.unwritten_for("3.5.1")
    assert "not 3.10.0" in conv_gluon.unwritten_for("3.10.0")


GOOD_LOOP = """
        /*1b90*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*1c50*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR7+0x20000], R4 ;
        /*1c90*/              @!P0 BRA 0x2b40 ;
        /*1d00*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*20d0*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR16], R24, gsb0 ;
        /*22a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*22e0*/                   @UP3 UTMALDG.5D [UR8], [UR6] ;
        /*2330*/               @P0 BRA 0x1b90 ;
        /*2340*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*2790*/                   STSM.16.M88.4 [R0], R88 ;
        /*2b40*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR7+0x20000], R4 ;
        /*2b50*/              @!P0 BRA 0x2b40 ;
        /*2b60*/                   BRA 0x1ca0 ;
"""
REGISTER_A_LOOP = """
        /*0100*/                   UTMALDG.5D [UR8], [UR6] ;
        /*0110*/                   LDSM.16.M88.4 R4, [R2] ;
        /*0120*/                   HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR8], R24, gsb0 ;
        /*0130*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0140*/                   LDSM.16.M88.4 R4, [R2+0x800] ;
        /*0150*/                   HGMMA.64x128x16.F32.BF16 R24, R4, gdesc[UR8], R24, gsb0 ;
        /*0160*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0170*/               @P0 BRA 0x0100 ;
"""


STUB_NARROWER_THAN_LOOP = """
        /*17e0*/                   UTMALDG.5D [UR8], [UR28] ;
        /*1aa0*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x9000], R5 ;
        /*1b50*/              @!P0 BRA 0x2690 ;
        /*1c70*/                   HGMMA.64x32x16.F32.BF16 R24, gdesc[UR24].tnspA.tnspB, R24, gsb0 ;
        /*22d0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*2350*/               @P0 BRA 0x17e0 ;
        /*2360*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*2690*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x9000], R5 ;
        /*26a0*/              @!P0 BRA 0x2690 ;
        /*26b0*/                   BRA 0x1b60 ;
"""


def test_main_loop_reader():
    """The innermost loop around the MMA: the Gluon one has no shared-memory round trip and one wait at depth 1
    (the epilogue's STSM and final wait, outside it, do not count); the TMA kernel's A goes through registers."""
    assert main_loop(GOOD_LOOP) == (0, [1], 1)  # one CTA barrier around the single-thread TMA issue
    assert main_loop(REGISTER_A_LOOP) == (2, [0, 0], 0)
    assert main_loop(STUB_NARROWER_THAN_LOOP) == (0, [1], 0)  # the retry stub's jump back is no loop
    assert main_loop("        /*0100*/                   FFMA R1, R2, R3, R4 ;\n") == (None, [], None)


SPECIALIZED = """
        /*0100*/                   MUFU.RCP R6, R6 ;
        /*0110*/                   IMAD.HI.U32 R3, R3, R6, RZ ;
        /*0120*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR30+0x16090], R6 ;
        /*0130*/              @!P1 BRA 0x0400 ;
        /*0140*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR16], R24, gsb0 ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0160*/               @P1 BRA 0x0120 ;
        /*0170*/                   STSM.16.M88.4 [R2+0x12000], R24 ;
        /*0180*/                   @UP0 UTMASTG.5D [UR8], [UR16] ;
        /*0190*/              @!P0 BRA 0x0100 ;
        /*01a0*/                   EXIT ;
        /*0200*/                   MUFU.RCP R9, R9 ;
        /*0210*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR9+0x20], R2 ;
        /*0220*/              @!P0 BRA 0x0410 ;
        /*0230*/                   UTMALDG.5D [UR8], [UR30] ;
        /*0240*/                   UTMALDG.3D [UR16], [UR34] ;
        /*0250*/               @P0 BRA 0x0210 ;
        /*0260*/              @!P0 BRA 0x0200 ;
        /*0400*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR30+0x16090], R6 ;
        /*0410*/              @!P1 BRA 0x0400 ;
"""


def test_warp_specialized_loops_reader():
    """A warp-specialized kernel's producer loop (TMA loads, no MMA; the innermost: not its tile loop) and its
    MMA warps' path between two tiles (the tile loop less the main loop: the epilogue, the next tile's
    divisions); the retry stubs' jumps back are neither."""
    from tconv3d.inspect.compile import specialized_loops

    assert specialized_loops(SPECIALIZED) == {
        "producer_instructions": 5, "producer_divisions": 0, "tile_instructions": 5, "tile_divisions": 1,
    }  # fmt: skip
    assert specialized_loops(GOOD_LOOP) == {
        "producer_instructions": None, "producer_divisions": None, "tile_instructions": None, "tile_divisions": None,
    }  # fmt: skip


def test_issue_ceiling_from_the_main_loop():
    """What share of the tensor cores' peak a loop's instruction issue allows: the MMA clocks of a pass (a wgmma
    is a warpgroup's, shared by its 4 warps; an HMMA a warp's) over the clocks 4 schedulers take to issue every
    warp's instructions of it."""
    from tconv3d.inspect.compile import ARCHS, KernelReport, loop_work

    assert loop_work(GOOD_LOOP) == (8, 2 * 64 * 256 * 16 // 4, 16)  # 8 instructions from the branch target back
    assert loop_work(REGISTER_A_LOOP) == (8, 2 * 64 * 128 * 16 // 4, 16)
    assert loop_work("        /*0100*/                   FFMA R1, R2, R3, R4 ;\n") == (None, None, None)
    busy = "".join(f"        /*{0x100 + 16 * i:04x}*/                   IADD3 R1, R2, R3, R4 ;\n" for i in range(99))
    sync_mma = (busy + "        /*0730*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;\n"
                "        /*0740*/               @P0 BRA 0x100 ;\n")  # fmt: skip
    assert loop_work(sync_mma) == (101, 16 * 8 * 16, 16)
    assert loop_work(sync_mma.replace(".F32.BF16", ".F32")) == (101, 16 * 8 * 16, 16)  # fp16 operands: no suffix
    assert loop_work(sync_mma.replace("16816.F32.BF16", "1688.F32.TF32")) == (101, 16 * 8 * 8, 32)

    def report(sass, warps):
        instructions, fma, bits = loop_work(sass)
        return KernelReport("k", [1], warps, loop_instructions=instructions, loop_mma_fma=fma, loop_mma_bits=bits)

    # 2 x 64x256x16 on 2 warpgroups = 512 clocks on an H100 SM; 8 warps x 8 instructions = 16 issue clocks.
    assert report(GOOD_LOOP, 8).issue_ceiling(ARCHS[90]) == 1.0
    # One m16n8k16 per warp against 101 instructions: 8 tensor clocks (A100) over 101 issue clocks.
    assert report(sync_mma, 4).issue_ceiling(ARCHS[80]) == pytest.approx(4 * 2048 / 1024 / 101)
    assert report(sync_mma, 4).issue_ceiling(ARCHS[90]) == pytest.approx(4 * 2048 / 2048 / 101)
    assert KernelReport("k", [1], 4).issue_ceiling(ARCHS[90]) is None


def test_warp_specialized_twins(monkeypatch):
    """gluon = 2 (persistent, a one-warp TMA producer) is a twin of every Gluon tile in the tuner's space, in all
    three directions; its register limit leaves room for the producer's warpgroup."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    geom = conv_geometry((1, 64, 4, 16, 32), (64, 64, 3, 3, 3), 1, 1, 1)
    for direction in ("fwd", "dgrad", "wgrad"):
        found = configs.candidates(direction, geom, torch.bfloat16, 227 * 1024, tma=True, gluon=True)
        assert {c.gluon for c in found if c.gluon} == {1, 2}, direction
    assert configs.with_gluon(KernelConfig(128, 128, 64, 8, 3), geom, "wgrad", specialized=True).gluon == 2
    # The forward's epilogue tile sits beside the ring: 4 stages of 128x256x64 bf16 (192 KB) and the tile (64 KB)
    # do not fit; the weight gradient stores from registers, so its 4-stage ring does.
    wide = conv_geometry((1, 256, 4, 16, 32), (256, 256, 3, 3, 3), 1, 1, 1)
    for direction, fits_four in (("fwd", False), ("wgrad", True)):
        found = configs.candidates(direction, wide, torch.bfloat16, 227 * 1024, tma=True, gluon=True)
        big = [c for c in found if c.gluon and (c.block_m, c.block_n, c.block_k) in ((128, 256, 64), (256, 128, 64))]
        stages = {kind: {c.num_stages for c in big if c.gluon == kind} for kind in (1, 2)}
        assert (4 in stages[2]) == fits_four and {2, 3} <= stages[2] <= stages[1], (direction, stages)
    assert conv_gluon.specialized_max_registers(8) == 168 and conv_gluon.specialized_max_registers(4) == 256
    assert conv_gluon.specialized_max_registers(4, programs_per_sm=2) == 128
    assert all(
        conv_gluon.specialized_max_registers(w, p) * 32 * (w + 4) * p <= 65536 for w in (4, 8, 16) for p in (1, 2)
    )


def test_persistent_programs_per_sm():
    """Two persistent programs an SM where the kernel's warps are one warpgroup whose accumulators fit in the
    registers two programs leave it and the shared memory fits twice (one's epilogue overlaps the other's wgmma);
    else one. The launch sizes the grid and maxnreg by it."""
    bf16 = 2

    def programs(block_m, block_n, block_k, warps, stages, direction="fwd", split_k=1):
        config = KernelConfig(block_m, block_n, block_k, warps, stages, split_k=split_k, tma_box_w=16, gluon=2)
        shared = conv_gluon.persistent_shared_bytes(config, bf16, direction == "wgrad")
        return conv_gluon.persistent_programs_per_sm(config, shared)

    assert programs(128, 64, 64, 4, 3) == 2  # 72 KB of ring and a 16 KB epilogue tile, twice
    assert programs(128, 128, 64, 4, 3) == 1  # 96 + 32 KB: not twice in 228 KB
    assert programs(128, 128, 64, 4, 3, "wgrad") == 2  # the weight gradient stores from registers: 96 KB
    assert programs(128, 64, 64, 4, 4, split_k=2) == 1  # 96 KB of ring, 32 KB of fp32 partial sums
    assert programs(128, 64, 64, 8, 3) == 1  # two warpgroups on one tile: the cooperative schedule
    assert programs(128, 256, 32, 4, 2) == 1  # 256 fp32 accumulators a thread: no room for a second program
    # 128 accumulators a thread, but in one m64n256 wgmma, which ptxas will not fit in a maxnreg of 128
    assert programs(64, 256, 16, 4, 2) == 1 and programs(64, 256, 16, 4, 2, "wgrad") == 1
    assert programs(128, 128, 16, 4, 2) == 2  # the same accumulators in two m64n128 wgmmas


@pytest.mark.parametrize("index", range(len(TMA_CASES)))
def test_warp_specialized_gluon_matches_float64(index, monkeypatch, device):
    """The warp-specialized forward and input gradient (gluon = 2) against float64 on every TMA case, bf16: on an
    sm_90 GPU only (the interpreter cannot run Gluon; the compile is checked on CPU)."""
    if not gluon_runs(device):
        pytest.skip("the warp-specialized Gluon kernel runs only on sm_90 with the Triton it is written for")
    case = TMA_CASES[index]

    def specialized(direction, geom, dtype, device, run):
        tiles = choice.heuristic_gluon_tiles(configs.heuristic_config(direction, geom, dtype, 132, 90))
        return configs.with_gluon(tiles, geom, direction, specialized=True)

    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", specialized)
    ours, expected = conv_and_reference(case, torch.bfloat16, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("gluon", [1, 2], ids=["pipelined", "warp_specialized"])
@pytest.mark.parametrize("tile", HALF_TAIL_TILES)
def test_gluon_half_tiles_match_float64(tile, gluon, device):
    """The last row or column block's half tiles (half_tail, wgrad_half_tails) on the hardware: 192 -> 192 channels
    in 128 blocks, forward and input gradient (swapped too, into split-K partials too) and the warp-specialized
    weight gradient, against float64. sm_90 GPU only; the emulator runs the same problems on CPU
    (tests/test_gluon_emulated.py)."""
    if not gluon_runs(device):
        pytest.skip("the Gluon kernels run only on sm_90 with the Triton they are written for")
    if HALF_TAIL_TILES[tile][0] == "wgrad" and gluon == 1:
        pytest.skip("the weight gradient's half tiles are the warp-specialized kernel's")
    run, expected = half_tail_conv(HALF_TAIL_TILES[tile], gluon, device)
    assert rel_l2(run(), expected) < tolerance(torch.bfloat16)


@pytest.mark.parametrize("stride", [1, 2])
def test_warp_specialized_weight_gradient_equals_the_pipelined_one(stride, device):
    """The persistent warp-specialized weight gradient sums each tile's patches in the pipelined kernel's order
    into the same split partials: bit for bit its result, with split-K and (stride 2) phase views. sm_90 GPU only."""
    if not gluon_runs(device):
        pytest.skip("the Gluon kernels run only on sm_90 with the Triton they are written for")
    from tconv3d.geometry import check_weight_grad
    from tconv3d.kernels.conv_wgrad import conv3d_wgrad

    x = torch.randn(2, 64, 6, 20, 36, device=device, dtype=torch.bfloat16).contiguous(memory_format=CL)
    weight = torch.empty(128, 64, 3, 3, 3, device=device)
    grad_out = torch.randn_like(torch.nn.functional.conv3d(x.float(), weight, None, stride, 1)).to(x.dtype)
    grad_out = grad_out.contiguous(memory_format=CL)
    geom = check_weight_grad(grad_out, x, weight.shape, [stride] * 3, [1] * 6, [1] * 3)
    tiles = configs.with_gluon(KernelConfig(128, 128, 64, 8, 3, split_k=3), geom, "wgrad")
    pipelined = conv3d_wgrad(grad_out, x, None, geom, tiles)
    specialized = conv3d_wgrad(grad_out, x, None, geom, dataclasses.replace(tiles, gluon=2))
    assert torch.equal(pipelined, specialized)
    expected = torch.nn.grad.conv3d_weight(x.double(), weight.shape, grad_out.double(), stride, 1)
    assert rel_l2(specialized, expected) < tolerance(torch.bfloat16)


def test_inspect_forces_the_warp_specialized_twin(monkeypatch):
    """python -m tconv3d.inspect --variant gluon-ws plans the Gluon kernel's persistent warp-specialized twin of
    each eligible launch on sm_90 (gluon forces the software-pipelined one, gluon-halo the twin's halo tiles where
    the forward and input gradient may take them; a transposed weight gradient, warp-specialized only, as its plain
    tiles); sm_80 keeps its own kernels."""
    from tconv3d.inspect.__main__ import _wait_depth, plan, specialized_only
    from tconv3d.tune.shapes import load_shape_set

    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = [s for s in load_shape_set("bench") if s.name in ("unet_32", "first_cin3")]
    jobs = {(job[0].name, job[2], job[3], variant): job[4] for variant in ("gluon", "gluon-ws", "gluon-halo")
            for job in plan(shapes, ["bf16"], DIRECTIONS, [90, 80], False, variant)}  # fmt: skip
    for direction in DIRECTIONS:
        pipelined = jobs[("unet_32", direction, 90, "gluon")]  # its transposed weight gradient's plain tiles
        assert pipelined.gluon == 1 and not specialized_only(direction, pipelined)  # what the launcher takes
        assert jobs[("unet_32", direction, 90, "gluon-ws")].gluon == 2
        halo = jobs[("unet_32", direction, 90, "gluon-halo")]
        assert (halo.gluon, halo.halo_d) == (2, 0 if direction == "wgrad" else 2)
        assert _wait_depth({"config": halo.to_dict()}) == (1 if direction == "wgrad" else 6)
        assert not jobs[("unet_32", direction, 80, "gluon-ws")].gluon
        assert not jobs[("first_cin3", direction, 90, "gluon-ws")].gluon  # 3 channels: no TMA box
