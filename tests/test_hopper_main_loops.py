"""The box kernels' main loops as the sm_90 compiler makes them, without a GPU: the TMA variants (UTMALDG loads,
HGMMA) and the Gluon kernels (both operands in shared memory, wgmma waits, producer warps, tensor maps the driver
would encode) for the bench suite's eligible cases and the real models' layer kinds. Apart from
tests/test_static_compile.py, whose inspection of every chosen config holds one pytest-xdist worker for minutes:
CI runs both files under the newest triton and under triton 3.6, the GPU image's, where the Gluon kernels compile
for every case.
"""

import pytest
from test_static_compile import CUOBJDUMP, compile_script

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")

TMA_COMPILE = """
import dataclasses, json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels.config import off_gluon
from tconv3d.tune import configs
from tconv3d.tune.shapes import load_shape_set
from tconv3d.inspect.compile import ARCHS, compile_launch, report_rows
out = []
for shape in load_shape_set("bench"):
    geom = shape.geometry()
    for dtype in (torch.bfloat16, torch.float32):
        for direction in ("fwd", "dgrad", "wgrad"):
            if not configs.tma_eligible(direction, geom, dtype):
                continue
            config = configs.heuristic_config(direction, geom, dtype, ARCHS[90].sm_count, capability=90)
            config = off_gluon(config)  # the Triton TMA kernel on the Gluon kernel's tiles (one tap's, unswapped)
            if not config.tma_box_w:  # strided: the heuristic keeps the pointer kernels, a table may take TMA
                config = configs.with_tma(config, geom, direction)
            report = compile_launch(direction, geom, dtype, config, 90, read=False)[0]
            out.append(({"case": shape.name, "direction": direction, "config": config.to_dict()}, report))
# A UNet decoder's first conv reading its skip connection in place (channels_after): the forward's boxes from two
# descriptors, the weight gradient one launch per source
skip = conv_geometry((1, 64, 32, 64, 64), (64, 128, 3, 3, 3), 1, 1, 1, after_channels=64)
for direction in ("fwd", "wgrad"):
    config = configs.heuristic_config(direction, skip, torch.bfloat16, 132, 90)
    config = configs.with_tma(off_gluon(config), skip, direction)
    for report in compile_launch(direction, skip, torch.bfloat16, config, 90, read=False):
        if "tma" in report.kernel:
            out.append(({"case": "unet_skip", "direction": direction, "config": config.to_dict()}, report))
# MONAI UNet's up conv (stride 2) transposing a 64 + 64-channel concatenation: the input gradient's boxes from two
# descriptors, through the phase views of grad_in
up = dataclasses.replace(conv_geometry((1, 64, 32, 64, 64), (128, 64, 3, 3, 3), 2, 1, 1), out_after_channels=64)
config = configs.heuristic_config("dgrad", up, torch.bfloat16, 132, 90)
config = configs.with_tma(off_gluon(config), up, "dgrad")
report = compile_launch("dgrad", up, torch.bfloat16, config, 90, read=False)[0]
out.append(({"case": "unet_up", "direction": "dgrad", "config": config.to_dict()}, report))
print(json.dumps(report_rows(out)))
"""


def test_tma_kernels_compile_to_tma_loads_and_wgmma():
    """The sm_90 heuristic's tiles as TMA forward, input gradient and weight gradient for every eligible case of
    the bench suite (bf16 and fp32; down_s2's through phase views), and a UNet decoder conv reading its skip
    connection as channels_after: UTMALDG (TMA) loads, HGMMA (wgmma), no spills."""
    reports = compile_script(TMA_COMPILE)
    assert len(reports) >= 24 and {r["direction"] for r in reports} == {"fwd", "dgrad", "wgrad"}
    assert {r["direction"] for r in reports if r["case"] == "down_s2"} == {"fwd", "dgrad", "wgrad"}
    # channels_after: the forward from two descriptors, the weight gradient as one launch per source
    assert [r["direction"] for r in reports if r["case"] == "unet_skip"] == ["fwd", "wgrad", "wgrad"]
    assert [r["direction"] for r in reports if r["case"] == "unet_up"] == ["dgrad"]  # a transposed conv's skip
    for r in reports:
        assert r["config"]["tma_box_w"] > 0, r
        assert any(load.startswith("UTMALDG") for load in r["loads"]), r
        assert r["mma_kind"] == "HGMMA" and not r["spill_bytes"] and not r["local_accesses"], r
        _assert_tensor_maps_encode(r)


def _assert_tensor_maps_encode(report):
    """Every tensor map of a TMA launch meets cuTensorMapEncodeTiled's documented requirements as the compiled
    kernel hands it over (swizzle, the box Triton splits wider rows into): the driver would encode it."""
    maps = report["tensor_maps"]
    assert maps and all(m["swizzle"] is not None for m in maps), report["kernel"]
    assert not [m for m in maps if m["problems"]], [m for m in maps if m["problems"]]
    assert all(m["box"][-1] * m["element_size"] <= 128 for m in maps), maps


GLUON_COMPILE = """
import dataclasses, json, torch, triton
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_gluon
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import load_shape_set
from tconv3d.inspect.compile import ARCHS, compile_launch, report_rows
from tconv3d.kernels.config import KernelConfig
out = []
arch = ARCHS[90]
# Every case under the GPU image's triton (3.6); elsewhere one of each kind, to keep CI's main step short.
KINDS = {"wan_dec_384b", "hunyuan_128", "cogvideo_256", "down_s2", "last_cout3", "unet_32", "unet_320"}
if conv_gluon.UNAVAILABLE is None:
    for shape in load_shape_set("bench"):
        if not triton.__version__.startswith("3.6") and shape.name not in KINDS:
            continue
        geom = shape.geometry()
        # fp16 compiles the same loop as bf16 with another element type; fp32 (TF32, not the weight gradient) another
        for dtype in (torch.bfloat16, torch.float32):
            if dtype == torch.float32 and shape.name not in KINDS:  # one of each kind: CI's time
                continue
            for direction in ("fwd", "dgrad", "wgrad"):
                if not configs.gluon_eligible(direction, geom, dtype):  # fp32: TF32 allowed here, torch's default
                    continue
                chosen, _ = choice.choose(direction, geom, dtype, arch.device_name, arch.sm_count, 90)
                tiles = [choice.force_variant(direction, geom, dtype, chosen, "gluon", True)]
                # the Hopper GEMM tile on the Wan layers, 128 x 256 x 64 on two warpgroups
                if shape.name.startswith("wan_") and dtype == torch.bfloat16:
                    hopper = dataclasses.replace(chosen, block_m=128, block_n=256, block_k=64, num_warps=8,
                                                 num_stages=3)  # (the chosen weight gradient's ring is deeper)
                    tiles.append(configs.with_gluon(hopper, geom, direction))
                    # and persistent, warp-specialized (3 stages beside the forward's epilogue tile)
                    ws = dataclasses.replace(hopper, num_stages=3)
                    tiles.append(configs.with_gluon(ws, geom, direction, specialized=True))
                    # and 64 x 256 on one warpgroup: one program an SM (one m64n256 wgmma's accumulators)
                    if shape.name == "wan_dec_384b":
                        ws = dataclasses.replace(hopper, block_m=64, block_k=16, num_warps=4, num_stages=2)
                        tiles.append(configs.with_gluon(ws, geom, direction, specialized=True))
                    # and 256 voxels x 128 columns swapped (swap_ab): m64n256 at 128 columns, both kernels
                    tall = dataclasses.replace(hopper, block_m=256, block_n=128, num_stages=3)
                    for specialized in (False, True):
                        tiles.append(configs.swapped_twin(configs.with_gluon(tall, geom, direction, specialized),
                                                          direction))
                # the weight gradient with its taps grouped to 256 columns (tap_group): Wan's 2 x 128, down_s2's
                # 4 x 64 through the phase views (each tap's box from its own view)
                if direction == "wgrad" and dtype == torch.bfloat16 and shape.name in ("wan_dec_384b", "down_s2"):
                    ci = 128 if shape.name == "wan_dec_384b" else 64
                    one = configs.with_gluon(dataclasses.replace(chosen, block_m=128, block_n=ci, block_k=64,
                                                                 num_warps=8, num_stages=3), geom, direction, True)
                    tiles.append(configs.grouped_taps_twin(one, direction))
                # the weight gradient's columns as 4 taps' 32 input channels where one tap's 96 leave 128 part empty
                if direction == "wgrad" and dtype == torch.bfloat16 and shape.name == "wan_dec_96":
                    forced = choice.force_variant(direction, geom, dtype, chosen, "gluon", True)
                    tiles.append(configs.channel_taps_twin(dataclasses.replace(forced, gluon=2), geom, direction))
                # the weight gradient of 32 output channels transposed, the taps' input channels on the wgmma's
                # rows (configs.swapped_wgrad_twin: 4 taps on two warpgroups, unet_aniso's 9 taps 2 on one)
                # (the twin of the timed rules' choice, its split kept: the tuner's candidate; the heuristic's own,
                # its split refitted, is `chosen`)
                if direction == "wgrad" and dtype == torch.bfloat16 and shape.name in ("unet_32", "unet_aniso"):
                    plain, _ = choice.choose(direction, geom, dtype, arch.device_name, arch.sm_count, 90, True)
                    forced = choice.force_variant(direction, geom, dtype, plain, "gluon", True)
                    tiles.append(configs.swapped_wgrad_twin(dataclasses.replace(forced, gluon=2), geom))
                # swapped through the phase views (down_s2) and from registers (last_cout3's 3-channel rows)
                if shape.name in ("down_s2", "last_cout3") and dtype == torch.bfloat16:
                    tall = dataclasses.replace(chosen, block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
                    tiles.append(configs.swapped_twin(configs.with_gluon(tall, geom, direction, True), direction))
                # a layer of few tiles on one warpgroup, its reduction split (configs.small_grid_twin)
                if shape.name in ("hunyuan_512", "unet_320") and dtype == torch.bfloat16 and direction != "wgrad":
                    small = configs.small_grid_twin(direction, geom, chosen, arch.sm_count, 2)
                    report = compile_launch(direction, geom, dtype, small, 90, read=False)[0]
                    out.append(({"case": shape.name, "direction": direction, "dtype": str(dtype), "row": "small_grid",
                                "config": small.to_dict()}, report))
                # a tap's 96 channels in three full 32-deep steps (configs.whole_steps_twin)
                if shape.name in ("wan_dec_96", "last_cout3") and dtype == torch.bfloat16:
                    forced = choice.force_variant(direction, geom, dtype, chosen, "gluon", True)
                    whole = configs.whole_steps_twin(direction, geom, dataclasses.replace(forced, gluon=2), 2)
                    if forced.gluon == 2 and forced.block_k == 32 and direction != "wgrad":
                        whole = forced  # the heuristic took the twin (wan_dec_96's forward and input gradient)
                    if whole is not None:
                        report = compile_launch(direction, geom, dtype, whole, 90, read=False)[0]
                        out.append(({"case": shape.name, "direction": direction, "dtype": str(dtype),
                                    "row": "whole_steps", "config": whole.to_dict()}, report))
                # the narrow forwards' halo tiles (configs.halo_twin): two frames a tile, the kd taps' input
                # frames one box, every (frame, kd) wgmma reading its frame as a slice
                if shape.name in ("unet_32", "unet_64") and dtype == torch.bfloat16 and direction != "wgrad":
                    forced = choice.force_variant(direction, geom, dtype, chosen, "gluon", True)
                    halo = configs.halo_twin(direction, geom, dataclasses.replace(forced, gluon=2), 2)
                    report = compile_launch(direction, geom, dtype, halo, 90, read=False)[0]
                    out.append(({"case": shape.name, "direction": direction, "dtype": str(dtype), "row": "halo",
                                "config": halo.to_dict()}, report))
                # down_s2's phase views, the warp-specialized producer's predicated copies too
                if shape.name == "down_s2" and dtype == torch.bfloat16:
                    ws = choice.heuristic_gluon_tiles(chosen)
                    tiles.append(configs.with_gluon(ws, geom, direction, specialized=True))
                for config in filter(None, tiles):  # the twins: None for the weight gradient
                    report = compile_launch(direction, geom, dtype, config, 90, read=False)[0]
                    out.append(({"case": shape.name, "direction": direction, "dtype": str(dtype),
                                "config": config.to_dict()}, report))
    # MONAI UNet's 16-channel weight gradients as chosen: transposed, 4 taps of 16 input channels (32-byte swizzle
    # rows) on one warpgroup's rows
    for shape in load_shape_set("unets"):
        chosen, _ = choice.choose("wgrad", shape.geometry(), torch.bfloat16, arch.device_name, arch.sm_count, 90)
        report = compile_launch("wgrad", shape.geometry(), torch.bfloat16, chosen, 90, read=False)[0]
        out.append(({"case": shape.name, "direction": "wgrad", "dtype": str(torch.bfloat16),
                     "config": chosen.to_dict()}, report))
    # BasicUNet's decoder conv of [upsampled, skip] (32 + 32 -> 32), its weight gradient as chosen: one transposed
    # launch a source, 4 taps of 32 input channels on the wgmma's rows
    skip_32 = conv_geometry((1, 32, 16, 32, 32), (32, 64, 3, 3, 3), 1, 1, 1, after_channels=32)
    chosen, _ = choice.choose("wgrad", skip_32, torch.bfloat16, arch.device_name, arch.sm_count, 90)
    for report in compile_launch("wgrad", skip_32, torch.bfloat16, chosen, 90, read=False):
        if report.kernel == "_conv3d_wgrad_gluon_kernel":
            out.append(({"case": "unet_skip_32", "direction": "wgrad", "dtype": str(torch.bfloat16),
                        "config": chosen.to_dict()}, report))
    # unet_64's halo tiles swapped (each frame's tile transposed: m64n128), forward and input gradient
    narrow = next(s for s in load_shape_set("bench") if s.name == "unet_64").geometry()
    for direction in ("fwd", "dgrad"):
        tile = configs.with_gluon(KernelConfig(128, 64, 64, 4, 4), narrow, direction, True)
        config = configs.swapped_twin(configs.halo_twin(direction, narrow, tile, 2), direction)
        report = compile_launch(direction, narrow, torch.bfloat16, config, 90, read=False)[0]
        out.append(({"case": "unet_64", "direction": direction, "dtype": str(torch.bfloat16), "row": "halo_swapped",
                    "config": config.to_dict()}, report))
    # The last column block's half tiles (half_tail): 192 channels in 128-column blocks, swapped, both kernels
    wide = next(s for s in load_shape_set("bench") if s.name == "wan_dec_192").geometry()
    for direction in ("fwd", "dgrad"):
        for specialized in (False, True):
            tall = configs.with_gluon(KernelConfig(256, 128, 64, 8, 3), wide, direction, specialized)
            config = configs.swapped_twin(tall, direction)
            report = compile_launch(direction, wide, torch.bfloat16, config, 90, read=False)[0]
            out.append(({"case": "wan_dec_192", "direction": direction, "dtype": str(torch.bfloat16),
                        "row": "half_tail", "config": config.to_dict()}, report))
    # and its weight gradient's, rows and columns (wgrad_half_tails): warp-specialized, one tap a tile
    config = configs.with_gluon(KernelConfig(128, 128, 64, 8, 3, split_k=6), wide, "wgrad", True)
    report = compile_launch("wgrad", wide, torch.bfloat16, config, 90, read=False)[0]
    out.append(({"case": "wan_dec_192", "direction": "wgrad", "dtype": str(torch.bfloat16), "row": "half_tail",
                "config": config.to_dict()}, report))
    # The chosen tiles forced to the Gluon kernel, and their warp-specialized form, per direction (bf16).
    def pipelined_and_specialized(case, geom, directions):
        for direction in directions:
            chosen, _ = choice.choose(direction, geom, torch.bfloat16, arch.device_name, arch.sm_count, 90)
            # (off the Gluon kernel first: where the heuristic chose the persistent one, the pipelined one too)
            tiles = choice.force_variant(direction, geom, torch.bfloat16, choice.off_gluon(chosen), "gluon", True)
            for config in (tiles, configs.with_gluon(tiles, geom, direction, specialized=True)):
                report = compile_launch(direction, geom, torch.bfloat16, config, 90, read=False)[0]
                out.append(({"case": case, "direction": direction, "dtype": str(torch.bfloat16),
                            "config": config.to_dict()}, report))

    # A video VAE's causal conv as a converted decoder calls it: replicate along D and two cached frames in front
    # (frames_before).
    causal = conv_geometry((1, 384, 4, 60, 104), (384, 384, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1,
                           padding_mode="replicate,zeros,zeros", prefix_frames=2)
    pipelined_and_specialized("causal_cached", causal, ("fwd", "wgrad"))
    # HunyuanVideo's causal conv (replicate in all three dimensions): the forward's and the weight gradient's
    # interior on the Gluon kernel (the first launch; the strips follow on the pointer kernel)
    replicate = conv_geometry((1, 128, 5, 64, 64), (128, 128, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1,
                              padding_mode="replicate")
    pipelined_and_specialized("replicate_hw", replicate, ("fwd", "wgrad"))
    # A UNet decoder's first conv reading its skip connection in place (channels_after)
    skip = conv_geometry((1, 64, 32, 64, 64), (64, 128, 3, 3, 3), 1, 1, 1, after_channels=64)
    pipelined_and_specialized("unet_skip", skip, ("fwd", "wgrad"))
    # MONAI UNet's up conv transposing a skip connection's concatenation (the input gradient's second source)
    up = dataclasses.replace(conv_geometry((1, 64, 32, 64, 64), (128, 64, 3, 3, 3), 2, 1, 1), out_after_channels=64)
    pipelined_and_specialized("unet_up", up, ("dgrad",))
    # A strided weight gradient of channels no multiple of 8 (the awkward set's stride2_odd, 24 -> 40), its tile
    # stored one element at a time: the conversions kept in pairs (conv_gluon._downcast), without which triton
    # 3.9's ptxas serialized its wgmmas (C7514)
    odd = next(s for s in load_shape_set("awkward") if s.name == "stride2_odd").geometry()
    pipelined_and_specialized("stride2_odd", odd, ("wgrad",))
print(json.dumps({"unavailable": conv_gluon.UNAVAILABLE, "reports": report_rows(out)}))
"""


def test_gluon_kernels_compile_to_the_hopper_main_loop():
    """The Gluon forward, input gradient and weight gradient for every eligible case of the bench suite under triton 3.6
    (one of each kind under another: large, strided, small-channel, 3-channel output) (bf16, and the forward and input
    gradient in fp32 as TF32, one layer of each kind; the chosen tiles and, on the Wan layers, 128x256x64 on 8 warps,
    also warp-specialized, and on wan_dec_384b 64x256x16 on one warpgroup, warp-specialized, and 256x128x64 with the
    forward's and input gradient's operands swapped (m64n256 wgmmas), both kernels, and the weight gradient with two
    taps a 256-column tile (down_s2's: four, through the phase views), and unet_32's (unet_aniso's under 3.6)
    transposed, 2-4 taps of 32 input channels on the wgmma's rows, as the tuner's twin and as chosen, and MONAI
    UNet's 16-channel ones (the unets set) as chosen, 4 taps of 16, and BasicUNet's decoder conv of a skip
    connection (32 + 32 -> 32), one transposed launch a source; down_s2's phase views warp-specialized too, and
    swapped, as last_cout3's forward; the forward and input gradient of the layers of few tiles (unet_320, and
    hunyuan_512 under 3.6) on one warpgroup with their reduction split, and 96 channels a tap in three 32-deep steps
    (last_cout3's forward, and wan_dec_96's under 3.6, whose weight gradient also as 4 taps of 32 input channels a
    tile); wan_dec_192's forward and input gradient, swapped, their last
    column block in half tiles (half_tail: a second wgmma loop, also held to this), and its weight gradient's last
    Cout and Cin blocks (four loops); last_cout3's forward storing its
    3-channel rows
    from registers; a video VAE's causal conv with replicate borders along D and cached frames, forward and weight
    gradient, and the interior of one with replicate borders in all three dimensions, forward and weight gradient; a
    UNet decoder conv reading its skip connection as channels_after, forward and weight gradient; a strided weight
    gradient of 24 -> 40 channels, its tile stored element by element), for sm_90: TMA loads,
    wgmma with both operands in shared memory (no LDS/LDSM/STS/STSM in the main loop), one wgmma group in flight (a
    single wait at depth 1 per step; unet_32's and unet_64's halo tiles (unet_64's swapped too), two frames a tile
    reading the input frames of the three taps along D from one box, 6: a step's 2 x 3), no spills, within the 227
    KB a program may take; a warp-specialized kernel's load loop without a runtime division (the strided input
    gradient's live taps aside). Runs where the Triton is one the kernel is written for (CI's main step, triton 3.9,
    and its triton 3.6 step); elsewhere the kernel says it is unavailable."""
    from tconv3d.inspect.compile import ARCHS
    from tconv3d.kernels import conv_gluon
    from tconv3d.kernels.config import KernelConfig

    result = compile_script(GLUON_COMPILE)
    if result["unavailable"]:
        assert "Triton" in result["unavailable"] and not result["reports"]
        pytest.skip(result["unavailable"])
    reports = result["reports"]
    large = {(r["case"].split("_")[0], r["direction"]) for r in reports}
    assert {(family, d) for family in ("wan", "hunyuan", "cogvideo") for d in ("fwd", "dgrad", "wgrad")} <= large
    assert ("last", "fwd") in large  # the output stored from registers (DST_PTR)
    causal = {(r["direction"], r["config"]["gluon"]) for r in reports if r["case"] == "causal_cached"}
    assert causal == {("fwd", 1), ("fwd", 2), ("wgrad", 1), ("wgrad", 2)}  # replicate along D, frames_before
    interior = {(r["direction"], r["config"]["gluon"]) for r in reports if r["case"] == "replicate_hw"}
    assert interior == {("fwd", 1), ("fwd", 2), ("wgrad", 1), ("wgrad", 2)}  # the interior on the Gluon kernels
    skip = {(r["direction"], r["config"]["gluon"]) for r in reports if r["case"] == "unet_skip"}
    assert skip == {("fwd", 1), ("fwd", 2), ("wgrad", 1), ("wgrad", 2)}  # channels_after
    up = {(r["direction"], r["config"]["gluon"]) for r in reports if r["case"] == "unet_up"}
    assert up == {("dgrad", 1), ("dgrad", 2)}  # a transposed conv's channels_after, through phase views
    odd = {(r["direction"], r["config"]["gluon"]) for r in reports if r["case"] == "stride2_odd"}
    assert odd == {("wgrad", 1), ("wgrad", 2)}  # stored element by element, converted in pairs
    tf32 = [r for r in reports if r["dtype"] == "torch.float32"]  # fp32 read as TF32: k8 wgmma atoms
    assert {r["direction"] for r in tf32} == {"fwd", "dgrad"}  # the input gradient over the transposed weight
    assert all(r["mma"].startswith("HGMMA.64x") and r["mma"].endswith("x8.F32.TF32") for r in tf32), tf32[0]["mma"]
    assert any(r["config"]["block_n"] == 256 and r["config"]["num_warps"] == 8 for r in reports)
    assert {r["direction"] for r in reports if r["config"]["gluon"] == 2} == {"fwd", "dgrad", "wgrad"}
    assert {r["direction"] for r in reports if r["case"] == "down_s2" and r["config"]["gluon"] == 2} == {
        "fwd", "dgrad", "wgrad"
    }  # fmt: skip
    swapped = [r for r in reports if r["config"].get("swap_ab")]  # the wgmma's N the voxels
    assert {(r["case"], r["direction"]) for r in swapped} >= {
        ("wan_dec_384b", "fwd"), ("wan_dec_384b", "dgrad"), ("down_s2", "fwd"), ("down_s2", "dgrad"),
        ("last_cout3", "fwd"),
    }  # fmt: skip
    assert all(r["mma"].startswith(f"HGMMA.64x{r['config']['block_m']}x") for r in swapped), swapped[0]["mma"]
    small = [r for r in reports if r.get("row") == "small_grid"]
    hunyuan = any(r["case"] == "hunyuan_512" for r in reports)  # under 3.6
    assert {(r["case"], r["direction"]) for r in small} == {
        (case, direction) for case in ("unet_320", "hunyuan_512")[: 1 + hunyuan] for direction in ("fwd", "dgrad")
    }
    assert all(r["mma"].startswith("HGMMA.64x128x") and r["config"]["split_k"] > 1 for r in small), small[0]
    whole = {(r["case"], r["direction"]): r for r in reports if r.get("row") == "whole_steps"}
    wan_96 = any(r["case"] == "wan_dec_96" for r in reports)  # under 3.6
    assert set(whole) == {("last_cout3", "fwd")} | (
        {("wan_dec_96", "fwd"), ("wan_dec_96", "dgrad")} if wan_96 else set()
    )
    assert all(r["config"]["block_k"] == 32 for r in whole.values())
    channel_taps = [r for r in reports if r["case"] == "wan_dec_96" and r["config"].get("tap_group") == 4]
    assert len(channel_taps) == wan_96 and all(r["mma"].startswith("HGMMA.64x128x") for r in channel_taps)
    grouped = [r for r in reports if r["config"].get("tap_group") and not r["config"].get("swap_ab")]
    grouped = [r for r in grouped if r not in channel_taps]  # the taps grouped to 256 columns
    assert {(r["case"], r["config"]["tap_group"]) for r in grouped} >= {("wan_dec_384b", 2), ("down_s2", 4)}
    assert all(r["mma"].startswith("HGMMA.64x256x") for r in grouped), grouped[0]["mma"]  # one wgmma across the taps
    transposed = {r["case"]: r for r in swapped if r["direction"] == "wgrad"}  # the taps on the wgmma's rows
    assert "unet_32" in transposed and transposed["unet_32"]["config"]["tap_group"] == 4
    assert transposed["unet_16"]["config"]["block_n"] == 64 and transposed["unet_16"]["config"]["tap_group"] == 4
    skip_32 = [r for r in swapped if r["case"] == "unet_skip_32"]  # one launch a source
    assert len(skip_32) == 2 and all(r["config"]["tap_group"] == 4 for r in skip_32)
    assert all(r["mma"].startswith(f"HGMMA.64x{r['config']['block_m']}x") for r in transposed.values())
    half = [r for r in reports if r.get("row") == "half_tail"]
    assert {(r["direction"], r["config"]["gluon"]) for r in half} == {
        ("fwd", 1), ("fwd", 2), ("dgrad", 1), ("dgrad", 2), ("wgrad", 2)
    }  # fmt: skip
    for r in half:  # the full tiles' loop and the half tiles': one warpgroup's 64 rows, the voxels split in two
        if r["direction"] == "wgrad":  # full, half the rows, half the columns, a quarter: 128 x 128 on 8 warps
            shapes = ["64x128x16", "64x32x16", "64x64x16", "64x64x16"]
        else:
            shapes = ["64x128x16", "64x256x16"]
        assert sorted(loop["mma"].split(".")[1] for loop in r["mma_loops"]) == shapes, r["mma_loops"]
        assert r["mma"].split(".")[1] == shapes[-1 if r["direction"] != "wgrad" else 0], r["mma"]  # the widest
    halo = {(r["case"], r["direction"]): r for r in reports if r.get("row") == "halo"}  # unet_64's under 3.6
    assert (
        {("unet_32", "fwd"), ("unet_32", "dgrad")}
        <= set(halo)
        <= {(case, direction) for case in ("unet_32", "unet_64") for direction in ("fwd", "dgrad")}
    )
    assert all(r["config"]["halo_d"] == 2 and r["tensor_maps"][0]["box"][1] == 4 for r in halo.values())
    halo_swapped = [r for r in reports if r.get("row") == "halo_swapped"]
    assert {r["direction"] for r in halo_swapped} == {"fwd", "dgrad"}
    assert all(r["mma"].startswith("HGMMA.64x128x16") and r["config"]["swap_ab"] for r in halo_swapped)
    programs_seen = set()
    for r in reports:
        name = f"{r['case']} {r['direction']} {r['dtype']} {r['config']}"
        # one wgmma group in flight: a halo tile's step issues 2 x 3 (two frames, three kd taps), the step before's
        # retired before its stage goes back
        depth = [6] if r["config"].get("halo_d") else [1]
        # every loop of wgmmas, not only the first (the half tiles' has its own), on the Hopper main loop
        assert r["mma_loops"] and all(loop["smem_ops"] == 0 and loop["waits"] == depth for loop in r["mma_loops"]), (
            name,
            r["mma_loops"],
        )
        assert r["config"]["gluon"] in (1, 2), name
        if r["config"]["gluon"] == 2:  # persistent: the programs an SM holds at once on every SM, within its limits
            config = KernelConfig.from_dict(r["config"])
            element = 4 if r["dtype"] == "torch.float32" else 2
            shared = conv_gluon.persistent_shared_bytes(config, element, r["direction"] == "wgrad")
            programs = conv_gluon.persistent_programs_per_sm(config, shared)
            programs_seen.add(programs)
            assert r["shared_bytes"] <= shared, (name, r["shared_bytes"], shared)
            assert r["registers"] <= conv_gluon.specialized_max_registers(config.num_warps, programs), name
            assert r["grid"][0] <= programs * ARCHS[90].sm_count, name
        assert r["mma_kind"] == "HGMMA" and any(load.startswith("UTMALDG") for load in r["loads"]), name
        assert r["loop_smem_ops"] == 0 and r["loop_wgmma_waits"] == depth, (
            name,
            r["loop_smem_ops"],
            r["loop_wgmma_waits"],
        )
        assert not r["spill_bytes"] and not r["local_accesses"] and r["shared_bytes"] <= 232448, name
        if r["config"]["gluon"] == 2:  # the producer warp's load loop: its steps carried, not divided out
            strided_dgrad = r["direction"] == "dgrad" and r["case"] in ("down_s2", "unet_up")  # live taps counted
            assert r["producer_instructions"] and (strided_dgrad or r["producer_divisions"] == 0), (
                name,
                r["producer_instructions"],
                r["producer_divisions"],
            )
        _assert_tensor_maps_encode(r)
    assert programs_seen == {1, 2}  # one-warpgroup tiles that fit twice run two programs an SM
