"""python -m bench.precompile: compile here, with no GPU, the kernels a GPU session's bench stages will launch, into a
Triton cache the session carries, so that its minutes go to timing rather than compiling.

    python -m bench.precompile --wheel PATH --variants-args "..." --bench-args "..." --scenarios stack
    python -m bench.precompile --unpack .triton-sm90        # on the GPU machine: prints the cache dir to use
    python -m bench.precompile --census .triton-sm90        # after: what the cache held and what was compiled there

`bash bench/gpu_session.sh plan2` with PRECOMPILE=<wheel> set runs the first form with plan2's own arguments, and
every call of the script runs the other two where `.triton-sm90` travelled (name it in the run's `carry`). It needs
a Triton of the GPU image's version here (CI's `.venv-triton36`: PATH=.venv-triton36/bin:$PATH) and that image's
wheel of it, outside the tree (the tree travels):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 triton==3.6.0 -d ~/.cache/tconv3d-wheels

Triton looks a compiled kernel up on disk by a key of its own build (`triton_key`: its Python sources and
`libtriton.so`), the kernel's source and specialisation, the target and the options. The GPU image runs triton
3.6.0 under CPython 3.12: its wheel's files are this Triton's except `libtriton.so` (one build per CPython), whose
code generation is the same (checked: a Triton and a Gluon kernel compiled for sm_90 by the cp311 and cp312 builds
of 3.6.0 give byte-identical PTX and cubins). So this compiles with the local Triton of the same version under the
key the GPU image's would compute (`wheel_key`: the local key with the wheel's libtriton hash in place of the
local one), through the same static compile that the tuner and bench.variants already fill their GPU machine's
cache with (tconv3d.inspect.compile: on the H100 every kernel compiled ahead was found by the JIT). What is planned
is what the stages will launch on an H100 or an H200 (both asked: whichever is lent), from their own argument
parsers: bench.variants' rows, python -m bench's chosen configs per case and direction (bwd: the input and
weight gradients), the stack scenario's three layers, the host stage's layers (bench.host_overhead.gpu_launches),
and the tuner's default and candidates of every key it would tune (the tune stage: ~1900 launches for the bench
suite, ~15 CPU-minutes a core here). The test stages compile their own: their kernels are the many small problems
of the suite, each compiled by one of 12 xdist workers.

Triton records a cached kernel's files by absolute path, so the cache is built at CACHE_DIR and unpacked there.
Only what the JIT reads back is packed (the metadata JSON, the cubin and the group file): a third of the size.
torch is imported only to plan and compile, triton only to key: a GPU call's unpack and census cost it no import
of either.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import shlex
import shutil
import sys
import tarfile
import time
import zipfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# Where the cache is built here and unpacked on the GPU machine: Triton's group files name their members by path.
CACHE_DIR = Path("/tmp/tconv3d-triton-cache")
PACKED = "cache.tar.gz"
MANIFEST = "manifest.json"
# The GPUs a session may be lent (bench/NOTES.md): their names pick their tuning tables; both are sm_90 with 132 SMs.
DEVICES = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
CAPABILITY = 90
# Files of a cached kernel the JIT reads back: its metadata, its binary and the group file that names them.
KEPT_SUFFIXES = (".json", ".cubin")


def _libtriton(root: Path) -> Path:
    return root / "_C" / "libtriton.so"


def _triton_root() -> Path:
    import triton

    return Path(triton.__file__).parent


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def local_key() -> str:
    from triton.runtime import cache

    return cache.triton_key()


def wheel_key(wheel: Path) -> str:
    """The triton_key the Triton of `wheel` computes where it is installed: the local one's, the wheel's libtriton
    hash in place of the local libtriton's. Refused (ValueError) where any other file of the wheel's package differs
    from the local install's (another version or build): its key would differ in ways this cannot follow."""
    import triton

    root = _triton_root()
    with zipfile.ZipFile(wheel) as archive:
        members = {n.removeprefix("triton/"): n for n in archive.namelist() if n.startswith("triton/") and n[-1] != "/"}
        if "_C/libtriton.so" not in members:
            raise ValueError(f"{wheel} holds no triton/_C/libtriton.so")
        different = [
            name for name, member in members.items()
            if name.endswith(".py") and (not (root / name).is_file()
                                         or _sha256((root / name).read_bytes()) != _sha256(archive.read(member)))
        ]  # fmt: skip
        if different:
            raise ValueError(
                f"{wheel}'s Triton is not this one ({triton.__version__}) built for another Python: "
                f"{len(different)} sources differ, e.g. {different[:3]}"
            )
        theirs = _sha256(archive.read(members["_C/libtriton.so"]))
    ours = _sha256(_libtriton(root).read_bytes())
    key = local_key()
    if key.count(ours) != 1:
        raise ValueError("this Triton's key does not hold its libtriton hash once: its triton_key changed")
    return key.replace(ours, theirs)


def _keyed_as(key: str) -> None:
    """In a compiling process: Triton's disk cache keyed as the target Triton's (wheel_key), niced below other work,
    and with none of the variables Triton keys its cache on (TRITON_DISABLE_LINE_INFO among them): the GPU machines
    set none, and a kernel compiled under one would be looked up under another key there."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime import cache

    for name in get_cache_invalidating_env_vars():
        os.environ.pop(name, None)
    cache.triton_key = lambda: key
    with contextlib.suppress(OSError):
        os.nice(10)


@contextlib.contextmanager
def posing_as(device_name: str, capability: int = CAPABILITY, sm_count: int = 132):
    """Inside, torch.cuda answers the questions tconv3d's choice asks of a CUDA device (name, capability, SM count) as
    `device_name` would, so that bench.variants plans its rows here; the choice's memo is set aside on both sides."""
    import torch

    from tconv3d.inspect.compile import ARCHS, arch_of
    from tconv3d.tune import choice

    class Properties:
        name, major, minor, multi_processor_count = device_name, capability // 10, capability % 10, sm_count
        shared_memory_per_block_optin = ARCHS[capability].smem_per_block
        shared_memory_per_multiprocessor = ARCHS[capability].smem_per_sm

    saved = (torch.cuda.get_device_name, torch.cuda.get_device_capability, torch.cuda.get_device_properties)
    memo = dict(choice._memo)
    choice._memo.clear()
    arch_of.cache_clear()
    torch.cuda.get_device_name = lambda device=None: device_name
    torch.cuda.get_device_capability = lambda device=None: (Properties.major, Properties.minor)
    torch.cuda.get_device_properties = lambda device=None: Properties
    try:
        yield torch.device("cuda")
    finally:
        torch.cuda.get_device_name, torch.cuda.get_device_capability, torch.cuda.get_device_properties = saved
        choice._memo.clear()
        choice._memo.update(memo)
        arch_of.cache_clear()


def bench_launches(bench_args: list[str], directions: tuple[str, ...], scenarios: str, device) -> list:
    """The launches of python -m bench with `bench_args` over `directions` (bwd: both gradients) and the stack,
    skip, causal and subpixel scenarios where `scenarios` names them, as the device tconv3d runs on (posing_as)
    chooses them (of the skip scenario's transposed conv, its forward, with its bias and without: its backward's are
    plain launches). A launch is (direction, geometry, dtype, config), and a fifth True where it has a bias."""
    from bench import run
    from tconv3d.tune import choice
    from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set

    args = run.build_parser().parse_args(bench_args)
    names = set(args.cases.split(",")) if args.cases else None
    cases = run.plan_cases(load_shape_set(args.suite), args.dtype, directions, names)
    if "stack" in scenarios.split(","):  # bench_stack: its three layers, bf16, forward and both gradients
        cases += [(shape, "bf16", direction) for shape in load_shape_set("stack") for direction in ("fwd", "bwd")]
    launches = []
    for shape, dtype_name, direction in cases:
        geom, dtype = shape.launched_geometry(), DTYPES_BY_NAME[dtype_name]
        for kernel_direction in ("dgrad", "wgrad") if direction == "bwd" else (direction,):
            config = choice.pick_config(kernel_direction, geom, dtype, device)
            launches.append((kernel_direction, shape.geometry(), dtype, config))  # compiled as choice.launch runs it
    if "skip" in scenarios.split(","):  # bench_skip: forward and both gradients, also as TCONV3D_KERNELS=pointer
        bf16 = DTYPES_BY_NAME["bf16"]
        for _, batch, channels, size, cout, transposed in run.SKIP_LAYERS:
            for direction, geom in run.skip_geometries(batch, channels, size, cout, transposed).items():
                config = choice.pick_config(direction, geom, bf16, device)
                pointer = choice.force_variant(direction, geom, bf16, config, "pointer")
                launches += [(direction, geom, bf16, config), (direction, geom, bf16, pointer)]
                if transposed:  # tconv3d and tconv3d_pointer with the layer's bias (tconv3d_bias_after without)
                    launches += [(direction, geom, bf16, config, True), (direction, geom, bf16, pointer, True)]
    if "causal" in scenarios.split(","):  # bench_causal: wan_dec_384b bordered by zeros and by replicate, fwd+bwd
        bf16 = DTYPES_BY_NAME["bf16"]
        shape = next(s for s in load_shape_set("bench") if s.name == "wan_dec_384b")
        for geom in run.causal_geometries(shape).values():
            launches += [(d, geom, bf16, choice.pick_config(d, geom, bf16, device)) for d in ("fwd", "dgrad", "wgrad")]
    if "subpixel" in scenarios.split(","):  # bench_subpixel: both tconv3d forms, forward and both gradients
        bf16 = DTYPES_BY_NAME["bf16"]
        for _, *layer in run.SUBPIXEL_LAYERS:
            for form, geoms in run.subpixel_geometries(*layer).items():
                biased = "dgrad" if form == "subpixel" else "fwd"  # the launch that takes the Conv2d's bias
                for direction, geom in geoms.items():
                    config = choice.pick_config(direction, geom, bf16, device)
                    launches.append((direction, geom, bf16, config, *((True,) if direction == biased else ())))
    return launches


def variants_launches(variants_args: list[str], device) -> list:
    """The launches of python -m bench.variants with `variants_args`, on the device tconv3d runs on (posing_as)."""
    from bench import variants

    args = variants.build_parser().parse_args(variants_args)
    impls = set(args.impls.split(",")) if args.impls else None
    cases = variants.case_dtypes(args.cases.split(","), args.dtype)
    return variants.planned_launches(cases, args.directions, impls, device)


@functools.cache
def _census_counts(spec: str) -> tuple:
    """(the model's (direction, geometry) -> calls, its dtype's name) of one bench.census argument list: built once
    for all of DEVICES (a default-size VAE takes seconds to build, even on the meta device)."""
    from bench import census

    args = census.build_parser().parse_args(shlex.split(spec))
    return census.model_counts(args)[0], args.dtype


def census_launches(models: str, device) -> list:
    """The launches of python -m bench.census --time for each of `models` (";"-separated argument lists, one model
    each, as the census stage passes them): each timed row's chosen config, on the device tconv3d runs on
    (posing_as)."""
    import torch

    from bench import census, variants
    from tconv3d.tune import configs
    from tconv3d.tune.shapes import DTYPES_BY_NAME

    name, sms, capability = (torch.cuda.get_device_name(device), configs.multiprocessor_count(device),
                             configs.compute_capability(device))  # fmt: skip
    launches = []
    for spec in filter(None, (part.strip() for part in models.split(";"))):
        counts, dtype_name = _census_counts(spec)
        rows, _ = census.census(counts, DTYPES_BY_NAME[dtype_name], name, sms, capability)
        for index, shape in census.timeable_rows(rows, dtype_name):
            launches += variants.planned_launches([(shape, dtype_name)], rows[index][1], {"chosen"}, device)
    return launches


def tune_launches(tune_args: list[str], device) -> list:
    """What python -m tconv3d.tune with `tune_args` times: each job's default and candidates."""
    from tconv3d.tune import tuner

    launches = []
    for job in tuner.planned_jobs(tuner.build_parser().parse_args(tune_args)):
        default, found = tuner.job_configs(job, device)
        launches += [(job.direction, job.shape.geometry(), job.dtype, c) for c in (default, *found)]  # as timed
    return launches


def plan(
    stages: list[str],
    variants_args: str,
    bench_args: str,
    scenarios: str,
    tune_args: str = "",
    census_models: str = "",
    decoded: str = "",
) -> list:
    """Every distinct launch `stages` (bench/gpu_session.sh's) make with these arguments, on any of DEVICES.
    `decoded`: the models stage's VAEs (space-separated), whose converted decodes launch their layers' chosen
    kernels: the census's rows of the same VAEs at the same latent (bench.vaes.DEFAULT_LATENTS)."""
    from bench import host_overhead

    launches = []
    for name in DEVICES:
        with posing_as(name) as device:
            if "host" in stages:
                launches += host_overhead.gpu_launches(device)
            if "census" in stages:
                launches += census_launches(census_models, device)
            if "models" in stages:
                launches += census_launches(";".join(f"--vae {model}" for model in decoded.split()), device)
            if "tune" in stages:
                launches += tune_launches(shlex.split(tune_args), device)
            if "variants" in stages:
                launches += variants_launches(shlex.split(variants_args), device)
            if "bench" in stages:
                directions = tuple(os.environ.get("DIRECTIONS", "fwd bwd").split())
                launches += bench_launches(shlex.split(bench_args), directions, scenarios, device)
    return list(dict.fromkeys(launches))


def _compile(launch: tuple) -> tuple[bool, float]:
    from tconv3d.inspect.compile import ARCHS, compiles_cleanly

    direction, geom, dtype, config, *bias = launch  # a fifth True: with a bias (bench_launches)
    start = time.perf_counter()
    return compiles_cleanly(direction, geom, dtype, config, ARCHS[CAPABILITY], bool(bias)), time.perf_counter() - start


def build(launches: list, key: str, out: Path, workers: int) -> dict:
    """Compile `launches` into a fresh CACHE_DIR under `key`, pack what the JIT reads into out/PACKED, and write
    out/MANIFEST. Returns the manifest."""
    shutil.rmtree(CACHE_DIR, ignore_errors=True)
    CACHE_DIR.mkdir(parents=True)
    os.environ["TRITON_CACHE_DIR"] = str(CACHE_DIR)  # the workers' Triton reads it at their first compile
    start = time.perf_counter()
    with ProcessPoolExecutor(workers, initializer=_keyed_as, initargs=(key,)) as pool:
        results = list(pool.map(_compile, launches))
    out.mkdir(parents=True, exist_ok=True)
    kernels = sorted(p.parent.name for p in CACHE_DIR.glob("*/*.cubin"))
    with tarfile.open(out / PACKED, "w:gz") as archive:
        for path in sorted(CACHE_DIR.glob("*/*")):
            if path.suffix in KEPT_SUFFIXES:
                archive.add(path, arcname=str(path.relative_to(CACHE_DIR)))
    import triton

    manifest = {
        "triton": triton.__version__,
        "key_sha256": _sha256(key.encode()),
        "cache_dir": str(CACHE_DIR),
        "capability": CAPABILITY,
        "devices": list(DEVICES),
        "launches": len(launches),
        "failed": sum(not ok for ok, _ in results),
        "kernels": kernels,
        "compile_cpu_s": round(sum(s for _, s in results), 1),
        "wall_s": round(time.perf_counter() - start, 1),
        "packed_bytes": (out / PACKED).stat().st_size,
        "commit": _commit(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _commit() -> str:
    from bench.run import git_commit

    return git_commit()


def unpack(carried: Path) -> str:
    """On the GPU machine: unpack the carried cache where it was built and return the directory for
    TRITON_CACHE_DIR, or say why not (another Triton build: its kernels would be looked up under other keys)."""
    import triton

    manifest = json.loads((carried / MANIFEST).read_text())
    if _sha256(local_key().encode()) != manifest["key_sha256"]:
        raise ValueError(
            f"the carried kernels were compiled for another Triton build than this one ({triton.__version__}, "
            f"{sys.version.split()[0]}): not used"
        )
    target = Path(manifest["cache_dir"])
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(carried / PACKED) as archive:
        archive.extractall(target, filter="data")
    (target / ".unpacked").write_text(str(time.time()))
    return str(target)


def census(carried: Path) -> dict:
    """What the carried cache held, and the kernels compiled on this machine since it was unpacked."""
    manifest = json.loads((carried / MANIFEST).read_text())
    target = Path(manifest["cache_dir"])
    marker = target / ".unpacked"
    if not marker.is_file():
        return {"carried": len(manifest["kernels"]), "unpacked": False}
    since = float(marker.read_text())
    carried_kernels = set(manifest["kernels"])
    here = {p.parent.name for p in target.glob("*/*.cubin") if p.stat().st_mtime > since}
    return {"carried": len(carried_kernels), "unpacked": True, "compiled_here": len(here - carried_kernels)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.precompile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheel", type=Path, help="the GPU image's triton wheel (same version as this Triton)")
    parser.add_argument("--stages", default="variants bench", help="bench/gpu_session.sh stages to compile for")
    parser.add_argument("--variants-args", default="", help="bench.variants' arguments, as the stage passes them")
    parser.add_argument("--bench-args", default="", help="python -m bench's arguments, as the stage passes them")
    parser.add_argument("--scenarios", default="stack", help="python -m bench's scenarios (stack is planned)")
    parser.add_argument("--tune-args", default="", help="python -m tconv3d.tune's arguments, as the stage passes them")
    parser.add_argument(
        "--census-models", default="", help="python -m bench.census's argument lists, ';'-separated (census stage)"
    )
    parser.add_argument(
        "--models", default="", help="the models stage's VAEs, space-separated (bench/gpu_session.sh's MODELS)"
    )
    parser.add_argument("--out", type=Path, default=Path(".triton-sm90"), help="where the packed cache goes")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="compiling processes")
    parser.add_argument("--unpack", type=Path, help="unpack this carried cache; print the directory for Triton")
    parser.add_argument("--census", type=Path, help="what this carried cache held and what compiled since")
    args = parser.parse_args(argv)
    if args.unpack:
        try:
            print(unpack(args.unpack))
        except (OSError, ValueError, KeyError, tarfile.TarError) as error:
            print(f"[precompile] {error}", file=sys.stderr)
            return 1
        return 0
    if args.census:
        print(json.dumps(census(args.census)))
        return 0
    if args.wheel is None:
        parser.error("--wheel is needed to compile (the GPU image's triton wheel: its key)")
    import torch

    if torch.cuda.is_available():
        parser.error("compile here, on a machine without a GPU: this one would plan for its own device")
    try:
        key = wheel_key(args.wheel)
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        parser.error(str(error))
    launches = plan(
        args.stages.split(),
        args.variants_args,
        args.bench_args,
        args.scenarios,
        args.tune_args,
        args.census_models,
        args.models,
    )
    print(f"[precompile] {len(launches)} launches for {', '.join(DEVICES)} (sm_{CAPABILITY}), {args.jobs} processes")
    manifest = build(launches, key, args.out, args.jobs)
    print(
        f"[precompile] {len(manifest['kernels'])} kernels, {manifest['failed']} launches failed to compile cleanly, "
        f"{manifest['compile_cpu_s']} s of compiling in {manifest['wall_s']} s; "
        f"{manifest['packed_bytes'] / 2**20:.1f} MiB in {args.out / PACKED}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
