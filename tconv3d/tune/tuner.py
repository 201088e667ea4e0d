"""The tuner behind `python -m tconv3d.tune` (tune/__main__.py): tune the forward, input-grad and weight-grad
tilings of a shape set on this GPU and write them to autotune_configs/<device>.json; and the first-use tuning
behind TCONV3D_AUTOTUNE=1.

    python -m tconv3d.tune --shapes bench --out autotune_configs/

Every key the shape set needs is tuned once: each candidate of the pruned search space is first checked against
a cuDNN reference, then timed with triton.testing.do_bench (median), within a time bound per key. The table is
rewritten after every key, so an interrupted run resumes where it stopped. A candidate whose check never finishes
(a hung kernel) is written to <device>.hung.json beside the table and the run exits with status 75
(testing.HUNG_EXIT): run it again and it resumes without that candidate.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import settings
from ..geometry import ConvGeometry
from ..inspect import compile as static_compile
from ..kernels import aten, conv_gluon, grouped
from ..kernels.config import DIRECTIONS, KernelConfig
from ..kernels.conv_dgrad import conv3d_dgrad
from ..kernels.conv_fwd import conv3d_fwd
from ..kernels.conv_wgrad import conv3d_wgrad
from ..testing import exact_fp32, hang_guard, random_conv_inputs, rel_l2, tolerance
from . import configs, tables
from .configs import TuningKey, candidates, default_config, own_twins, split_workspace_bytes, tuning_key
from .shapes import DTYPES_BY_NAME, ConvShape, load_shape_set

Measure = Callable[[KernelConfig], "float | None"]  # ms, or None when the config fails to compile or to check

# Candidates timed per key, nearest the heuristic's config first. The pruned space holds hundreds per key, and a
# walk in its product order spent the whole budget on the smallest tiles (the first H100 run: 7-13 tried per key).
CANDIDATES_PER_KEY = 24
# do_bench's warm-up and repetition, in ms: a median of 10+ runs for the slowest kernels of the suite.
BENCH_WARMUP_MS, BENCH_REP_MS = 10, 60


@dataclass(frozen=True)
class Job:
    key: TuningKey
    shape: ConvShape
    direction: str
    dtype: torch.dtype


@dataclass(frozen=True)
class Outcome:
    config: KernelConfig
    ms: float
    default_config: KernelConfig
    default_ms: float | None
    tried: int

    @property
    def speedup(self) -> float | None:
        return self.default_ms / self.ms if self.default_ms else None

    def to_entry(self, shape_name: str) -> dict:
        return {
            "config": self.config.to_dict(),
            "ms": round(self.ms, 5),
            "default_config": self.default_config.to_dict(),
            "default_ms": None if self.default_ms is None else round(self.default_ms, 5),
            "tried": self.tried,
            "shape": shape_name,
        }


# A candidate within this factor of the fastest time is as fast, within a timing's noise: of those, the one whose
# split-K holds the least fp32 workspace wins (search's `workspace`).
LEANER_WITHIN = 1.02


def search(
    configs: Iterable[KernelConfig],
    default: KernelConfig,
    measure: Measure,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
    workspace: Callable[[KernelConfig], int] = lambda config: 0,
) -> Outcome | None:
    """Time the default, then candidates until the budget runs out; of those that passed their check, the fastest
    wins, or where others ran within LEANER_WITHIN of its time, the one of them with the least `workspace` (bytes of
    split-K partial sums: configs.split_workspace_bytes), the faster between equals. None if nothing, not even the
    default, ran correctly."""
    start = clock()
    default_ms = measure(default)
    timed = [(default_ms, default)] if default_ms is not None else []
    tried = 1
    for config in configs:
        if clock() - start > budget_s:
            break
        if config == default:
            continue
        ms = measure(config)
        tried += 1
        if ms is not None:
            timed.append((ms, config))
    if not timed:
        return None
    fastest = min(ms for ms, _ in timed)
    best_ms, best = min(
        ((ms, config) for ms, config in timed if ms <= fastest * LEANER_WITHIN),
        key=lambda entry: (workspace(entry[1]), entry[0]),
    )
    return Outcome(best, best_ms, default, default_ms, tried)


def _timed_if_correct(
    run: Callable[[KernelConfig], torch.Tensor],
    reference: torch.Tensor,
    tolerance: float,
    *,
    compiles_cleanly: Callable[[KernelConfig], bool] = lambda config: True,
    on_hang: Callable[[KernelConfig], None] | None = None,
) -> Measure:
    """Candidates that spill or overflow shared memory (by the static compile) are dropped before they run; the
    rest must match the reference before they are timed. With `on_hang`, a first run that does not finish calls
    it with the candidate and ends the process (testing.hang_guard)."""
    import triton.testing

    def measure(config: KernelConfig) -> float | None:
        if not compiles_cleanly(config):
            return None
        try:
            result = run(config)  # compiled and launched: only the GPU's part is guarded
            if on_hang is not None:
                with hang_guard(lambda: on_hang(config)):
                    torch.cuda.synchronize()
            if rel_l2(result, reference) > tolerance:
                return None
            return triton.testing.do_bench(
                lambda: run(config), warmup=BENCH_WARMUP_MS, rep=BENCH_REP_MS, return_mode="median"
            )
        except Exception as error:  # a candidate that fails to compile or launch is skipped, not fatal
            if "OutOfResources" not in type(error).__name__:
                print(f"  {config}: {type(error).__name__}: {error}", file=sys.stderr)
            return None

    return measure


def _compile_filter(direction: str, geom: ConvGeometry, dtype: torch.dtype, device) -> Callable[[KernelConfig], bool]:
    """Whether a candidate compiles for this device without spills and within its shared memory."""
    return lambda config: static_compile.compiles_cleanly(
        direction, geom, dtype, config, static_compile.arch_of(device)
    )


def smem_limit(device: torch.device) -> int:
    return static_compile.arch_of(device).smem_per_block


def config_steps(a: KernelConfig, b: KernelConfig) -> int:
    """How far apart two configs are: doublings of each block, of the warps, the split and the group, plus the
    difference in stages."""
    doubling = ("block_m", "block_n", "block_k", "num_warps", "split_k", "group_m")
    doublings = sum(abs(round(math.log2(getattr(a, f) / getattr(b, f)))) for f in doubling)
    if bool(a.tma_box_w) != bool(b.tma_box_w):
        doublings += 1  # the other kernel variant
    elif a.tma_box_w:
        doublings += abs(round(math.log2(a.tma_box_w / b.tma_box_w)))
    doublings += a.gluon != b.gluon  # the Gluon kernel on the same patch
    return doublings + abs(a.num_stages - b.num_stages)


def _tile(config: KernelConfig) -> tuple:
    return config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages, config.group_m


def nearest_candidates(
    configs: Iterable[KernelConfig], default: KernelConfig, limit: int, twins: Iterable[KernelConfig] = ()
) -> list[KernelConfig]:
    """The `limit` candidates nearest `default` (the default itself aside): first its `twins` (configs.own_twins:
    its tile swapped or with taps grouped, whether or not the space holds them), then its own tile in each other
    form the space holds (another variant, TMA box or split: a row box or an unsplit twin is several doublings away,
    and would otherwise never be timed against it), then the fewest steps away; the space's order among equals."""
    twins = [t for t in dict.fromkeys(twins) if t != default]
    others = [c for c in configs if c != default and c not in twins]
    forms = [c for c in others if _tile(c) == _tile(default)]
    rest = [c for c in others if _tile(c) != _tile(default)]
    by_steps = lambda c: config_steps(c, default)  # noqa: E731
    return (twins + sorted(forms, key=by_steps) + sorted(rest, key=by_steps))[:limit]


def _workspace(direction: str, geom: ConvGeometry) -> Callable[[KernelConfig], int]:
    """search's `workspace` for a problem: a config's bytes of split-K partial sums."""
    return lambda config: split_workspace_bytes(direction, geom, config)


def _twins(direction: str, geom: ConvGeometry, default: KernelConfig, dtype, device) -> list[KernelConfig]:
    """The default's own Gluon twins (configs.own_twins) where this device runs the Gluon kernel, else none."""
    return own_twins(direction, geom, default, dtype, smem_limit(device)) if _has_gluon(device) else []


# ---------------------------------------------------------------------------------------------------------------
# first-use tuning (TCONV3D_AUTOTUNE=1)

FIRST_USE_BUDGET_S = 20.0


def tune_on_first_use(key: TuningKey, direction: str, geom: ConvGeometry, dtype, device, run) -> KernelConfig:
    """Tune one key with the caller's own tensors, checking each candidate against the default config's result;
    keep the winner in memory and in the cache folder's table for this GPU."""
    default = default_config(direction, geom, dtype, device)
    reference = run(default).clone()
    measure = _timed_if_correct(
        run, reference, tolerance(dtype), compiles_cleanly=_compile_filter(direction, geom, dtype, device)
    )
    found = candidates(direction, geom, dtype, smem_limit(device), tma=_has_tma(device), gluon=_has_gluon(device))
    configs = nearest_candidates(found, default, CANDIDATES_PER_KEY, _twins(direction, geom, default, dtype, device))
    outcome = search(configs, default, measure, FIRST_USE_BUDGET_S, workspace=_workspace(direction, geom))
    if outcome is None:
        return default
    device_name = torch.cuda.get_device_name(device)
    path = settings.CACHE_DIR / tables.table_file_name(device_name)
    entry = outcome.to_entry(f"first use, input {tuple(geom.input_shape())}")
    tables.write_entry(path, key, entry, tables.table_metadata(device_name, searched_variants(device)))
    tables.device_table(device)[key] = outcome.config
    return outcome.config


# ---------------------------------------------------------------------------------------------------------------
# the generator


def plan_jobs(shapes: list[ConvShape], directions=DIRECTIONS, dtypes: Iterable[str] | None = None) -> list[Job]:
    """One job per distinct tuning key the shape set needs (the first shape that needs a key tunes it)."""
    jobs: dict[TuningKey, Job] = {}
    for shape in shapes:
        shape.require_plain()
        for dtype_name in shape.dtypes:
            if dtypes is not None and dtype_name not in dtypes:
                continue
            dtype = DTYPES_BY_NAME[dtype_name]
            for direction in directions:
                key = tuning_key(direction, shape.launched_geometry(), dtype)
                jobs.setdefault(key, Job(key, shape, direction, dtype))
    return list(jobs.values())


def job_configs(
    job: Job, device: torch.device, hung: Iterable[KernelConfig] = ()
) -> tuple[KernelConfig, list[KernelConfig]]:
    """The default config of a job and the candidates to time against it, none that hung before."""
    geom = job.shape.launched_geometry()
    default = default_config(job.direction, geom, job.dtype, device)
    found = candidates(
        job.direction, geom, job.dtype, smem_limit(device), tma=_has_tma(device), gluon=_has_gluon(device)
    )
    hung = set(hung)
    twins = [t for t in _twins(job.direction, geom, default, job.dtype, device) if t not in hung]
    return default, nearest_candidates([c for c in found if c not in hung], default, CANDIDATES_PER_KEY, twins)


def searched_variants(device: torch.device) -> set[str]:
    """The kernel variants candidates() offers on `device`: what a table tuned there searched (its "variants")."""
    return (
        {"pointer", "direct"} | ({"tma"} if _has_tma(device) else set()) | ({"gluon"} if _has_gluon(device) else set())
    )


def _has_tma(device: torch.device) -> bool:
    return device.type == "cuda" and configs.compute_capability(device) >= configs.TMA_MIN_CAPABILITY


def _has_gluon(device: torch.device) -> bool:
    """sm_90 with a Triton the Gluon kernel is written for: its twins join the space, checked against cuDNN
    before they are timed like every candidate."""
    return (
        device.type == "cuda"
        and not settings.INTERPRET
        and conv_gluon.UNAVAILABLE is None
        and configs.compute_capability(device) == configs.GLUON_CAPABILITY
    )


CompiledCheck = Callable[[Job, KernelConfig], bool]


def compile_ahead(jobs: list[Job], device: torch.device, workers: int) -> tuple[CompiledCheck, Callable[[], None]]:
    """Every job's default and candidates compiled in `workers` processes, in job order, while the GPU times
    earlier jobs (inspect.compile.compile_ahead). Returns the check the measure waits on, and a shutdown."""
    arch = static_compile.arch_of(device)
    planned = []
    for job in jobs:
        default, found = job_configs(job, device)
        planned += [(job.direction, job.shape.geometry(), job.dtype, config) for config in (default, *found)]
    wait, shutdown = static_compile.compile_ahead(planned, arch, workers)

    def check(job: Job, config: KernelConfig) -> bool:
        clean = wait((job.direction, job.shape.geometry(), job.dtype, config))
        if clean is None:  # a config not planned ahead: compile it here
            return _compile_filter(job.direction, job.shape.geometry(), job.dtype, device)(config)
        return clean

    return check, shutdown


def job_problem(job: Job, device: torch.device) -> tuple[Callable[[KernelConfig], torch.Tensor], torch.Tensor]:
    """(run, reference): the launch of one job's problem with a config, on random inputs, and its fp32 result by
    torch. A grouped problem of few channels a group runs as choice.launch runs it: on its coarse geometry (the
    key's), handed the problem's own weight (kernels/grouped.py), so a candidate's time counts what its variant
    pays for the grouped weight (the block-diagonal copy of the box kernels, the in-place blocks of the pointer
    kernels) and its weight gradient is the problem's own."""
    geom, coarse = job.shape.geometry(), job.shape.launched_geometry()
    x, w = random_conv_inputs(job.shape.input_shape, geom.weight_shape(), job.dtype, device)
    grad_out = (
        torch.randn(geom.output_shape(), device=device).to(job.dtype).contiguous(memory_format=torch.channels_last_3d)
    )
    x32, w32, g32 = x.float(), w.float(), grad_out.float()
    references = {
        "fwd": lambda: aten.conv3d_fwd(x32, w32, None, None, geom),
        "dgrad": lambda: aten.conv3d_dgrad(g32, w32, geom),
        "wgrad": lambda: aten.conv3d_wgrad(g32, x32, None, geom),
    }
    launcher, tensors = {
        "fwd": (conv3d_fwd, (x, w, None, None)),
        "dgrad": (conv3d_dgrad, (grad_out, w)),
        "wgrad": (conv3d_wgrad, (grad_out, x, None)),
    }[job.direction]
    with exact_fp32():
        reference = references[job.direction]()

    def run(config: KernelConfig) -> torch.Tensor:
        launch = lambda *t, **diagonal: launcher(*t, coarse, config, **diagonal)  # noqa: E731
        return grouped.on_coarse(geom, coarse, launch, *tensors)

    return run, reference


def _gpu_measure(
    job: Job, compiled: CompiledCheck | None = None, hung_path: Path | None = None
) -> tuple[Measure, KernelConfig, list[KernelConfig]]:
    """A measure for one job on the current GPU (job_problem's run against its cuDNN fp32 reference); with
    `hung_path`, candidates that hung before are left out and one that hangs now is recorded there."""
    device = torch.device("cuda", torch.cuda.current_device())
    run, reference = job_problem(job, device)
    compiles_cleanly = (
        _compile_filter(job.direction, job.shape.geometry(), job.dtype, device)
        if compiled is None
        else lambda c: compiled(job, c)
    )
    on_hang = None if hung_path is None else lambda config: tables.record_hung(hung_path, job.key, config)
    measure = _timed_if_correct(
        run, reference, tolerance(job.dtype), compiles_cleanly=compiles_cleanly, on_hang=on_hang
    )
    hung = () if hung_path is None else tables.read_hung(hung_path).get(str(job.key), ())
    default, configs = job_configs(job, device, hung)
    return measure, default, configs


def _progress(done: int, total: int, width: int = 24) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def tune_jobs(
    jobs: list[Job],
    table_path: Path,
    metadata: dict,
    prepare: Callable[[Job], tuple[Measure, KernelConfig, list[KernelConfig]]],
    budget_s: float,
    out=print,
) -> list[Outcome]:
    """Tune every job whose key the table at `table_path` lacks, writing after each; return the new outcomes."""
    done_keys = set(tables.read_entries(table_path))
    todo = [job for job in jobs if str(job.key) not in done_keys]
    out(f"{len(jobs)} keys in the shape set, {len(jobs) - len(todo)} already in {table_path}, {len(todo)} to tune")
    outcomes = []
    for index, job in enumerate(todo, start=1):
        started = time.monotonic()
        measure, default, configs = prepare(job)

        def logged(config: KernelConfig, measure=measure, default=default) -> float | None:
            """Each candidate's time in the log, the default marked: what a table entry won against."""
            ms = measure(config)
            time_text = "failed its check or did not compile" if ms is None else f"{ms:.4f} ms"
            out(f"    {config_text(config)}{' (default)' if config == default else ''}: {time_text}")
            return ms

        outcome = search(configs, default, logged, budget_s, workspace=_workspace(job.direction, job.shape.geometry()))
        if outcome is None:
            out(f"{_progress(index, len(todo))} {job.key}: no config passed its check; left out of the table")
            continue
        tables.write_entry(table_path, job.key, outcome.to_entry(job.shape.name), metadata)
        outcomes.append(outcome)
        gain = f"{outcome.speedup:.2f}x" if outcome.speedup else "default failed"
        out(
            f"{_progress(index, len(todo))} {job.key}: {outcome.ms:.3f} ms, {gain} over default, "
            f"{outcome.tried} configs in {time.monotonic() - started:.0f} s"
        )
    return outcomes


def config_text(config: KernelConfig) -> str:
    """A config in one short line: '128x64x16 w8 s3', then its split, variant and forms where it has them."""
    text = f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages}"
    extras = [f"k{config.split_k}"] if config.split_k > 1 else []
    extras += [] if config.variant == "pointer" else [config.variant + ("-ws" if config.gluon == 2 else "")]
    extras += ["swap"] * bool(config.swap_ab) + [f"taps{config.tap_group}"] * bool(config.tap_group)
    return " ".join([text, *extras])


def summarize(outcomes: list[Outcome]) -> str:
    speedups = [o.speedup for o in outcomes if o.speedup is not None]
    if not speedups:
        return f"keys tuned: {len(outcomes)}"
    median, worst, best = statistics.median(speedups), min(speedups), max(speedups)
    return (
        f"keys tuned: {len(outcomes)}; speedup of tuned over default config: median {median:.2f}x, "
        f"worst {worst:.2f}x, best {best:.2f}x"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line, also read by bench.precompile to compile what a run with the same arguments times."""
    parser = argparse.ArgumentParser(prog="python -m tconv3d.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="bench", help="a shipped shape set (bench) or a JSON file in its format")
    parser.add_argument("--out", default="autotune_configs", type=Path, help="folder for <device>.json")
    parser.add_argument("--directions", default=",".join(DIRECTIONS), help="comma-separated: fwd,dgrad,wgrad")
    parser.add_argument("--dtypes", default=None, help="comma-separated subset of each case's dtypes (bf16,fp16,fp32)")
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of search per key")
    parser.add_argument(
        "--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
        help="processes that compile candidates ahead of the timing (1: compile each just before timing it)",
    )  # fmt: skip
    return parser


def planned_jobs(args: argparse.Namespace) -> list[Job]:
    """The jobs a run with `args` (build_parser's) tunes, in order; ValueError for an unknown direction."""
    directions = tuple(args.directions.split(","))
    unknown = [d for d in directions if d not in DIRECTIONS]
    if unknown:
        raise ValueError(f"unknown direction(s) {unknown}; expected some of {DIRECTIONS}")
    dtypes = None if args.dtypes is None else set(args.dtypes.split(","))
    return plan_jobs(load_shape_set(args.shapes), directions, dtypes)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m tconv3d.tune needs a CUDA device: tuning times kernels on the GPU it tunes for.")
        return 2
    try:
        jobs = planned_jobs(args)
    except ValueError as error:
        parser.error(str(error))
    # The cuDNN reference runs once per key: searching its algorithms (slow in exact fp32) would cost more.
    torch.backends.cudnn.benchmark = False
    device_name = torch.cuda.get_device_name()
    path = args.out / tables.table_file_name(device_name)
    hung_path = tables.hung_file(path)
    prepare, shutdown = (lambda job: _gpu_measure(job, None, hung_path)), lambda: None
    if args.compile_workers > 1:
        done = set(tables.read_entries(path))
        todo = [job for job in jobs if str(job.key) not in done]
        device = torch.device("cuda", torch.cuda.current_device())
        compiled, shutdown = compile_ahead(todo, device, args.compile_workers)
        prepare = lambda job: _gpu_measure(job, compiled, hung_path)  # noqa: E731
    try:
        metadata = tables.table_metadata(device_name, searched_variants(torch.device("cuda")))
        outcomes = tune_jobs(jobs, path, metadata, prepare, args.budget)
    finally:
        shutdown()
    print(summarize(outcomes))
    return 0
