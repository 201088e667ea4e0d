"""Test set-up: on a machine without CUDA, run the Triton kernels through Triton's interpreter.

TRITON_INTERPRET must be set before tconv3d (and so its @triton.jit kernels) is imported. On a GPU the tests
run the compiled kernels on CUDA tensors.

There, every new tensor torch.empty makes is filled with NaN (torch's fill_uninitialized_memory, which acts with
deterministic algorithms on; warn_only: torch's nondeterministic CPU ops still run): a kernel that leaves part of
its output unwritten fails the comparison with float64 instead of passing on what the memory held. A freed buffer of
the same computation held the right values where test_gluon_emulated's wrong-coordinate test passed for a kernel
that skipped a column (CI at d9c0783). Not on a GPU: deterministic algorithms change cuDNN's, the references'.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True

import interpreter_bounds
import interpreter_fidelity
import interpreter_speedups
import pytest

import tconv3d  # noqa: F401  (registers torch.ops.tconv3d)
from tconv3d import settings
from tconv3d.kernels.config import KernelConfig
from tconv3d.tune import choice, configs


def _threads_per_worker() -> int | None:
    """The CPU threads each pytest-xdist worker may use: the machine's cores shared out between the workers; None
    outside xdist, or where the user chose (OMP_NUM_THREADS).

    Each worker's torch would otherwise start a thread a core: on CI's 2 cores, two workers ran 4 threads, and a
    worker's torch ops (the real models on the aten path, the float64 references, the distributed tests' processes)
    ran 2.6x slower than with one thread each (2026-11-30). The interpreted kernels (numpy) are not affected."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, cores() // int(workers))


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


THREADS = _threads_per_worker()
if THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)  # for the processes tests start (distributed workers, fresh imports)
    torch.set_num_threads(THREADS)

interpreter_speedups.install()  # where kernels run on Triton's interpreter: tests/interpreter_speedups.py
interpreter_fidelity.install()  # and where it computes other values than the GPU: tests/interpreter_fidelity.py
interpreter_bounds.install()  # and every access a kernel makes there, held to its tensors: tests/interpreter_bounds.py


@pytest.fixture(autouse=True)
def _overflow_checks(request):
    """The interpreter's int32 overflow checks (interpreter_speedups.overflow_checks), off unless a test asks for
    them: for the fuzzer's random problems (tests/test_fuzz.py, `pytest.mark.overflow_checks`), and everywhere with
    TCONV3D_OVERFLOW_CHECKS=1."""
    checked = request.node.get_closest_marker("overflow_checks") is not None
    with interpreter_speedups.overflow_checks(checked or os.environ.get("TCONV3D_OVERFLOW_CHECKS") == "1"):
        yield


# The test files that take longest through the interpreter and the sm_90 compiler (2 CPU cores, 2026-11-27), run
# first: pytest-xdist hands whole files to workers (--dist loadfile), and a long file handed out last ends the run
# on one worker while the others wait (the static compile tests, last by xdist's own order of files by test count,
# held one worker for their last 5 minutes). The real-models tests stay one file: split in two (2026-11-29), every
# order tried left a worker idle and CI's main run took 19-23 minutes against 18m34s.
LONGEST_FIRST = (
    "test_static_compile.py",
    "test_integrations.py",
    "test_tma.py",
    "test_hopper_main_loops.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's order of files by test count: ours instead
        config.option.loadscopereorder = False


# Files handed out a test at a time under --dist loadfile, after every other file: no module-scoped state, and long
# enough to keep one worker busy while the others idle, so they fill the workers' last minutes instead. CI's Triton
# 3.7.1 and 3.8.0 sections run four files, test_gluon_emulated 115 s of them: whole, it held one worker for 77 s
# after the other ran out of files (2026-12-06).
TEST_AT_A_TIME = ("test_gluon_emulated.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile's scheduler, but for TEST_AT_A_TIME's files, whose tests are each their own unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return nodeid if os.path.basename(path) in TEST_AT_A_TIME else path

    return Scheduling(config, log)


CPU_PROFILE = os.environ.get("TCONV3D_CPU_PROFILE")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TCONV3D_CPU_PROFILE=<file>, a line a test appended to it: its id, wall seconds, and the CPU seconds of
    its worker and of the processes it started and waited for (the static compile tests' compiling pool). On CI's 2
    cores the wall times of --durations are shared time: a test beside the compiling pool took 2.5x its own time
    (test_gluon_emulated 94 s alone, 225-297 s in CI), and only CPU seconds add up to the run."""
    if CPU_PROFILE is None:
        yield
        return
    import resource
    import time

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    start = time.perf_counter(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    wall = time.perf_counter() - start[0]
    own, children = cpu(resource.RUSAGE_SELF) - start[1], cpu(resource.RUSAGE_CHILDREN) - start[2]
    with open(CPU_PROFILE, "a") as f:  # one short write a line: workers append whole lines
        f.write(f"{item.nodeid}\t{wall:.2f}\t{own:.2f}\t{children:.2f}\n")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # stable: the rest as collected, TEST_AT_A_TIME's last
    items.sort(key=lambda item: (item.path.name in TEST_AT_A_TIME, rank.get(item.path.name, len(rank))))
    if os.environ.get("TCONV3D_EMULATED_SUBSET") == "1":
        emulated_subset(config, items)
    ran = os.environ.get("TCONV3D_TESTS_RAN")
    if ran:  # a GPU call's suite, cut at its limit, resumed by the next: what an earlier call's junit file names
        # but for the tests whose node ids hold one of TCONV3D_TESTS_AGAIN's comma-separated words: code changed
        # since those runs, run again first (they are kept in collection order, ahead of the suite's rest)
        again = [word for word in os.environ.get("TCONV3D_TESTS_AGAIN", "").split(",") if word]
        done, first, kept, deselected = ran_tests(ran), [], [], []
        for item in items:
            if any(word in item.nodeid for word in again):
                first.append(item)
            else:
                (deselected if junit_name(item.nodeid) in done else kept).append(item)
        kept[:0] = first
        if deselected:
            config.hook.pytest_deselected(items=deselected)
            items[:] = kept


def emulated_subset(config, items):
    """Of test_gluon_emulated.py, only tests/emulated_subset.py's SUBSET (CI's Triton 3.6, 3.7.1 and 3.8.0 sections:
    every line of the kernels and the emulator that the whole file runs, in ~9% of its time). A SUBSET name that
    names no collected test is an error, not a test quietly left out."""
    from emulated_subset import SUBSET

    emulated = [item for item in items if item.path.name == "test_gluon_emulated.py"]
    unknown = set(SUBSET) - {item.name for item in emulated}
    if emulated and unknown:
        raise pytest.UsageError(f"tests/emulated_subset.py's SUBSET names tests the file lacks: {sorted(unknown)}")
    deselected = [item for item in emulated if item.name not in SUBSET]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item.path.name != "test_gluon_emulated.py" or item.name in SUBSET]


def junit_name(nodeid: str) -> str:
    """A test's "classname::name" as pytest's junit xml writes it (junitxml's mangle_test_address): the file's
    path dotted without ".py", any class, then the name with its parameters."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = names[0].replace("/", ".").removesuffix(".py")
    names[-1] += bracket + params
    return ".".join(names[:-1]) + "::" + names[-1]


def ran_tests(junit_files: str) -> set[str]:
    """The junit_name of every test the `os.pathsep`-separated junit xml files recorded as passed or skipped: on the
    GPU machines the suite outlasts a call, and TCONV3D_TESTS_RAN set to the earlier calls' files runs the rest and
    what failed there again (H200 run 11's failures, mended since)."""
    import xml.etree.ElementTree as ElementTree

    done = set()
    for name in junit_files.split(os.pathsep):
        for case in ElementTree.parse(name).getroot().iter("testcase"):
            if case.find("failure") is None and case.find("error") is None:
                done.add(f"{case.get('classname')}::{case.get('name')}")
    return done


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed_and_precision():
    """A fixed seed per test, and exact fp32 matmuls in both tconv3d and the reference, unless a test opts in."""
    torch.manual_seed(0)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def aten_path(monkeypatch):
    """CPU tensors through aten inside the ops (fast): what a converted model does on a machine without a GPU (the
    real-model tests')."""
    monkeypatch.setattr(settings, "CPU_BACKEND", "aten")


SMALL_TILES = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=2, split_k=3)


@pytest.fixture
def small_tiles(monkeypatch):
    """Force 16x16x16 tiles so that problems span many tiles along every axis (and wgrad several splits)."""
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", lambda *args: SMALL_TILES)


@pytest.fixture
def gpu_heuristic_tiles(monkeypatch):
    """Run with the tiles the heuristic picks for an H100 (132 SMs), so the interpreter checks the masks and
    split-K ranges of the configs GPUs will actually launch."""
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(
        choice,
        "_select",
        lambda direction, geom, dtype, device, run: configs.heuristic_config(direction, geom, dtype, 132),
    )
