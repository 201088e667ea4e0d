"""python -m tconv3d.inspect: what the compiler makes of every kernel tconv3d would launch, on a machine with no GPU.

    python -m tconv3d.inspect                          # bench suite + awkward shapes, bf16/fp16/fp32, sm_90 and sm_80
    python -m tconv3d.inspect --arch 90 --dtype bf16 --direction wgrad --json out.json
    python -m tconv3d.inspect --shapes bench --space   # every candidate of the pruned search space, per key
    python -m tconv3d.inspect --direction fwd,dgrad --bias  # with a bias: a layer's, a transposed convolution's

For each (case, dtype, direction, arch) it takes the config that GPU model would choose (its tuning table, else
the heuristic for its SM count), compiles the launch exactly as the launcher would (compile.py)
and prints: config and where it came from, grid and waves on the SM count (132 for sm_90, 108 for sm_80),
registers, spill bytes, shared memory, the MMA instruction, the global-load kinds, the main loop (its
shared-memory round trips, wgmma wait depths and CTA barriers), its instructions a pass and the share of the tensor
cores' peak their issue allows (KernelReport.issue_ceiling), a warp-specialized kernel's load loop ('load': the
instructions its producer warp issues a K step) and what its MMA warps do between two tiles ('tile'), the FLOPs a
byte of the operands its tiles read ('fl/B', configs.operand_intensity: times L2's read bandwidth, a bound on its
TFLOP/s), the share of its MMA work that is the convolution's ('fill', configs.mma_fill: tiles over the real rows,
columns and reduction), and the compile time; the tensor maps each TMA launch
hands the driver are checked against cuTensorMapEncodeTiled's requirements (compile.tensor_maps). `--variant
gluon` (or tma, pointer) compiles what TCONV3D_KERNELS would force, the Gluon kernel software-pipelined; gluon-ws,
its persistent warp-specialized twin (the sm_90 heuristic's choice); gluon-halo, that twin's halo tiles
(configs.halo_twin: two output frames a tile) where a forward or input gradient may take them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

from .. import settings
from ..kernels import conv_gluon
from ..kernels.config import DIRECTIONS, HALO_KD, KernelConfig, off_gluon, pointer_form
from ..tune import choice
from ..tune.configs import GLUON_CAPABILITY, candidates, halo_twin, mma_fill, operand_intensity
from ..tune.shapes import DTYPES_BY_NAME, ConvShape, load_shape_set
from .compile import ARCHS, compile_launch, fits, read_reports

DEFAULT_SHAPES = "bench,awkward"


def _job_records(jobs: list[tuple], bias: bool = False) -> list[dict]:
    """Compile each (case, dtype, direction, arch, config), then read every cubin of them at once (read_reports:
    one disassembler run an architecture) and describe each; a failure is a record, not a crash. `bias`:
    compile_launch's."""
    compiled = [_compile_job(job, bias) for job in jobs]
    read_reports([report for _, reports in compiled for report in reports or ()])
    return [_describe(job, record, reports) for job, (record, reports) in zip(jobs, compiled, strict=True)]


def _compile_job(job, bias: bool = False) -> tuple[dict, list | None]:
    shape, dtype_name, direction, capability, config, source = job
    geom, dtype = shape.launched_geometry(), DTYPES_BY_NAME[dtype_name]
    record = {
        "case": shape.name,
        "dtype": dtype_name,
        "direction": direction,
        "arch": capability,
        "config": config.to_dict(),
        "config_source": source,
        "form": pointer_form(direction, geom) if config.variant == "pointer" else None,
        "compiled": False,
        "error": None,
    }
    start = time.perf_counter()
    try:  # as choice.launch runs it
        reports = compile_launch(direction, shape.geometry(), dtype, config, capability, read=False, bias=bias)
    except Exception as error:  # e.g. out of shared memory at compile time: report it
        record["error"] = f"{type(error).__name__}: {error}"[:500]
        reports = None
    record["compile_s"] = round(time.perf_counter() - start, 2)
    return record, reports


def _describe(job, record: dict, reports: list | None) -> dict:
    if reports is None:
        return record
    shape, dtype_name, direction, capability, config, _ = job
    arch, geom, dtype = ARCHS[capability], shape.launched_geometry(), DTYPES_BY_NAME[dtype_name]
    main = reports[0]  # the convolution itself; the weight gradient's split-K reduction follows it
    intensity = operand_intensity(direction, geom, config, dtype.itemsize)
    fill = mma_fill(direction, geom, config, dtype.itemsize)
    record.update(
        compiled=True,
        registers=main.registers,
        spill_bytes=max(r.spill_bytes or 0 for r in reports),
        local_accesses=sum(r.local_accesses for r in reports),
        loop_local_accesses=sum(r.loop_local_accesses or 0 for r in reports),
        shared_bytes=main.shared_bytes,
        fits=fits(reports, arch),
        mma=main.mma_kind,
        mma_instruction=main.mma,
        loads=main.loads,
        grid=main.grid,
        waves=round(main.waves(arch), 3),
        loop_smem_ops=main.loop_smem_ops,
        loop_wgmma_waits=main.loop_wgmma_waits,
        loop_barriers=main.loop_barriers,
        loop_instructions=main.loop_instructions,
        producer_instructions=main.producer_instructions,
        producer_divisions=main.producer_divisions,
        tile_instructions=main.tile_instructions,
        tile_divisions=main.tile_divisions,
        issue_ceiling=None if (ceiling := main.issue_ceiling(arch)) is None else round(ceiling, 3),
        operand_flop_per_byte=None if intensity is None else round(intensity, 1),
        mma_fill=None if fill is None else round(fill, 3),
        kernels=[r.to_dict() for r in reports],
        tensor_map_problems=_tensor_map_notes(reports, "problems"),
        tensor_map_risks=_tensor_map_notes(reports, "risks"),
    )
    return record


def _tensor_map_notes(reports, kind: str) -> list[str]:
    """`kind` (problems, risks) of every tensor map of the launch's kernels, each naming the map's shape and box."""
    return [
        f"{r.kernel} map {m['shape']} box {m['box']}: {note}"
        for r in reports
        for m in r.tensor_maps
        for note in m[kind]
    ]


def specialized_only(direction: str, config: KernelConfig) -> bool:
    """Whether `config` has what only the warp-specialized Gluon kernel runs: a transposed (swap_ab) weight gradient,
    grouped taps, halo tiles (KernelConfig's checks, conv_gluon.conv3d_wgrad_gluon's)."""
    return (direction == "wgrad" and bool(config.swap_ab)) or config.tap_group > 1 or bool(config.halo_d)


def plan(
    shapes: list[ConvShape], dtypes, directions, archs, space: bool, variant: str = "auto", distinct: bool = False
) -> list[tuple]:
    """(shape, dtype, direction, arch, config, source) of each launch to compile. With `distinct`, a 16-bit dtype's
    launch whose config an earlier 16-bit dtype's launch of the same case, direction and arch has is left out: the
    two compile to one kernel but for the MMA's operand type and the epilogue's conversion."""
    jobs = []
    sixteen_bit = {}  # (case, direction, arch) -> the configs its 16-bit launches have
    for shape in shapes:
        geom = shape.launched_geometry()
        for dtype_name in dtypes:
            dtype = DTYPES_BY_NAME[dtype_name]
            for direction in directions:
                for capability in archs:
                    arch = ARCHS[capability]
                    config, source = choice.choose(
                        direction, geom, dtype, arch.device_name, arch.sm_count, arch.capability
                    )
                    if variant != "auto":  # what TCONV3D_KERNELS=<variant> would run on that GPU
                        gluon_runs = capability == GLUON_CAPABILITY and conv_gluon.UNAVAILABLE is None
                        kernels = "gluon" if variant.startswith("gluon") else variant
                        forced = choice.force_variant(direction, geom, dtype, config, kernels, gluon_runs)
                        if variant == "gluon" and forced.gluon and specialized_only(direction, forced):
                            # the pipelined kernel on the plain tiles of a transposed or tap-grouped weight gradient
                            # or of halo tiles, which only the warp-specialized one has
                            forced = choice.force_variant(direction, geom, dtype, off_gluon(forced), kernels, True)
                        if variant.startswith("gluon") and forced.gluon:  # pipelined, or the persistent
                            # warp-specialized twin (what the sm_90 heuristic chooses), or its halo tiles
                            forced = dataclasses.replace(forced, gluon=1 if variant == "gluon" else 2)
                            if variant == "gluon-halo":
                                forced = halo_twin(direction, geom, forced, dtype.itemsize) or forced
                        config, source = forced, source if forced == config else f"{variant}"
                    if distinct and dtype.itemsize == 2:
                        seen = sixteen_bit.setdefault((shape.name, direction, capability), set())
                        if config in seen:
                            continue
                        seen.add(config)
                    jobs.append((shape, dtype_name, direction, capability, config, source))
                    if space:
                        gluon = capability == GLUON_CAPABILITY and conv_gluon.UNAVAILABLE is None
                        found = candidates(
                            direction, geom, dtype, arch.smem_per_block, tma=capability >= 90, gluon=gluon
                        )
                        for candidate in found:
                            if candidate != config:
                                jobs.append((shape, dtype_name, direction, capability, candidate, "space"))
    return jobs


# Jobs a worker compiles before it reads their cubins in one go: few enough that the workers stay evenly loaded
# (compiles take 0.1-6 s), many enough that the disassembler's set-up (some 0.5 s a run) is paid rarely.
CHUNK = 16


def run(jobs: list[tuple], workers: int, bias: bool = False) -> list[dict]:
    chunks = [jobs[i : i + CHUNK] for i in range(0, len(jobs), CHUNK)]
    if workers <= 1 or len(chunks) <= 1:
        return [record for chunk in chunks for record in _job_records(chunk, bias)]
    # fork: the workers inherit the imported kernels; compiling is CPU-bound, one process per core.
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        records = pool.map(functools.partial(_job_records, bias=bias), chunks, chunksize=1)
    return [record for chunk in records for record in chunk]


# A pointer launch's small-channel form (config.pointer_form) in the config column.
_FORM_TEXT = {"tap_pairs": "pairs", "out_tap_rows": "out-rows", "w_tap_columns": "w-cols"}


def _config_text(config: dict, form: str | None = None) -> str:
    text = f"{config['block_m']}x{config['block_n']}x{config['block_k']} w{config['num_warps']} s{config['num_stages']}"
    gluon = config.get("gluon")
    variant = "gluon-ws" if gluon == 2 else "gluon" if gluon else "tma" if config.get("tma_box_w") else ""
    variant = variant or _FORM_TEXT.get(form, "")
    variant += " swap" if config.get("swap_ab") else ""
    variant += " halo" if config.get("halo_d") else ""
    return text + (f" k{config['split_k']}" if config["split_k"] > 1 else "") + (f" {variant}" if variant else "")


def _wait_depth(record: dict) -> int:
    """The wgmma wait depth a Gluon main loop with one step's groups in flight has: 1, a halo tile's 2 x KD (each
    step's wgmmas, one a frame and tap along D; the step before's retired)."""
    return 2 * HALO_KD if record["config"].get("halo_d") else 1


def _loop_text(record: dict) -> str:
    """The main loop in short: shared-memory round trips, each wgmma wait's depth, CTA-wide barriers ('smem 0,
    wait 1, bar 4')."""
    if record.get("loop_smem_ops") is None:
        return "-"
    waits = record["loop_wgmma_waits"]
    text = f"smem {record['loop_smem_ops']}, wait " + (",".join(str(w) for w in waits) if waits else "-")
    return text + (f", bar {record['loop_barriers']}" if record.get("loop_barriers") is not None else "")


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.0f}%"


def table(records: list[dict]) -> str:
    header = (
        f"{'case':16} {'dtype':5} {'dir':5} {'sm':>3} {'config':28} {'from':9} {'grid':>11} {'waves':>6} "
        f"{'regs':>4} {'spill':>5} {'smem KB':>7} {'mma':26} {'loads':34} {'main loop':20} {'instr':>5} {'load':>4} "
        f"{'tile':>4} {'issue':>5} {'fill':>4} {'fl/B':>5} {'s':>4}"
    )
    lines = [header, "-" * len(header)]
    for r in records:
        config = _config_text(r["config"], r.get("form"))
        start = f"{r['case']:16} {r['dtype']:5} {r['direction']:5} {r['arch']:>3} {config:28} {r['config_source']:9}"
        if not r["compiled"]:
            lines.append(f"{start} FAILED: {r['error']}")
            continue
        grid = list(r["grid"])
        while len(grid) > 1 and grid[-1] == 1:  # the groups axis of an ungrouped launch
            grid.pop()
        grid = "x".join(str(g) for g in grid)
        loads = ",".join(load.replace(".E", "") for load in r["loads"]) or "-"
        lines.append(
            f"{start} {grid:>11} {r['waves']:>6.2f} {r['registers'] or 0:>4} {r['spill_bytes']:>5} "
            f"{r['shared_bytes'] / 1024:>7.1f} {r['mma_instruction']:26} {loads[:34]:34} {_loop_text(r):20} "
            f"{r.get('loop_instructions') or '-':>5} {r.get('producer_instructions') or '-':>4} "
            f"{r.get('tile_instructions') or '-':>4} "
            f"{_percent(r.get('issue_ceiling')):>5} {_percent(r.get('mma_fill')):>4} "
            f"{r.get('operand_flop_per_byte') or '-':>5} {r['compile_s']:>4.1f}"
        )
    return "\n".join(lines)


def _misfit_text(record: dict) -> str:
    """What keeps a launch from fitting (compile.fits): its spill, and where its local-memory accesses are (in the
    main loop, every K step pays them; outside it, a program pays a few), a stack frame nothing reads or writes
    (compile.fits refuses it all the same), or its shared memory over the limit."""
    found = []
    local, looped = record["local_accesses"], record.get("loop_local_accesses") or 0
    if local:
        where = f"{looped} of them in the main loop" if looped else "none in the main loop"
        found.append(f"spills {record['spill_bytes']} bytes a thread ({local} local loads and stores, {where})")
    elif record["spill_bytes"]:  # a frame ptxas keeps for its subroutine calls (64-bit divisions): never touched
        found.append(f"keeps a stack frame of {record['spill_bytes']} bytes, with no local load or store")
    limit = ARCHS[record["arch"]].smem_per_block
    if record["shared_bytes"] > limit:
        found.append(f"takes {record['shared_bytes']} bytes of shared memory, over sm_{record['arch']}'s {limit}")
    return "; ".join(found) or "spills or overflows shared memory"


def problems(records: list[dict]) -> list[str]:
    """What a chosen config must never do: fail to compile, spill, overflow shared memory, or (sm_90, 16-bit,
    GEMM tiles of 64+ rows) miss wgmma; and a Gluon launch's main loop must hold no shared-memory round trip and
    wait for wgmma at depth 1. The depthwise direct kernels have no MMA to run."""
    found = []
    for r in records:
        if r["config_source"] == "space":
            continue
        name = f"{r['case']} {r['dtype']} {r['direction']} sm_{r['arch']} {_config_text(r['config'], r.get('form'))}"
        if not r["compiled"]:
            found.append(f"{name}: did not compile ({r['error']})")
        elif not r["fits"]:
            found.append(f"{name}: {_misfit_text(r)}")
        elif (
            r["arch"] == 90 and r["dtype"] != "fp32" and r["config"]["block_m"] >= 64 and not r["config"].get("direct")
            and r["mma"] != "HGMMA"
        ):  # fmt: skip
            found.append(f"{name}: {r['mma_instruction']} where wgmma (HGMMA) was expected")
        elif r["config"].get("gluon") and (r["loop_smem_ops"] != 0 or r["loop_wgmma_waits"] != [_wait_depth(r)]):
            found.append(f"{name}: the Gluon main loop is not TMA -> shared memory -> wgmma with one group in flight "
                         f"({_loop_text(r)})")  # fmt: skip
        found += [f"{name}: the driver would refuse a tensor map: {p}" for p in r.get("tensor_map_problems", [])]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tconv3d.inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90,80", help="comma-separated compute capabilities: 90, 80")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated shape sets (names or JSON files)")
    parser.add_argument("--dtype", default="bf16,fp16,fp32", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--direction", default=",".join(DIRECTIONS), help="comma-separated: fwd, dgrad, wgrad")
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument("--space", action="store_true", help="also compile every candidate of each key's space")
    parser.add_argument(
        "--variant", default="auto", choices=(*settings.KERNEL_VARIANTS, "gluon-ws", "gluon-halo"),
        help="force a variant where eligible, as TCONV3D_KERNELS would on that GPU (gluon: sm_90, triton 3.6 to 3.9; "
        "gluon-ws: its persistent warp-specialized twin, as the tuner may choose; gluon-halo: that twin's halo "
        "tiles where a forward or input gradient may take them)",
    )  # fmt: skip
    parser.add_argument(
        "--distinct", action="store_true",
        help="leave out a 16-bit launch whose config the other 16-bit dtype's launch of the case already has (fp16 "
        "after bf16: the same kernel but for the MMA's operand type)",
    )  # fmt: skip
    parser.add_argument(
        "--bias", action="store_true",
        help="launch with a bias: the forward's (a layer's), the input gradient's (a transposed convolution's)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="write the records here")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    args = parser.parse_args(argv)
    if settings.INTERPRET:
        print("python -m tconv3d.inspect compiles kernels: unset TRITON_INTERPRET (the interpreter has no compiler)")
        return 2
    archs = [int(a) for a in args.arch.split(",")]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown:
        parser.error(f"unknown arch(s) {unknown}; known: {sorted(ARCHS)}")
    dtypes = args.dtype.split(",")
    if any(d not in DTYPES_BY_NAME for d in dtypes):
        parser.error(f"--dtype takes some of {sorted(DTYPES_BY_NAME)}")
    directions = args.direction.split(",")
    if any(d not in DIRECTIONS for d in directions):
        parser.error(f"--direction takes some of {DIRECTIONS}")
    shapes = [shape for name in args.shapes.split(",") for shape in load_shape_set(name)]
    if args.cases:
        shapes = [s for s in shapes if s.name in set(args.cases.split(","))]
    torch.set_num_threads(1)
    records = run(
        plan(shapes, dtypes, directions, archs, args.space, args.variant, args.distinct), args.jobs, args.bias
    )
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    space = [r for r in records if r["config_source"] == "space"]
    if space:
        unfit = sum(not r["compiled"] or not r["fits"] for r in space)
        print(f"\nsearch space: {unfit} of {len(space)} other candidates fail to compile, spill or overflow")
    risky = [r for r in records if r["config_source"] != "space" and r.get("tensor_map_risks")]
    if risky:
        print(
            f"\n{len(risky)} launches hand the driver tensor maps that cuda.h allows and CCCL refuses "
            f"(utils.tensor_map_problems; tests/gpu/tma_probe.py tries them), e.g. {risky[0]['tensor_map_risks'][0]}"
        )
    found = problems(records)
    print(f"\n{len(records)} launches compiled; {len(found)} problem(s)" + "".join(f"\n  {p}" for p in found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
