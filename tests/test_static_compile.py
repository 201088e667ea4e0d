"""What the compiler makes of every kernel, without a GPU: `python -m tconv3d.inspect --distinct` compiles each
config tconv3d would choose for the bench suite and the awkward shapes (bf16, fp32, and fp16 where its config is
not bf16's; forward, input-grad, weight-grad) for sm_90 and sm_80. CI runs this under the newest triton and under
triton 3.6, the GPU image's; the second run compiles for sm_90 alone (TCONV3D_STATIC_ARCHS=90, STATIC_ARCHS: the
GPU machines are all Hopper).

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

from tconv3d.kernels import launch

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
         "--arch", ",".join(map(str, STATIC_ARCHS)), "--distinct"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(out.read_text())


def _names(records):
    return [f"{r['case']} {r['dtype']} {r['direction']} sm_{r['arch']} {r['config']}" for r in records]


def test_every_chosen_config_compiles_for_both_archs(records):
    """Each case, dtype, direction and arch's chosen config: bf16 and fp32 every one, fp16 those whose config
    differs from bf16's (inspect --distinct; the same kernel but for the MMA's operand type otherwise: 148 of 150
    at 2026-11-29, 230 s of the compile time)."""
    from tconv3d.tune.shapes import load_shape_set

    cases = len(load_shape_set("bench")) + len(load_shape_set("awkward"))
    keys = [(r["case"], r["dtype"], r["direction"], r["arch"]) for r in records]
    assert len(set(keys)) == len(keys)
    assert sum(r["dtype"] != "fp16" for r in records) == cases * 2 * 3 * len(STATIC_ARCHS)
    assert {(r["arch"], r["dtype"], r["direction"]) for r in records if r["dtype"] != "fp16"} == {
        (a, d, k) for a in STATIC_ARCHS for d in ("bf16", "fp32") for k in ("fwd", "dgrad", "wgrad")
    }
    bf16 = {(r["case"], r["direction"], r["arch"]): r["config"] for r in records if r["dtype"] == "bf16"}
    assert all(r["config"] != bf16[r["case"], r["direction"], r["arch"]] for r in records if r["dtype"] == "fp16")
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


# The Tritons whose ptxas the heuristic's tiles are chosen spill-free under (tune/configs.py's notes: 3.6 and 3.9, CI's;
# torch 2.14's 3.8 ran this file clean). Another's ptxas may spill a few bytes outside a main loop: triton 3.7's (torch
# 2.12 and 2.13's CUDA builds) on sm_80, 8-16 bytes and 2-8 local accesses a tile, in the 32-channel layers' 128 x 32
# forwards and x3d_depthwise_192's, where 3.9's ptxas takes more registers (unet_32's bf16 forward: 162, 3.7's 128). A
# warning there; a spill inside a main loop, or shared memory past the limit, fails under any Triton.
SPILL_FREE_TRITONS = ("3.6", "3.8", "3.9")


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
    if ".".join(triton.__version__.split(".")[:2]) not in SPILL_FREE_TRITONS:
        outside = [r for r in ours if r["loop_local_accesses"] == 0 and r["shared_bytes"] <= limit[r["arch"]]]
        if outside:
            warnings.warn(f"spill outside a main loop under {triton.__version__}: {_names(outside)}", stacklevel=1)
        ours = [r for r in ours if r not in outside]
    assert not ours, _names(ours)


def test_every_tensor_map_meets_the_drivers_requirements(records):
    """No chosen launch hands the driver a tensor map that cuTensorMapEncodeTiled's documented requirements
    refuse (compile.tensor_maps, as the compiled kernel encodes it); sm_90's TMA launches were there to check."""
    refused = [r for r in records if r.get("tensor_map_problems")]
    assert not refused, [p for r in refused for p in r["tensor_map_problems"]]
    assert sum(bool(k["tensor_maps"]) for r in records if r["compiled"] for k in r["kernels"]) > 30


def test_every_chosen_gluon_launch_keeps_the_hopper_main_loop(records):
    """Every case of the bench and awkward sets as chosen on the Gluon kernels, under each triton CI runs: TMA into
    shared memory, wgmma from it with one group in flight (inspect's problems). test_hopper_main_loops compiles
    tiles of each kind; this holds every chosen one (a strided weight gradient of 24 -> 40 channels, stored element
    by element, had its wgmmas serialized under triton 3.9 alone until conv_gluon._downcast)."""
    from tconv3d.inspect.__main__ import problems

    gluon = [r for r in records if r["compiled"] and r["config"].get("gluon")]
    if 90 in STATIC_ARCHS and not gluon:
        from tconv3d.kernels import conv_gluon

        assert conv_gluon.UNAVAILABLE, "no chosen launch on the Gluon kernels where this triton has them"
    found = [p for p in problems(gluon) if "Gluon main loop" in p]
    assert not found, found


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
from tconv3d.kernels.group_norm import group_norm_bwd, group_norm_fwd, update_running_statistics
from tconv3d.inspect.compile import compile_only, report_rows
out = []
for capability in ARCHS:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.empty(2, 256, 8, 64, 64, device="meta", dtype=dtype).contiguous(memory_format=torch.channels_last_3d)
        w = torch.empty(256, device="meta", dtype=dtype)
        statistic = torch.empty(256, device="meta")
        count = torch.empty((), device="meta", dtype=torch.int64)
        launches = []
        with compile_only(capability, launches):
            y, mean, rstd = group_norm_fwd(x, w, w, 32, 1e-6, "silu")
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "silu")
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "none")
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "relu")
            group_norm_fwd(x, w, w, 32, 1e-6, "leaky_relu", None, 0.2)
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "leaky_relu", None, 0.2)
            group_norm_fwd(x, w, w, 32, 1e-6, "prelu", None, w)
            group_norm_bwd(x, x, mean, rstd, w, w, 32, "prelu", None, w)
            update_running_statistics(statistic, statistic, w, w.clone(), count, None, 1e-5, 1024)
        wide = len(launches)
        # a sample of 2.2G voxels: indices in int64 (WIDE), the reduction's splits within the grid's limit
        x = torch.empty(1, 16, 1300, 1300, 1300, device="meta", dtype=dtype).to(memory_format=torch.channels_last_3d)
        with compile_only(capability, launches):
            y, mean, rstd = group_norm_fwd(x, w[:16], w[:16], 2, 1e-6, "silu")
            group_norm_bwd(x, x, mean, rstd, w[:16], w[:16], 2, "silu")
        for i, (name, grid, warps, kernel, seconds, _) in enumerate(launches):
            row = {"kernel": name, "arch": capability, "dtype": str(dtype), "wide": i >= wide, "grid": list(grid)}
            out.append((row, kernel.asm["cubin"]))
print(json.dumps(report_rows(out)))
"""


RMS_NORM_COMPILE = """
import json, torch
from tconv3d.kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
from tconv3d.inspect.compile import compile_only, report_rows
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
                for name, grid, warps, kernel, seconds, _ in launches:  # the backward's sum of both partials too
                    out.append(({"kernel": name, "arch": capability, "dtype": str(dtype), "channels": channels,
                                "clamp": clamp}, kernel.asm["cubin"]))
print(json.dumps(report_rows(out)))
"""


CHANNEL_SUMS_COMPILE = """
import json, torch
from tconv3d.kernels.split_k import channel_sums
from tconv3d.inspect.compile import compile_only, report_rows
out = []
for capability in ARCHS:
    for dtype in (torch.bfloat16, torch.float32):
        for channels in (96, 320, 512):
            x = torch.empty(2, channels, 8, 32, 32, device="meta", dtype=dtype).contiguous(
                memory_format=torch.channels_last_3d)
            launches = []
            with compile_only(capability, launches):
                channel_sums(x, dtype)
            for name, grid, warps, kernel, seconds, _ in launches:
                out.append(({"kernel": name, "arch": capability, "dtype": str(dtype), "channels": channels,
                            "grid": list(grid)}, kernel.asm["cubin"]))
print(json.dumps(report_rows(out)))
"""


BORDER_FOLD_COMPILE = """
import json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels.fold import fold_bordered
from tconv3d.inspect.compile import compile_only, report_rows
out = []
for capability in ARCHS:
    for mode, padding in (("replicate", (2, 0, 1, 1, 1, 1)), ("reflect", (1, 1, 1, 1, 1, 1))):
        for source, into in ((torch.float32, torch.bfloat16), (torch.float32, torch.float32)):
            for channels in (64, 384):
                for bias in (False, True):
                    geom = conv_geometry((2, channels, 5, 32, 32), (channels, channels, 3, 3, 3), 1, padding, 1,
                                         padding_mode=mode)
                    size = [n + p + q for n, p, q in zip(geom.in_size, padding[0::2], padding[1::2])]
                    bordered = torch.empty(2, channels, *size, device="meta", dtype=source).contiguous(
                        memory_format=torch.channels_last_3d)
                    b = torch.empty(channels, device="meta", dtype=into) if bias else None
                    launches = []
                    with compile_only(capability, launches):
                        fold_bordered(bordered, geom, b, into)
                    for name, grid, warps, kernel, seconds, _ in launches:
                        out.append(({"kernel": name, "arch": capability, "mode": mode, "into": str(into),
                                     "channels": channels, "bias": bias}, kernel.asm["cubin"]))
print(json.dumps(report_rows(out)))
"""


def within_grid(grid) -> bool:
    """Whether a launch's grid (one to three axes) is within CUDA's (launch.MAX_GRID)."""
    return all(programs <= most for programs, most in zip(grid, launch.MAX_GRID))  # noqa: B905


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
inspect_compile._KEPT_SOURCE = b"another tconv3d"  # what an older or newer inspect.compile kept is not read
changed = inspect_compile.read_cubin(cubin)
print(json.dumps([first == again == torn == changed, first["registers"] > 0, tools, len(kept)]))
"""


def test_disassembly_is_read_once_per_cubin(tmp_path, monkeypatch):
    """cuobjdump's output is kept by the cubin's content in Triton's cache (0.6 s a cubin, half of what inspect
    spent a record): a second read of the same cubin runs no tool and parses the same facts; a
    torn or unreadable kept file, or one kept by another version of inspect.compile, is read from the tools again."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    same, registers, tools, kept = compile_script(WALK_KERNEL + KEPT_DISASSEMBLY)
    assert same and registers
    # the first read, the torn one and another version's: nvdisasm over the raw instructions, cuobjdump's resource usage
    assert tools == ["-b", "-res-usage"] * 3
    assert kept == 1


RAW_AGAINST_CUOBJDUMP = """
import json, os, subprocess, tempfile
from pathlib import Path
import triton
from tconv3d.inspect import compile as inspect_compile
# The largest cubin of each kernel and arch in Triton's cache (what the inspection of every chosen config compiled).
# The cache is shared: with runs of other archs (CI's under the newest triton; a user's sm_89 or sm_100), skipped.
largest, other = {}, []
for path in Path(triton.knobs.cache.dir).glob("*/*.cubin"):
    cubin = path.read_bytes()
    if inspect_compile.cubin_capability(cubin) not in ARCHS:
        continue
    code = inspect_compile._raw_code(cubin)
    if code is None:
        other.append(path.name)
    elif (key := code[:2]) not in largest or len(cubin) > len(largest[key]):
        largest[key] = cubin
out = []
for capability in sorted({c for c, _ in largest}):
    chosen = sorted((name, cubin) for (c, name), cubin in largest.items() if c == capability)
    raw = inspect_compile._raw_sass(capability, [inspect_compile._raw_code(cubin)[1:] for _, cubin in chosen])
    for (name, cubin), sass in zip(chosen, raw):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        tool = inspect_compile._nvidia_tool("cuobjdump")
        usage, reference = (subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout
                            for flag in ("-res-usage", "-sass"))
        os.unlink(f.name)
        lines = lambda text: [" ".join(l.split()) for l in (text or "").splitlines() if l.strip().startswith("/*")]
        out.append({"kernel": name, "arch": capability, "read": sass is not None,
                    "lines": len(lines(reference)), "same_lines": lines(sass) == lines(reference),
                    "same_facts": inspect_compile._cubin_facts(usage, sass or "") == inspect_compile._cubin_facts(
                        usage, reference)})
print(json.dumps({"other": other, "kernels": out}))
"""


def test_sass_read_in_one_run_is_cuobjdumps(records):
    """The SASS read from raw instructions laid end to end, one nvdisasm run an arch (compile._raw_sass: cuobjdump
    paid nvdisasm's 0.5 s set-up once a cubin, a quarter of the static compile tests' time), has cuobjdump's lines
    (addresses, instructions, encodings; branch and call targets each kernel's own again) and the facts read from
    them: the largest cubin of every kernel and arch the inspection compiled. A kernel with a jump table (BRX) is
    left to cuobjdump."""
    found = compile_script(RAW_AGAINST_CUOBJDUMP)
    kernels = found["kernels"]
    assert found["other"] == []  # every cubin has one kernel's code, nothing relocated, an arch known
    assert {k["arch"] for k in kernels} == set(STATIC_ARCHS)
    assert len(kernels) >= 8 * len(STATIC_ARCHS), [k["kernel"] for k in kernels]
    read = [k for k in kernels if k["read"]]
    assert len(read) >= len(kernels) - 2, [k["kernel"] for k in kernels if not k["read"]]  # Gluon's jump tables
    assert all(k["lines"] > 100 for k in read)
    assert all(k["same_lines"] and k["same_facts"] for k in read), [k for k in read if not k["same_lines"]]


def test_rms_norm_kernels_compile_without_spills_and_vectorised():
    """The rms_norm kernels for the static archs (sm_90 and sm_80; sm_90 alone under the GPU image's triton), bf16
    and fp32, rows of 96 to 4,096 channels (the widest a row may be), eps under the root and clamped, forward and
    backward with SiLU, and the one sum of the backward's weight and bias partials: no spills, 128-bit loads along
    the contiguous channels (and the partials)."""
    reports = compile_script(RMS_NORM_COMPILE)
    # archs x 2 dtypes x 4 widths x 2 uses of eps x (fwd, bwd, the partials' sum)
    assert len(reports) == 48 * len(STATIC_ARCHS)
    assert sum(r["kernel"] == "_sum_splits_kernel" for r in reports) == 16 * len(STATIC_ARCHS)
    for r in reports:
        assert r["sm"] == r["arch"], r  # sm_80's are not sm_90's cubins again (compile_only forgot this module)
        assert not r["spill_bytes"] and not r["local_accesses"], r
        assert "LDG.E.128" in r["loads"], r


def test_group_norm_kernels_compile_without_spills_and_vectorised():
    """The norm kernels for the static archs, both dtypes, forward and backward (with a fused SiLU, a fused ReLU,
    a fused leaky ReLU, a fused PReLU of a weight a channel and without; the leaky ReLU's and PReLU's forwards too),
    and BatchNorm's running statistics' update; and the SiLU's forward and backward of a sample of 2.2G voxels
    (their int64 voxel indices, WIDE, within the grid's limits): no spills, 128-bit loads along the contiguous
    channels in the passes over the tensors (the fold of a group's partials reads a few floats a split; the
    update, C values)."""
    reports = compile_script(NORM_COMPILE)
    # archs x 2 dtypes x (3 + 2 forwards, SiLU's (twice), ReLU's, leaky ReLU's, PReLU's and the plain backward:
    # reduce, fold, affine each + the update)
    assert len(reports) == 62 * len(STATIC_ARCHS)
    assert sum(r["kernel"] == "_fold_kernel" for r in reports) == 20 * len(STATIC_ARCHS)
    assert sum(r["wide"] for r in reports) == 12 * len(STATIC_ARCHS)
    assert sum(r["kernel"] == "_running_statistics_kernel" for r in reports) == 2 * len(STATIC_ARCHS)
    for r in reports:
        assert within_grid(r["grid"]), r
        assert r["sm"] == r["arch"], r
        assert not r["spill_bytes"] and not r["local_accesses"], r
        assert "LDG.E.128" in r["loads"] or r["kernel"] in ("_fold_kernel", "_running_statistics_kernel"), r


def test_the_bias_gradient_kernels_compile_without_spills_and_vectorised():
    """split_k.channel_sums (a conv's bias gradient) for the static archs, bf16 and fp32, 96 to 512 channels: its
    partial sums (128-bit loads along the contiguous channels, the voxels split between up to CHANNEL_SUM_PROGRAMS
    programs) and the fixed-order sum of them, no spills."""
    reports = compile_script(CHANNEL_SUMS_COMPILE)
    assert len(reports) == 2 * 2 * 3 * len(STATIC_ARCHS)  # archs x 2 dtypes x 3 widths x (partials + their sum)
    for r in reports:
        assert r["sm"] == r["arch"], r
        assert not r["spill_bytes"] and not r["local_accesses"], r
        if r["kernel"] == "_channel_sums_kernel":
            assert "LDG.E.128" in r["loads"], r
            assert r["grid"][0] > 100, r  # 16,384 voxels: split between many programs


def test_the_border_fold_compiles_without_spills_and_vectorised():
    """kernels.fold.fold_bordered (a bordered layer's input gradient folded in one launch) for the static archs:
    replicate and reflect borders, the float32 buffer into bf16 and into fp32, 64 and 384 channels, with a bias and
    without: no spills, 128-bit loads along the contiguous channels."""
    reports = compile_script(BORDER_FOLD_COMPILE)
    assert len(reports) == 16 * len(STATIC_ARCHS)  # archs x 2 modes x 2 destinations x 2 widths x bias or not
    for r in reports:
        assert r["kernel"] == "_fold_borders_kernel" and r["sm"] == r["arch"], r
        assert not r["spill_bytes"] and not r["local_accesses"], r
        assert "LDG.E.128" in r["loads"], r


def test_depthwise_kernels_read_channels_as_vectors_whatever_the_multiplier(records):
    """The suite's depthwise layers, channel multipliers 1 and 2: every direct kernel loads activations and
    gradients in 128-bit vectors along the contiguous channels, and the weight gradient (which reads no weight)
    nothing narrower. Reading x[.., co // 2] or go[.., ci * 2 + j] for a run of channels compiled to one load
    an element (LDG.E.U16 alone in bf16, 72 loads a forward tap row where the multiplier-1 layer issues 30)."""
    found = [(r, k) for r in records if r["case"] in ("x3d_depthwise_192", "depthwise_mult2_96")
             for k in r["kernels"] if k["kernel"].startswith("_depthwise_")]  # fmt: skip
    assert len(found) >= 2 * 2 * 3 * len(STATIC_ARCHS)  # bf16 and fp32; fp16 where its config is not bf16's
    for r, k in found:
        assert "LDG.E.128" in k["loads"], (r["case"], r["dtype"], r["direction"], r["arch"], k["loads"])
        if r["direction"] == "wgrad":
            assert k["loads"] == ["LDG.E.128"], (r["case"], r["dtype"], r["arch"], k["loads"])


POINTER_AFTER_COMPILE = """
import dataclasses, json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.tune import configs
from tconv3d.inspect.compile import compile_launch, report_rows
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
            report = compile_launch(direction, geom, torch.bfloat16, config, capability, read=False)[0]
            out.append(({"after": after, "arch": capability, "direction": direction}, report))
print(json.dumps(report_rows(out)))
"""


DECODERS_COMPILE = """
import json, torch
from tconv3d.kernels import conv_gluon
from tconv3d.tune import configs
from tconv3d.tune.shapes import load_shape_set
from tconv3d.inspect.compile import compile_launch, report_rows
out = []
if conv_gluon.UNAVAILABLE is None:
    for shape in load_shape_set("decoders"):
        geom = shape.launched_geometry()
        config = configs.heuristic_config("fwd", geom, torch.bfloat16, 132, 90)
        for report in compile_launch("fwd", geom, torch.bfloat16, config, 90, read=False):
            out.append(({"case": shape.name, "config": config.to_dict()}, report))
print(json.dumps(report_rows(out)))
"""


def test_the_decoders_forwards_compile_as_chosen_without_spills():
    """The video VAE decoders' forwards as the sm_90 heuristic chooses them (the persistent Gluon kernel: H100 run 15
    timed it 1.7-2.8x the pointer kernels'): Wan's reading its cached frames, HunyuanVideo's and Mochi's interior
    within replicate borders, their border ring on the pointer kernel at tiles of at most 128 rows (the 256x128
    swapped tile's spilled 24 bytes there), LTX-2's reflect-bordered layers of few tiles on the pointer kernel (H200
    run 5 timed them split on both 1.5-3.4x slower); no kernel of a launch spills, the Gluon one on the Hopper main
    loop."""
    from tconv3d.tune.shapes import load_shape_set

    if 90 not in STATIC_ARCHS:
        pytest.skip("sm_90 is not among the static archs")
    reports = compile_script(DECODERS_COMPILE)
    if not reports:
        pytest.skip("this Triton has no Gluon kernel")
    assert {r["case"] for r in reports} == {s.name for s in load_shape_set("decoders")}
    ltx2 = ["ltx2_dec_256_reflect", "ltx2_dec_512_reflect"]
    assert all(r["config"].get("gluon", 0) == (0 if r["case"] in ltx2 else 2) for r in reports)
    spilled = [(r["case"], r["kernel"], r["spill_bytes"]) for r in reports if r["spill_bytes"] or r["local_accesses"]]
    assert not spilled
    gluon = [r for r in reports if "gluon" in r["kernel"]]
    assert len(gluon) == 6 and all(r["mma"].startswith("HGMMA") and r["loop_smem_ops"] == 0 for r in gluon)
    assert all(r["loop_wgmma_waits"] == [1] for r in gluon), [r["loop_wgmma_waits"] for r in gluon]
    pointer = [r for r in reports if r["kernel"] == "_conv3d_fwd_kernel"]  # the border rings, and LTX-2's whole
    bordered = ["hunyuan_dec_128_replicate", "mochi_dec_256_replicate", "mochi_dec_768_replicate"]
    assert sorted(r["case"] for r in pointer) == sorted([*bordered, *ltx2])
    summed = {r["case"] for r in reports if r["kernel"] == "_sum_splits_kernel"}
    assert summed == {"ltx2_dec_512_reflect"}  # its reduction split 4 ways (small_grid_split)


PACKED_COMPILE = """
import json, re, torch
from tconv3d.inspect.compile import _disassemble, _main_loop_body, compile_only, launch_on_meta
from tconv3d.inspect.__main__ import plan
from tconv3d.tune.shapes import load_shape_set
shapes = {s.name: s for name in ("bench", "awkward", "stack") for s in load_shape_set(name)}
compiled = []
for case, direction in (("first_cin3", "fwd"), ("last_cout3", "dgrad"), ("cin1", "fwd"), ("conv2d_like_c2", "dgrad"),
                        ("last_cout3", "wgrad"), ("last_cout3", "fwd"), ("first_cin3", "dgrad"),
                        ("stack_in8", "dgrad"), ("stack_in8", "fwd"), ("stack_out8", "dgrad")):
    for capability in ARCHS:
        shape = shapes[case]
        config = plan([shape], ["bf16"], [direction], [capability], False)[0][4]
        launches = []
        with compile_only(capability, launches):
            launch_on_meta(direction, shape.launched_geometry(), torch.bfloat16, config)
        compiled.append((case, direction, capability, shape, config, launches))
out = []
texts = _disassemble([launches[0][3].asm["cubin"] for *_, launches in compiled])  # every cubin in one go
for (case, direction, capability, shape, config, launches), (usage, sass) in zip(compiled, texts):
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


POINTWISE_COMPILE = """
import json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels.config import pointer_tiles
from tconv3d.tune import configs
from tconv3d.inspect.compile import _meta, compile_launch, report_rows
assert _meta((128, 192, 1, 1, 1), torch.bfloat16).stride()[2:] == (1, 1, 1)  # as a contiguous 1x1x1 weight's
out = []
for capability in ARCHS:
    for direction in ("fwd", "dgrad"):
        # a VAE res block's shortcut (192 -> 128 channels), the heuristic's tiles on the pointer kernel
        geom = conv_geometry((2, 192, 16, 32, 32), (128, 192, 1, 1, 1), 1, 0, 1)
        config = configs.heuristic_config(direction, geom, torch.bfloat16, 132, capability)
        config = pointer_tiles(config, direction, geom, 2)
        report = compile_launch(direction, geom, torch.bfloat16, config, capability, read=False)[0]
        out.append(({"arch": capability, "direction": direction, "tiles": config.to_dict()}, report))
print(json.dumps(report_rows(out)))
"""


def test_pointwise_pointer_kernels_load_the_weight_as_vectors():
    """A contiguous 1x1x1 weight's tap strides are 1, which Triton specializes: until the kernels zeroed a pointwise
    weight's tap strides, kd * stride_wd hid every weight row's alignment, and the forward and input gradient
    loaded the weight element by element (sm_80 bf16 at 128 x 128 x 64 on 8 warps: 16 LDG.U16 and STS.U16
    a step, 255 registers and 40 bytes spilled, 6 local accesses in the main loop; 397 instructions a step, now
    241 with 198 registers). Every load a 16-byte cp.async, nothing spilled."""
    reports = compile_script(POINTWISE_COMPILE)
    assert len(reports) == 2 * len(STATIC_ARCHS)
    for r in reports:
        name = (r["arch"], r["direction"], r["tiles"])
        assert not r["spill_bytes"] and not r["local_accesses"], name
        vectors = all(load.startswith("LDGSTS") and load.endswith(".128") for load in r["loads"])
        assert r["loads"] and vectors, (name, r["loads"])


PLAIN_RUN_COMPILE = """
import json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_fwd, conv_wgrad, utils
from tconv3d.kernels.config import pointer_tiles
from tconv3d.tune import configs
from tconv3d.inspect.compile import ARCHS as TARGETS, compile_launch, report_rows
geom = conv_geometry((2, 72, 9, 64, 16), (216, 72, 4, 4, 4), 2, 1, 1)  # 144- and 432-byte rows in 16 bits
out = []
for capability in ARCHS:
    for dtype in (torch.bfloat16, torch.float32):
        for direction, module in (("fwd", conv_fwd), ("wgrad", conv_wgrad)):
            chosen = configs.heuristic_config(direction, geom, dtype, TARGETS[capability].sm_count, capability)
            config = pointer_tiles(chosen, direction, geom, dtype.itemsize)
            for runs in (True, False):
                module.unseen_run = utils.unseen_run if runs else (lambda channels, *tensors: 1)
                reports = compile_launch(direction, geom, dtype, config, capability, read=False)
                case = {"arch": capability, "dtype": str(dtype), "direction": direction, "runs": runs}
                out += [({**case, "launch_index": i}, report) for i, report in enumerate(reports)]
print(json.dumps(report_rows(out)))
"""


def test_plain_loops_load_unseen_channel_runs_as_vectors():
    """72 -> 216 channels (stride 2, 4 x 4 x 4): Triton proves no stride of it 16-divisible, so until the plain
    pointer loops took their runs (utils.unseen_run, RUN and GO_RUN) the forward and weight gradient gathered x,
    grad_out and the weight element by element, the weight gradient's addresses for every element (fp32: 1363
    instructions a step on sm_90 with a 16-byte spill, 1473 on sm_80 with 56, 26 local accesses in its loop; 428
    and 497 now, nothing spilled). With the runs: no kernel spills, and each main loop at most 0.7 of its length
    without them (the forwards' 0.48-0.64, the weight gradients' 0.16-0.34, triton 3.9)."""
    reports = compile_script(PLAIN_RUN_COMPILE)
    mains = {(r["arch"], r["dtype"], r["direction"], r["runs"]): r for r in reports if r["launch_index"] == 0}
    assert len(mains) == 8 * len(STATIC_ARCHS)
    for r in (r for r in reports if r["runs"]):
        assert not r["spill_bytes"] and not r["local_accesses"], (r["arch"], r["dtype"], r["direction"], r["kernel"])
    for (arch, dtype, direction, runs), r in mains.items():
        if runs:
            before = mains[arch, dtype, direction, False]["loop_instructions"]
            assert r["loop_instructions"] <= 0.7 * before, (arch, dtype, direction, r["loop_instructions"], before)


INT32_ROWS_COMPILE = """
import json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_dgrad, conv_fwd, utils
from tconv3d.kernels.config import KernelConfig
from tconv3d.inspect.compile import compile_launch, report_rows
geom = conv_geometry((2, 56, 9, 33, 20), (54, 56, 3, 3, 3), 1, 1, 1)  # r30_56_54: 54-channel rows stored one by one
config = KernelConfig(64, 64, 16, 4, 3)
flat_y, out = conv_fwd._flat_y, []
for capability in ARCHS:
    for direction, module in (("fwd", conv_fwd), ("dgrad", conv_dgrad)):
        for narrow in (True, False):
            module.wide_rows = utils.wide_rows if narrow else (lambda rows, block_m: True)
            if direction == "fwd":
                module._flat_y = flat_y if narrow else (lambda y: False)
            else:
                module.flat_rows = utils.flat_rows if narrow else (lambda t: False)
            reports = compile_launch(direction, geom, torch.bfloat16, config, capability, read=False)
            out.append(({"arch": capability, "direction": direction, "narrow": narrow}, reports[0]))
        module.wide_rows = utils.wide_rows
print(json.dumps(report_rows(out)))
"""


def test_rows_split_in_int32_and_flat_stores_keep_the_epilogue_light():
    """r30_56_54's bf16 forward and input gradient at 64 x 64 x 16: each thread of the element-by-element store
    (54 channels) holds many rows, and the epilogue found each row's voxel again by dividing its index, in int64
    a subroutine call (the forward on sm_90: 186 calls after the loop, 255 registers, 368 bytes spilled). With the
    rows in int32 (WIDE_ROWS) and a flat output's rows at m * stride_w (FLAT_Y, FLAT_GI): nothing spills, and each
    kernel holds at most half the registers it did (the forward 70 on sm_90, triton 3.9)."""
    reports = compile_script(INT32_ROWS_COMPILE)
    found = {(r["arch"], r["direction"], r["narrow"]): r for r in reports}
    assert len(found) == 4 * len(STATIC_ARCHS)
    for (arch, direction, narrow), r in found.items():
        if narrow:
            before = found[arch, direction, False]
            assert not r["spill_bytes"] and not r["local_accesses"], (arch, direction, r["registers"])
            assert r["registers"] <= before["registers"] / 2, (arch, direction, r["registers"], before["registers"])


RING_WGRAD_COMPILE = """
import json, re, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_wgrad, utils
from tconv3d.kernels.config import KernelConfig
from tconv3d.tune import configs
from tconv3d.inspect.compile import _disassemble, compile_launch
geom = conv_geometry((2, 64, 8, 32, 32), (64, 64, 3, 3, 3), 1, 1, 1, "replicate")  # an interior and its ring
config = configs.with_tma(KernelConfig(128, 64, 32, 8, 3, split_k=4), geom, "wgrad")
out = []
for capability in ARCHS:
    for narrow in (True, False):
        conv_wgrad.wide_rows = utils.wide_rows if narrow else (lambda rows, block: True)
        ring = compile_launch("wgrad", geom, torch.bfloat16, config, capability, read=False)[1]
        usage, sass = _disassemble([ring.cubin])[0]
        # Calls into a subroutine (laid out past the kernel's last EXIT): triton 3.7's ptxas also leaves a loop on
        # sm_80 by a CALL.REL.NOINC to the instruction after the loop's branch back, which calls nothing.
        exits = [int(a, 16) for a in re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+(?:@!?U?P\\w+\\s+)?EXIT\\b", sass)]
        targets = re.findall(r"CALL\\.REL\\.NOINC\\s+`?\\(?0x([0-9a-f]+)", sass)
        calls = sum(int(t, 16) > max(exits) for t in targets)
        out.append({"arch": capability, "narrow": narrow, "kernel": ring.kernel, "calls": calls})
print(json.dumps(out))
"""


def test_weight_gradient_ring_splits_its_voxels_in_int32():
    """A replicate-bordered weight gradient's ring launch (the pointer kernel over each frame's border voxels, RING)
    splits its voxels from their index every step (utils.ring_voxel). In int64 each division was a call to a
    subroutine (bf16: 20 calls on sm_90, 18 on sm_80; 112 -> 73 registers on sm_90 in int32, triton 3.9); in int32
    (WIDE_ROWS off) none. A call counts where it enters a subroutine: under triton 3.7 (torch 2.12 and 2.13's CUDA
    builds) the sm_80 ring leaves its loop by a CALL.REL.NOINC to the instruction after the branch back, which
    this test once counted as a division."""
    reports = compile_script(RING_WGRAD_COMPILE)
    assert len(reports) == 2 * len(STATIC_ARCHS)
    for r in reports:
        assert r["kernel"] == "_conv3d_wgrad_kernel", r
        assert (r["calls"] == 0) == r["narrow"], r


GATHERED_COMPILE = """
import dataclasses, json, torch
from tconv3d.geometry import conv_geometry
from tconv3d.kernels.config import off_gluon, pointer_tiles
from tconv3d.tune import configs
from tconv3d.inspect.compile import compile_launch, report_rows
# channel rows of 144 and 432 bytes (not multiples of 16 channels): r56_72_216's gradients, a stride-1 forward
strided = conv_geometry((2, 72, 9, 64, 16), (216, 72, 4, 4, 4), 2, 1, 1)
plain = conv_geometry((2, 216, 8, 48, 48), (160, 216, 3, 3, 3), 1, 1, 1)
out = []
for direction, geom in (("fwd", plain), ("dgrad", strided), ("wgrad", strided)):
    chosen = configs.heuristic_config(direction, geom, torch.bfloat16, 132, 90)  # the sm_90 box launch's tiles
    twins = {"gathered": pointer_tiles(chosen, direction, geom, 2)}
    if direction == "dgrad":  # the box tiles as they were on the pointer kernel
        twins["box"] = dataclasses.replace(off_gluon(chosen), tma_box_w=0)
    for name, twin in twins.items():
        report = compile_launch(direction, geom, torch.bfloat16, twin, 90, read=False)[0]
        out.append(({"direction": direction, "twin": name, "chosen": chosen.to_dict(), "tiles": twin.to_dict()},
                    report))
print(json.dumps(report_rows(out)))
"""


@pytest.mark.skipif(90 not in STATIC_ARCHS, reason="the box kernels and their pointer twins are sm_90's")
def test_pointer_twins_of_unaligned_box_tiles_spill_nothing():
    """Channels not 16-divisible in bf16: the sm_90 heuristic runs them on the Gluon kernel at a plain problem's tiles
    (128 x 128), which the pointer kernel, whose gathers load such channels element by element, does not hold (the
    input gradient of 72 -> 216 channels at stride 2: 255 registers, 480 bytes spilled, triton 3.9); a launch of
    them that falls back to the pointer kernel (a ring, tensors TMA cannot describe) takes gathered_tiles (64 x 32
    for a forward and input gradient, 32 deep for a weight gradient) and spills nothing."""
    reports = compile_script(GATHERED_COMPILE)
    assert len(reports) == 4
    for r in reports:
        name = (r["direction"], r["twin"], r["registers"], r["spill_bytes"])
        assert r["chosen"]["gluon"] == 2 and r["chosen"]["block_m"] * r["chosen"]["block_n"] >= 64 * 128, name
        if r["twin"] == "box":
            assert r["spill_bytes"], name
        else:
            assert not r["spill_bytes"] and not r["local_accesses"], name
            if r["direction"] != "wgrad":
                assert (r["tiles"]["block_m"], r["tiles"]["block_n"], r["tiles"]["num_warps"]) == (64, 32, 4), name


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
