"""What tests/conftest.py (with tests/interpreter_speedups.py, interpreter_fidelity.py and interpreter_bounds.py)
does to a run: it makes Triton's interpreter patch triton.language once a launch, takes shortcuts through its
frontend's types that give what its own path gives, rounds its float32 -> bfloat16 casts to nearest even as the GPU
does, holds every access a kernel makes to the tensors its launch was handed, runs
int32 overflow checks only where asked (for real there), hands the longest test files out first, and shares the
cores out between pytest-xdist's workers. CI runs this under triton 3.9 and, with the static compile tests, under
3.6: the interpreter's internals it leans on differ."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from conftest import LONGEST_FIRST, TEST_AT_A_TIME, pytest_xdist_make_scheduler


def _interpreted():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("compiled kernels do not go through the interpreter")


@triton.jit
def _add_one(x):
    return x + 1


@triton.jit
def _nested_helpers_kernel(ptr):
    value = tl.load(ptr)
    for _ in tl.static_range(3):
        value = _add_one(value)
    tl.store(ptr, value)


def test_the_interpreter_patches_the_language_once_a_launch(monkeypatch):
    """conftest's speed-up of the interpreter is in place under this Triton (3.6 and 3.9 in CI): a launch whose kernel
    calls a helper three times patches triton.language once, not four times, and computes what it should."""
    from triton.runtime import interpreter

    _interpreted()
    patch_lang = interpreter._patch_lang
    assert patch_lang.__module__ == "interpreter_speedups", "the interpreter's _patch_lang is not ours"
    originals = []
    original = patch_lang.original
    monkeypatch.setattr(patch_lang, "original", lambda fn: originals.append(fn) or original(fn))
    value = torch.tensor([4], dtype=torch.int32)
    _nested_helpers_kernel[(1,)](value)
    assert value.item() == 7
    assert len(originals) == 1


@triton.jit
def _square_kernel(ptr):
    value = tl.load(ptr)
    tl.store(ptr, value * value)


def _square_int32(value: int) -> int:
    x = torch.tensor([value], dtype=torch.int32)
    _square_kernel[(1,)](x)
    return x.item()


@pytest.mark.overflow_checks
def test_marked_tests_check_int32_overflow():
    """conftest turns the interpreter's int32 overflow checks on for tests with the mark (the fuzzer's): a product
    that leaves int32 stops the launch."""
    import test_fuzz

    _interpreted()
    assert test_fuzz.pytestmark.name == "overflow_checks"
    assert _square_int32(3000) == 9_000_000
    with pytest.raises(BaseException, match="overflow"):
        _square_int32(50_000)


def test_other_tests_run_without_int32_overflow_checks():
    """...and off elsewhere (the interpreter's default computes the check and drops it, a third to a half of a test's
    time): the product wraps, as on a GPU."""
    _interpreted()
    if os.environ.get("TCONV3D_OVERFLOW_CHECKS") == "1":
        pytest.skip("TCONV3D_OVERFLOW_CHECKS=1 keeps them on everywhere")
    assert _square_int32(50_000) == 50_000**2 - 2**32


def test_the_longest_files_are_handed_out_first(request):
    """The session's files start with the longest ones (those it holds), the rest as collected, TEST_AT_A_TIME's
    last; xdist's own order of files by test count is off, so the workers take them in this order."""
    files = list(dict.fromkeys(item.path.name for item in request.session.items))
    longest = [name for name in LONGEST_FIRST if name in files]
    assert files[: len(longest)] == longest
    last = [name for name in files if name in TEST_AT_A_TIME]
    assert files[len(files) - len(last) :] == last
    assert getattr(request.config.option, "loadscopereorder", False) is False


def test_loadfile_hands_out_some_files_a_test_at_a_time():
    """Under --dist loadfile the scheduler keeps each file one unit but for TEST_AT_A_TIME's, whose tests are each
    their own (so both workers take them); another --dist keeps xdist's own scheduler."""
    pytest.importorskip("xdist")

    class Config:
        option = type("Option", (), {"loadscopereorder": False})()

        def __init__(self, dist):
            self.dist = dist

        def getvalue(self, name):
            return {"dist": self.dist, "tx": ["2*popen"]}[name]

    scheduler = pytest_xdist_make_scheduler(Config("loadfile"), None)
    assert TEST_AT_A_TIME
    for name in TEST_AT_A_TIME:
        test = f"tests/{name}::test_one[case-2]"
        assert scheduler._split_scope(test) == test
    assert scheduler._split_scope("tests/test_tma.py::test_one[case-2]") == "tests/test_tma.py"
    assert pytest_xdist_make_scheduler(Config("load"), None) is None


def test_each_xdist_worker_takes_its_share_of_the_cores():
    """Under pytest-xdist each worker's torch runs on cores / workers threads (at least one), and the processes a test
    starts inherit it; a run without xdist, or one whose OMP_NUM_THREADS the user set, keeps torch's own count."""
    import conftest

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        assert conftest.THREADS is None
        pytest.skip("not under pytest-xdist")
    if conftest.THREADS is None:
        pytest.skip("OMP_NUM_THREADS set by the user")
    threads = max(1, conftest.cores() // int(workers))
    assert torch.get_num_threads() == threads
    assert os.environ["OMP_NUM_THREADS"] == str(threads)


def _interpreter_shortcuts():
    from triton.runtime import interpreter

    _interpreted()
    operands = interpreter.interpreter_semantic.binary_op_type_checking_impl
    assert operands.__module__ == "interpreter_speedups", "the shortcuts through its types are not in place"
    assert interpreter._patch_attr.__module__ == "interpreter_speedups", "its builtins are not our stand-ins"
    return interpreter, operands


def _operand_kinds(interpreter):
    """Tensors of each element type the kernels use (and pointers, bools, unsigned), as scalars and blocks of two
    shapes, with values that would show a conversion; and Python numbers at the edges of int32 and int64."""
    core = tl.core
    rng = np.random.default_rng(0)
    pointer = tl.pointer_type(tl.float32)
    elements = [
        tl.int1, tl.int32, tl.int64, tl.uint32, tl.int16, tl.float16, tl.bfloat16, tl.float32, tl.float64, pointer,
    ]  # fmt: skip
    kinds = []
    for element in elements:
        np_type = interpreter._get_np_dtype(element)
        for shape in ((), (4,), (2, 4)):
            data = rng.integers(-(2**20), 2**20, size=shape or (1,)).astype(np_type)
            if element == pointer:
                data = rng.integers(2**20, 2**21, size=shape or (1,)).astype(np_type) * 4
            ty = core.block_type(element, list(shape)) if shape else element
            kinds.append(core.tensor(interpreter.TensorHandle(data, element), ty))
    numbers = [0, 7, -3, 2**31 - 1, 2**31, -(2**31) - 1, 2**40, 2**63 - 1, 2**63, True, 1.5, -0.25]
    return kinds + numbers


def _described(result):
    """What a binary operation's operands came out as: their types, shapes and values (or the error raised)."""
    if isinstance(result, Exception):
        return type(result).__name__, str(result)
    return [
        (str(x.type), str(x.dtype), tuple(int(s) for s in x.shape), int(x.numel), str(x.handle.dtype),
         x.handle.data.dtype.str, np.asarray(x.handle.data).tolist())
        for x in result
    ]  # fmt: skip


def test_the_interpreters_operands_come_out_as_its_own_path_makes_them():
    """conftest's shortcut through binary_op_type_checking_impl (behind every +, *, //, %, comparison) gives the
    operands the interpreter's own path gives, with the same types, shapes, values and errors, for every pair of
    operand kinds and every combination of its flags; and it is in place under this Triton (3.6 and 3.9 in CI)."""
    interpreter, operands = _interpreter_shortcuts()
    kinds = _operand_kinds(interpreter)
    compared = 0
    for lhs in kinds:
        for rhs in kinds:
            if not isinstance(lhs, tl.core.tensor) and not isinstance(rhs, tl.core.tensor):
                continue
            for flags in ((False, False, True, False), (True, True, True, False), (False, False, True, True),
                          (False, False, False, False)):  # fmt: skip
                results = []
                for check in (operands, operands.original):
                    try:
                        results.append(_described(check(lhs, rhs, *flags)))
                    except Exception as error:  # the errors must agree too
                        results.append(_described(error))
                assert results[0] == results[1], (lhs, rhs, flags)
                compared += 1
    assert compared > 1000


def test_the_interpreters_types_are_built_as_its_own_constructors_build_them():
    """conftest's cached block types and typed tensors have the fields the interpreter's constructors give them."""
    interpreter, _ = _interpreter_shortcuts()
    core = tl.core
    block_init, tensor_init = core.block_type.__init__, core.tensor.__init__
    assert block_init.__module__ == tensor_init.__module__ == "interpreter_speedups"
    for element in (tl.int32, tl.float32, tl.bfloat16, tl.pointer_type(tl.float16), tl.int1):
        for shape in ([4], [2, 8], core.tuple([core.constexpr(2), core.constexpr(4)]), [core.constexpr(16)]):
            for _ in range(2):  # built, then from the cache
                ours, theirs = object.__new__(core.block_type), object.__new__(core.block_type)
                block_init(ours, element, shape)
                block_init.original(theirs, element, shape)
                assert (ours.element_ty, ours.shape, ours.numel, ours.name) == (
                    theirs.element_ty, theirs.shape, theirs.numel, theirs.name
                )  # fmt: skip
                data = np.zeros(ours.numel, interpreter._get_np_dtype(element))
                handle = interpreter.TensorHandle(data, element)
                for ty in (ours, element):
                    a, b = object.__new__(core.tensor), object.__new__(core.tensor)
                    tensor_init(a, handle, ty)
                    tensor_init.original(b, handle, ty)
                    assert (a.type, a.dtype, int(a.numel), str(a.shape), str(a.shape.type)) == (
                        b.type, b.dtype, int(b.numel), str(b.shape), str(b.shape.type)
                    )  # fmt: skip
    for bad in ([3], [], [2**30, 2**30], (2, 8), [[2]]):  # (2, 8): a Python tuple, which triton's assertion refuses
        errors = []
        for init in (block_init, block_init.original):
            with pytest.raises(Exception) as raised:  # whatever the interpreter raises
                init(object.__new__(core.block_type), tl.int32, bad)
            errors.append((raised.type, str(raised.value)))
        assert errors[0] == errors[1]


TESTS = os.path.dirname(__file__)
# What conftest reads from the environment to change a run: a test that starts pytest sets the ones it checks.
RUN_SETTINGS = ("PYTEST_XDIST_WORKER_COUNT", "TCONV3D_TESTS_RAN", "TCONV3D_TESTS_AGAIN", "TCONV3D_EMULATED_SUBSET",
                "TCONV3D_CPU_PROFILE")  # fmt: skip


def _environment(**settings) -> dict:
    """This process's environment without RUN_SETTINGS, tests/ on PYTHONPATH, and `settings`."""
    env = {k: v for k, v in os.environ.items() if k not in RUN_SETTINGS}
    return {**env, "PYTHONPATH": TESTS + os.pathsep + env.get("PYTHONPATH", ""), **settings}


def _pytest_with_our_conftest(target, *args, rootdir, **settings) -> subprocess.CompletedProcess:
    """pytest in a fresh process over `target` (a scratch file or directory) with tests/conftest.py as its only
    conftest and no ini file, its environment _environment(**settings)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(target), "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
         "--rootdir", str(rootdir), "--confcutdir", TESTS, "-c", os.devnull, "-p", "conftest", *args],
        env=_environment(**settings), capture_output=True, text=True,
    )  # fmt: skip


@pytest.mark.one_triton
def test_the_cpu_profile_counts_a_tests_own_and_its_childrens_seconds(tmp_path):
    """TCONV3D_CPU_PROFILE: a line a test, its own CPU seconds and those of the processes it waited for apart."""
    profile = tmp_path / "cpu.tsv"
    script = tmp_path / "test_busy.py"
    script.write_text(
        "import subprocess, sys\n"
        "def test_spins():\n"
        "    x = 0\n"
        "    for i in range(3_000_000):\n"
        "        x += i\n"
        "def test_waits_for_a_spinning_child():\n"
        "    subprocess.run([sys.executable, '-c', 'sum(range(30_000_000))'], check=True)\n"
    )
    run = _pytest_with_our_conftest(script, rootdir=TESTS, TCONV3D_CPU_PROFILE=str(profile))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {line.split("\t")[0].split("::")[1]: [float(v) for v in line.split("\t")[1:]]
            for line in profile.read_text().splitlines()}  # fmt: skip
    assert set(rows) == {"test_spins", "test_waits_for_a_spinning_child"}
    wall, own, children = rows["test_spins"]
    assert own > 0.05 and children == 0 and wall >= own * 0.5
    wall, own, children = rows["test_waits_for_a_spinning_child"]
    assert children > 0.1 and own < children


@pytest.mark.one_triton
def test_a_suite_cut_short_resumes_past_the_tests_its_junit_file_names(tmp_path):
    """TCONV3D_TESTS_RAN: the tests an earlier run's junit xml records as passed or skipped (a class's and
    parametrized ones too) are deselected, the rest and the failed ones run (the GPU calls' suite outlasts a call)."""
    script = tmp_path / "test_some.py"
    script.write_text(
        "import pytest\n"
        "def test_one():\n    pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\n"
        "def test_two(n):\n    pass\n"
        "class TestK:\n    def test_three(self):\n        pass\n"
    )
    again = {}

    def pytest(*args, ran=None):
        run = _pytest_with_our_conftest(
            script, *args, rootdir=tmp_path, **again, **({"TCONV3D_TESTS_RAN": ran} if ran else {})
        )
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        return run.stdout

    first = tmp_path / "first.xml"
    # selected by node id (a -k expression also matches the directories' names: pytest-of-root/popen-gw1/...)
    assert "2 passed, 2 deselected" in pytest("--deselect", "test_some.py::test_two", "--junitxml", str(first))
    second = tmp_path / "second.xml"
    assert "1 passed, 3 deselected" in pytest(
        "--deselect", "test_some.py::test_two[2]", "--junitxml", str(second), ran=str(first)
    )
    out = pytest("-rA", ran=os.pathsep.join(map(str, (first, second))))
    assert "1 passed, 3 deselected" in out and "test_two[2]" in out, out
    failed = tmp_path / "failed.xml"  # as pytest writes a failure and an error
    failed.write_text(
        '<testsuites><testsuite><testcase classname="test_some" name="test_one"><failure message="no"/></testcase>'
        '<testcase classname="test_some" name="test_two[1]"><error message="no"/></testcase>'
        '<testcase classname="test_some.TestK" name="test_three"/></testsuite></testsuites>'
    )
    out = pytest("-rA", ran=str(failed))
    assert "3 passed, 1 deselected" in out and "test_one" in out and "test_two[1]" in out, out
    # TCONV3D_TESTS_AGAIN: tests of code changed since, run again whatever the junit files say, first
    again["TCONV3D_TESTS_AGAIN"] = "TestK,one"
    out = pytest("-vv", ran=os.pathsep.join(map(str, (first, second))))  # -q -vv: one line a test
    assert "3 passed, 1 deselected" in out, out
    order = [line.split(" ")[0].split("::", 1)[1] for line in out.splitlines() if " PASSED" in line]
    assert order == ["test_one", "TestK::test_three", "test_two[2]"], out


@pytest.mark.one_triton
def test_the_emulated_subset_is_collected_and_nothing_else_of_its_file():
    """TCONV3D_EMULATED_SUBSET=1 (CI's Triton 3.6, 3.7.1 and 3.8.0 sections): of test_gluon_emulated.py, exactly
    tests/emulated_subset.py's SUBSET is collected, every name in it a test of the file; other files whole."""
    from emulated_subset import SUBSET

    def collected(subset):
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
             "test_gluon_emulated.py", "test_conftest.py"],
            cwd=TESTS, env=_environment(TCONV3D_EMULATED_SUBSET="1" if subset else "0"), capture_output=True, text=True,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        ids = [line.split("::", 1) for line in run.stdout.splitlines() if "::" in line]
        return {
            path: {name for p, name in ids if p.endswith(path)}
            for path in ("test_gluon_emulated.py", "test_conftest.py")
        }

    whole, subset = collected(False), collected(True)
    if not whole["test_gluon_emulated.py"]:
        pytest.skip("this Triton runs no Gluon kernels (conv_gluon.UNAVAILABLE)")
    assert subset["test_gluon_emulated.py"] == set(SUBSET) < whole["test_gluon_emulated.py"]
    assert subset["test_conftest.py"] == whole["test_conftest.py"]


@pytest.mark.one_triton
def test_an_emulated_subset_naming_a_test_the_file_lacks_stops_the_run(tmp_path):
    """A SUBSET name that no collected test has is an error, not a check quietly left out (a test renamed)."""
    (tmp_path / "test_gluon_emulated.py").write_text("def test_renamed():\n    pass\n")
    run = _pytest_with_our_conftest(tmp_path, rootdir=tmp_path, TCONV3D_EMULATED_SUBSET="1")
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout[-2000:] + run.stderr[-2000:]
    assert "SUBSET names tests the file lacks" in run.stderr


@triton.jit
def _to_bfloat16_kernel(x_ptr, cast_ptr, stored_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    value = tl.load(x_ptr + offs)
    tl.store(cast_ptr + offs, value.to(tl.bfloat16))
    tl.store(stored_ptr + offs, value)  # the store's own conversion


def test_the_interpreters_bfloat16_casts_round_to_nearest_even():
    """A kernel's float32 -> bfloat16 conversions (tl.tensor.to, and a store into a bfloat16 tensor) round as torch's
    .to(torch.bfloat16) does, bit for bit (NaN stays NaN): random values of every scale, ties both ways, overflow,
    subnormals, signed zeros. The interpreter's own cast truncates: it differs on about half of them."""
    _interpreted()
    import interpreter_fidelity
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl
    assert getattr(cast, "rounds_to_nearest_even", False), "the interpreter's bfloat16 cast is not ours"
    torch.manual_seed(0)
    ties = (torch.randint(0, 2**16, (256,), dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 0.0, -0.0, 1e-40, -1e-40, float("nan")])
    scales = torch.tensor([1e-38, 1e-3, 1.0, 1e3, 1e37]).repeat_interleave(152)[: 1024 - 256 - len(special)]
    x = torch.cat([torch.randn(len(scales)) * scales, ties, special])  # 1024: a power of two for tl.arange
    cast_out, stored = (torch.empty(x.numel(), dtype=torch.bfloat16) for _ in range(2))
    _to_bfloat16_kernel[(1,)](x, cast_out, stored, N=x.numel())
    expected = x.to(torch.bfloat16)
    finite = ~x.isnan()
    for out in (cast_out, stored):
        assert torch.equal(out[finite].view(torch.int16), expected[finite].view(torch.int16))
        assert out[~finite].isnan().all()
    rounded = interpreter_fidelity.to_bfloat16_bits(x[finite].numpy()).view(np.int16)
    assert np.array_equal(rounded, expected[finite].view(torch.int16).numpy())
    handle = interpreter.TensorHandle(x[finite].numpy(), tl.float32)
    own = cast.truncating(interpreter.InterpreterBuilder(), handle, tl.bfloat16).data.view(np.int16)
    assert (own != expected[finite].view(torch.int16).numpy()).mean() > 0.3


IMPORT_ON_A_GPU_MACHINE = """
import os, sys, torch
torch.cuda.is_available = lambda: True  # as on a GPU machine, where conftest leaves the interpreter off
sys.path.insert(0, "tests")
import {module}
print(os.environ.get("TRITON_INTERPRET"))
"""


@pytest.mark.one_triton
@pytest.mark.parametrize("module", ["fuzz", "fuzz_args", "fuzz_models"])
def test_the_fuzzers_leave_the_interpreter_off_on_a_gpu_machine(module):
    """The test modules import the fuzzers; on a GPU machine a fuzzer that set TRITON_INTERPRET at its import made
    every test module collected after it define its kernels for the interpreter and run the interpreter's own tests
    (H200 run 4: 8 failures, test_fuzz_models' import of fuzz_models). Each sets it only where CUDA is absent."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = IMPORT_ON_A_GPU_MACHINE.format(module=module)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "None"


def test_new_cpu_tensors_hold_nan_until_written():
    """conftest fills what torch.empty makes with NaN on a machine without CUDA: an output a kernel leaves partly
    unwritten fails against float64 whatever the memory held before (a freed copy of the same result, as once)."""
    if torch.cuda.is_available():
        pytest.skip("the fill is the CPU run's (conftest)")
    assert torch.empty(64).isnan().all() and torch.empty(2, 3, 4, 5, 6, dtype=torch.bfloat16).isnan().all()
    freed = torch.ones(64)
    del freed
    assert torch.empty(64).isnan().all()  # not the ones just freed


@triton.jit
def _shifted_copy_kernel(x_ptr, y_ptr, n, SHIFT, READ_PAST, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    value = tl.load(x_ptr + SHIFT + offs, mask=offs < n + READ_PAST, other=0.0)
    tl.store(y_ptr + offs, value, mask=offs < n)


@triton.jit
def _atomic_add_kernel(y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.atomic_add(y_ptr + offs, 1.0, mask=offs < n)


def test_the_interpreter_holds_every_access_to_the_launchs_tensors():
    """tests/interpreter_bounds.py: a load one element past its tensor, a store past its tensor and an atomic past it
    fail with the kernel named; masked-off lanes are no access; a view's kernel may read its whole storage; a
    second source addressed from the first (a launch.Distance, handed to Triton as a plain int) is readable in the
    launch that follows its conversion, and only there."""
    _interpreted()
    from tconv3d.kernels.launch import Distance

    x, y = torch.randn(10), torch.empty(10)
    _shifted_copy_kernel[(1,)](x, y, 10, 0, 0, BLOCK=16)  # 16 lanes, 6 masked off
    assert torch.equal(x, y)
    with pytest.raises(Exception, match=r"out-of-bounds load in _shifted_copy_kernel: 1 of 11 active lanes"):
        _shifted_copy_kernel[(1,)](x, y, 10, 0, 1, BLOCK=16)
    with pytest.raises(Exception, match=r"out-of-bounds store in _shifted_copy_kernel: 6 of 16"):
        _shifted_copy_kernel[(1,)](torch.randn(16), y, 16, 0, 0, BLOCK=16)
    with pytest.raises(Exception, match=r"out-of-bounds atomic in _atomic_add_kernel"):
        _atomic_add_kernel[(1,)](torch.zeros(4), 5, BLOCK=8)
    whole = torch.randn(20)
    _shifted_copy_kernel[(1,)](whole[:10], y, 10, 0, 6, BLOCK=16)  # past the view, inside its storage
    second = torch.randn(10)
    distance = Distance((second.data_ptr() - x.data_ptr()) // 4, second, x)
    shift = int(distance)
    _shifted_copy_kernel[(1,)](x, y, 10, shift, 0, BLOCK=16)
    assert torch.equal(y, second)
    with pytest.raises(Exception, match=r"out-of-bounds load in _shifted_copy_kernel"):
        _shifted_copy_kernel[(1,)](x, y, 10, shift, 0, BLOCK=16)  # the distance spent on the launch before
