"""Launching a compiled kernel without JITFunction.run's per-call Python (issue 29).

`launch(kernel, grid, *args, **kwargs)` is `kernel[grid](*args, **kwargs)`. The first launch of each argument
signature goes through Triton's run, which specialises, compiles and launches; later launches with the same
signature call the compiled kernel's launcher directly, with exactly the arguments run would pass it. The
signature is finer than Triton's specialisation, so it can only split a specialisation, never merge two: every
int, float, bool, None and string by value (but an int computed from addresses, a `Distance`, by Triton's own
class of it, checked at import), each tensor by dtype and 16-byte alignment of its address, each TMA
descriptor by base dtype and alignment, shape, strides, block and layout, every keyword (constexprs and
options) by value, and the device and Triton's debug and instrumentation settings. Anything else (a type it
does not know) goes through run every time, and so does a kernel with pre-run hooks (run calls them). Run's
check that the kernel's global values have not changed since it compiled is not repeated: tconv3d's kernels
read no mutable globals.

The direct call leans on Triton internals that 3.6 to 3.9 share (JITFunction.run ends in
`kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata, ...)`): they
are checked once, at import, and where they differ, or under the interpreter, `launch` is Triton's run. A direct
launch also skips the compiled launcher's own Python (CudaLauncher.__call__ and its tensor-descriptor wrapper) and
calls its C launch with the arguments they would give it, each descriptor's encoded map kept while its tensor's
address, shape and strides repeat (`_Past`: 3.6's way of calling the C launch or 3.7 to 3.9's, `CONVENTION`, checked
at import too; `WRAPPER` says why not where neither holds).

Inside `traced()` (ops.py's Inductor path) a launch is not run but recorded into the graph being traced, through
torch.library.wrap_triton: Inductor's generated code then launches the kernel itself.

Every launch asks for fused multiply-adds (enable_fp_fusion=FP_FUSION), whatever the installed Triton defaults
to: Triton 3.9 warns that its default (fused) turns to unfused in 3.10, which would change what the kernels compute
in their last bits (the norms' x * a + b, the SiLU) and their speed between two Triton releases without a change
here. TRITON_FORCE_DISABLE_FP_FUSION=1 (Triton 3.9 on) still turns fusion off. A launch recorded for Inductor
(`traced`) leaves the option to Inductor, whose compile options are its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import threading
import types

import torch
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from .. import settings

# The launch JITFunction.run makes, which the direct path repeats.
_RUN_LAUNCH = (
    "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, launch_metadata,",
    "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())",
)


def _why_off() -> str | None:
    """Why the direct path is off in this process, or None."""
    if settings.INTERPRET:
        return "the interpreter runs kernels itself"
    if not settings.DIRECT_LAUNCH:
        return "TCONV3D_DIRECT_LAUNCH=0"
    try:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel

        source = " ".join(inspect.getsource(JITFunction.run).split())
    except (ImportError, OSError, TypeError) as error:
        return f"this Triton's launch internals could not be read: {error}"
    if not all(" ".join(part.split()) in source for part in _RUN_LAUNCH):
        return "this Triton's JITFunction.run launches differently from what the direct path repeats"
    if not all(hasattr(CompiledKernel, name) for name in ("run", "launch_metadata")):
        return "this Triton's CompiledKernel lacks run or launch_metadata"
    if not all(hasattr(knobs.runtime, name) for name in ("launch_enter_hook", "launch_exit_hook", "debug")):
        return "this Triton's knobs lack the launch hooks"
    if not hasattr(knobs.compilation, "instrumentation_mode"):
        return "this Triton's knobs lack instrumentation_mode"
    return None


OFF = _why_off()
try:  # (the launch hooks and options launch_compiled reads: Triton 3.6 and later have them)
    from triton import knobs
except ImportError:
    knobs = None

# The compile option every launch passes (see the module's docstring), unless its caller names it.
FP_FUSION = True

# CUDA's largest grid: programs along its first, second and third axes. A launch past them fails in the driver
# ("invalid argument"); the interpreter takes any grid, so the launchers keep within these themselves
# (inspect.compile.stubbed_launches refuses what the driver would).
MAX_GRID = (2**31 - 1, 65535, 65535)

# signature -> (the compiled kernel, the values of the parameters after the positional ones). Kernels are in
# signatures by id: JITFunction's own hash recomputes its cache key on every call.
_compiled: dict = {}
_MAX_COMPILED = 8192
_suspended = 0
_traced = 0
# Which set of remembered kernels is current: forget() starts a new one, so that whatever holds a compiled kernel
# past it (plans.py) can tell that it may no longer launch it.
generation = 0
# While a call plan records on this thread (tconv3d/plans.py, `recording`), its list: each launch appends
# (compiled, trailing values, grid, args) where it is direct, a marker where it went through Triton's run (RUN_NOW:
# it compiled just now; RUN_ALWAYS: it always will, so there is no plan to make). Per thread, so that another
# thread's launches (DataParallel's replicas) never enter a plan.
_thread = threading.local()
RUN_NOW, RUN_ALWAYS = "compiled now", "not on the direct path"


class Distance(int):
    """An int argument computed from addresses: a second source's distance in elements from the tensor a pointer
    kernel addresses it from (utils.second_source_arguments; `source`, `base`). It changes whenever either tensor
    is allocated elsewhere, so the signature holds it as Triton specialises it (`specialization`), not by value:
    a layer's next call reuses the compiled kernel on the direct path, where keying by value sent every call of a
    moved source through Triton's run and remembered one more signature each time. Triton itself is handed plain
    ints; a plan (plans.py) recomputes the distance from the two tensors it replays with."""

    def __new__(cls, value: int, source: torch.Tensor, base: torch.Tensor):
        distance = super().__new__(cls, value)
        distance.source, distance.base = source, base
        return distance


def specialization(value: int):
    """What Triton's run specialises an int argument on: 1 as a constant, else its type (i32, i64 or u64 by range)
    and whether 16 divides it (checked against this Triton's own at import: _SPECIALIZES_AS_TRITON)."""
    if value == 1:
        return 1
    kind = "i32" if -(2**31) <= value < 2**31 else "i64" if -(2**63) <= value < 2**63 else "u64"
    return kind, value % 16 == 0


def _specializes_as_triton() -> bool:
    """Whether `specialization` tells apart every pair of ints this Triton compiles apart (on values around each
    boundary); where it cannot be checked or differs, distances are keyed by value, as other ints."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return False
    values = [v + d for v in (0, 1, 16, 2**31, -(2**31), 2**40, 2**63) for d in (-17, -16, -1, 0, 1, 15, 16)]
    try:
        theirs = [native_specialize_impl(BaseBackend, v, False, True, True) for v in values if v < 2**64]
    except Exception:
        return False
    ours = [specialization(v) for v in values if v < 2**64]
    return all((ours[i] == ours[j]) <= (theirs[i] == theirs[j]) for i in range(len(ours)) for j in range(i))


_SPECIALIZES_AS_TRITON = _specializes_as_triton()


@contextlib.contextmanager
def recording(launches: list):
    """Inside, this thread's launches are appended to `launches` (see _thread)."""
    _thread.recorder = launches
    try:
        yield launches
    finally:
        _thread.recorder = None


def forget() -> None:
    """Drop every remembered kernel: the next launch of each signature goes through run again."""
    global generation
    _compiled.clear()
    generation += 1


def signature_state() -> tuple:
    """What a launch's signature holds besides its kernel and arguments: the device and Triton's debug and
    instrumentation settings (plans.py checks these before launching a remembered kernel)."""
    return driver.active.get_current_device(), knobs.runtime.debug, knobs.compilation.instrumentation_mode


@contextlib.contextmanager
def suspended():
    """Inside, every launch is Triton's run and nothing is remembered (compile-only runs for an absent GPU)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@contextlib.contextmanager
def traced():
    """Inside, every launch is recorded into the graph that torch.compile is tracing (torch.library.wrap_triton)
    instead of run: the launchers run on its fake tensors and the graph holds their kernels, grids and arguments."""
    global _traced
    _traced += 1
    try:
        yield
    finally:
        _traced -= 1


def tracing() -> bool:
    """Whether launches are being recorded into a traced graph (see `traced`)."""
    return _traced > 0


def _arg_signature(a):
    """What one non-int argument contributes to a launch's signature (ints stand for themselves). The common kinds
    first: a launch's tensors, Nones and flags are a tenth of its arguments, and this runs for each on every
    launch."""
    kind = type(a)
    if kind is torch.Tensor:
        return a.dtype, a.data_ptr() % 16 == 0
    if a is None or kind in (bool, float, str):
        return kind, a
    if kind is Distance:
        return Distance, specialization(a) if _SPECIALIZES_AS_TRITON else int(a)
    described = getattr(a, "launch_signature", None)  # a descriptor from utils.tensor_descriptor, made once there
    if described is not None:
        return described, a.base.data_ptr() % 16 == 0
    if isinstance(a, torch.Tensor):  # a subclass (a Parameter)
        return a.dtype, a.data_ptr() % 16 == 0
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor) and hasattr(a, "block_shape"):  # any other host TMA descriptor
        described = (kind, base.dtype, tuple(a.shape), tuple(a.strides), tuple(a.block_shape),
                     getattr(a, "layout", None), getattr(a, "padding", None))  # fmt: skip
        return described, base.data_ptr() % 16 == 0
    raise TypeError(kind)


def _trailing_values(kernel: JITFunction, positional: int, kwargs: dict) -> tuple:
    """The values of the kernel's parameters after the positional arguments, in order, defaults for those the
    call leaves out: the rest of what run binds and launches with (options such as num_warps are no parameters).
    Every keyword is in the signature, so these are fixed per signature."""
    parameters = list(kernel.signature.parameters.values())[positional:]
    return tuple(kwargs.get(p.name, p.default) for p in parameters)


def launch(kernel, grid, *args, _distances: bool = False, **kwargs):
    """kernel[grid](*args, **kwargs), through the compiled kernel's launcher after the first launch of a
    signature (see the module's docstring). `kernel` may be anything with `[grid]` (a stand-in in tests).
    `_distances`: some of `args` are Distances, which the signature and a recording plan take as they are and
    Triton as plain ints (a launch without any skips that comprehension: 2-3 us over a pointer kernel's 60-80
    arguments)."""
    given = args
    if _distances:
        args = tuple([int(a) if type(a) is Distance else a for a in args])
    if _traced:
        if any(hasattr(a, "block_shape") for a in args):  # choice.inductor_refusal keeps TMA launches out
            raise RuntimeError(f"tconv3d: {kernel} takes TMA descriptors, which a traced launch cannot carry")
        return torch.library.wrap_triton(kernel)[grid](*args, **kwargs)
    kwargs.setdefault("enable_fp_fusion", FP_FUSION)  # kwargs is this call's own dict
    recorder = getattr(_thread, "recorder", None)
    if (
        OFF is not None
        or _suspended
        or not isinstance(kernel, JITFunction)
        or callable(grid)
        or getattr(kernel, "pre_run_hooks", None)
    ):
        if recorder is not None:
            recorder.append(RUN_ALWAYS)
        if isinstance(kernel, JITFunction) and not (settings.INTERPRET or _suspended):
            context_current(driver.active.get_current_device())
        return kernel[grid](*args, **kwargs)
    device = driver.active.get_current_device()
    context_current(device)
    try:
        signature = (
            id(kernel), device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            tuple([a if type(a) is int else _arg_signature(a) for a in given]), tuple(kwargs.items()),
        )  # fmt: skip
        compiled = _compiled.get(signature)
    except TypeError:  # an argument type the signature does not know, or an unhashable value: run decides
        if recorder is not None:
            recorder.append(RUN_ALWAYS)
        return kernel[grid](*args, **kwargs)
    if compiled is None:
        if recorder is not None:
            recorder.append(RUN_NOW)
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if compiled is not None and len(_compiled) < _MAX_COMPILED:
            _compiled[signature] = compiled, _trailing_values(kernel, len(args), kwargs)
        return compiled
    compiled, trailing = compiled
    if recorder is not None:
        recorder.append((compiled, trailing, grid, given))
    launch_compiled(compiled, grid, args + trailing, device)
    return compiled


# The CUDA driver library, loaded at the first launch on a thread with no current context (see context_current).
_libcuda = None
_CUDA_ERROR_NOT_INITIALIZED = 3


def context_current(device: int) -> None:
    """Make a CUDA context current on this thread before a launch, once a thread. Triton's launcher encodes each
    TMA descriptor (fill_tma_descriptor: cuTensorMapEncodeTiled) in Python before its C launch code makes the
    device's primary context current (its ensureCudaContext), so on a thread with no current context the encode
    fails: "Failed to create tensor map descriptor: invalid device context" (H200 run 4, tests/gpu/host_overhead.py:
    a backward's Gluon input gradient on autograd's device thread, the first launch there, its memory from the
    caching allocator with no CUDA runtime call before it). As that launch code does, the device's primary context
    (torch's) is made current where none is. Where the driver library cannot be loaded, or the process has not
    initialized it, nothing is done: no CUDA tensor exists then, and Triton's own launch reports what is missing.
    (The second: launches stubbed on CPU tensors on a machine with a driver, H200 run 6's test_plans script.)"""
    global _libcuda
    if getattr(_thread, "context", False):
        return
    try:
        if _libcuda is None:
            _libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        _thread.context = True
        return
    current = ctypes.c_void_p()
    status = _libcuda.cuCtxGetCurrent(ctypes.byref(current))
    if status == _CUDA_ERROR_NOT_INITIALIZED:  # asked again next launch: the process may initialize CUDA later
        return
    _driver_check(status, "cuCtxGetCurrent")
    if not current.value:
        handle = ctypes.c_int()
        _driver_check(_libcuda.cuDeviceGet(ctypes.byref(handle), int(device)), "cuDeviceGet")
        _driver_check(_libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(current), handle), "cuDevicePrimaryCtxRetain")
        _driver_check(_libcuda.cuCtxSetCurrent(current), "cuCtxSetCurrent")
    _thread.context = True


def _driver_check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"tconv3d: {call} returned CUDA driver error {status} making a context current to launch in")


def launch_compiled(compiled, grid, values, device) -> None:
    """What JITFunction.run does last: the compiled kernel's launcher on the current stream of `device`, with
    `values` (every parameter's, in order) and the launch hooks; past the launcher's Python wrapper where this
    Triton's allows it (`WRAPPER`). The caller has made a context current on this thread (context_current).
    With no launch hook set, the launcher gets None for the hooks and their metadata, as Triton's launchers take
    (they call a hook that is not None): Triton's own run hands them its empty hook chains, and makes the metadata
    for them, at every launch."""
    stream = driver.active.get_current_stream(device)
    size = len(grid)
    grid_0, grid_1, grid_2 = grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    if _hook_set(enter) or _hook_set(leave):
        metadata = compiled.launch_metadata(grid, stream, *values)
    else:
        past = _past_wrapper(compiled) if WRAPPER is None else None
        if past is not None:
            past(compiled, grid_0, grid_1, grid_2, stream, values)
            return
        metadata = enter = leave = None
    compiled.run(grid_0, grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, metadata, enter, leave,
                 *values)  # fmt: skip


def _hook_set(hook) -> bool:
    """Whether a launch hook is set. Triton 3.6's and 3.9's knobs hold a HookChain, never None, empty where no hook
    was added: launch_compiled once took it for a hook, and no launch went past the wrapper on the H200 (run 11's
    profile: Triton's CudaLauncher.__call__ and its wrapper at every launch)."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


# Past the launcher's wrapper (issue 29). Triton's compiled launcher is a CudaLauncher whose __call__ (Python)
# allocates no scratch for tconv3d's kernels and calls `inner`, the wrapper Triton puts around the C launch where a
# kernel takes tensor descriptors: it expands every descriptor into its encoded tensor map, shape and strides
# (make_tensordesc_arg) at every launch, then calls the C launch. On the H200's host that cost ~15 us a Gluon
# launch under 3.6 (H200 run 9's profile, bench/NOTES.md); on a CPU, with stand-ins for the C launch and the encode,
# 7-9 us a launch of 60 arguments and three descriptors under 3.6 to 3.9. `_Past` calls the C launch itself: the
# same leading arguments, the descriptors expanded at positions found once a kernel, and each descriptor's
# expansion kept while its tensor's address, shape and strides repeat (the map encodes exactly these and the
# kernel's own block and swizzle: a repeat is the same map). The C launch takes its arguments one of two ways:
# 3.6's (FLAT: every kernel argument after 13 leading ones) or 3.7 to 3.9's (PACKED: 15 leading ones, then the
# kernel's arguments in one list). Which way the installed Triton's launcher and wrapper go is checked once, at
# import (`CONVENTION`, or `WRAPPER`: why neither), and 3.8 and 3.9's expansion in libtriton
# (make_tensordesc_args) once a kernel against _Past's. Anything else (another launcher, scratch, launch hooks,
# GSan, a descriptor inside a tuple argument, the CPU stand-ins of inspect.compile.stubbed_launches) launches
# through the wrapper.
FLAT, PACKED = "flat", "packed"
_LEADING = "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, "
_CALLS = {  # CudaLauncher.__call__'s parameters, and its call of the C launch
    FLAT: (["self", "gridX", "gridY", "gridZ", "stream", "function", "args"],
           (_LEADING + "global_scratch, profile_scratch, *args)",)),
    PACKED: (["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
              "launch_enter_hook", "launch_exit_hook", "args"],
             tuple(_LEADING + "kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch, "
                   f"profile_scratch, self.arg_annotations, self.kernel_signature, {last})"
                   for last in ("args", "kernel_args"))),  # 3.7's; 3.8's and 3.9's (kernel_args: _GSAN)
}  # fmt: skip
_WRAPPERS = {  # what the tensor-descriptor wrapper does with them: 3.6's, 3.7's and 3.8-3.9's
    FLAT: ("final_args = list(args[:_BASE_ARGS_FORMAT_LEN])",),
    PACKED: ("base_args = args[:-1] kernel_args = args[-1]",
             "final_kernel_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))",
             "return launcher(*base_args, final_kernel_args)"),
    "shared": ("base_args = args[:-1] kernel_args = args[-1]",
               "wrapped = make_tensordesc_args( kernel_args, signature, relevant_paths, tensordesc_meta, base_args, "
               "make_tensordesc_arg, )", "return launcher(*base_args, wrapped)"),
}  # fmt: skip
_GSAN = "kernel_args = args if self.gsan_enabled:"  # 3.8's and 3.9's kernel_args: args, but under GSan
_MAX_MAPS = 64  # encoded descriptors kept a kernel: a few layouts a layer


def _source(function) -> str:
    return " ".join(inspect.getsource(function).split())


def _launch_convention() -> tuple[str | None, str | None]:
    """(FLAT or PACKED, None) where this Triton's launcher and wrapper go one of _Past's ways, else (None, why)."""
    if OFF is not None:
        return None, OFF
    try:
        from triton.backends.nvidia import driver as nvidia

        call = _source(nvidia.CudaLauncher.__call__)
        parameters = list(inspect.signature(nvidia.CudaLauncher.__call__).parameters)
        wrap = _source(nvidia.wrap_handle_tensordesc)
        wrappers = "shared" if "wrap_handle_tensordesc_impl(" in wrap else None
        if wrappers:  # 3.8, 3.9: the backends' shared wrapper, expanding in libtriton
            from triton.backends import driver as shared

            wrap = _source(shared.wrap_handle_tensordesc_impl)
    except (ImportError, AttributeError, OSError, TypeError) as error:
        return None, f"this Triton's launcher could not be read: {error}"
    convention = next((way for way, (names, calls) in _CALLS.items()
                       if parameters == names and any(line in call for line in calls)), None)  # fmt: skip
    if convention is None:
        return None, "this Triton's CudaLauncher calls its launch in neither way _Past repeats (3.6's, 3.7-3.9's)"
    if "kernel_args" in call and _GSAN not in call:
        return None, "this Triton's CudaLauncher changes the kernel's arguments where _Past does not"
    if not all(line in wrap for line in _WRAPPERS[wrappers or convention]):
        return None, "this Triton's tensor-descriptor wrapper lays its arguments out otherwise than _Past repeats"
    if convention == FLAT and getattr(nvidia, "_BASE_ARGS_FORMAT_LEN", None) != 13:
        return None, "this Triton's C launch takes another number of leading arguments than 3.6's 13"
    return convention, None


CONVENTION, WRAPPER = _launch_convention()


class _Past:
    """A compiled kernel's C launch with the arguments its CudaLauncher and wrapper would give it."""

    __slots__ = ("annotations", "c_launch", "descriptors", "flags", "make", "maps", "packed", "takes_leading")

    def __init__(self, c_launch, descriptors, launcher, make, takes_leading):
        self.c_launch, self.descriptors, self.make, self.takes_leading = c_launch, descriptors, make, takes_leading
        self.packed = CONVENTION == PACKED
        self.flags = (launcher.launch_cooperative_grid, launcher.launch_pdl)
        self.annotations = (launcher.arg_annotations, launcher.kernel_signature) if self.packed else ()
        self.maps = {}

    def __call__(self, compiled, grid_0, grid_1, grid_2, stream, values):
        if self.packed:  # the metadata, no launch metadata nor hooks, no scratch, then the arguments as one list
            leading = (grid_0, grid_1, grid_2, stream, compiled.function, *self.flags, compiled.packed_metadata,
                       None, None, None, None, None, *self.annotations)  # fmt: skip
            self.c_launch(*leading, self.expanded(values, leading) if self.descriptors else values)
        else:  # no scratch, then the metadata, no launch metadata nor hooks, then the arguments
            self.c_launch(grid_0, grid_1, grid_2, stream, compiled.function, *self.flags, None, None,
                          compiled.packed_metadata, None, None, None, *self.expanded(values, None))  # fmt: skip

    def expanded(self, values, leading) -> list:
        """The kernel's arguments with each descriptor expanded in place, as the wrapper expands them:
        make_tensordesc_arg(descriptor, meta), kept by what it encodes where `meta` gives the map's layout."""
        args, maps = list(values), self.maps
        for index, meta in reversed(self.descriptors):  # from the last: the earlier positions stay
            descriptor = values[index]
            if meta is None or meta.get("is_im2col"):  # the tensor itself among the arguments, or a map kept elsewhere
                args[index : index + 1] = self._made(descriptor, meta, leading)
                continue
            key = (index, descriptor.base.data_ptr(), *descriptor.shape, *descriptor.strides, descriptor.padding,
                   getattr(descriptor, "round_f32_to_tf32", False))  # fmt: skip
            found = maps.get(key)
            if found is None:
                if len(maps) >= _MAX_MAPS:
                    maps.clear()
                found = maps[key] = self._made(descriptor, meta, leading)
            args[index : index + 1] = found
        return args

    def _made(self, descriptor, meta, leading) -> list:
        return self.make(descriptor, meta, leading) if self.takes_leading else self.make(descriptor, meta)


def _past_wrapper(compiled) -> _Past | None:
    """The compiled kernel's _Past, made at its first launch here; None where its launcher is not this Triton's
    CudaLauncher with no scratch (then it launches through the wrapper). Either answer is kept on the kernel, but
    for a launcher that is no CudaLauncher at all (a stand-in of stubbed_launches: asked again next launch)."""
    past = compiled.__dict__.get("_tconv3d_past")
    if past is not None:
        return past or None
    from triton.backends.nvidia import driver as nvidia

    launcher = compiled.run
    if type(launcher) is not nvidia.CudaLauncher:
        return None
    past = compiled.__dict__["_tconv3d_past"] = _past_of(launcher, nvidia) or False
    return past or None


def _past_of(launcher, nvidia) -> _Past | None:
    """A CudaLauncher's _Past, or None where it needs scratch or GSan, or its launch is neither the C launch nor a
    wrapper of the Triton imported (3.6's or 3.7's in nvidia's driver, 3.8's or 3.9's shared one) that _Past
    repeats."""
    if launcher.global_scratch_size or launcher.profile_scratch_size or getattr(launcher, "gsan_enabled", False):
        return None
    wrapped, make, takes_leading = launcher.launch, nvidia.make_tensordesc_arg, False
    code = getattr(wrapped, "__code__", None)
    if code is None:  # the C launch itself: the kernel takes no descriptor
        return _Past(wrapped, (), launcher, make, takes_leading)
    if code.co_name != "inner" or not wrapped.__closure__:
        return None
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in wrapped.__closure__), strict=True))
    metas = cells.get("tensordesc_meta")
    if code.co_filename == nvidia.__file__ and {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
        indices = sorted(cells["tensordesc_indices"])  # 3.6, 3.7
        metas = metas or [None] * len(indices)
    elif {"launcher", "signature", "relevant_paths", "tensordesc_meta", "make_tensordesc_arg"} <= cells.keys():
        paths = cells["relevant_paths"]  # 3.8, 3.9: descriptors by their paths in the (nested) arguments
        if any(paths.values()) or not isinstance(metas, list):  # one inside a tuple argument; no metadata list
            return None
        indices, make, takes_leading = sorted(paths), cells["make_tensordesc_arg"], True
    else:
        return None
    past = _Past(cells["launcher"], tuple(zip(indices, metas, strict=True)), launcher, make, takes_leading)
    if takes_leading and not _expands_as_triton(past, wrapped.__globals__.get("make_tensordesc_args"), cells):
        return None
    return past


def _expands_as_triton(past: _Past, expand, cells: dict) -> bool:
    """Whether libtriton's make_tensordesc_args (3.8, 3.9), asked about stand-ins for every argument, expands the
    descriptors where _Past does, with the same metadata, handing the leading arguments on: its rules are compiled
    code, so they are read here by what they do, once a kernel."""
    if expand is None:
        return False
    values = [types.SimpleNamespace(base=types.SimpleNamespace(data_ptr=lambda i=i: i), shape=(i,), strides=(1,),
                                    padding="zero", index=i) for i in range(len(cells["signature"]))]  # fmt: skip
    leading = ("leading",)

    def marked(descriptor, meta, given):
        return [("map", descriptor.index, id(meta), given is leading)]

    probe = _Past(None, past.descriptors, types.SimpleNamespace(launch_cooperative_grid=0, launch_pdl=0,
                  arg_annotations=None, kernel_signature=None), marked, True)  # fmt: skip
    try:
        theirs = expand(values, cells["signature"], cells["relevant_paths"], cells["tensordesc_meta"], leading, marked)
    except Exception:  # any refusal: the wrapper stays
        return False
    return list(theirs) == probe.expanded(values, leading)
