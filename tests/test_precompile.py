"""bench/precompile.py: the kernels a GPU session will launch, compiled here into a Triton cache it carries.

The key of the GPU image's Triton is taken from its wheel (the local key with that build's libtriton hash), the
launches are planned as the stages' own argument parsers and an H100's choices make them, and a packed cache,
unpacked, is what Triton's JIT finds: it compiles nothing it holds. The planning and the JIT run in a subprocess:
this suite sets TRITON_INTERPRET=1, under which no GPU's choice is made and nothing compiles."""

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import triton

from bench import precompile

ROOT = Path(__file__).resolve().parent.parent


def _fake_wheel(path: Path, libtriton: bytes, tamper: str | None = None) -> Path:
    """A wheel of this Triton's Python sources and `libtriton` as its libtriton.so; `tamper`: one source changed."""
    root = Path(triton.__file__).parent
    with zipfile.ZipFile(path, "w") as archive:
        for source in root.rglob("*.py"):
            name = source.relative_to(root).as_posix()
            data = source.read_bytes() + (b"\n# another build\n" if name == tamper else b"")
            archive.writestr(f"triton/{name}", data)
        archive.writestr("triton/_C/libtriton.so", libtriton)
    return path


def test_the_wheels_key_is_this_tritons_with_its_libtriton(tmp_path):
    local = precompile.local_key()
    ours = hashlib.sha256((Path(triton.__file__).parent / "_C" / "libtriton.so").read_bytes()).hexdigest()
    theirs = hashlib.sha256(b"the same sources built for another CPython").hexdigest()
    key = precompile.wheel_key(_fake_wheel(tmp_path / "t.whl", b"the same sources built for another CPython"))
    assert key == local.replace(ours, theirs) and key != local
    with pytest.raises(ValueError, match="sources differ"):
        precompile.wheel_key(_fake_wheel(tmp_path / "u.whl", b"x", tamper="runtime/cache.py"))


def _run(script: str, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "unrelated")  # the scripts' own compiles never reach the shared cache
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "shapes.json")], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_plan_is_what_the_stages_launch_or_time_on_an_h100(tmp_path):
    script = """
import torch
from bench import precompile
from tconv3d.kernels.config import KernelConfig
from tconv3d.tune import choice
from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set

calls = (torch.cuda.get_device_name, torch.cuda.get_device_capability, torch.cuda.get_device_properties)
unet_64 = next(s for s in load_shape_set("bench") if s.name == "unet_64")
geom, bf16 = unet_64.launched_geometry(), DTYPES_BY_NAME["bf16"]
# A choice remembered before (another device's) is neither used while posing nor lost after.
remembered = {choice._memo_key("fwd", geom, bf16, torch.device("cuda")): KernelConfig(16, 16, 16, 4, 1)}
choice._memo.update(remembered)
with precompile.posing_as("NVIDIA H100 80GB HBM3") as device:
    variants = precompile.variants_launches(["--cases", "unet_64", "--impls", "chosen,pointer"], device)
    suite = precompile.bench_launches(["--dtype", "bf16", "--cases", "unet_64"], ("fwd", "bwd"), "none", device)
    causal = precompile.bench_launches(["--dtype", "bf16", "--cases", "unet_64"], ("fwd",), "causal", device)
# the causal scenario's layer under zeros and replicate, each direction; the replicate input gradient written in
# float32 before its fold, its persistent ring fitted to that epilogue tile (configs.fit_destination)
bordered = [(d, c) for d, g, _, c in causal if g.reads_border]
assert len(causal) == 1 + 6 and [d for d, _ in bordered] == ["fwd", "dgrad", "wgrad"], causal
assert (bordered[1][1].gluon, bordered[1][1].num_stages) == (2, 2), bordered
assert (torch.cuda.get_device_name, torch.cuda.get_device_capability, torch.cuda.get_device_properties) == calls
assert choice._memo == remembered
h100 = {d: choice.choose(d, geom, bf16, "NVIDIA H100 80GB HBM3", 132, 90)[0] for d in ("fwd", "dgrad", "wgrad")}
assert [(d, c) for d, _, _, c in suite] == list(h100.items()), suite
assert all(c.gluon == 2 for c in h100.values())  # the H100's Gluon tiles, not the interpreter's or the pointer's
chosen = [(d, c) for d, _, _, c in variants if c.gluon]
assert chosen == list(h100.items()) and len(variants) == 6, variants
with_stack = precompile.plan(["bench"], "", "--dtype bf16 --cases unet_64", "stack")
# unet_64's three launches (no table entry is near it), the stack's three layers' nine on each device (the H200's
# table tunes them), each distinct launch once
stack = {(d, s.launched_geometry(), choice.choose(d, s.launched_geometry(), bf16, name, 132, 90)[0])
         for name in precompile.DEVICES for s in load_shape_set("stack") for d in ("fwd", "dgrad", "wgrad")}
assert 9 < len(stack) < 18 and len(with_stack) == 3 + len(stack), with_stack
assert {(d, g, c) for d, g, _, c in with_stack} == {(d, geom, c) for d, c in h100.items()} | stack
import json, pathlib, sys
from tconv3d.tune import configs, tuner
shapes = pathlib.Path(sys.argv[1])
shapes.write_text(json.dumps({"cases": [{"name": "unet_64", "batch": 2, "cin": 64, "cout": 64, "size": [64, 64, 64],
                                         "kernel": [3, 3, 3], "stride": 1}]}))
tuned = precompile.plan(["tune"], "", "", "none", f"--shapes {shapes} --dtypes bf16 --directions wgrad")
default = configs.heuristic_config("wgrad", geom, bf16, 132, 90)
assert tuned[0][3] == default and len(tuned) == 1 + tuner.CANDIDATES_PER_KEY, tuned
assert any(c.gluon for *_, c in tuned[1:]) and any(not c.gluon for *_, c in tuned[1:])  # the H100's space: Gluon too
print("ok")
"""
    assert _run(script, tmp_path).strip().endswith("ok")


def test_the_host_stage_is_planned_as_its_script_launches(tmp_path):
    """plan1's host stage (tests/gpu/host_overhead.py) compiled its layers' kernels on the GPU machine: its cases'
    chosen configs each direction, and bench.host_overhead.triton_launch's layer launched for real there too."""
    script = """
import runpy, torch
from bench import host_overhead, precompile
from tconv3d.tune import choice
from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set

script = runpy.run_path("tests/gpu/host_overhead.py", run_name="not_main")
assert script["CASES"] == host_overhead.GPU_CASES  # the plan follows the script's cases
shapes = {s.name: s for s in load_shape_set("bench")}
planned = precompile.plan(["host"], "", "", "none")
layer = host_overhead._layer("meta")[3]
expected = set()
for name in precompile.DEVICES:
    for case, dtype_name in host_overhead.GPU_CASES:
        geom, dtype = shapes[case].geometry(), DTYPES_BY_NAME[dtype_name]
        expected |= {(d, geom, dtype, choice.choose(d, geom, dtype, name, 132, 90)[0]) for d in ("fwd", "dgrad",
                                                                                                 "wgrad")}
expected |= {("fwd", layer, torch.bfloat16, host_overhead.LAYER_POINTER), ("wgrad", layer, torch.bfloat16,
             host_overhead.LAYER_POINTER), ("fwd", layer, torch.bfloat16, host_overhead.LAYER_TMA)}
assert set(planned) == expected and len(planned) == len(expected), (planned, expected)
assert any(c.gluon for *_, c in planned) and any(c.tma_box_w and not c.gluon for *_, c in planned)
print("ok")
"""
    assert _run(script, tmp_path).strip().endswith("ok")


def test_an_unpacked_cache_is_what_the_jit_finds(tmp_path):
    script = f"""
import json, shutil
from pathlib import Path
import torch
from bench import precompile
from tconv3d.geometry import ConvGeometry
from tconv3d.inspect.compile import compile_launch
from tconv3d.kernels.config import KernelConfig

precompile.CACHE_DIR = Path({str(tmp_path / "cache")!r})
out = Path({str(tmp_path / "carried")!r})
x, w = (torch.empty(s, device="meta") for s in ((1, 16, 4, 8, 8), (16, 16, 3, 3, 3)))
from tconv3d.geometry import check_conv3d
geom = check_conv3d(x, w, None, 1, 1, 1, 1)
planned = ("fwd", geom, torch.bfloat16, KernelConfig(64, 16, 16, 4, 2))
other = ("fwd", geom, torch.bfloat16, KernelConfig(64, 16, 16, 4, 3))
import os
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # one of the variables Triton keys its cache on: the build drops it
manifest = precompile.build([planned], precompile.local_key(), out, 1)
del os.environ["TRITON_DISABLE_LINE_INFO"]
assert manifest["launches"] == 1 and manifest["failed"] == 0 and len(manifest["kernels"]) == 1, manifest
packed = {{p.suffix for p in precompile.CACHE_DIR.glob("*/*")}}
assert {{".cubin", ".json", ".ptx"}} <= packed, packed  # built with everything; packed without the PTX and the IRs
shutil.rmtree(precompile.CACHE_DIR)
cache = precompile.unpack(out)
assert sorted(p.suffix for p in Path(cache).glob("*/*") if p.suffix) == [".cubin", ".json", ".json"]
os.environ["TRITON_CACHE_DIR"] = cache
compile_launch(*planned, 90)
assert precompile.census(out) == {{"carried": 1, "unpacked": True, "compiled_here": 0}}, precompile.census(out)
compile_launch(*other, 90)
assert precompile.census(out)["compiled_here"] == 1
manifest["key_sha256"] = "another build"
(out / precompile.MANIFEST).write_text(json.dumps(manifest))
try:
    precompile.unpack(out)
except ValueError as error:
    assert "another Triton build" in str(error)
else:
    raise AssertionError("a cache of another Triton build was unpacked")
print("ok")
"""
    assert _run(script, tmp_path).strip().endswith("ok")


def _plan_argv(tmp_path, plan: str) -> list[str]:
    """The arguments `PRECOMPILE=<wheel> bash bench/gpu_session.sh <plan>` hands to bench.precompile."""
    stub = tmp_path / "python3"
    stub.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "PRECOMPILE": "/wheels/triton.whl"}
    result = subprocess.run(
        ["bash", "bench/gpu_session.sh", plan], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_session_script_hands_a_plans_own_arguments_to_precompile(tmp_path):
    """`PRECOMPILE=<wheel> bash bench/gpu_session.sh plan2` compiles for what plan2's stages will be given."""
    argv = _plan_argv(tmp_path, "plan2")
    assert argv[:6] == ["-m", "bench.precompile", "--wheel", "/wheels/triton.whl", "--stages", "bench variants"]
    options = dict(zip(argv[6::2], argv[7::2], strict=True))
    assert options["--bench-args"] == "--dtype bf16 --no-graphs" and options["--scenarios"] == "stack,norms,causal"
    flag, cases, impls_flag, impls = options["--variants-args"].split()
    assert (flag, impls_flag) == ("--cases", "--impls"), options["--variants-args"]
    cases = {case.split("@")[0] for case in cases.split(",")}  # each impl names a case the call times
    assert cases and all(impl.split(":")[0] in cases for impl in impls.split(",")), options["--variants-args"]


def test_every_row_plan2_names_is_one_bench_variants_times_on_an_h200(tmp_path):
    """bench.variants times only the rows --impls names that a case has: a name it does not know (a twin the
    heuristic took over, a misspelling) costs nothing and times nothing. Each of plan2's names is a row of its case
    in some direction, as an H200 chooses (chosen and timed_only: bench.variants' own)."""
    argv = _plan_argv(tmp_path, "plan2")
    variants_args = dict(zip(argv[6::2], argv[7::2], strict=True))["--variants-args"]
    script = f"""
from bench import precompile, variants
from tconv3d.tune.shapes import DTYPES_BY_NAME

args = variants.build_parser().parse_args({variants_args.split()!r})
rows = set()
with precompile.posing_as("NVIDIA H200") as device:
    for shape, dtype_name in variants.case_dtypes(args.cases.split(","), args.dtype):
        for direction in variants.case_directions(shape, args.directions):
            configs = variants.variant_configs(direction, shape.launched_geometry(), DTYPES_BY_NAME[dtype_name], device)
            rows |= {{f"{{shape.name}}:{{name}}" for name in (*configs, "chosen", "timed_only")}}
print(sorted(set(args.impls.split(",")) - rows))
"""
    assert _run(script, tmp_path).strip() == "[]"


def test_a_gpu_calls_unpack_and_census_import_neither_torch_nor_triton_to_start(tmp_path):
    """The module imports torch only to plan and compile and triton only to key: each GPU call runs it twice."""
    script = "import sys, bench.precompile; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    assert _run(script, tmp_path).strip() == "[]"
