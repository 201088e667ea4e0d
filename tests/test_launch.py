"""The direct launch path (kernels/launch.py): after a signature's first launch through Triton's run, the compiled
kernel's launcher is called directly, with exactly the arguments run would give it.

Compiled kernels cannot run here, so the checks stop at the driver (inspect.compile.stubbed_launches: the
kernels compile for sm_90 and each launcher is a recorder), in a process without the interpreter: for every
kernel family, the second launch of the same call reaches the driver with the same arguments, grid, stream,
function and metadata as the first, without calling run; a tensor that moves to an unaligned address or an int
that changes goes back through run (Triton may specialise differently), a second source's distance from the input
only where its class of Triton's specialisation changes; compile-only runs remember nothing.
CI runs this under triton 3.9 and, with the static compile tests, under 3.6."""

import pytest
import triton
from test_static_compile import CUOBJDUMP, compile_script

from tconv3d.kernels import launch

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")

SCRIPT = """
import json, torch
from triton.runtime.jit import JITFunction
from tconv3d.geometry import check_conv3d
from tconv3d.inspect.compile import compile_launch, stubbed_launches
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_tma, conv_wgrad, group_norm, launch, split_k
from tconv3d.kernels.config import KernelConfig

assert launch.OFF is None, launch.OFF
runs = []
original_run = JITFunction.run
def counting_run(self, *args, **kwargs):
    runs.append(self.__name__)
    return original_run(self, *args, **kwargs)
JITFunction.run = counting_run

calls = []  # what each launcher hands launch(): replayed below through both paths
def capturing(kernel, grid, *args, **kwargs):
    calls.append((kernel, grid, args, kwargs))
    return launch.launch(kernel, grid, *args, **kwargs)
for module in (conv_fwd, conv_dgrad, conv_wgrad, conv_tma, group_norm, split_k):
    module.launch = capturing

cl = dict(dtype=torch.bfloat16, memory_format=torch.channels_last_3d)
x, go = torch.randn(1, 64, 4, 16, 16).to(**cl), torch.randn(1, 64, 4, 16, 16).to(**cl)
w = torch.randn(64, 64, 3, 3, 3).to(**cl)
geom = check_conv3d(x, w, None, 1, 1, 1, 1)
pointer = KernelConfig(64, 64, 32, 4, 3, split_k=2)
tma = KernelConfig(64, 64, 32, 4, 3, split_k=2, tma_box_w=16)
out = {"families": {}}
record = []
with stubbed_launches(90, record):
    conv_fwd.conv3d_fwd(x, w, None, None, geom, pointer)
    conv_fwd.conv3d_fwd(x, w, None, None, geom, tma)
    conv_dgrad.conv3d_dgrad(go, w, geom, pointer)
    conv_dgrad.conv3d_dgrad(go, w, geom, tma)
    conv_wgrad.conv3d_wgrad(go, x, None, geom, pointer)  # two kernels: the split partials and their sum
    conv_wgrad.conv3d_wgrad(go, x, None, geom, tma)
    scale, shift = torch.ones(64, dtype=torch.bfloat16), torch.zeros(64, dtype=torch.bfloat16)
    group_norm.group_norm_fwd(x, scale, shift, 8, 1e-5, "silu")
    def plain(value):  # the launch metadata is a fresh LazyDict per launch: compare what it holds
        return (type(value).__name__, dict(value.data)) if type(value).__name__ == "LazyDict" else value

    for kernel, grid, args, kwargs in list(calls):
        launch.forget()
        del record[:], runs[:]
        first = launch.launch(kernel, grid, *args, **kwargs)  # through Triton's run
        after_first = list(runs)
        second = launch.launch(kernel, grid, *args, **kwargs)  # direct
        out["families"][kernel.__name__] = {
            "runs": after_first, "runs_after_second": list(runs), "same_kernel": first is second,
            "launches": len(record),
            "identical": len(record) == 2 and [plain(v) for v in record[0][1]] == [plain(v) for v in record[1][1]],
            "arguments": len(record[0][1]) if record else 0,
        }
    # What makes Triton specialise differently goes back through run.
    kernel, grid, args, kwargs = calls[0]
    launch.launch(kernel, grid, *args, **kwargs)  # remembered
    unaligned = torch.empty(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)  # 2 bytes past a 16-byte boundary
    moved = tuple(unaligned if a is x else a for a in args)
    del runs[:]
    launch.launch(kernel, grid, *moved, **kwargs)
    out["unaligned_runs"] = list(runs)
    index = next(i for i, a in enumerate(args) if type(a) is int and a % 16 == 0 and a > 16)
    changed = args[:index] + (args[index] + 1,) + args[index + 1:]
    del runs[:]
    launch.launch(kernel, grid, *changed, **kwargs)
    out["int_runs"] = list(runs)
    # A second source's distance from the input (launch.Distance) counts by its class of Triton's specialisation:
    # another value of the same class launches directly, one of another class goes through run.
    position = kernel.arg_names.index("Q_DELTA")
    out["distance_runs"] = []
    for value in (2**20, 2**20 + 16 * 977, 2**20 + 8, 2**33):
        del runs[:]
        with_distance = args[:position] + (launch.Distance(value, go, x),) + args[position + 1:]
        launch.launch(kernel, grid, *with_distance, **{**kwargs, "_distances": True})
        out["distance_runs"].append(list(runs))
    handed = record[-1][1][9 + position]  # after the grid, stream, function, metadata and the two hooks
    out["distance_handed_as"] = [type(handed).__name__, handed]
    del runs[:]
    with launch.suspended():
        launch.launch(kernel, grid, *args, **kwargs)
        launch.launch(kernel, grid, *args, **kwargs)
    out["suspended_runs"] = list(runs)
out["remembered_after"] = len(launch._compiled)
print(json.dumps(out))
"""


def test_direct_launches_reach_the_driver_with_runs_arguments():
    result = compile_script(SCRIPT)
    families = result["families"]
    expected = {
        "_conv3d_fwd_kernel", "_conv3d_dgrad_kernel", "_conv3d_wgrad_kernel", "_sum_splits_kernel",
        "_conv3d_tma_kernel", "_conv3d_wgrad_tma_kernel", "_channel_reduce_kernel", "_affine_kernel",
    }  # fmt: skip
    assert expected <= set(families), sorted(families)
    for name, family in families.items():
        assert family["runs"] == [name] and family["runs_after_second"] == [name], (name, family)  # one run only
        assert family["same_kernel"] and family["launches"] == 2 and family["identical"], (name, family)
        assert family["arguments"] > 10, (name, family)  # grid, stream, function, metadata, hooks, arguments
    assert result["unaligned_runs"] == ["_conv3d_fwd_kernel"]
    assert result["int_runs"] == ["_conv3d_fwd_kernel"]
    fwd = ["_conv3d_fwd_kernel"]
    # i32 divisible by 16, again, i32 not divisible, i64
    assert result["distance_runs"] == [fwd, [], fwd, fwd], result["distance_runs"]
    assert result["distance_handed_as"] == ["int", 2**33]  # Triton is handed a plain int
    assert result["suspended_runs"] == ["_conv3d_fwd_kernel", "_conv3d_fwd_kernel"]
    assert result["remembered_after"] == 0  # nothing compiled for the stand-in target outlives it


def test_the_interpreter_launches_through_run():
    """Under the interpreter (this suite on CPU) the direct path is off, and says why."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        assert launch.OFF == "the interpreter runs kernels itself"
    else:
        assert launch.OFF is None or "Triton" in launch.OFF


def test_the_direct_path_can_be_turned_off():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from tconv3d.kernels import launch; print(launch.OFF)"
    for value, expected in (("0", "TCONV3D_DIRECT_LAUNCH=0"), ("1", "None")):
        result = subprocess.run(
            [sys.executable, "-c", code], env={**env, "TCONV3D_DIRECT_LAUNCH": value}, capture_output=True, text=True
        )
        assert result.stdout.strip().splitlines()[-1] == expected, result.stderr[-2000:]


FUSION = """
import json, warnings, torch
warnings.simplefilter("error")  # triton 3.9 warns on every compile that leaves fp fusion to its default
from tconv3d.kernels.group_norm import group_norm_fwd
from tconv3d.inspect.compile import compile_only
x = torch.empty(1, 64, 4, 16, 16, device="meta", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
w = torch.empty(64, device="meta", dtype=torch.bfloat16)
launches = []
with compile_only(90, launches):
    group_norm_fwd(x, w, w, 8, 1e-6, "silu")
print(json.dumps({name: kernel.metadata.enable_fp_fusion for name, _, _, kernel, _, _ in launches}))
"""


@pytest.mark.parametrize("environment", ["unfused_default", "forced_off"])
def test_every_launch_asks_for_fused_multiply_adds(environment, monkeypatch):
    """Every launch compiles with fused multiply-adds whatever Triton's default (3.10 turns it off; here, its
    TRITON_DEFAULT_FP_FUSION=0), with no warning about it; TRITON_FORCE_DISABLE_FP_FUSION=1 (triton 3.9) still
    turns it off."""
    if environment == "unfused_default":
        monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    else:
        from triton import knobs

        if not hasattr(knobs.language, "force_disable_fp_fusion"):
            pytest.skip(f"triton {triton.__version__} has no TRITON_FORCE_DISABLE_FP_FUSION")
        monkeypatch.setenv("TRITON_FORCE_DISABLE_FP_FUSION", "1")
    fused = compile_script(FUSION)
    assert set(fused) == {"_channel_reduce_kernel", "_fold_kernel", "_affine_kernel"}
    assert set(fused.values()) == {environment == "unfused_default"}, fused


class _FakeDriver:
    """libcuda's four calls context_current makes, on a thread whose current context is `current` (0: none)."""

    def __init__(self, current: int):
        self.current, self.calls = current, []

    def cuCtxGetCurrent(self, context):
        self.calls.append("cuCtxGetCurrent")
        context._obj.value = self.current
        return 0

    def cuDeviceGet(self, handle, ordinal):
        self.calls.append(("cuDeviceGet", ordinal))
        handle._obj.value = 40 + ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, context, handle):
        self.calls.append(("cuDevicePrimaryCtxRetain", handle.value))
        context._obj.value = 0xC0
        return 0

    def cuCtxSetCurrent(self, context):
        self.calls.append(("cuCtxSetCurrent", context.value))
        self.current = context.value
        return 0


@pytest.mark.parametrize("current", [0, 0xAB], ids=["none_current", "one_current"])
def test_a_thread_gets_a_current_context_once(current, monkeypatch):
    """context_current: on a thread with no current context (autograd's device thread, where a Gluon launch's tensor
    map failed to encode on the H200: "invalid device context"), the device's primary context is made current
    before the first launch, once a thread; a thread with one keeps it. Each new thread asks again."""
    import threading

    fake = _FakeDriver(current)
    monkeypatch.setattr(launch, "_libcuda", fake)
    _two_launches_on_a_new_thread(1)
    made = [("cuDeviceGet", 1), ("cuDevicePrimaryCtxRetain", 41), ("cuCtxSetCurrent", 0xC0)]
    assert fake.calls == ["cuCtxGetCurrent", *(made if not current else [])]
    fake.calls.clear()
    other = threading.Thread(target=launch.context_current, args=(1,))
    other.start()
    other.join()
    assert fake.calls == ["cuCtxGetCurrent"]  # the fake's context is current by now: nothing made


def test_a_process_that_never_initialized_cuda_is_left_alone(monkeypatch):
    """Launches stubbed on CPU tensors on a machine with a driver (H200 run 6: test_plans' script) reach
    context_current in a process that never called cuInit: cuCtxGetCurrent answers CUDA_ERROR_NOT_INITIALIZED.
    Nothing is made current and nothing raised, and the next launch asks again (CUDA may be initialized by then)."""
    fake = _FakeDriver(0)
    fake.cuCtxGetCurrent = lambda context: fake.calls.append("cuCtxGetCurrent") or 3
    monkeypatch.setattr(launch, "_libcuda", fake)
    _two_launches_on_a_new_thread(0)
    assert fake.calls == ["cuCtxGetCurrent", "cuCtxGetCurrent"]


def _two_launches_on_a_new_thread(device: int) -> None:
    """context_current as a thread's first two launches on `device` call it."""
    import threading

    worker = threading.Thread(target=lambda: [launch.context_current(device) for _ in range(2)])
    worker.start()
    worker.join()


def test_a_driver_error_making_a_context_current_is_named(monkeypatch):
    import threading

    fake = _FakeDriver(0)
    fake.cuDevicePrimaryCtxRetain = lambda context, handle: 101  # CUDA_ERROR_INVALID_DEVICE
    monkeypatch.setattr(launch, "_libcuda", fake)
    errors = []

    def first_launch():
        try:
            launch.context_current(0)
        except RuntimeError as error:
            errors.append(str(error))

    worker = threading.Thread(target=first_launch)
    worker.start()
    worker.join()
    assert errors and "cuDevicePrimaryCtxRetain" in errors[0] and "101" in errors[0]
