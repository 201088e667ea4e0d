"""The torch.library custom ops, their fake implementations and autograd: the one place tconv3d meets PyTorch.

    torch.ops.tconv3d.conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros",
                             frames_before=None, channels_after=None)
    torch.ops.tconv3d.conv3d_input_grad(grad_output, weight, input_size, stride, padding, dilation, padding_mode,
                                        groups=1, channels_after=None, bias=None)
    torch.ops.tconv3d.conv3d_weight_grad(grad_output, input, weight_size, stride, padding, dilation, padding_mode,
                                         frames_before=None, groups=1, channels_after=None)
    torch.ops.tconv3d.group_norm(input, weight, bias, groups, eps, activation="none", channels_after=None,
                                 negative_slope=0.01, activation_weight=None) -> (y, mean, rstd)
    torch.ops.tconv3d.rms_norm(input, weight, bias, eps, activation="none", clamp=False)
    torch.ops.tconv3d.upsample_linear(input, factors)            trilinear, align_corners=False, factors 1 or 2
    torch.ops.tconv3d.upsample_linear_backward(grad_output, input_size, factors)

padding is 3 ints (symmetric) or 6 (d_front, d_back, h_top, h_bottom, w_left, w_right); padding_mode one of
"zeros", "replicate", "reflect", "circular" or three of them "d,h,w" (F.pad's meaning, done inside the kernels).
frames_before (N, C, P, H, W) is read in front of the input along D, as if concatenated; the input gradient op
then returns the gradient of that concatenation (input_size counts its frames) and autograd splits it.
channels_after (N, C2, D, H, W) follows the input's channels, as if torch.cat([input, channels_after], dim=1) were
convolved (a UNet decoder's skip connection), likewise read in place and its gradient split off; the input
gradient op's channels_after (N, C2, Do, Ho, Wo) follows grad_output's channels (conv_transpose3d of such a
concatenation: MONAI UNet's decoder), its weight gradient the two sources' rows of it; the input gradient op's
bias (one per input channel) is conv_transpose3d's, added in the kernels' epilogue; group_norm's normalizes
that concatenation (a diffusion UNet's res block takes its skip connection into its norm first). Every
result is channels_last_3d, and the fake implementations say so, so torch.compile plans no layout copies.
The two gradient ops are differentiable too (each is linear in both tensor arguments), so double backward works.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.autograd import forward_ad
from torch.utils.flop_counter import register_flop_formula

from . import settings
from .geometry import (
    PLAIN_TENSORS,
    check_conv3d,
    check_group_norm,
    check_input_grad,
    check_rms_norm,
    check_upsample_linear,
    check_weight_grad,
)
from .kernels import aten
from .kernels.tensors import (
    cat_channels,
    empty_ndhwc,
    exporting_to_onnx,
    func_transformed,
    on_storage,
    parameter_grad_dtype,
)  # fmt: skip
from .settings import runs_triton

if settings.TRITON_MISSING is None:  # else every op runs torch's own (runs_triton is False), and none of these
    from . import plans
    from .kernels import launch
    from .kernels.conv_dgrad import conv3d_dgrad
    from .kernels.conv_fwd import conv3d_fwd
    from .kernels.conv_wgrad import conv3d_wgrad
    from .kernels.group_norm import group_norm_bwd, group_norm_fwd
    from .kernels.resample import upsample_linear_bwd, upsample_linear_fwd
    from .kernels.rms_norm import rms_norm_bwd, rms_norm_fwd
    from .kernels.split_k import channel_sums
    from .tune import choice


def _planned(op: str, tensors: tuple, int_sequences: tuple, scalars: tuple, run):
    """run(), which checks an op's arguments (a convolution's or a norm's) and runs it on `tensors`, under the device
    guard of the first (the device it runs on), or replayed from the plan of these arguments where one was
    recorded (plans.py)."""
    first = tensors[0]
    if not runs_triton(first):
        return run()
    plan_key = plans.key(op, tensors, int_sequences, *scalars)
    plan = plans.find(plan_key)
    with _device_guard(first):
        if plan is not None:
            return plans.replay(plan, plan_key, tensors, run)
        return plans.recorded(plan_key, tensors, run)


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the tensor's.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# The ops are defined on a torch.library.Library with their implementation for every device and their fake,
# and their autograd kernel is a torch.autograd.Function written out here: @torch.library.custom_op and
# torch.library.register_autograd wrap each call in several more Python layers (argument flattening, keyset
# bookkeeping, an alias check), which cost 5-10 us per call (issue 19, bench/NOTES.md). The dynamo-disable
# wrapper they also add is kept where dynamo watches (see _dynamo_disabled).
_lib = torch.library.Library("tconv3d", "DEF")


def _define(schema: str, fake):
    """Define an op from its schema; the decorated function is its implementation on every device."""

    def register(implementation):
        name = schema.split("(", 1)[0]
        _lib.define(schema)
        _lib.impl(name, _dynamo_disabled(implementation), "CompositeExplicitAutograd")
        torch.library.register_fake(f"tconv3d::{name}", fake, lib=_lib)
        return implementation

    return register


def _dynamo_disabled(implementation):
    # Dynamo must never trace an implementation (it would trace into the kernels' launch code): when a compiled
    # region runs eager code that calls an op (a DDP forward, a graph break), its frames are otherwise offered to
    # dynamo, which is what a set frame callback means. The eager callers skip this wrapper (~1 us a call, issue
    # 19) while no callback is set; where torch lacks the query, the wrapper always runs.
    return torch._dynamo.disable(implementation, recursive=True)


_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", lambda: "unknown")

# The C++ apply of autograd Functions, without Function.apply's Python layer (functorch transforms, dead
# functorch wrappers, default-argument binding), for the eager callers, which take none of those cases: ~2.5 us a
# call (issue 19).
_function_apply = torch._C._FunctionBase.__dict__["apply"]
_is_functorch_wrapper = torch._C._functorch.is_functorch_wrapped_tensor


def _register_autograd(name: str, implementation, backward, setup_context, jvp, in_torch_ops):
    """Register the op's autograd kernel and return its eager caller (see `_intercepted`), which takes the
    schema's arguments positionally (trailing ones with defaults may be left out).

    The kernel: below autograd, the op itself; with a gradient to record or a tangent to carry (forward-mode AD:
    torch.func.jvp, torch.autograd.forward_ad), a Function whose forward runs the op below autograd, whose
    setup_context is `setup_context` (a separate staticmethod, as torch.func's transforms require), whose backward
    is `backward` (which may call the ops again, so double backward works) and whose jvp is `jvp(inputs, tangents)`
    (the output's tangent from the call's inputs and their tangents, None where an input has none, by the ops
    again). The eager caller runs the same Function, or the implementation, directly.

    `in_torch_ops` is the op in torch's own differentiable ops (the aten path's): what a graph compiled under a
    torch.func transform traces in the op's place (see `eager`), and what torch.onnx.export traces (ONNX has
    functions for torch's ops, none for tconv3d's; both its exporters, the torch.export one and the TorchScript
    one; no dispatch mode or trace runs the eager callers' direct path, so the check costs nothing there)."""
    op = getattr(torch.ops.tconv3d, name).default

    def below_autograd(*inputs):
        with torch._C._AutoDispatchBelowAutograd():
            return op(*inputs)

    def function(run):
        class Function(torch.autograd.Function):
            @staticmethod
            def forward(*inputs):
                return run(*inputs)

            @staticmethod
            def setup_context(ctx, inputs, output):
                setup_context(ctx, inputs, output)
                if forward_ad._current_level >= 0:  # a tangent may be asked for, right after this
                    ctx.jvp_inputs = inputs  # primals: autograd hands setup_context no tangents

            @staticmethod
            def jvp(ctx, *tangents):
                inputs = ctx.jvp_inputs
                del ctx.jvp_inputs  # the call's inputs, held only until its tangent is made
                return jvp(inputs, tangents)

        Function.backward = staticmethod(backward)
        Function.__name__ = Function.__qualname__ = f"{name}_autograd"
        return Function

    # Under torch.func's transforms (grad, jvp, vjp, jacrev, vmap of those) the eager caller runs the Function's
    # own apply, which hands it to the transforms (their custom_function_call runs forward, setup_context, backward
    # and jvp one level down; generate_vmap_rule batches them by running them under vmap, the op's batching the
    # dispatcher's fallback, a loop). The autograd kernel cannot: the transforms have unwrapped its inputs already.
    transformed = function(below_autograd)
    transformed.generate_vmap_rule = True
    dispatched = _function_apply.__get__(None, transformed)
    disabled = _dynamo_disabled(implementation)

    def run_direct(*inputs):
        return (implementation if _frame_callback() is None else disabled)(*inputs)

    apply_direct = _function_apply.__get__(None, function(run_direct))

    def records_grad(inputs) -> bool:
        return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)

    tensor_positions = [i for i, argument in enumerate(op._schema.arguments) if _is_tensor_type(argument.type)]

    def plain(inputs) -> bool:
        for i in tensor_positions:
            t = inputs[i] if i < len(inputs) else None
            if t is not None and not _plain_tensor(t):
                return False
        return not _intercepted()

    def autograd_kernel(*inputs):
        if records_grad(inputs) or _has_tangent(inputs):
            if torch._C._functorch.peek_interpreter_stack() is not None:
                raise RuntimeError(
                    f"torch.ops.tconv3d.{name} was called directly under a torch.func transform, which reaches "
                    "its autograd only through tconv3d's callers: use tconv3d.functional or tconv3d.nn"
                )
            return dispatched(*inputs)
        # What Inductor's code calls (torch.ops.tconv3d.*, autograd done by AOTAutograd): where nothing below
        # could intercept it, the implementation itself, as the eager callers run it, not a second dispatch
        return run_direct(*inputs) if plain(inputs) else below_autograd(*inputs)

    _lib.impl(name, autograd_kernel, "Autograd")

    def eager(*inputs):
        if torch.compiler.is_compiling():  # first: dynamo reads it as a constant and traces the op
            if func_transformed():  # (dynamo wraps peek_interpreter_stack's None: not None)
                # torch.compile of torch.func.jvp, grad or vmap over the op: dynamo traces no autograd Function
                # that has a jvp (a graph break, an error under fullgraph=True), and the op's autograd kernel does
                # not take the transforms (it raises, below), so the graph holds the op's torch ops, which
                # every transform and Inductor take: aten's convolutions, not tconv3d's kernels.
                return in_torch_ops(*inputs)
            if exporting_to_onnx():  # torch.onnx.export's torch.export (dynamo reads it as False)
                return in_torch_ops(*inputs)
            return op(*inputs)
        records = False
        for i in tensor_positions:
            t = inputs[i] if i < len(inputs) else None
            if t is not None:
                # A subclass (DTensor, FakeTensor...) has its own dispatch; a functorch wrapper its transform's.
                if _is_functorch_wrapper(t):
                    return transformed.apply(*inputs)
                if type(t) not in PLAIN_TENSORS:
                    return op(*inputs)
                records = records or t.requires_grad
        if _intercepted():
            if torch._C._get_tracing_state() is not None:
                inputs = _static_sizes(inputs, tensor_positions)
                if exporting_to_onnx():  # torch.onnx.export's TorchScript exporter
                    return in_torch_ops(*inputs)
            return op(*inputs)
        if (records and torch.is_grad_enabled()) or _has_tangent(inputs):
            return apply_direct(*inputs)
        return run_direct(*inputs)

    return eager


def _static_sizes(inputs, tensor_positions) -> tuple:
    """`inputs` with the sizes in their other arguments ints: under torch.jit.trace a tensor's sizes are 0-dim
    tensors (which the tracer follows), and an argument made of them (a transposed conv's input size, an instance
    norm's groups, its channel count) fails the tracer's record of the op (an internal assert) and the checks. The
    trace then holds them as constants, as it holds a conv's padding."""

    def static(value):
        if isinstance(value, (list, tuple)):
            return [int(n) if isinstance(n, torch.Tensor) else n for n in value]
        return int(value) if isinstance(value, torch.Tensor) else value

    return tuple(value if i in tensor_positions else static(value) for i, value in enumerate(inputs))


def _has_tangent(inputs) -> bool:
    """Whether forward-mode AD is on (a dual level entered: torch.autograd.forward_ad, or torch.func.jvp's) and one
    of `inputs` carries a tangent at its level: then the op's tangent is computed by its jvp (by the kernels: they
    see only primals). One attribute read otherwise."""
    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None for t in inputs)


def _is_tensor_type(schema_type) -> bool:
    if isinstance(schema_type, torch.OptionalType):
        schema_type = schema_type.getElementType()
    return isinstance(schema_type, torch.TensorType)


def _intercepted() -> bool:
    """Whether something may intercept ops: a torch function or dispatch mode (tracing, fake tensors, export,
    counting modes), a functorch transform, autocast, the profiler (which records ops by name) or torch.jit.trace
    (which records the op where it passes the dispatcher, else the aten ops it runs, shapes as tensors). Without any,
    and with plain tensors, the eager callers run the op's implementation and autograd Function directly, which
    computes the same and saves two Python round trips through the dispatcher (about 15 us a call, issue 19);
    otherwise the op runs."""
    return (
        torch._C._is_torch_function_mode_enabled()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_any_autocast_enabled()
        or torch._C._functorch.peek_interpreter_stack() is not None
        or torch.autograd.profiler._is_profiler_enabled
        or torch._C._get_tracing_state() is not None
    )


# ---------------------------------------------------------------------------------------------------------------
# Inductor: the ops' Triton launches in the compiled graph (issue 29, TCONV3D_INDUCTOR_KERNELS=1)
#
# Inductor calls an opaque op through the dispatcher and this module's Python (checks, choice, launch) on every
# call. With the setting, AOTAutograd's functionalization (FunctionalTensorMode, which runs after autograd, on
# the forward and the backward graph) instead runs the op's implementation on its fake tensors with the launches
# recorded (kernels/launch.traced, torch.library.wrap_triton), as torch.library.triton_op does: the graph holds
# the allocations, views and Triton kernels, and Inductor's generated code launches them itself. What the path
# cannot express (choice.inductor_refusal: the TMA and Gluon kernels, frames_before, the interpreter, ...; symbolic
# shapes; torch.export, which keeps ops whole) stays an opaque call. tconv3d.explain says which launches it takes.


_choice_pass = None  # keep_choices_in_cache_keys's pass once installed; False where it could not be


def keep_choices_in_cache_keys() -> None:
    """Make choice.decision_state part of Inductor's cache keys, once. AOTAutograd's cache keys a compiled graph
    on Dynamo's graph, which holds the tconv3d op whatever the rule below then does with it, so without this a
    graph compiled under one TCONV3D_KERNELS, TCONV3D_AUTOTUNE or tuning table (its launches handed over or not,
    at that table's tiles) can be reused under another (on the H200 a test compiled with TCONV3D_KERNELS=pointer
    kept the op call the same process's earlier compile under auto had made for a TMA launch; that cache is the
    likeliest reason: bench/NOTES.md). The carrier is a post-grad pass that does nothing and whose uuid (part of
    both caches' keys) is a hash of that state. Where the user has a post-grad pass of their own, that stays, with
    a warning instead."""
    global _choice_pass
    if _choice_pass is not None:
        return
    try:
        from torch._inductor import config as inductor_config
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # a torch without custom passes: nothing to carry the state
        _choice_pass = False
        return

    class ChoiceState(CustomGraphPass):
        def __call__(self, graph) -> None:
            return None

        def uuid(self) -> str:
            return hashlib.sha256(repr(choice.decision_state()).encode()).hexdigest()

    if inductor_config.post_grad_custom_post_pass is not None:
        warnings.warn(
            "tconv3d: TCONV3D_INDUCTOR_KERNELS=1 with a post_grad_custom_post_pass of your own: Inductor's caches "
            "may return a graph compiled under other tconv3d settings or tables (TORCHINDUCTOR_AUTOGRAD_CACHE=0 "
            "avoids that)",
            stacklevel=2,
        )
        _choice_pass = False
        return
    _choice_pass = inductor_config.post_grad_custom_post_pass = ChoiceState()


def _traceable(types, args) -> bool:
    """Whether the setting is on and the op's tensors are plain, on a device running compiled kernels (not the
    interpreter's), with int shapes."""
    if not settings.INDUCTOR_KERNELS or settings.INTERPRET:
        return False
    try:  # torch.export keeps ops whole (as it does torch.library.triton_op's)
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # a torch without the switch
        custom_triton_ops_decomposition_disabled = torch.compiler.is_exporting
    if custom_triton_ops_decomposition_disabled():
        return False
    if any(not (issubclass(t, (FakeTensor, FunctionalTensor)) or t is torch.Tensor) for t in types):
        return False  # a tensor subclass of its own: its dispatch decides
    for t in args:
        if isinstance(t, torch.Tensor):
            if not runs_triton(t):
                return False
            if any(isinstance(n, torch.SymInt) for n in (*t.shape, *t.stride(), t.storage_offset())):
                return False  # the launchers plan with ints
    return True


def _inductor_launches(name: str, implementation, refusal=lambda *args, **kwargs: None) -> None:
    """Under functionalization, run `implementation` with its launches recorded into the graph, unless
    `refusal(*args)` says why not (or _traceable does not hold); otherwise the op stays whole."""

    def rule(mode, op, types, args, kwargs):
        if settings.INDUCTOR_KERNELS and settings.TRITON_MISSING is None:  # set at run time (tests do) too
            keep_choices_in_cache_keys()
        if _traceable(types, args) and refusal(*args, **kwargs) is None:
            with mode, launch.traced():
                return implementation(*args, **kwargs)
        return mode.__torch_dispatch__(op, types, args, kwargs)

    torch.library.register_torch_dispatch(f"tconv3d::{name}", FunctionalTensorMode, rule, lib=_lib)


def _conv_refusal(direction: str, check):
    """choice.inductor_refusal for a convolution op, whose first two arguments are its launch's operands."""
    return lambda *args, **kwargs: choice.inductor_refusal(direction, check(*args, **kwargs), args[0], args[1])


# ---------------------------------------------------------------------------------------------------------------
# torch.func.vmap: the vmapped dimension folded into the batch


def _batching_rule(name: str, shared, size_argument: int | None = None) -> None:
    """Register the op's vmap rule. Where no tensor at the positions `shared` (the weight's and the bias's, which
    every sample shares) is vmapped, the vmapped dimension is folded into the batch of the others (a vmapped tensor's
    moved to the front, an unvmapped one expanded: a view where the vmapped dimension is outermost in memory, as
    vmap over a batch makes it) and the op runs once, with `size_argument`'s first entry (its output's batch)
    scaled to match. Otherwise (per-sample weights: an ensemble's; `shared` None: an output summed over the batch,
    the weight gradient's) the op runs once a sample, as the dispatcher's fallback would, without its warning."""
    op = getattr(torch.ops.tconv3d, name).default

    def rule(info, in_dims, *args):
        size = info.batch_size
        vmapped = {i: dim for i, dim in enumerate(in_dims) if isinstance(args[i], torch.Tensor) and dim is not None}
        if shared is not None and not any(i in vmapped for i in shared):
            args = list(args)
            for i, arg in enumerate(args):
                if isinstance(arg, torch.Tensor) and i not in shared:
                    arg = arg.movedim(vmapped[i], 0) if i in vmapped else arg.expand(size, *arg.shape)
                    args[i] = arg.flatten(0, 1)
            if size_argument is not None:
                args[size_argument] = [args[size_argument][0] * size, *args[size_argument][1:]]
            out = op(*args)
            if isinstance(out, tuple):
                return tuple(_unfolded(t, size) for t in out), (0,) * len(out)
            return _unfolded(out, size), 0
        outs = [
            op(*(arg.select(vmapped[i], sample) if i in vmapped else arg for i, arg in enumerate(args)))
            for sample in range(size)
        ]
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(parts) for parts in zip(*outs, strict=True)), (0,) * len(outs[0])
        return torch.stack(outs), 0

    torch.library.register_vmap(f"tconv3d::{name}", rule, lib=_lib)


def _unfolded(t: torch.Tensor, size: int) -> torch.Tensor:
    """t with its batch split into (size, the rest), on t's storage but not a view of t: the op's output under vmap
    is an autograd Function's, which callers modify in place (conv_transpose3d's bias, an in-place SiLU)."""
    view = t.unflatten(0, (size, -1))
    return on_storage(t, view.shape, view.stride(), view.storage_offset())


# ---------------------------------------------------------------------------------------------------------------
# forward


def _conv3d_fake(
    input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros", frames_before=None,
    channels_after=None,
):  # fmt: skip
    geom = check_conv3d(
        input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after
    )
    return empty_ndhwc(geom.output_shape(), like=input)


@_define(
    "conv3d(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups,"
    ' str padding_mode="zeros", Tensor? frames_before=None, Tensor? channels_after=None) -> Tensor',
    _conv3d_fake,
)
def conv3d(
    input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros", frames_before=None,
    channels_after=None,
):  # fmt: skip
    arguments = (input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after)

    def run():
        if not runs_triton(input):
            return _conv3d_in_torch_ops(*arguments)
        geom = check_conv3d(*arguments)
        return choice.launch("fwd", conv3d_fwd, geom, input, weight, bias, frames_before, channels_after=channels_after)

    tensors = (input, weight, bias, frames_before, channels_after)
    return _planned("fwd", tensors, (stride, padding, dilation), (groups, padding_mode), run)


def _conv3d_in_torch_ops(input, weight, bias, stride, padding, dilation, groups, *rest):
    """conv3d in torch's ops (aten's convolution, F.pad and torch.cat where aten cannot express the call)."""
    padding_mode, frames_before, channels_after = _trailing_arguments(rest)
    geom = check_conv3d(
        input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after
    )
    return aten.conv3d_fwd(input, weight, bias, frames_before, geom, channels_after)


def _trailing_arguments(rest, defaults=("zeros", None, None)) -> tuple:
    """The optional arguments at the end of an op's inputs (after dilation, or groups), with `defaults` for those
    the call left out: conv3d's (padding_mode, frames_before, channels_after) unless told otherwise."""
    return (*rest, *defaults[len(rest) :])


def _needs_grad(ctx, index: int) -> bool:
    """needs_input_grad[index] for an argument the call may have left to its default."""
    return len(ctx.needs_input_grad) > index and ctx.needs_input_grad[index]


def in_strides_of(grad: torch.Tensor, stride) -> torch.Tensor:
    """A parameter's gradient (or optimizer state: tconv3d.nn.match_optimizer_state) in exactly the parameter's
    strides, size-1 dims included: DDP's buckets and FSDP's reduce-scatter take it as it is, where a gradient whose
    strides differ even only in a size-1 dim (a 1x1x1 channels_last_3d weight's) is copied every step, with a
    warning from DDP. In the same memory order
    (the channels_last_3d weight tconv3d.nn keeps) this is a view; in another (a contiguous weight, as sharded
    models keep) one copy. Under torch.func's vmap (per-sample gradients) the gradient is returned as it is."""
    stride = tuple(stride)
    if grad.stride() == stride or _is_functorch_wrapper(grad):
        return grad
    if all(have == want for size, have, want in zip(grad.shape, grad.stride(), stride, strict=True) if size > 1):
        return grad.as_strided(grad.shape, stride)
    return torch.empty_strided(grad.shape, stride, dtype=grad.dtype, device=grad.device).copy_(grad)


def _split_prefix(grad, prefix_frames):
    """The gradient of torch.cat([frames_before, input], dim=2) -> (input's, frames_before's), as views."""
    if not prefix_frames:
        return grad, None
    return grad.narrow(2, prefix_frames, grad.shape[2] - prefix_frames), grad.narrow(2, 0, prefix_frames)


def _split_channels(grad, after_channels):
    """The gradient of torch.cat([input, channels_after], dim=1) -> (input's, channels_after's), as views."""
    if not after_channels:
        return grad, None
    first = grad.shape[1] - after_channels
    return grad.narrow(1, 0, first), grad.narrow(1, first, after_channels)


def _conv3d_setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, groups, *rest = inputs
    mode, frames_before, channels_after = _trailing_arguments(rest)
    # Each gradient needs only the other tensor(s); save nothing that no gradient will read.
    second_grad = any(t is not None and t.requires_grad for t in (frames_before, channels_after))
    ctx.save_for_backward(
        input if weight.requires_grad else None,
        weight if input.requires_grad or second_grad else None,
        frames_before if weight.requires_grad else None,
        channels_after if weight.requires_grad else None,
    )
    ctx.prefix_frames = frames_before.shape[2] if frames_before is not None else 0
    ctx.after_channels = channels_after.shape[1] if channels_after is not None else 0
    ctx.input_size, ctx.weight_size = list(input.shape), list(weight.shape)
    ctx.input_size[2] += ctx.prefix_frames  # the input gradient op differentiates the concatenation
    ctx.input_size[1] += ctx.after_channels
    ctx.weight_stride = weight.stride()
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.conv_args = (list(stride), list(padding), list(dilation), mode)
    ctx.groups = groups


def _conv3d_backward(ctx, grad_output):
    input, weight, frames_before, channels_after = ctx.saved_tensors
    grad_input = grad_weight = grad_bias = grad_frames_before = grad_channels_after = grad_concat = None
    needs = (
        ctx.needs_input_grad[0] or _needs_grad(ctx, 8) or _needs_grad(ctx, 9),
        ctx.needs_input_grad[1],
        ctx.has_bias and ctx.needs_input_grad[2],
    )
    if sum(needs) > 1 and grad_output.dim() == 5 and not _is_functorch_wrapper(grad_output):
        # A gradient of another layout (autograd's sum of a channels_last_3d one and an NCDHW one, a slice's
        # backward): laid out once here, not once by each gradient op that reads it.
        grad_output = grad_output.contiguous(memory_format=torch.channels_last_3d)
    if any(needs) and _plain_call(grad_output, weight, input, frames_before, channels_after):
        grads = iter(_gradients(ctx, needs, grad_output, weight, input, frames_before, channels_after))
        grad_concat, grad_weight, grad_bias = (next(grads) if need else None for need in needs)
    else:
        if needs[0]:
            grad_concat = call_conv3d_input_grad(
                grad_output, weight, ctx.input_size, *ctx.conv_args, ctx.groups, None
            )  # fmt: skip
        if needs[1]:
            grad_weight = call_conv3d_weight_grad(
                grad_output, input, ctx.weight_size, *ctx.conv_args, frames_before, ctx.groups, channels_after
            )
        if needs[2]:
            grad_bias = _summed_bias_grad(grad_output, ctx.bias_dtype)
    if grad_concat is not None:
        grad_input, grad_frames_before = _split_prefix(grad_concat, ctx.prefix_frames)
        grad_input, grad_channels_after = _split_channels(grad_input, ctx.after_channels)
    if grad_weight is not None:
        grad_weight = in_strides_of(grad_weight, ctx.weight_stride)
    grads = (grad_input, grad_weight, grad_bias, None, None, None, None, None, grad_frames_before, grad_channels_after)
    return grads[: len(ctx.needs_input_grad)]


def _plain_call(*tensors) -> bool:
    """Whether a backward's ops may run as one call here, as the eager callers run one op (`_register_autograd`):
    not traced or compiled, nothing intercepting ops, plain tensors, and no graph of the gradients recorded
    (create_graph=False, so no op's own autograd Function is needed)."""
    if torch.compiler.is_compiling() or torch.is_grad_enabled() or _intercepted():
        return False
    return all(t is None or _plain_tensor(t) for t in tensors)


def _plain_tensor(t: torch.Tensor) -> bool:
    """A tensor with no dispatch of its own: no subclass (DTensor, FakeTensor...), no functorch wrapper."""
    return type(t) in PLAIN_TENSORS and not _is_functorch_wrapper(t)


def _direct_or_op(implementation, *tensors):
    """An op's implementation itself where a call with `tensors` is plain (_plain_call), as a convolution's backward
    calls its own (_gradients): past the dispatcher and the dynamo-disable wrapper (~4 us a norm's backward on the
    host); else the op, through the dispatcher."""
    return implementation if _plain_call(*tensors) else getattr(torch.ops.tconv3d, implementation.__name__)


def _gradients(ctx, needs: tuple, grad_output, weight, input, frames_before, channels_after) -> tuple:
    """The gradients a convolution's backward needs (`needs`: the input's (the concatenation's), the weight's, the
    bias's), in that order, as the gradient ops and torch's sum compute them, in one call planned by all its
    arguments (plans.py): one key and one replay where the ops would each take theirs (issue 29: ~10 us of a small
    layer's backward on the host), with the bias gradient's two launches (split_k.channel_sums) among the plan's
    where torch's sum and cast ran outside it."""
    stride, padding, dilation, mode = ctx.conv_args

    def run():
        grads = []
        if needs[0]:
            grads.append(_input_grad(grad_output, weight, ctx.input_size, *ctx.conv_args, ctx.groups, None, None))
        if needs[1]:
            grads.append(_weight_grad(
                grad_output, input, ctx.weight_size, *ctx.conv_args, frames_before, ctx.groups, channels_after
            ))  # fmt: skip
        if needs[2]:
            grads.append(_bias_grad(grad_output, ctx.bias_dtype))
        return tuple(grads)

    tensors = (grad_output, weight, input, frames_before, channels_after)
    ints = (ctx.input_size, ctx.weight_size, stride, padding, dilation)
    return _planned("backward", tensors, ints, (mode, ctx.groups, *needs, str(ctx.bias_dtype)), run)


def _bias_grad(grad_output, dtype: torch.dtype) -> torch.Tensor:
    """A convolution's bias gradient: grad_output summed over all but its channels, in fp32, as `dtype`; by the
    kernels where the convolution's run (split_k.channel_sums), else by torch."""
    return channel_sums(grad_output, dtype) if runs_triton(grad_output) else _summed_bias_grad(grad_output, dtype)


def _summed_bias_grad(grad_output, dtype: torch.dtype) -> torch.Tensor:
    """The bias gradient by torch's sum: what a traced or intercepted backward records."""
    return grad_output.sum(dim=(0, 2, 3, 4), dtype=torch.float32).to(dtype)


def _or_zeros(tangent, primal):
    """An input's tangent for a jvp's term that needs one where the input has none: zeros like its primal (None
    where the input is None too)."""
    return tangent if tangent is not None or primal is None else torch.zeros_like(primal)


def _ndhwc_tangent(tangent):
    """A norm's tangent channels_last_3d, as its output (under torch.func's vmap, jacfwd's, as it is)."""
    return tangent if _is_functorch_wrapper(tangent) else tangent.contiguous(memory_format=torch.channels_last_3d)


def _summed(terms):
    """The sum of a jvp's terms (one or two, each a call of the op)."""
    terms = [term for term in terms if term is not None]
    return terms[0] if len(terms) == 1 else terms[0] + terms[1]


def _conv3d_jvp(inputs, tangents):
    # conv3d is linear in its input side (input, frames_before, channels_after, with the bias) and in the weight:
    # its tangent is the convolution of the input side's tangents (and the bias's) plus the convolution of the
    # input by the weight's tangent, each by the kernels.
    input, weight, bias, stride, padding, dilation, groups, *rest = inputs
    mode, frames_before, channels_after = _trailing_arguments(rest)
    t_input, t_weight, t_bias, *_, t_frames, t_after = (*tangents, *(None,) * (10 - len(tangents)))

    def conv(x, w, b, frames, after):
        return call_conv3d(x, w, b, stride, padding, dilation, groups, mode, frames, after)

    terms = [None, None]
    if t_input is not None or t_frames is not None or t_after is not None:
        terms[0] = conv(
            _or_zeros(t_input, input), weight, t_bias, _or_zeros(t_frames, frames_before),
            _or_zeros(t_after, channels_after),
        )  # fmt: skip
        t_bias = None
    if t_weight is not None:
        terms[1] = conv(input, t_weight, t_bias, frames_before, channels_after)
    elif terms[0] is None:  # the bias's tangent alone, broadcast
        geom = check_conv3d(input, weight, bias, stride, padding, dilation, groups, mode, frames_before, channels_after)
        terms[0] = empty_ndhwc(geom.output_shape(), like=input).copy_(t_bias.view(1, -1, 1, 1, 1))
    return _summed(terms)


call_conv3d = _register_autograd(
    "conv3d", conv3d, _conv3d_backward, _conv3d_setup_context, _conv3d_jvp, _conv3d_in_torch_ops
)
_inductor_launches("conv3d", conv3d, _conv_refusal("fwd", check_conv3d))
_batching_rule("conv3d", shared=(1, 2))


# ---------------------------------------------------------------------------------------------------------------
# input gradient


def _input_grad_fake(
    grad_output, weight, input_size, stride, padding, dilation, padding_mode="zeros", groups=1, channels_after=None,
    bias=None,
):  # fmt: skip
    geom = check_input_grad(
        grad_output, weight, input_size, stride, padding, dilation, padding_mode, groups, channels_after, bias
    )
    return empty_ndhwc(geom.input_shape(), like=grad_output)


# bias (one per input channel) is conv_transpose3d's, added in the kernels' epilogue.
@_define(
    "conv3d_input_grad(Tensor grad_output, Tensor weight, SymInt[] input_size, int[] stride, int[] padding,"
    ' int[] dilation, str padding_mode="zeros", int groups=1, Tensor? channels_after=None, Tensor? bias=None)'
    " -> Tensor",
    _input_grad_fake,
)
def conv3d_input_grad(
    grad_output, weight, input_size, stride, padding, dilation, padding_mode="zeros", groups=1, channels_after=None,
    bias=None,
):  # fmt: skip
    def run():
        return _input_grad(
            grad_output, weight, input_size, stride, padding, dilation, padding_mode, groups, channels_after, bias
        )

    ints = (input_size, stride, padding, dilation)
    return _planned("dgrad", (grad_output, weight, channels_after, bias), ints, (padding_mode, groups), run)


def _input_grad(
    grad_output, weight, input_size, stride, padding, dilation, padding_mode, groups, channels_after, bias
):  # fmt: skip
    """The input gradient op's arguments checked and its launches run (or torch's ops where the kernels do not)."""
    arguments = (
        grad_output, weight, input_size, stride, padding, dilation, padding_mode, groups, channels_after, bias
    )  # fmt: skip
    if not runs_triton(grad_output):
        return _input_grad_in_torch_ops(*arguments)
    geom = check_input_grad(*arguments)
    return choice.launch("dgrad", conv3d_dgrad, geom, grad_output, weight, channels_after=channels_after, bias=bias)


def _input_grad_in_torch_ops(grad_output, weight, input_size, stride, padding, dilation, *rest):
    """conv3d_input_grad in torch's ops (aten's convolution backward)."""
    padding_mode, groups, channels_after, bias = _trailing_arguments(rest, ("zeros", 1, None, None))
    geom = check_input_grad(
        grad_output, weight, input_size, stride, padding, dilation, padding_mode, groups, channels_after, bias
    )
    return aten.conv3d_dgrad(grad_output, weight, geom, channels_after, bias)


def _save_gradient_context(
    ctx, grad_output, other, frames_before, stride, padding, dilation, mode, groups, channels_after=None
):
    ctx.save_for_backward(grad_output, other, frames_before, channels_after)
    ctx.other_size, ctx.other_stride = list(other.shape), other.stride()
    ctx.prefix_frames = frames_before.shape[2] if frames_before is not None else 0
    ctx.after_channels = channels_after.shape[1] if channels_after is not None else 0
    ctx.conv_args = (list(stride), list(padding), list(dilation), mode)
    ctx.groups = groups


def _input_grad_setup_context(ctx, inputs, output):
    grad_output, weight, _size, stride, padding, dilation, *rest = inputs
    mode, groups, channels_after, bias = _trailing_arguments(rest, ("zeros", 1, None, None))
    _save_gradient_context(ctx, grad_output, weight, None, stride, padding, dilation, mode, groups, channels_after)
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _weight_grad_setup_context(ctx, inputs, output):
    grad_output, input, _size, stride, padding, dilation, *rest = inputs
    mode, frames_before, groups, channels_after = _trailing_arguments(rest, ("zeros", None, 1, None))
    _save_gradient_context(
        ctx, grad_output, input, frames_before, stride, padding, dilation, mode, groups, channels_after
    )


def _input_grad_backward(ctx, grad_grad_input):
    # grad_input = dgrad(grad_output, weight) is bilinear: its adjoint in grad_output is the forward
    # convolution, in weight the weight gradient with grad_grad_input standing for the input. With channels_after
    # (grad_output's second source) the first is split along C as the forward's input gradient is, and the second
    # is the two sources' weight gradients, each the weight's rows of its channels. The bias's is grad_grad_input's
    # sum over all but its channels, as a forward convolution's.
    grad_output, weight, _, channels_after = ctx.saved_tensors
    stride, padding, dilation, mode = ctx.conv_args
    d_grad_output = d_weight = d_channels_after = d_bias = None
    if ctx.needs_input_grad[0] or _needs_grad(ctx, 8):
        d_concat = call_conv3d(grad_grad_input, weight, None, stride, padding, dilation, ctx.groups, mode, None, None)
        d_grad_output, d_channels_after = _split_channels(d_concat, ctx.after_channels)
    if ctx.needs_input_grad[1]:
        d_weight = _weight_grad_of_rows(ctx, grad_output, channels_after, grad_grad_input)
        d_weight = in_strides_of(d_weight, ctx.other_stride)  # the weight of conv_transpose3d is a parameter
    if ctx.bias_dtype is not None and ctx.needs_input_grad[9]:  # by the kernels in a plain call, else torch's sum
        bias_grad = _bias_grad if _plain_call(grad_grad_input) else _summed_bias_grad
        d_bias = bias_grad(grad_grad_input, ctx.bias_dtype)
    grads = (d_grad_output, d_weight, None, None, None, None, None, None, d_channels_after, d_bias)
    return grads[: len(ctx.needs_input_grad)]


def _weight_grad_of_rows(ctx, grad_output, channels_after, input):
    """The weight gradient of a convolution of `input` whose output gradient is grad_output, followed along C by
    channels_after where given: one weight-gradient op per source, each its rows of the weight's (a concatenation
    of two weight-sized gradients, not of the activations); grouped, the activations concatenated."""
    if channels_after is None or ctx.groups > 1:
        if channels_after is not None:
            grad_output = torch.cat([grad_output, channels_after], dim=1)
        size = ctx.other_size
        return call_conv3d_weight_grad(grad_output, input, size, *ctx.conv_args, None, ctx.groups, None)
    rows = []
    for source in (grad_output, channels_after):
        size = [source.shape[1], *ctx.other_size[1:]]
        rows.append(call_conv3d_weight_grad(source, input, size, *ctx.conv_args, None, 1, None))
    return torch.cat(rows, dim=0)


def _input_grad_jvp(inputs, tangents):
    # Linear in grad_output (with its channels_after and the bias) and in the weight, as the backward above says.
    grad_output, weight, input_size, stride, padding, dilation, *rest = inputs
    mode, groups, channels_after, bias = _trailing_arguments(rest, ("zeros", 1, None, None))
    t_grad, t_weight, *_, t_after, t_bias = (*tangents, *(None,) * (10 - len(tangents)))

    def dgrad(grad, w, after, b):
        return call_conv3d_input_grad(grad, w, input_size, stride, padding, dilation, mode, groups, after, b)

    terms = [None, None]
    if t_grad is not None or t_after is not None:
        terms[0] = dgrad(_or_zeros(t_grad, grad_output), weight, _or_zeros(t_after, channels_after), t_bias)
        t_bias = None
    if t_weight is not None:
        terms[1] = dgrad(grad_output, t_weight, channels_after, t_bias)
    elif terms[0] is None:  # the bias's tangent alone, broadcast
        geom = check_input_grad(
            grad_output, weight, input_size, stride, padding, dilation, mode, groups, channels_after, bias
        )
        terms[0] = empty_ndhwc(geom.input_shape(), like=grad_output).copy_(t_bias.view(1, -1, 1, 1, 1))
    return _summed(terms)


call_conv3d_input_grad = _register_autograd(
    "conv3d_input_grad", conv3d_input_grad, _input_grad_backward, _input_grad_setup_context, _input_grad_jvp,
    _input_grad_in_torch_ops,
)  # fmt: skip
_inductor_launches("conv3d_input_grad", conv3d_input_grad, _conv_refusal("dgrad", check_input_grad))
_batching_rule("conv3d_input_grad", shared=(1, 9), size_argument=2)


# ---------------------------------------------------------------------------------------------------------------
# weight gradient


def _weight_grad_fake(
    grad_output, input, weight_size, stride, padding, dilation, padding_mode="zeros", frames_before=None, groups=1,
    channels_after=None,
):  # fmt: skip
    geom = check_weight_grad(
        grad_output, input, weight_size, stride, padding, dilation, padding_mode, frames_before, groups,
        channels_after,
    )  # fmt: skip
    return empty_ndhwc(geom.weight_shape(), like=input)


@_define(
    "conv3d_weight_grad(Tensor grad_output, Tensor input, SymInt[] weight_size, int[] stride, int[] padding,"
    ' int[] dilation, str padding_mode="zeros", Tensor? frames_before=None, int groups=1,'
    " Tensor? channels_after=None) -> Tensor",
    _weight_grad_fake,
)
def conv3d_weight_grad(
    grad_output, input, weight_size, stride, padding, dilation, padding_mode="zeros", frames_before=None, groups=1,
    channels_after=None,
):  # fmt: skip
    def run():
        return _weight_grad(
            grad_output, input, weight_size, stride, padding, dilation, padding_mode, frames_before, groups,
            channels_after,
        )  # fmt: skip

    ints = (weight_size, stride, padding, dilation)
    tensors = (grad_output, input, frames_before, channels_after)
    return _planned("wgrad", tensors, ints, (padding_mode, groups), run)


def _weight_grad(
    grad_output, input, weight_size, stride, padding, dilation, padding_mode, frames_before, groups, channels_after
):  # fmt: skip
    """The weight gradient op's arguments checked and its launches run (or torch's ops where the kernels do not)."""
    arguments = (
        grad_output, input, weight_size, stride, padding, dilation, padding_mode, frames_before, groups, channels_after
    )  # fmt: skip
    if not runs_triton(input):
        return _weight_grad_in_torch_ops(*arguments)
    geom = check_weight_grad(*arguments)
    return choice.launch("wgrad", conv3d_wgrad, geom, grad_output, input, frames_before, channels_after=channels_after)


def _weight_grad_in_torch_ops(grad_output, input, weight_size, stride, padding, dilation, *rest):
    """conv3d_weight_grad in torch's ops (aten's convolution backward)."""
    padding_mode, frames_before, groups, channels_after = _trailing_arguments(rest, ("zeros", None, 1, None))
    geom = check_weight_grad(
        grad_output, input, weight_size, stride, padding, dilation, padding_mode, frames_before, groups,
        channels_after,
    )  # fmt: skip
    return aten.conv3d_wgrad(grad_output, input, frames_before, geom, channels_after)


def _weight_grad_backward(ctx, grad_grad_weight):
    # grad_weight = wgrad(grad_output, input) is bilinear: its adjoint in grad_output is the forward convolution
    # with grad_grad_weight as the weight, in input the input gradient through grad_grad_weight.
    grad_output, input, frames_before, channels_after = ctx.saved_tensors
    stride, padding, dilation, mode = ctx.conv_args
    d_grad_output = d_input = d_frames_before = d_channels_after = None
    if ctx.needs_input_grad[0]:
        d_grad_output = call_conv3d(
            input, grad_grad_weight, None, stride, padding, dilation, ctx.groups, mode, frames_before, channels_after
        )
    if ctx.needs_input_grad[1] or _needs_grad(ctx, 7) or _needs_grad(ctx, 9):
        concat_size = list(ctx.other_size)
        concat_size[2] += ctx.prefix_frames
        concat_size[1] += ctx.after_channels
        d_concat = call_conv3d_input_grad(grad_output, grad_grad_weight, concat_size, *ctx.conv_args, ctx.groups, None)
        d_input, d_frames_before = _split_prefix(d_concat, ctx.prefix_frames)
        d_input, d_channels_after = _split_channels(d_input, ctx.after_channels)
    grads = (d_grad_output, d_input, None, None, None, None, None, d_frames_before, None, d_channels_after)
    return grads[: len(ctx.needs_input_grad)]


def _weight_grad_jvp(inputs, tangents):
    # Linear in grad_output and in the input side (input, frames_before, channels_after).
    grad_output, input, weight_size, stride, padding, dilation, *rest = inputs
    mode, frames_before, groups, channels_after = _trailing_arguments(rest, ("zeros", None, 1, None))
    t_grad, t_input, *_, t_frames, _, t_after = (*tangents, *(None,) * (10 - len(tangents)))

    def wgrad(grad, x, frames, after):
        return call_conv3d_weight_grad(grad, x, weight_size, stride, padding, dilation, mode, frames, groups, after)

    terms = [None, None]
    if t_grad is not None:
        terms[0] = wgrad(t_grad, input, frames_before, channels_after)
    if t_input is not None or t_frames is not None or t_after is not None:
        terms[1] = wgrad(
            grad_output, _or_zeros(t_input, input), _or_zeros(t_frames, frames_before),
            _or_zeros(t_after, channels_after),
        )  # fmt: skip
    return _summed(terms)


call_conv3d_weight_grad = _register_autograd(
    "conv3d_weight_grad", conv3d_weight_grad, _weight_grad_backward, _weight_grad_setup_context, _weight_grad_jvp,
    _weight_grad_in_torch_ops,
)  # fmt: skip
_inductor_launches("conv3d_weight_grad", conv3d_weight_grad, _conv_refusal("wgrad", check_weight_grad))
_batching_rule("conv3d_weight_grad", shared=None)


# ---------------------------------------------------------------------------------------------------------------
# group norm (instance norm = groups == channels), optionally with an activation fused (SiLU, ReLU, leaky ReLU of
# slope negative_slope, or PReLU of weight activation_weight: geometry.NORM_ACTIVATIONS)


def _group_norm_fake(
    input, weight, bias, groups, eps, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    check_group_norm(input, weight, bias, groups, activation, channels_after, activation_weight)
    stats = input.new_empty((input.shape[0], groups), dtype=torch.float32)
    return empty_ndhwc(_concatenated_shape(input, channels_after), like=input), stats, stats.clone()


def _concatenated_shape(input, channels_after) -> tuple:
    """The shape of torch.cat([input, channels_after], dim=1) (input's without channels_after)."""
    extra = channels_after.shape[1] if channels_after is not None else 0
    return (input.shape[0], input.shape[1] + extra, *input.shape[2:])


@_define(
    'group_norm(Tensor input, Tensor? weight, Tensor? bias, int groups, float eps, str activation="none",'
    " Tensor? channels_after=None, float negative_slope=0.01, Tensor? activation_weight=None)"
    " -> (Tensor, Tensor, Tensor)",
    _group_norm_fake,
)
def group_norm(
    input, weight, bias, groups, eps, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    def run():
        if not runs_triton(input):
            return _group_norm_in_torch_ops(
                input, weight, bias, groups, eps, activation, channels_after, negative_slope, activation_weight
            )  # fmt: skip
        check_group_norm(input, weight, bias, groups, activation, channels_after, activation_weight)
        slope = _slope(negative_slope, activation_weight)
        return group_norm_fwd(input, weight, bias, groups, eps, activation, channels_after, slope)

    scalars = (groups, eps, activation, negative_slope)
    return _planned("group_norm", (input, weight, bias, channels_after, activation_weight), (), scalars, run)


def _slope(negative_slope, activation_weight):
    """What the kernels and aten's twin take as the activation's slope: a PReLU's weight, else the leaky ReLU's
    negative_slope (read by no other activation)."""
    return activation_weight if activation_weight is not None else negative_slope


def _group_norm_in_torch_ops(
    input, weight, bias, groups, eps, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    """group_norm in torch's ops (the kernels' formula, fp32), over the concatenation with channels_after."""
    check_group_norm(input, weight, bias, groups, activation, channels_after, activation_weight)
    whole = cat_channels(input, channels_after)
    slope = _slope(negative_slope, activation_weight)
    return aten.group_norm_fwd(whole, weight, bias, groups, eps, activation, slope)


def _norm_backward_fake(input, channels_after=None, grad_dtype=torch.float32):
    """What a norm's backward returns: the input gradient (channels_last_3d; of the concatenation with
    channels_after) and per-channel weight and bias gradients of `grad_dtype`."""
    shape = _concatenated_shape(input, channels_after)
    channels = input.new_empty((shape[1],), dtype=grad_dtype)
    return empty_ndhwc(shape, like=input), channels, channels.clone()


def _backward_differentiated(*tensors) -> bool:
    """Whether a norm's backward must itself be differentiable (its kernels' backward op is not): a gradient graph
    recorded (create_graph=True: grad mode is on inside the backward; a gradient penalty, double backward), a
    torch.func transform over it (grad of grad, jvp of grad), or a tangent on its arguments (forward over reverse
    by forward_ad)."""
    return torch.is_grad_enabled() or torch._C._functorch.peek_interpreter_stack() is not None or _has_tangent(tensors)


def varying(f, args, positions):
    """f as a function of the arguments at `positions` alone, the others held at `args`' (what torch.func's vjp and
    jvp differentiate: tensors only, each one varied)."""

    def of(*values):
        call = list(args)
        for i, value in zip(positions, values, strict=True):
            call[i] = value
        return f(*call)

    return of


def _vjp_of(forward, grad_output, *inputs) -> list:
    """The gradients of forward(*inputs) (a norm's forward in torch ops, aten's) along grad_output, None for the
    inputs that are None: torch's own differentiable ops, recomputed from the saved inputs, where a norm's backward
    is itself differentiated."""
    present = [i for i, t in enumerate(inputs) if t is not None]
    _, vjp = torch.func.vjp(varying(forward, inputs, present), *(inputs[i] for i in present))
    grads = [None] * len(inputs)
    for i, grad in zip(present, vjp(grad_output), strict=True):
        grads[i] = grad
    return grads


def _needed(ctx, grads) -> tuple:
    """An autograd Function's gradients, None where not needed, as many as its call's inputs."""
    grads = (*grads, *(None,) * len(ctx.needs_input_grad))[: len(ctx.needs_input_grad)]
    return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad, strict=True))


def _norm_input_grads(ctx, grad_input, grad_weight, grad_bias, weight, bias_dtype):
    """A norm's autograd gradients for (input, weight, bias, the rest): the parameter gradients in the parameters'
    dtypes (`bias_dtype`: None without a bias), None where not needed."""
    grad_weight = grad_weight.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    grad_bias = grad_bias.to(bias_dtype) if bias_dtype is not None and ctx.needs_input_grad[2] else None
    grads = (grad_input if ctx.needs_input_grad[0] else None, grad_weight, grad_bias)
    return (grads + (None,) * len(ctx.needs_input_grad))[: len(ctx.needs_input_grad)]


def _group_norm_backward_fake(
    grad_output, input, mean, rstd, weight, bias, groups, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    # the PReLU weight's gradient: of its shape and dtype, None without one
    slope_grad = torch.empty_like(activation_weight) if activation_weight is not None else None
    return (*_norm_backward_fake(input, channels_after, parameter_grad_dtype(weight)), slope_grad)


@_define(
    "group_norm_backward(Tensor grad_output, Tensor input, Tensor mean, Tensor rstd, Tensor? weight, Tensor? bias,"
    ' int groups, str activation="none", Tensor? channels_after=None, float negative_slope=0.01,'
    " Tensor? activation_weight=None) -> (Tensor, Tensor, Tensor, Tensor?)",
    _group_norm_backward_fake,
)
def group_norm_backward(
    grad_output, input, mean, rstd, weight, bias, groups, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    """(the input's gradient, the weight's, the bias's, the PReLU weight's: None without one)."""
    slope = _slope(negative_slope, activation_weight)

    def run():
        if not runs_triton(input):
            return _group_norm_backward_in_torch_ops(
                grad_output, input, mean, rstd, weight, bias, groups, activation, channels_after, negative_slope,
                activation_weight,
            )  # fmt: skip
        return group_norm_bwd(grad_output, input, mean, rstd, weight, bias, groups, activation, channels_after, slope)

    tensors = (grad_output, input, mean, rstd, weight, bias, channels_after, activation_weight)
    return _planned("group_norm_backward", tensors, (), (groups, activation, negative_slope), run)


def _group_norm_backward_in_torch_ops(
    grad_output, input, mean, rstd, weight, bias, groups, activation="none", channels_after=None, negative_slope=0.01,
    activation_weight=None,
):  # fmt: skip
    whole = cat_channels(input, channels_after)
    slope = _slope(negative_slope, activation_weight)
    return aten.group_norm_bwd(grad_output, whole, mean, rstd, weight, bias, groups, activation, slope)


# group_norm's optional trailing arguments' defaults: activation, channels_after, negative_slope, activation_weight
GROUP_NORM_DEFAULTS = ("none", None, 0.01, None)


def _group_norm_setup_context(ctx, inputs, output):
    input, weight, bias, groups, eps, *rest = inputs
    activation, channels_after, negative_slope, activation_weight = _trailing_arguments(rest, GROUP_NORM_DEFAULTS)
    _, mean, rstd = output
    # The bias's gradient reads none of it, and the input's only through a fused activation (its input recomputed):
    # saved only there, as the conv saves only what a gradient reads.
    saved_bias = bias if activation != "none" else None
    ctx.save_for_backward(input, mean, rstd, weight, saved_bias, channels_after, activation_weight)
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.groups, ctx.eps, ctx.activation, ctx.negative_slope = groups, eps, activation, negative_slope
    ctx.after_channels = channels_after.shape[1] if channels_after is not None else 0
    # The statistics' gradients stay None where nothing downstream read them (nearly always): autograd would make
    # zeros of both, two fills a backward (H200 run 11's trace of a GroupNorm backward).
    ctx.set_materialize_grads(False)


def _group_norm_backward(ctx, grad_output, grad_mean, grad_rstd):
    input, mean, rstd, weight, bias, channels_after, activation_weight = ctx.saved_tensors
    statistics = grad_mean is not None or grad_rstd is not None
    if grad_output is None and not statistics:
        return (None,) * len(ctx.needs_input_grad)
    if statistics or _backward_differentiated(grad_output, input, weight, bias, channels_after, activation_weight):
        # In torch's ops: a backward itself differentiated, or gradients through the mean and rstd too, which the
        # kernels' backward does not take (torch's native_group_norm takes them the same way)
        if bias is None and ctx.bias_dtype is not None:  # not saved: any values give the same gradients
            bias = input.new_zeros(input.shape[1] + ctx.after_channels, dtype=ctx.bias_dtype)
        outputs = (grad_output, grad_mean, grad_rstd)

        def forward(input, weight, bias, channels_after, activation_weight):
            y, mean, rstd = _group_norm_in_torch_ops(
                input, weight, bias, ctx.groups, ctx.eps, ctx.activation, channels_after, ctx.negative_slope,
                activation_weight,
            )  # fmt: skip
            return tuple(t for t, g in zip((y, mean, rstd), outputs, strict=True) if g is not None)

        given = tuple(g for g in outputs if g is not None)
        grads = _vjp_of(forward, given, input, weight, bias, channels_after, activation_weight)
        return _needed(ctx, (*grads[:3], None, None, None, grads[3], None, grads[4]))
    tensors = (grad_output, input, mean, rstd, weight, bias, channels_after, activation_weight)
    grad_input, grad_weight, grad_bias, grad_slope = _direct_or_op(group_norm_backward, *tensors)(
        grad_output, input, mean, rstd, weight, bias, ctx.groups, ctx.activation, channels_after, ctx.negative_slope,
        activation_weight,
    )  # fmt: skip
    grad_input, grad_channels_after = _split_channels(grad_input, ctx.after_channels)
    grads = _norm_input_grads(ctx, grad_input, grad_weight, grad_bias, weight, ctx.bias_dtype)
    if _needs_grad(ctx, 6):  # channels_after's (a view of the concatenation's gradient, as the input's)
        grads = (*grads[:6], grad_channels_after, *grads[7:])
    if _needs_grad(ctx, 8):  # the PReLU weight's
        grads = (*grads[:8], grad_slope)
    return grads


def _group_norm_jvp(inputs, tangents):
    # The tangents of (y, mean, rstd) in torch ops (aten.group_norm_jvp), over the concatenation with channels_after.
    input, weight, bias, groups, eps, *rest = inputs
    activation, channels_after, negative_slope, activation_weight = _trailing_arguments(rest, GROUP_NORM_DEFAULTS)
    t_input, t_weight, t_bias, _, _, _, t_after, _, t_slope = (*tangents, *(None,) * (9 - len(tangents)))
    whole = cat_channels(input, channels_after)
    t_whole = cat_channels(
        _or_zeros(t_input, input), _or_zeros(t_after, channels_after)
    )  # fmt: skip
    slope = _slope(negative_slope, activation_weight)
    t_y, t_mean, t_rstd = aten.group_norm_jvp(
        whole, t_whole, weight, bias, t_weight, t_bias, groups, eps, activation, slope, t_slope
    )  # fmt: skip
    return _ndhwc_tangent(t_y), t_mean, t_rstd


call_group_norm = _register_autograd(
    "group_norm", group_norm, _group_norm_backward, _group_norm_setup_context, _group_norm_jvp,
    _group_norm_in_torch_ops,
)  # fmt: skip
_inductor_launches("group_norm", group_norm)
_inductor_launches("group_norm_backward", group_norm_backward)
_batching_rule("group_norm", shared=(1, 2, 8))


# ---------------------------------------------------------------------------------------------------------------
# rms norm: each voxel's channels divided by their root mean square (eps added under the root, or with `clamp` the
# root clamped to at least eps), then affine, optionally an activation (SiLU or ReLU)


def _rms_norm_fake(input, weight, bias, eps, activation="none", clamp=False):
    check_rms_norm(input, weight, bias, eps, activation)
    return empty_ndhwc(input.shape, like=input)


@_define(
    'rms_norm(Tensor input, Tensor? weight, Tensor? bias, float eps, str activation="none", bool clamp=False)'
    " -> Tensor",
    _rms_norm_fake,
)
def rms_norm(input, weight, bias, eps, activation="none", clamp=False):
    def run():
        if not runs_triton(input):
            return _rms_norm_in_torch_ops(input, weight, bias, eps, activation, clamp)
        check_rms_norm(input, weight, bias, eps, activation)
        return rms_norm_fwd(input, weight, bias, eps, activation, clamp)

    return _planned("rms_norm", (input, weight, bias), (), (eps, activation, clamp), run)


def _rms_norm_in_torch_ops(input, weight, bias, eps, activation="none", clamp=False):
    """rms_norm in torch's ops (the kernel's formula, fp32)."""
    check_rms_norm(input, weight, bias, eps, activation)
    return aten.rms_norm_fwd(input, weight, bias, eps, activation, clamp)


def _rms_norm_backward_fake(grad_output, input, weight, bias, eps, activation="none", clamp=False):
    return _norm_backward_fake(input, grad_dtype=parameter_grad_dtype(weight))


@_define(
    "rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, float eps,"
    ' str activation="none", bool clamp=False) -> (Tensor, Tensor, Tensor)',
    _rms_norm_backward_fake,
)
def rms_norm_backward(grad_output, input, weight, bias, eps, activation="none", clamp=False):
    def run():
        if not runs_triton(input):
            return _rms_norm_backward_in_torch_ops(grad_output, input, weight, bias, eps, activation, clamp)
        return rms_norm_bwd(grad_output, input, weight, bias, eps, activation, clamp)

    tensors = (grad_output, input, weight, bias)
    return _planned("rms_norm_backward", tensors, (), (eps, activation, clamp), run)


def _rms_norm_backward_in_torch_ops(grad_output, input, weight, bias, eps, activation="none", clamp=False):
    return aten.rms_norm_bwd(grad_output, input, weight, bias, eps, activation, clamp)


def _rms_norm_setup_context(ctx, inputs, output):
    input, weight, bias, eps, *options = inputs
    ctx.save_for_backward(input, weight, bias)
    ctx.eps, ctx.options = eps, options  # activation and clamp, as the call passed them


def _rms_norm_backward(ctx, grad_output):
    input, weight, bias = ctx.saved_tensors
    if _backward_differentiated(grad_output, input, weight, bias):
        activation, clamp = _trailing_arguments(ctx.options, ("none", False))

        def forward(input, weight, bias):
            return _rms_norm_in_torch_ops(input, weight, bias, ctx.eps, activation, clamp)

        return _needed(ctx, _vjp_of(forward, grad_output, input, weight, bias))
    grads = _direct_or_op(rms_norm_backward, grad_output, input, weight, bias)(
        grad_output, input, weight, bias, ctx.eps, *ctx.options
    )
    return _norm_input_grads(ctx, *grads, weight, bias.dtype if bias is not None else None)


def _rms_norm_jvp(inputs, tangents):
    # The tangent in torch ops (aten.rms_norm_jvp).
    input, weight, bias, eps, *options = inputs
    t_input, t_weight, t_bias = (*tangents, None, None, None)[:3]
    activation, clamp = _trailing_arguments(options, ("none", False))
    t_y = aten.rms_norm_jvp(input, _or_zeros(t_input, input), weight, bias, t_weight, t_bias, eps, activation, clamp)
    return _ndhwc_tangent(t_y)


call_rms_norm = _register_autograd(
    "rms_norm", rms_norm, _rms_norm_backward, _rms_norm_setup_context, _rms_norm_jvp, _rms_norm_in_torch_ops
)
_inductor_launches("rms_norm", rms_norm)
_inductor_launches("rms_norm_backward", rms_norm_backward)
_batching_rule("rms_norm", shared=(1, 2))


# ---------------------------------------------------------------------------------------------------------------
# linear upsampling by 2 (or 1) along D, H and W: F.interpolate(mode="trilinear", align_corners=False). Linear in
# its input: the gradient op is its adjoint, each the other's backward, and the tangent the op on the tangent.


def _upsample_linear_fake(input, factors):
    check_upsample_linear(input, factors)
    return empty_ndhwc((*input.shape[:2], *(n * f for n, f in zip(input.shape[2:], factors, strict=True))), input)


@_define("upsample_linear(Tensor input, int[] factors) -> Tensor", _upsample_linear_fake)
def upsample_linear(input, factors):
    def run():
        if not runs_triton(input):
            return _upsample_linear_in_torch_ops(input, factors)
        check_upsample_linear(input, factors)
        return upsample_linear_fwd(input, factors)

    return _planned("upsample_linear", (input,), (factors,), (), run)


def _upsample_linear_backward_fake(grad_output, input_size, factors):
    check_upsample_linear(grad_output, factors, input_size)
    return empty_ndhwc(input_size, grad_output)


@_define(
    "upsample_linear_backward(Tensor grad_output, SymInt[] input_size, int[] factors) -> Tensor",
    _upsample_linear_backward_fake,
)
def upsample_linear_backward(grad_output, input_size, factors):
    def run():
        if not runs_triton(grad_output):
            return _upsample_linear_backward_in_torch_ops(grad_output, input_size, factors)
        check_upsample_linear(grad_output, factors, input_size)
        return upsample_linear_bwd(grad_output, input_size, factors)

    return _planned("upsample_linear_backward", (grad_output,), (input_size, factors), (), run)


def _upsample_linear_setup_context(ctx, inputs, output):
    input, ctx.factors = inputs
    ctx.input_size = list(input.shape)


def _upsample_linear_backward_setup_context(ctx, inputs, output):
    _, _, ctx.factors = inputs


def _upsample_linear_in_torch_ops(input, factors):
    check_upsample_linear(input, factors)
    return aten.upsample_linear_fwd(input, factors)


def _upsample_linear_backward_in_torch_ops(grad_output, input_size, factors):
    check_upsample_linear(grad_output, factors, input_size)
    return aten.upsample_linear_bwd(grad_output, input_size, factors)


call_upsample_linear = _register_autograd(
    "upsample_linear", upsample_linear,
    lambda ctx, grad: (call_upsample_linear_backward(grad, ctx.input_size, ctx.factors), None),
    _upsample_linear_setup_context,
    lambda inputs, tangents: call_upsample_linear(tangents[0], inputs[1]),
    _upsample_linear_in_torch_ops,
)  # fmt: skip
call_upsample_linear_backward = _register_autograd(
    "upsample_linear_backward", upsample_linear_backward,
    lambda ctx, grad: (call_upsample_linear(grad, ctx.factors), None, None),
    _upsample_linear_backward_setup_context,
    lambda inputs, tangents: call_upsample_linear_backward(tangents[0], inputs[1], inputs[2]),
    _upsample_linear_backward_in_torch_ops,
)  # fmt: skip
_inductor_launches("upsample_linear", upsample_linear)
_inductor_launches("upsample_linear_backward", upsample_linear_backward)
_batching_rule("upsample_linear", shared=())
_batching_rule("upsample_linear_backward", shared=(), size_argument=1)


# ---------------------------------------------------------------------------------------------------------------
# autocast: conv3d runs in the autocast dtype, as aten's conv3d does (torch.library.register_autocast would pin
# one dtype at registration; this follows the region's, bf16 or fp16).


def _cast_for_autocast(value, device_type: str, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == device_type:
        return value if value.dtype == torch.float64 else value.to(dtype)
    return value


def _autocast(op: str, device_type: str):
    def kernel(_dispatch_keys, *args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return getattr(torch.ops.tconv3d, op).default(*(_cast_for_autocast(a, device_type, dtype) for a in args))

    return kernel


for _device_type, _dispatch_key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    for _op in ("conv3d", "conv3d_input_grad"):  # the input gradient is also conv_transpose3d's forward
        _lib.impl(_op, _autocast(_op, _device_type), _dispatch_key, with_keyset=True)


# ---------------------------------------------------------------------------------------------------------------
# FLOPs: torch.utils.flop_counter's FlopCounterMode counts the convolutions as it counts aten's (the norms and the
# upsampling, as torch's, count none)


def _convolution_flops(output_shape, weight_shape) -> int:
    """A convolution's FLOPs as torch.utils.flop_counter counts aten.convolution's and its backward's
    (conv_flop_count): 2 a multiply-add, one per output voxel (an input gradient's: grad_output's, as a transposed
    convolution's input), output channel, input channel of its group and tap; the same for each direction."""
    batch = output_shape[0] if len(output_shape) == 5 else 1
    return 2 * batch * math.prod(output_shape[-3:]) * math.prod(weight_shape)


@register_flop_formula(torch.ops.tconv3d.conv3d)
def _conv3d_flops(input, weight, *args, out_shape=None, **kwargs) -> int:
    return _convolution_flops(out_shape, weight)


@register_flop_formula(torch.ops.tconv3d.conv3d_input_grad)
def _input_grad_flops(grad_output, weight, *args, out_shape=None, **kwargs) -> int:
    return _convolution_flops(grad_output, weight)


@register_flop_formula(torch.ops.tconv3d.conv3d_weight_grad)
def _weight_grad_flops(grad_output, input, weight_size, *args, out_shape=None, **kwargs) -> int:
    return _convolution_flops(grad_output, weight_size)


# ---------------------------------------------------------------------------------------------------------------
# Exporters: each op in torch's own ops, for a graph that must run without tconv3d


def decompositions() -> dict:
    """Each tconv3d op (its overload) mapped to itself in torch's own ops: aten's convolutions, F.pad and
    torch.cat where aten cannot express the call (padding modes, frames_before, channels_after), the norms' and
    the upsampling's formulas in fp32 as the kernels compute them, nothing written in place (a decomposition runs
    below functionalization). The table for `ExportedProgram.run_decompositions(tconv3d.ops.decompositions())`:
    a converted model's exported graph then holds no tconv3d op, for runtimes without tconv3d (torch.onnx.export
    of that program, an AOTInductor package run where tconv3d is not installed). torch.export and AOTInductor
    otherwise keep the ops whole, running tconv3d's kernels.

    Not entered into torch's global decomposition table, where torch.onnx.export would find it by itself: fake
    tensors of symbolic sizes prefer that table to an op's own fake, so every compiled graph of dynamic shapes
    would take the ops' output strides from the torch ops instead (an opcheck of the ops' fakes fails so)."""
    in_torch_ops = {
        "conv3d": _conv3d_in_torch_ops,
        "conv3d_input_grad": _input_grad_in_torch_ops,
        "conv3d_weight_grad": _weight_grad_in_torch_ops,
        "group_norm": _group_norm_in_torch_ops,
        "group_norm_backward": _group_norm_backward_in_torch_ops,
        "rms_norm": _rms_norm_in_torch_ops,
        "rms_norm_backward": _rms_norm_backward_in_torch_ops,
        "upsample_linear": _upsample_linear_in_torch_ops,
        "upsample_linear_backward": _upsample_linear_backward_in_torch_ops,
    }
    return {getattr(torch.ops.tconv3d, name).default: fn for name, fn in in_torch_ops.items()}


if settings.INDUCTOR_KERNELS:  # before the first compile computes its cache keys
    keep_choices_in_cache_keys()
