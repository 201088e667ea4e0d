"""What tests/conftest.py does to a run: it makes Triton's interpreter patch triton.language once a launch, runs
int32 overflow checks only where asked (for real there), hands the longest test files out first, and shares the
cores out between pytest-xdist's workers. CI runs this under triton 3.9 and, with the static compile tests, under
3.6: the interpreter's internals it leans on differ."""

import os

import pytest
import torch
import triton
import triton.language as tl
from conftest import LONGEST_FIRST


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
    assert patch_lang.__module__ == "conftest", "the interpreter's _patch_lang is not conftest's"
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
    """The session's files start with the longest ones (those it holds), the rest as collected; xdist's own order
    of files by test count is off, so the workers take them in this order."""
    files = list(dict.fromkeys(item.path.name for item in request.session.items))
    longest = [name for name in LONGEST_FIRST if name in files]
    assert files[: len(longest)] == longest
    assert getattr(request.config.option, "loadscopereorder", False) is False


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
