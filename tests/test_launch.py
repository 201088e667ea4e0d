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
from test_static_compile import CUOBJDUMP, compile_script, within_grid

from tconv3d.kernels import launch

pytestmark = pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")

SCRIPT = """
import json, torch
from triton import knobs
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
            # the same but for the hooks and their metadata, which the direct path hands as None with no hook set
            "identical": len(record) == 2 and [plain(v) for v in record[0][1][:6] + record[0][1][9:]]
            == [plain(v) for v in record[1][1][:6] + record[1][1][9:]],
            "hooks": [[type(v).__name__ for v in r[1][6:9]] for r in record],
            "arguments": len(record[0][1]) if record else 0,
        }
    # With a launch hook set, the direct path hands the hook chains and the metadata, as run does.
    knobs.runtime.launch_enter_hook.add(print)
    try:
        del record[:]
        launch.launch(kernel, grid, *args, **kwargs)
        out["hooked"] = [type(v).__name__ for v in record[-1][1][6:9]]
    finally:
        knobs.runtime.launch_enter_hook.remove(print)
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
        # run hands its empty hook chains and their metadata; the direct path None for each, with no hook set
        assert family["hooks"] == [["LazyDict", "HookChain", "HookChain"], ["NoneType"] * 3], (name, family)
    assert result["hooked"] == ["LazyDict", "HookChain", "HookChain"]
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
# triton 3.9 warns (UserWarning) on every compile that leaves fp fusion to its default. Not every warning: under
# Python 3.13, triton 3.7's code generator makes AST nodes Python deprecates (DeprecationWarning), not ours.
warnings.simplefilter("error", UserWarning)
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


# A norm's grids at the sizes that pass CUDA's limits (launch.MAX_GRID): a sample of 67.2M voxels (65,600 splits
# of the reduction's 1,024 voxels) and a batch of 70,000, compiled for sm_90 and stopped at the stubbed driver, which
# refuses a grid past the limits as CUDA's does; then the old splits (MAX_SPLITS lifted), which it refuses, and a
# forward's tiles of more shared memory than an H100's program may have (256 KiB), which Triton refuses.
GRIDS = """
import json, torch
from tconv3d.geometry import check_conv3d
from tconv3d.inspect.compile import stubbed_launches
from tconv3d.kernels import conv_fwd, group_norm
from tconv3d.kernels.config import KernelConfig
cl = dict(dtype=torch.bfloat16, memory_format=torch.channels_last_3d)
cases = {"voxels": (torch.randn(1, 1, 64, 1024, 1025), 1), "batch": (torch.randn(70000, 8, 1, 2, 2), 2)}
out = {}
for name, (x, groups) in cases.items():
    x = x.to(**cl)
    w, b = torch.randn(x.shape[1], dtype=torch.bfloat16), torch.randn(x.shape[1], dtype=torch.bfloat16)
    record = []
    with stubbed_launches(90, record):
        y, mean, rstd = group_norm.group_norm_fwd(x, w, b, groups, 1e-5, "silu")
        group_norm.group_norm_bwd(x, x, mean, rstd, w, b, groups, "silu")
    out[name] = [(kernel, list(args[:3])) for kernel, args in record]
group_norm.MAX_SPLITS = 2**31
try:
    with stubbed_launches(90):
        group_norm.group_norm_fwd(cases["voxels"][0].to(**cl), None, None, 1, 1e-5, "none")
except RuntimeError as error:
    out["refused"] = str(error)
x, w = torch.randn(1, 64, 4, 16, 16).to(**cl), torch.randn(64, 64, 3, 3, 3).to(**cl)
try:
    with stubbed_launches(90):
        conv_fwd.conv3d_fwd(x, w, None, None, check_conv3d(x, w, None, 1, 1, 1, 1), KernelConfig(256, 256, 64, 8, 4))
except Exception as error:
    out["shared"] = f"{type(error).__name__}: {error}"
print(json.dumps(out))
"""


def test_a_norm_past_the_grids_limits_launches_within_them():
    """The group norm's launches at a sample of 67.2M voxels and a batch of 70,000 reach the stubbed driver within
    CUDA's grid (the reduction's splits capped, the affine kernel's batch in launches of 65,535 entries); the same
    norm with the splits uncapped is refused by it, as the driver refuses it, and so are tiles of more shared
    memory than a program may have, as Triton refuses them."""
    result = compile_script(GRIDS)
    voxels = dict(result["voxels"])
    assert voxels["_channel_reduce_kernel"] == [1, 1, 61742]  # 64 x 1,024 x 1,025 voxels, 1,088 a split
    assert [grid for kernel, grid in result["batch"] if kernel == "_affine_kernel"] == [[1, 1, 65535], [1, 1, 4465]] * 2
    for kernel, grid in result["voxels"] + result["batch"]:
        assert within_grid(grid), (kernel, grid)
    assert "_channel_reduce_kernel: grid (1, 1, 65600) passes CUDA's" in result["refused"]
    assert result["shared"].startswith("OutOfResources: out of resource: shared memory, Required: 262144"), result


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


PAST_SCRIPT = """
import json
from bench.host_overhead import launcher_past
print(json.dumps(launcher_past(3)))
"""


def test_past_the_wrapper_with_compiled_kernels_arguments():
    """launch._Past on real launches: bench.host_overhead's launcher_past compiles the TMA and Gluon forwards for
    sm_90, builds Triton's own CudaLauncher and wrapper around a recorder from each compiled kernel's signature and
    metadata, and raises where _Past hands the C launch anything else; a kernel _Past refuses is named. Under each
    Triton CI runs (3.9; 3.6, 3.7.1, 3.8.0), so each one's wrapper is met with kernels as compiled there."""
    result = compile_script(PAST_SCRIPT)
    assert set(result) == {"tma fwd", "gluon fwd"}, result
    assert all("refused" not in times and times["arguments"] > 40 for times in result.values()), result


class _CLaunch:
    """Stands in for a compiled launcher's C launch (no __code__, as a builtin): records its arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_past_the_wrapper_the_c_launch_gets_the_wrappers_arguments(monkeypatch):
    """launch._Past, under each Triton CI runs (3.9, and 3.6, 3.7.1 and 3.8.0 in its later sections): the C launch
    receives exactly what CudaLauncher.__call__ and its tensor-descriptor wrapper (Triton's own, around a recorder)
    give it, descriptors expanded in place, the leading arguments laid out 3.6's way (flat) or 3.7 to 3.9's (the
    kernel's arguments in one list, which the C launch reads by its annotations with no count check); a
    descriptor's expansion is made again only when its tensor's address, shape or strides change."""
    import types

    import torch

    monkeypatch.setattr(launch, "OFF", None)  # this process runs the interpreter: the check alone, as on a GPU
    convention, why = launch._launch_convention()
    assert why is None and convention == (launch.FLAT if triton.__version__.startswith("3.6") else launch.PACKED), why
    monkeypatch.setattr(launch, "CONVENTION", convention)
    from triton.backends.nvidia import driver as nvidia

    made = []

    def make_tensordesc_arg(arg, meta, *leading):  # Triton's encodes a map; this one says what it was asked
        made.append((arg.base.data_ptr(), meta["id"], *leading))
        return [("map", arg.base.data_ptr(), meta["id"]), *arg.shape, *arg.strides]

    monkeypatch.setattr(nvidia, "make_tensordesc_arg", make_tensordesc_arg)  # before the wrappers take it (3.8 on)
    monkeypatch.setattr(triton.runtime.driver, "_active", types.SimpleNamespace())  # 3.8 on: __call__ asks for it
    signature = {0: "*bf16", 1: "tensordesc<bf16[64, 32]>", 2: "i32", 3: "tensordesc<bf16[32, 16]>", 4: "constexpr"}
    c_launch = _CLaunch()

    def compiled_with(launch_of):
        launcher = object.__new__(nvidia.CudaLauncher)
        launcher.launch = launch_of
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.global_scratch_align = launcher.profile_scratch_align = 1
        launcher.num_ctas, launcher.launch_cooperative_grid, launcher.launch_pdl = 1, False, True
        launcher.arg_annotations, launcher.kernel_signature, launcher.gsan_enabled = ("notes",), b"sig", False
        return types.SimpleNamespace(run=launcher, function=1234, packed_metadata=(4, 1, 0))

    compiled = compiled_with(nvidia.wrap_handle_tensordesc(c_launch, signature, [{"id": "a"}, {"id": "b"}]))
    x, y = torch.zeros(64, 64), torch.zeros(32, 32)

    def descriptor(t, shape):
        return types.SimpleNamespace(base=t, shape=shape, strides=[shape[1], 1], padding="zero",
                                     round_f32_to_tf32=False)  # fmt: skip

    values = (x, descriptor(x, [64, 64]), 7, descriptor(y, [32, 32]), 32)
    nvidia.CudaLauncher.__call__(compiled.run, 5, 2, 1, 99, compiled.function, compiled.packed_metadata, None,
                                 None, None, *values)  # fmt: skip
    past = launch._past_wrapper(compiled)
    assert past is not None and launch._past_wrapper(compiled) is past  # made once a kernel
    inner = compiled.run.launch
    if "relevant_paths" in inner.__code__.co_freevars:  # 3.8 on: libtriton's expansion, read by what it does
        cells = dict(zip(inner.__code__.co_freevars, (cell.cell_contents for cell in inner.__closure__), strict=True))
        expand = inner.__globals__["make_tensordesc_args"]
        assert launch._expands_as_triton(past, expand, cells)
        (first, a), (second, b) = past.descriptors
        swapped = launch._Past(c_launch, ((first, b), (second, a)), compiled.run, past.make, True)  # metadata swapped
        assert not launch._expands_as_triton(swapped, expand, cells)
    past(compiled, 5, 2, 1, 99, list(values))
    wrapper, ours = c_launch.calls
    flat = convention == launch.FLAT

    def split(call):  # (the leading arguments, the kernel's) as the C launch received them
        return (call[:13], list(call[13:])) if flat else (call[:-1], list(call[-1]))

    assert split(ours) == split(wrapper)
    assert split(ours)[1] == [x, ("map", x.data_ptr(), "a"), 64, 64, 64, 1, 7, ("map", y.data_ptr(), "b"), 32, 32,
                              32, 1, 32]  # fmt: skip
    assert split(ours)[0] == ((5, 2, 1, 99, 1234, False, True, None, None, (4, 1, 0), None, None, None) if flat else
                              (5, 2, 1, 99, 1234, False, True, (4, 1, 0), None, None, None, None, None, ("notes",),
                               b"sig"))  # fmt: skip
    assert len(made) == 4 and made[0][2:] == made[2][2:]  # the wrapper's two and ours; 3.8 on: with the leading ones
    past(compiled, 5, 2, 1, 99, values)
    assert len(made) == 4 and split(c_launch.calls[-1]) == split(ours)  # the same tensors: the expansions kept
    z = torch.zeros(32, 32)
    past(compiled, 5, 2, 1, 99, (x, values[1], 7, descriptor(z, [32, 32]), 32))
    assert made[-1][:2] == (z.data_ptr(), "b") and len(made) == 5
    assert split(c_launch.calls[-1])[1][7] == ("map", z.data_ptr(), "b")
    past(compiled, 5, 2, 1, 99, (x, values[1], 7, descriptor(y, [16, 32]), 32))  # another shape, same address
    assert len(made) == 6 and split(c_launch.calls[-1])[1][8:10] == [16, 32]

    plain = compiled_with(c_launch)  # a kernel without descriptors: its launch is the C launch itself
    launch._past_wrapper(plain)(plain, 1, 1, 1, 7, (x, 3))
    nvidia.CudaLauncher.__call__(plain.run, 1, 1, 1, 7, plain.function, plain.packed_metadata, None, None, None, x, 3)
    assert split(c_launch.calls[-2]) == split(c_launch.calls[-1]) and split(c_launch.calls[-1])[1] == [x, 3]
    scratch = compiled_with(c_launch)
    scratch.run.global_scratch_size = 128  # the wrapper allocates it: launched through it
    assert launch._past_wrapper(scratch) is None
    python_launch = compiled_with(lambda *args: None)  # not the C launch nor Triton's wrapper: left alone
    assert launch._past_wrapper(python_launch) is None
    if convention == launch.PACKED:
        sanitized = compiled_with(c_launch)
        sanitized.run.gsan_enabled = True  # 3.8 on: GSan adds arguments in __call__
        assert launch._past_wrapper(sanitized) is None

    # launch_compiled takes it under Triton's own knobs, whose hooks are empty chains, never None (H200 run 11: it
    # took them for hooks set, and no launch went past the wrapper)
    stream_of = types.SimpleNamespace(active=types.SimpleNamespace(get_current_stream=lambda device: 99))
    monkeypatch.setattr(launch, "driver", stream_of)
    monkeypatch.setattr(launch, "WRAPPER", why)  # as imported on a GPU machine: None
    fresh = compiled_with(nvidia.wrap_handle_tensordesc(c_launch, signature, [{"id": "a"}, {"id": "b"}]))
    launch.launch_compiled(fresh, (5, 2), values, 0)
    assert "_tconv3d_past" in vars(fresh) and split(c_launch.calls[-1]) == split(ours)
