"""What the compiler makes of every kernel, without a GPU: `python -m tconv3d.inspect` compiles each config
tconv3d would choose for the bench suite and the awkward shapes (bf16, fp16, fp32; forward, input-grad,
weight-grad) for sm_90 and sm_80. CI runs this under the newest triton and under triton 3.6, the GPU image's; the
second run compiles for sm_90 alone (TCONV3D_STATIC_ARCHS=90, STATIC_ARCHS: the GPU machines are all Hopper).

The inspection runs in a subprocess: this suite sets TRITON_INTERPRET=1 on CPU machines, and interpreted
kernels have no compiler behind them.
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")
STATIC_ARCHS = tuple(int(a) for a in os.environ.get("TCONV3D_STATIC_ARCHS", "90,80").split(","))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect") / "records.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    result = subprocess.run(
        [sys.executable, "-m", "tconv3d.inspect", "--json", str(out), "--jobs", str(os.cpu_count() or 1),
         "--arch", ",".join(map(str, STATIC_ARCHS))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def _names(records):
    return [f"{r['case']} {r['dtype']} {r['direction']} sm_{r['arch']} {r['config']}" for r in records]


def test_every_chosen_config_compiles_for_both_archs(records):
    from tconv3d.tune.shapes import load_shape_set

    cases = len(load_shape_set("bench")) + len(load_shape_set("awkward"))
    assert len(records) == cases * 3 * 3 * len(STATIC_ARCHS)
    assert {(r["arch"], r["dtype"], r["direction"]) for r in records} == {
        (a, d, k) for a in STATIC_ARCHS for d in ("bf16", "fp16", "fp32") for k in ("fwd", "dgrad", "wgrad")
    }
    failed = [r for r in records if not r["compiled"]]
    assert not failed, _names(failed)
    # Each kernel compiled for its record's GPU (the split-K reduction's sm_80 records once read sm_90's cubin).
    foreign = [r for r in records if any(k["sm"] != r["arch"] for k in r["kernels"])]
    assert not foreign, _names(foreign)
    # Every launch with a tensor-core main loop says how much of the peak its instruction issue allows.
    looped = [r for r in records if r["mma"] in ("HGMMA", "HMMA") and r["loop_instructions"]]
    assert len(looped) > len(records) // 2
    assert all(0 < r["issue_ceiling"] <= 1 for r in looped), _names(r for r in looped if not r["issue_ceiling"])


def _tuned_with_this_triton(record) -> bool:
    """Whether a record's config is the heuristic's, or comes from a table tuned under the triton running here.
    A table's configs were measured, spill-free, with the compiler that tuned them; another triton allocates
    registers differently (the H100 table, tuned with triton 3.6, lends unet_320's fp32 forward a 64x128 tile
    that spills a little under 3.9). CI compiles under both, so every table is held to its own triton."""
    from tconv3d.inspect.compile import ARCHS
    from tconv3d.tune.tables import table_file_name

    if record["config_source"] not in ("table", "nearest"):
        return True
    table = ROOT / "autotune_configs" / table_file_name(ARCHS[record["arch"]].device_name)
    return json.loads(table.read_text())["triton"] == triton.__version__


def test_nothing_spills_and_shared_memory_fits(records):
    limit = {90: 227 * 1024, 80: 163 * 1024}
    bad = [
        r
        for r in records
        if r["compiled"] and (r["spill_bytes"] or r["local_accesses"] or r["shared_bytes"] > limit[r["arch"]])
    ]
    foreign = [r for r in bad if not _tuned_with_this_triton(r)]
    if foreign:
        message = f"tuned under another triton, these spill under {triton.__version__}: {_names(foreign)}"
        warnings.warn(message, stacklevel=1)
    ours = [r for r in bad if r not in foreign]
    assert not ours, _names(ours)


def test_every_tensor_map_meets_the_drivers_requirements(records):
    """No chosen launch hands the driver a tensor map that cuTensorMapEncodeTiled's documented requirements
    refuse (compile.tensor_maps, as the compiled kernel encodes it); sm_90's TMA launches were there to check."""
    refused = [r for r in records if r.get("tensor_map_problems")]
    assert not refused, [p for r in refused for p in r["tensor_map_problems"]]
    assert sum(bool(k["tensor_maps"]) for r in records if r["compiled"] for k in r["kernels"]) > 30


def test_hopper_runs_wgmma_on_16_bit_tiles_of_64_rows(records):
    wanted = [
        r for r in records
        if r["arch"] == 90 and r["dtype"] != "fp32" and r["config"]["block_m"] >= 64 and not r["config"].get("direct")
    ]  # fmt: skip
    assert len(wanted) > len(records) // 8
    missing = [r for r in wanted if r["mma"] != "HGMMA"]
    assert not missing, _names(missing)


def _heuristic(records):
    """The records whose config the heuristic chose. A tuning table's configs won on measured time and need not
    have the heuristic's properties (the H100 table holds 32-row weight-gradient tiles split 128 ways); they
    are held to compiling cleanly alone."""
    chosen = [r for r in records if r["config_source"] == "heuristic"]
    assert len({(r["arch"], r["direction"]) for r in chosen}) == 3 * len(STATIC_ARCHS)  # awkward keys: no table
    return chosen


def test_weight_gradient_tiles_are_wgmma_sized(records):
    """wgmma works on 64-row tiles: the weight gradient's 32x32 tiles for 32-channel layers ran mma.sync. (A
    transposed tile's rows are its block_n: its taps' input channels.)"""
    gemm = [r for r in _heuristic(records) if not r["config"].get("direct")]  # the direct kernels have no MMA
    rows = lambda config: config["block_n"] if config.get("swap_ab") else config["block_m"]  # noqa: E731
    small = [r for r in gemm if r["direction"] == "wgrad" and rows(r["config"]) < 64]
    assert not small, _names(small)


def test_weight_gradient_grids_fill_their_waves(records):
    """Equal-length programs in 2.05 waves leave a third of the device idle in the third: the split-K choice
    must keep the last wave at least 3/4 busy wherever the reduction is long enough for 3 waves (each split
    keeps at least 8 steps; from 3 waves on, any count fills its last wave 3/4)."""
    from tconv3d.kernels.config import gemm_view, split_rows
    from tconv3d.tune.shapes import load_shape_set

    geoms = {s.name: s.geometry() for s in load_shape_set("bench") + load_shape_set("awkward")}
    poor = []
    for r in _heuristic(records):
        if r["direction"] != "wgrad" or r["config"].get("direct"):
            continue
        config, waves = r["config"], r["waves"]
        if config.get("gluon") == 2:  # persistent: its programs (one grid row) walk tiles x splits work units
            view = gemm_view("wgrad", geoms[r["case"]])
            tiles = -(-view.rows // config["block_m"]) * -(-view.cols // config["block_n"]) * view.grid_taps
            tiles *= view.groups
            rows = split_rows(view.reduction, config["split_k"], config["block_k"])
            splits = -(-view.reduction // rows)
            held_at_once = r["grid"][0]
            waves = tiles * splits / held_at_once
        else:
            tiles, splits, *groups = r["grid"]
            tiles *= groups[0] if groups else 1
            held_at_once = tiles * splits / waves  # programs the device holds at once, as compiled
        if waves < 1:
            continue
        most_splits = -(-geoms[r["case"]].output_voxels // config["block_k"]) // 8
        if tiles * most_splits < 3 * held_at_once:
            continue  # the reduction is too short to split into 3 waves
        if waves / -(-waves // 1) < 0.75:
            poor.append(r)
    assert not poor, [f"{n}: {r['waves']} waves" for n, r in zip(_names(poor), poor, strict=True)]


NORM_COMPILE = """
import json, sys, torch
from tconv3d.kernels.group_norm import group_norm_bwd, group_norm_fwd
from tconv3d.inspect.compile import compile_only, read_cubin
out = []
for capability in ARCHS:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(2, 256, 8, 64, 64, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last_3d)
        w = torch.empty(256, device="meta", dtype=dtype)
        launches = []
        with compile_only(capability, launches):
            y, mean, rstd = group_norm_fwd(x, w, w, 32, 1e-6, "silu")
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "silu")
        for name, grid, warps, kernel, seconds, _ in launches:
            out.append({"kernel": name, "arch": capability, "dtype": str(dtype), **read_cubin(kernel.asm["cubin"])})
print(json.dumps(out))
"""


RMS_NORM_COMPILE = """
import json, torch
from tconv3d.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from tconv3d.inspect.compile import compile_only, read_cubin
out = []
for capability in ARCHS:
    for dtype in (torch.bfloat16, torch.float32):
        for channels in (96, 384, 1024, 4096):
            x = torch.empty(1, channels, 4, 32, 32, device="meta", dtype=dtype).contiguous(
                memory_format=torch.channels_last_3d)
            w = torch.empty(channels, device="meta", dtype=dtype)
            for clamp in (False, True):
                launches = []
                with compile_only(capability, launches):
                    rms_norm_fwd(x, w, w, 1e-6, "silu", clamp)
                    rms_norm_bwd(x, x, w, w, 1e-6, "silu", clamp)
                for name, grid, warps, kernel, seconds, _ in launches:
                    if name.startswith("_rms_norm"):  # not the split sums (compiled with every weight gradient)
                        out.append({"kernel": name, "arch": capability, "dtype": str(dtype), "channels": channels,
                                    "clamp": clamp, **read_cubin(kernel.asm["cubin"])})
print(json.dumps(out))
"""


def compile_script(script: str) -> list[dict]:
    """Run a compile script in a process without the interpreter; its last stdout line is the JSON reports. The
    script sees ARCHS, the static archs (STATIC_ARCHS)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = f"ARCHS = {STATIC_ARCHS!r}\n" + script
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=900)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


# test_tma's walk of the carried steps, compiled for sm_90 (`kernel`)
WALK_KERNEL = """
import json, sys
sys.path.insert(0, "tests")
import triton
from triton.backends.compiler import GPUTarget
import test_tma
ints = ("first", "count", "D", "H", "W", "K_BLOCKS")
signature = {"got_ptr": "*i32", "want_ptr": "*i32", **dict.fromkeys(ints, "i32"), "BOX_H": "constexpr",
             "BOX_W": "constexpr"}
source = triton.compiler.ASTSource(fn=test_tma._walk_kernel, signature=signature, constexprs={"BOX_H": 4, "BOX_W": 8})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32))
"""


def test_the_suites_own_kernels_compile():
    """A kernel a test defines (test_tma's walk of the carried steps) runs compiled on a GPU, not interpreted: it
    compiles for sm_90 here (the interpreter took a starred tuple that triton 3.6's compiler refused on the H100,
    2026-11-26)."""
    assert compile_script(WALK_KERNEL + "print(json.dumps([len(kernel.asm['cubin'])]))")[0] > 0


KEPT_DISASSEMBLY = """
import subprocess
from tconv3d.inspect import compile as inspect_compile
cubin = kernel.asm["cubin"]
tools = []
original = subprocess.run
subprocess.run = lambda args, **kw: tools.append(args[1]) or original(args, **kw)
first, again = inspect_compile.read_cubin(cubin), inspect_compile.read_cubin(cubin)
kept = list((triton.knobs.cache.dir / inspect_compile.Path("tconv3d-cuobjdump")).glob("*.json.z"))
kept[0].write_bytes(b"torn")
torn = inspect_compile.read_cubin(cubin)
print(json.dumps([first == again == torn, first["registers"] > 0, tools, len(kept)]))
"""


def test_disassembly_is_read_once_per_cubin(tmp_path, monkeypatch):
    """cuobjdump's output is kept by the cubin's content in Triton's cache (0.6 s a cubin, half of what inspect
    spent a record): a second read of the same cubin runs no tool and parses the same facts; a
    torn or unreadable kept file is read from the tool again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    same, registers, tools, kept = compile_script(WALK_KERNEL + KEPT_DISASSEMBLY)
    assert same and registers
    assert tools == ["-res-usage", "-sass", "-res-usage", "-sass"]  # the first read and the torn one
    assert kept == 1


def test_rms_norm_kernels_compile_without_spills_and_vectorised():
    """The rms_norm kernels for the static archs (sm_90 and sm_80; sm_90 alone under the GPU image's triton), bf16
    and fp32, rows of 96 to 4,096 channels (the widest a row may be), eps under the root and clamped, forward and
    backward with SiLU: no spills, 128-bit loads along the contiguous channels."""
    reports = compile_script(RMS_NORM_COMPILE)
    assert len(reports) == 32 * len(STATIC_ARCHS)  # archs x 2 dtypes x 4 widths x 2 uses of eps x (fwd + bwd)
    for r in reports:
        assert r["sm"] == r["arch"], r  # sm_80's are not sm_90's cubins again (compile_only forgot this module)
        assert not r["spill_bytes"] and not r["local_accesses"], r
        assert "LDG.E.128" in r["loads"], r


def test_group_norm_kernels_compile_without_spills_and_vectorised():
    """The norm kernels for the static archs, both dtypes, forward and backward: no spills, 128-bit loads along
    the contiguous channels in the passes over the tensors (the fold of a group's partials reads a few floats a
    split)."""
    reports = compile_script(NORM_COMPILE)
    # archs x 2 dtypes x (forward: reduce, fold, affine + backward: fold, reduce, fold, affine)
    assert len(reports) == 14 * len(STATIC_ARCHS)
    assert sum(r["kernel"] == "_fold_kernel" for r in reports) == 6 * len(STATIC_ARCHS)
    for r in reports:
        assert r["sm"] == r["arch"], r
        assert not r["spill_bytes"] and not r["local_accesses"], r
        assert "LDG.E.128" in r["loads"] or r["kernel"] == "_fold_kernel", r


def test_depthwise_kernels_read_channels_as_vectors_whatever_the_multiplier(records):
    """The suite's depthwise layers, channel multipliers 1 and 2: every direct kernel loads activations and
    gradients in 128-bit vectors along the contiguous channels, and the weight gradient (which reads no weight)
    nothing narrower. Reading x[.., co // 2] or go[.., ci * 2 + j] for a run of channels compiled to one load
    an element (LDG.E.U16 alone in bf16, 72 loads a forward tap row where the multiplier-1 layer issues 30)."""
    found = [(r, k) for r in records if r["case"] in ("x3d_depthwise_192", "depthwise_mult2_96")
             for k in r["kernels"] if k["kernel"].startswith("_depthwise_")]  # fmt: skip
    assert len(found) == 2 * 3 * 3 * len(STATIC_ARCHS)
    for r, k in found:
        assert "LDG.E.128" in k["loads"], (r["case"], r["dtype"], r["direction"], r["arch"], k["loads"])
        if r["direction"] == "wgrad":
            assert k["loads"] == ["LDG.E.128"], (r["case"], r["dtype"], r["arch"], k["loads"])


TMA_COMPILE = """
import dataclasses, json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels.config import off_gluon
from tconv3d.tune import configs
from tconv3d.tune.shapes import load_shape_set
from tconv3d.inspect.compile import ARCHS, compile_launch
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
            report = compile_launch(direction, geom, dtype, config, 90)[0]
            out.append({"case": shape.name, "direction": direction, "config": config.to_dict(), **report.to_dict()})
# A UNet decoder's first conv reading its skip connection in place (channels_after): the forward's boxes from two
# descriptors, the weight gradient one launch per source
skip = conv_geometry((1, 64, 32, 64, 64), (64, 128, 3, 3, 3), 1, 1, 1, after_channels=64)
for direction in ("fwd", "wgrad"):
    config = configs.heuristic_config(direction, skip, torch.bfloat16, 132, 90)
    config = configs.with_tma(off_gluon(config), skip, direction)
    for report in (r for r in compile_launch(direction, skip, torch.bfloat16, config, 90) if "tma" in r.kernel):
        out.append({"case": "unet_skip", "direction": direction, "config": config.to_dict(), **report.to_dict()})
# MONAI UNet's up conv (stride 2) transposing a 64 + 64-channel concatenation: the input gradient's boxes from two
# descriptors, through the phase views of grad_in
up = dataclasses.replace(conv_geometry((1, 64, 32, 64, 64), (128, 64, 3, 3, 3), 2, 1, 1), out_after_channels=64)
config = configs.heuristic_config("dgrad", up, torch.bfloat16, 132, 90)
config = configs.with_tma(off_gluon(config), up, "dgrad")
report = compile_launch("dgrad", up, torch.bfloat16, config, 90)[0]
out.append({"case": "unet_up", "direction": "dgrad", "config": config.to_dict(), **report.to_dict()})
print(json.dumps(out))
"""


POINTER_AFTER_COMPILE = """
import dataclasses, json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.tune import configs
from tconv3d.inspect.compile import compile_launch
out = []
for after in (0, 64):  # the same 128 channels, one source or two (a skip connection read in place)
    geom = conv_geometry((1, 128 - after, 32, 64, 64), (64, 128, 3, 3, 3), 1, 1, 1, after_channels=after)
    # the input gradient's (a transposed conv's input): 128 channels of grad_output, 64 of them channels_after's
    transposed = conv_geometry((1, 64, 64, 128, 128), (128, 64, 3, 3, 3), 2, 1, 1)
    transposed = dataclasses.replace(transposed, out_after_channels=after)
    for capability in ARCHS:
        for direction, geom in (("fwd", geom), ("wgrad", geom), ("dgrad", transposed)):
            # the tiles a GPU has timed (timed_only), on the pointer kernel (on sm_90 a box kernel's else)
            config = configs.heuristic_config(direction, geom, torch.bfloat16, 132, capability, timed_only=True)
            config = dataclasses.replace(config, tma_box_w=0, gluon=0)
            report = compile_launch(direction, geom, torch.bfloat16, config, capability)[0]
            out.append({"after": after, "arch": capability, "direction": direction, **report.to_dict()})
print(json.dumps(out))
"""


DECODERS_COMPILE = """
import json, torch
from tconv3d.kernels import conv_gluon
from tconv3d.tune import configs
from tconv3d.tune.shapes import load_shape_set
from tconv3d.inspect.compile import compile_launch
out = []
if conv_gluon.UNAVAILABLE is None:
    for shape in load_shape_set("decoders"):
        geom = shape.launched_geometry()
        config = configs.heuristic_config("fwd", geom, torch.bfloat16, 132, 90)
        for report in compile_launch("fwd", geom, torch.bfloat16, config, 90):
            out.append({"case": shape.name, "config": config.to_dict(), **report.to_dict()})
print(json.dumps(out))
"""


def test_the_decoders_forwards_compile_as_chosen_without_spills():
    """The video VAE decoders' forwards as the sm_90 heuristic chooses them (the persistent Gluon kernel: H100 run 15
    timed it 1.7-2.8x the pointer kernels'): Wan's reading its cached frames, HunyuanVideo's and Mochi's interior
    within replicate borders, their border ring on the pointer kernel at tiles of at most 128 rows (the 256x128
    swapped tile's spilled 24 bytes there), LTX-2's reflect-bordered layers of few tiles split alike on both, the
    ring on 8 warps (472 bytes spilled on 4); no kernel of a launch spills, the Gluon one on the Hopper main loop."""
    from tconv3d.tune.shapes import load_shape_set

    if 90 not in STATIC_ARCHS:
        pytest.skip("sm_90 is not among the static archs")
    reports = compile_script(DECODERS_COMPILE)
    if not reports:
        pytest.skip("this Triton has no Gluon kernel")
    assert {r["case"] for r in reports} == {s.name for s in load_shape_set("decoders")}
    assert all(r["config"]["gluon"] == 2 for r in reports)
    spilled = [(r["case"], r["kernel"], r["spill_bytes"]) for r in reports if r["spill_bytes"] or r["local_accesses"]]
    assert not spilled
    gluon = [r for r in reports if "gluon" in r["kernel"]]
    assert len(gluon) == 8 and all(r["mma"].startswith("HGMMA") and r["loop_smem_ops"] == 0 for r in gluon)
    assert all(r["loop_wgmma_waits"] == [1] for r in gluon), [r["loop_wgmma_waits"] for r in gluon]
    rings = [r for r in reports if r["kernel"] == "_conv3d_fwd_kernel"]  # the bordered layers' border rings
    bordered = ["hunyuan_dec_128_replicate", "mochi_dec_256_replicate", "mochi_dec_768_replicate"]
    assert sorted(r["case"] for r in rings) == sorted([*bordered, "ltx2_dec_256_reflect", "ltx2_dec_512_reflect"])
    summed = {r["case"] for r in reports if r["kernel"] == "_sum_splits_kernel"}
    assert summed == {"ltx2_dec_256_reflect", "ltx2_dec_512_reflect"}


PACKED_COMPILE = """
import json, re, torch
from tconv3d.inspect.compile import _cuobjdump, _main_loop_body, compile_only, launch_on_meta
from tconv3d.inspect.__main__ import plan
from tconv3d.tune.shapes import load_shape_set
shapes = {s.name: s for name in ("bench", "awkward", "stack") for s in load_shape_set(name)}
out = []
for case, direction in (("first_cin3", "fwd"), ("last_cout3", "dgrad"), ("cin1", "fwd"), ("conv2d_like_c2", "dgrad"),
                        ("last_cout3", "wgrad"), ("last_cout3", "fwd"), ("first_cin3", "dgrad"),
                        ("stack_in8", "dgrad"), ("stack_in8", "fwd"), ("stack_out8", "dgrad")):
    for capability in ARCHS:
        shape = shapes[case]
        config = plan([shape], ["bf16"], [direction], [capability], False)[0][4]
        launches = []
        with compile_only(capability, launches):
            launch_on_meta(direction, shape.launched_geometry(), torch.bfloat16, config)
        usage, sass = _cuobjdump(launches[0][3].asm["cubin"])
        body = _main_loop_body(sass)
        out.append({"case": case, "direction": direction, "arch": capability, "kernel": launches[0][0],
                    "grid": launches[0][1], "block_m": config.block_m, "block_n": config.block_n,
                    "variant": config.variant,
                    "compares": sum(bool(re.search(r"\\bISETP\\.", line)) for line in body),
                    "divisions": sum("MUFU.RCP" in line for line in body), "instructions": len(body),
                    "local": sum(bool(re.search(r"\\b[LS]TL\\b", line)) for line in body),
                    "element_loads": sum(bool(re.search(r"\\bLDG\\.E\\.U16\\b", line)) for line in body),
                    "vector_copies": sum(bool(re.search(r"\\bLDGSTS\\.E\\.BYPASS\\.(LTC128B\\.)?128\\b", line))
                                         for line in body),
                    "warps": config.num_warps, "block_k": config.block_k, "taps": shape.launched_geometry().taps})
print(json.dumps(out))
"""


def test_packed_loops_test_one_bit_an_element():
    """The small-channel forms (PACK_TAPS: a step's (tap, channel) pairs each with its own tap) find which of a
    row's taps lie inside once a tile (utils.tap_bits), and divide by the channel count as a constant: their main
    loop (bf16, as the suite's stem, decoder head and two awkward shapes launch them on the pointer kernel) has
    no run-time division and at most 32 compares, where six bounds an element took 102 (first_cin3's forward,
    sm_90, triton 3.9: 584 instructions a pass, now 320; under 3.6 661 -> 447 -> 148 with its threads laid along
    the pairs). The decoder head's forward and the stem's input gradient, whose W taps are their columns, read
    each (kd, kh) tap's rows in one step, the stack's 8-channel input gradient its weight's rows as vectors."""
    reports = compile_script(PACKED_COMPILE)
    assert len(reports) == 10 * len(STATIC_ARCHS)
    for r in reports:
        assert not r["local"], r
        if (r["case"], r["direction"]) == ("stack_in8", "dgrad"):
            # 8 input channels' W taps as columns: each tap's 8 channels one 16-byte run of the weight's row
            # (conv_dgrad's W_CIN), copied whole, where they were gathered element by element (16 LDG.U16 a thread a
            # step, 379 instructions, sm_90 under 3.9; 337 under 3.6); now 285-294 on sm_80 and sm_90
            assert (r["kernel"], r["variant"]) == ("_conv3d_dgrad_kernel", "pointer"), r
            assert not r["element_loads"] and r["instructions"] <= 310 and r["divisions"] <= 1, r
            continue
        if r["case"] in ("stack_in8", "stack_out8"):
            # 8 channels a tap packed (the stack's forward from 8 channels, its input gradient from 8): each tap's
            # channels of a voxel one 16-byte run (utils.channel_run), copied whole into shared memory, where they
            # were gathered element by element (8 LDG.U16 a thread a step): 91 and 89 instructions a step for
            # 128 x 64 x 16 on 8 warps (sm_90, 3.9), where the element loads took 137 and 167
            assert r["kernel"] in ("_conv3d_fwd_kernel", "_conv3d_dgrad_kernel") and r["variant"] == "pointer", r
            assert not r["element_loads"] and r["vector_copies"] and r["block_k"] == 16 and r["warps"] == 8, r
            assert r["instructions"] <= 130 and not r["divisions"], r
            continue
        if (r["case"], r["direction"]) == ("last_cout3", "fwd"):
            # The decoder head's forward: its W taps as columns (config.w_tap_columns) on the pointer kernel, the
            # GPU's choice on sm_90 as on sm_80. Its rows are the output's rows extended by 2 (17 x 256 x 258), each
            # tile writing 126 of its 128 (one tap a step: 17 x 256 x 256 over 128); a step one (kd, kh) tap's
            # block of input channels, 270 instructions on 4 warps at 128 x 64 (sm_90, 3.9; 3.6: 262), its tap
            # divided out of the step once (a uniform division, as every one-tap loop)
            assert (r["kernel"], r["variant"], r["block_m"]) == ("_conv3d_fwd_kernel", "pointer", 128), r
            assert r["grid"][0] == -(-17 * 256 * 258 // 126), r
            assert r["instructions"] <= 300 and r["divisions"] <= 1, r
            continue
        if (r["case"], r["direction"]) == ("first_cin3", "dgrad"):
            # The stem's input gradient: its 3 input channels' W taps as columns, 4 a channel (16 columns, one
            # column tile), rows of 256 + 2, block_m - 2 written a tile; a step one (kd, kh) tap's block of 128
            # output channels: 296-401 instructions (sm_80, sm_90 under 3.9; 310 under 3.6)
            assert (r["kernel"], r["variant"], r["block_n"]) == ("_conv3d_dgrad_kernel", "pointer", 16), r
            assert r["grid"][0] == -(-17 * 256 * 258 // (r["block_m"] - 2)), r
            assert r["instructions"] <= 420 and r["divisions"] <= 1, r
            continue
        assert not r["divisions"], r
        if r["direction"] == "wgrad":
            # The decoder head's weight gradient: (tap, output channel) pairs on the rows, every tap of a step's
            # voxels at once; at most 6 warp instructions a (voxel, tap) (3.1 under 3.6, 4.1-4.3 under 3.9),
            # where one tap a program took 37 (586 a 64-voxel step on 4 warps, sm_90, triton 3.9; 822 under 3.6).
            assert r["kernel"] == "_conv3d_wgrad_out_pairs_kernel", r
            assert r["instructions"] * r["warps"] <= 6 * r["block_k"] * r["taps"], r
        else:  # each thread few pairs and many voxels (utils.gather_tile): under 3.6 first_cin3's forward took
            # 447 instructions a step and last_cout3's input gradient 467 with 8 pairs a thread, now 148 and 154;
            # under 3.9 the forward's weight tile 320 (sm_90) and 330 (sm_80), now 155 and 173
            assert r["kernel"] in ("_conv3d_fwd_kernel", "_conv3d_dgrad_kernel"), r
            assert r["compares"] <= 32 and r["instructions"] <= 200, r


def test_pointer_kernels_read_channels_after_at_the_same_width():
    """The pointer forward, weight gradient and input gradient with a second channel source (each channel block
    or column tile from one source, chosen by arithmetic): no spills, the same 128-bit cp.async loads as one
    source, and at most 15% more instructions in the main loop (sm_90 and sm_80, bf16, a UNet decoder conv's
    64 + 64 channels, and a stride-2 transposed conv of 64 + 64; the forward's 5-11% more under triton 3.6 and
    3.9, the weight gradient's 1%, the input gradient's 2-6%; sm_90 alone under the GPU image's triton)."""
    reports = compile_script(POINTER_AFTER_COMPILE)
    assert len(reports) == 6 * len(STATIC_ARCHS)
    plain = {(r["arch"], r["direction"]): r for r in reports if not r["after"]}
    for r in (r for r in reports if r["after"]):
        one = plain[r["arch"], r["direction"]]
        name = (r["arch"], r["direction"])
        assert not r["spill_bytes"] and not r["local_accesses"], name
        assert set(r["loads"]) == set(one["loads"]) and any(load.endswith(".128") for load in r["loads"]), name
        assert r["loop_instructions"] <= 1.15 * one["loop_instructions"], (name, r["loop_instructions"])


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
from tconv3d.inspect.compile import ARCHS, compile_launch
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
                    report = compile_launch(direction, geom, dtype, small, 90)[0]
                    out.append({"case": shape.name, "direction": direction, "dtype": str(dtype), "row": "small_grid",
                                "config": small.to_dict(), **report.to_dict()})
                # a tap's 96 channels in three full 32-deep steps (configs.whole_steps_twin)
                if shape.name in ("wan_dec_96", "last_cout3") and dtype == torch.bfloat16:
                    forced = choice.force_variant(direction, geom, dtype, chosen, "gluon", True)
                    whole = configs.whole_steps_twin(direction, geom, dataclasses.replace(forced, gluon=2), 2)
                    if forced.gluon == 2 and forced.block_k == 32 and direction != "wgrad":
                        whole = forced  # the heuristic took the twin (wan_dec_96's forward and input gradient)
                    if whole is not None:
                        report = compile_launch(direction, geom, dtype, whole, 90)[0]
                        out.append({"case": shape.name, "direction": direction, "dtype": str(dtype),
                                    "row": "whole_steps", "config": whole.to_dict(), **report.to_dict()})
                # the narrow forwards' halo tiles (configs.halo_twin): two frames a tile, the kd taps' input
                # frames one box, every (frame, kd) wgmma reading its frame as a slice
                if shape.name in ("unet_32", "unet_64") and dtype == torch.bfloat16 and direction != "wgrad":
                    forced = choice.force_variant(direction, geom, dtype, chosen, "gluon", True)
                    halo = configs.halo_twin(direction, geom, dataclasses.replace(forced, gluon=2), 2)
                    report = compile_launch(direction, geom, dtype, halo, 90)[0]
                    out.append({"case": shape.name, "direction": direction, "dtype": str(dtype), "row": "halo",
                                "config": halo.to_dict(), **report.to_dict()})
                # down_s2's phase views, the warp-specialized producer's predicated copies too
                if shape.name == "down_s2" and dtype == torch.bfloat16:
                    ws = choice.heuristic_gluon_tiles(chosen)
                    tiles.append(configs.with_gluon(ws, geom, direction, specialized=True))
                for config in filter(None, tiles):  # the twins: None for the weight gradient
                    report = compile_launch(direction, geom, dtype, config, 90)[0]
                    out.append({"case": shape.name, "direction": direction, "dtype": str(dtype),
                                "config": config.to_dict(), **report.to_dict()})
    # MONAI UNet's 16-channel weight gradients as chosen: transposed, 4 taps of 16 input channels (32-byte swizzle
    # rows) on one warpgroup's rows
    for shape in load_shape_set("unets"):
        chosen, _ = choice.choose("wgrad", shape.geometry(), torch.bfloat16, arch.device_name, arch.sm_count, 90)
        report = compile_launch("wgrad", shape.geometry(), torch.bfloat16, chosen, 90)[0]
        out.append({"case": shape.name, "direction": "wgrad", "dtype": str(torch.bfloat16), "config": chosen.to_dict(),
                    **report.to_dict()})
    # BasicUNet's decoder conv of [upsampled, skip] (32 + 32 -> 32), its weight gradient as chosen: one transposed
    # launch a source, 4 taps of 32 input channels on the wgmma's rows
    skip_32 = conv_geometry((1, 32, 16, 32, 32), (32, 64, 3, 3, 3), 1, 1, 1, after_channels=32)
    chosen, _ = choice.choose("wgrad", skip_32, torch.bfloat16, arch.device_name, arch.sm_count, 90)
    for report in compile_launch("wgrad", skip_32, torch.bfloat16, chosen, 90):
        if report.kernel == "_conv3d_wgrad_gluon_kernel":
            out.append({"case": "unet_skip_32", "direction": "wgrad", "dtype": str(torch.bfloat16),
                        "config": chosen.to_dict(), **report.to_dict()})
    # unet_64's halo tiles swapped (each frame's tile transposed: m64n128), forward and input gradient
    narrow = next(s for s in load_shape_set("bench") if s.name == "unet_64").geometry()
    for direction in ("fwd", "dgrad"):
        tile = configs.with_gluon(KernelConfig(128, 64, 64, 4, 4), narrow, direction, True)
        config = configs.swapped_twin(configs.halo_twin(direction, narrow, tile, 2), direction)
        report = compile_launch(direction, narrow, torch.bfloat16, config, 90)[0]
        out.append({"case": "unet_64", "direction": direction, "dtype": str(torch.bfloat16), "row": "halo_swapped",
                    "config": config.to_dict(), **report.to_dict()})
    # The last column block's half tiles (half_tail): 192 channels in 128-column blocks, swapped, both kernels
    wide = next(s for s in load_shape_set("bench") if s.name == "wan_dec_192").geometry()
    for direction in ("fwd", "dgrad"):
        for specialized in (False, True):
            tall = configs.with_gluon(KernelConfig(256, 128, 64, 8, 3), wide, direction, specialized)
            config = configs.swapped_twin(tall, direction)
            report = compile_launch(direction, wide, torch.bfloat16, config, 90)[0]
            out.append({"case": "wan_dec_192", "direction": direction, "dtype": str(torch.bfloat16),
                        "row": "half_tail", "config": config.to_dict(), **report.to_dict()})
    # and its weight gradient's, rows and columns (wgrad_half_tails): warp-specialized, one tap a tile
    config = configs.with_gluon(KernelConfig(128, 128, 64, 8, 3, split_k=6), wide, "wgrad", True)
    report = compile_launch("wgrad", wide, torch.bfloat16, config, 90)[0]
    out.append({"case": "wan_dec_192", "direction": "wgrad", "dtype": str(torch.bfloat16), "row": "half_tail",
                "config": config.to_dict(), **report.to_dict()})
    # The chosen tiles forced to the Gluon kernel, and their warp-specialized form, per direction (bf16).
    def pipelined_and_specialized(case, geom, directions):
        for direction in directions:
            chosen, _ = choice.choose(direction, geom, torch.bfloat16, arch.device_name, arch.sm_count, 90)
            # (off the Gluon kernel first: where the heuristic chose the persistent one, the pipelined one too)
            tiles = choice.force_variant(direction, geom, torch.bfloat16, choice.off_gluon(chosen), "gluon", True)
            for config in (tiles, configs.with_gluon(tiles, geom, direction, specialized=True)):
                report = compile_launch(direction, geom, torch.bfloat16, config, 90)[0]
                out.append({"case": case, "direction": direction, "dtype": str(torch.bfloat16),
                            "config": config.to_dict(), **report.to_dict()})

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
print(json.dumps({"unavailable": conv_gluon.UNAVAILABLE, "reports": out}))
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
    UNet decoder conv reading its skip connection as channels_after, forward and weight gradient), for sm_90: TMA loads,
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


AHEAD_COMPILE = """
import json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.inspect.compile import ARCHS, compile_ahead
from tconv3d.kernels.config import KernelConfig
geom = conv_geometry((1, 64, 4, 16, 32), (64, 64, 3, 3, 3), 1, 1, 1)
clean = ("fwd", geom, torch.bfloat16, KernelConfig(128, 128, 64, 8, 3))
too_big = ("fwd", geom, torch.bfloat16, KernelConfig(256, 256, 128, 4, 6))  # over 227 KB of shared memory
wait, shutdown = compile_ahead([clean, too_big, clean], ARCHS[90], 2)
found = [wait(clean), wait(too_big), wait(("dgrad", geom, torch.bfloat16, KernelConfig(64, 64, 32, 4, 3)))]
shutdown()
print(json.dumps(found))
"""


def test_compile_ahead_answers_each_planned_launch():
    """The tuner's and bench.variants' compile-ahead pool: each planned launch once, answered when compiled (clean
    or not); a launch nobody planned gets None, for the caller to compile itself."""
    assert compile_script(AHEAD_COMPILE) == [True, False, None]
