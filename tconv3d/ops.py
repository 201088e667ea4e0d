"""The torch.library custom ops, their fake implementations and autograd: the one place tconv3d meets PyTorch.

    torch.ops.tconv3d.conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros")
    torch.ops.tconv3d.conv3d_input_grad(grad_output, weight, input_size, stride, padding, dilation, padding_mode)
    torch.ops.tconv3d.conv3d_weight_grad(grad_output, input, weight_size, stride, padding, dilation, padding_mode)

padding is 3 ints (symmetric) or 6 (d_front, d_back, h_top, h_bottom, w_left, w_right); padding_mode one of
"zeros", "replicate", "reflect", "circular" (F.pad's meaning, done inside the kernels). Every result is
channels_last_3d, and the fake implementations say so, so torch.compile plans no layout copies around them.
The two gradient ops are differentiable too (each is linear in both tensor arguments), so double backward works.
"""

from __future__ import annotations

import contextlib

import torch

from . import aten, choice, settings
from .conv_dgrad import conv3d_dgrad
from .conv_fwd import conv3d_fwd
from .conv_wgrad import conv3d_wgrad
from .geometry import check_conv3d, check_tensors, conv_geometry
from .kernel_utils import empty_ndhwc

_CL = torch.channels_last_3d


def _runs_triton(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (t.device.type == "cpu" and settings.CPU_BACKEND == "triton")


def _device_guard(t: torch.Tensor):
    # Triton launches on the current CUDA device, which need not be the tensor's.
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _gradient_geometry(grad_output, other, other_name, input_size, weight_size, stride, padding, dilation, mode):
    """Check a gradient op's arguments and return the geometry of the forward convolution it differentiates."""
    check_tensors(grad_output=grad_output, **{other_name: other})
    geom = conv_geometry(input_size, weight_size, stride, padding, dilation, mode)
    if tuple(grad_output.shape) != geom.output_shape():
        raise ValueError(
            f"grad_output has shape {tuple(grad_output.shape)}, but the convolution's output is {geom.output_shape()}"
        )
    return geom


# ---------------------------------------------------------------------------------------------------------------
# forward


@torch.library.custom_op(
    "tconv3d::conv3d",
    mutates_args=(),
    schema="(Tensor input, Tensor weight, Tensor? bias, int[] stride, int[] padding, int[] dilation, int groups,"
    ' str padding_mode="zeros") -> Tensor',
)
def conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros"):
    geom = check_conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode)
    if not _runs_triton(input):
        return aten.conv3d_fwd(input, weight, bias, geom)
    with _device_guard(input):
        return choice.launch("fwd", conv3d_fwd, geom, input, weight, bias)


@conv3d.register_fake
def _(input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros"):
    geom = check_conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode)
    return empty_ndhwc(geom.output_shape(), like=input)


def _conv3d_setup_context(ctx, inputs, output):
    input, weight, bias, stride, padding, dilation, _groups, *mode = inputs
    # Each gradient needs only the other tensor; save nothing that no gradient will read.
    ctx.save_for_backward(input if weight.requires_grad else None, weight if input.requires_grad else None)
    ctx.input_size, ctx.weight_size = list(input.shape), list(weight.shape)
    ctx.weight_is_ndhwc = weight.is_contiguous(memory_format=_CL)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.conv_args = (list(stride), list(padding), list(dilation), mode[0] if mode else "zeros")


def _conv3d_backward(ctx, grad_output):
    input, weight = ctx.saved_tensors
    grad_input = grad_weight = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_input = torch.ops.tconv3d.conv3d_input_grad(grad_output, weight, ctx.input_size, *ctx.conv_args)
    if ctx.needs_input_grad[1]:
        grad_weight = torch.ops.tconv3d.conv3d_weight_grad(grad_output, input, ctx.weight_size, *ctx.conv_args)
        if not ctx.weight_is_ndhwc:
            grad_weight = grad_weight.contiguous()  # the gradient keeps the weight's memory format
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_bias = grad_output.sum(dim=(0, 2, 3, 4), dtype=torch.float32).to(ctx.bias_dtype)
    return grad_input, grad_weight, grad_bias, None, None, None, None, None


conv3d.register_autograd(_conv3d_backward, setup_context=_conv3d_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# input gradient


@torch.library.custom_op(
    "tconv3d::conv3d_input_grad",
    mutates_args=(),
    schema="(Tensor grad_output, Tensor weight, SymInt[] input_size, int[] stride, int[] padding, int[] dilation,"
    ' str padding_mode="zeros") -> Tensor',
)
def conv3d_input_grad(grad_output, weight, input_size, stride, padding, dilation, padding_mode="zeros"):
    geom = _gradient_geometry(
        grad_output, weight, "weight", input_size, weight.shape, stride, padding, dilation, padding_mode
    )
    if not _runs_triton(grad_output):
        return aten.conv3d_dgrad(grad_output, weight, geom)
    with _device_guard(grad_output):
        return choice.launch("dgrad", conv3d_dgrad, geom, grad_output, weight)


@conv3d_input_grad.register_fake
def _(grad_output, weight, input_size, stride, padding, dilation, padding_mode="zeros"):
    geom = _gradient_geometry(
        grad_output, weight, "weight", input_size, weight.shape, stride, padding, dilation, padding_mode
    )
    return empty_ndhwc(geom.input_shape(), like=grad_output)


def _gradient_setup_context(ctx, inputs, output):
    """Both gradient ops take (grad_output, the other tensor, a size, stride, padding, dilation, padding_mode)."""
    grad_output, other, _size, stride, padding, dilation, *mode = inputs
    ctx.save_for_backward(grad_output, other)
    ctx.other_size = list(other.shape)
    ctx.conv_args = (list(stride), list(padding), list(dilation), mode[0] if mode else "zeros")


def _input_grad_backward(ctx, grad_grad_input):
    # grad_input = dgrad(grad_output, weight) is bilinear: its adjoint in grad_output is the forward
    # convolution, in weight the weight gradient with grad_grad_input standing for the input.
    grad_output, weight = ctx.saved_tensors
    stride, padding, dilation, mode = ctx.conv_args
    d_grad_output = d_weight = None
    if ctx.needs_input_grad[0]:
        d_grad_output = torch.ops.tconv3d.conv3d(grad_grad_input, weight, None, stride, padding, dilation, 1, mode)
    if ctx.needs_input_grad[1]:
        d_weight = torch.ops.tconv3d.conv3d_weight_grad(grad_output, grad_grad_input, ctx.other_size, *ctx.conv_args)
    return d_grad_output, d_weight, None, None, None, None, None


conv3d_input_grad.register_autograd(_input_grad_backward, setup_context=_gradient_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# weight gradient


@torch.library.custom_op(
    "tconv3d::conv3d_weight_grad",
    mutates_args=(),
    schema="(Tensor grad_output, Tensor input, SymInt[] weight_size, int[] stride, int[] padding, int[] dilation,"
    ' str padding_mode="zeros") -> Tensor',
)
def conv3d_weight_grad(grad_output, input, weight_size, stride, padding, dilation, padding_mode="zeros"):
    geom = _gradient_geometry(
        grad_output, input, "input", input.shape, weight_size, stride, padding, dilation, padding_mode
    )
    if not _runs_triton(input):
        return aten.conv3d_wgrad(grad_output, input, geom)
    with _device_guard(input):
        return choice.launch("wgrad", conv3d_wgrad, geom, grad_output, input)


@conv3d_weight_grad.register_fake
def _(grad_output, input, weight_size, stride, padding, dilation, padding_mode="zeros"):
    geom = _gradient_geometry(
        grad_output, input, "input", input.shape, weight_size, stride, padding, dilation, padding_mode
    )
    return empty_ndhwc(geom.weight_shape(), like=input)


def _weight_grad_backward(ctx, grad_grad_weight):
    # grad_weight = wgrad(grad_output, input) is bilinear: its adjoint in grad_output is the forward convolution
    # with grad_grad_weight as the weight, in input the input gradient through grad_grad_weight.
    grad_output, input = ctx.saved_tensors
    stride, padding, dilation, mode = ctx.conv_args
    d_grad_output = d_input = None
    if ctx.needs_input_grad[0]:
        d_grad_output = torch.ops.tconv3d.conv3d(input, grad_grad_weight, None, stride, padding, dilation, 1, mode)
    if ctx.needs_input_grad[1]:
        d_input = torch.ops.tconv3d.conv3d_input_grad(grad_output, grad_grad_weight, ctx.other_size, *ctx.conv_args)
    return d_grad_output, d_input, None, None, None, None, None


conv3d_weight_grad.register_autograd(_weight_grad_backward, setup_context=_gradient_setup_context)


# ---------------------------------------------------------------------------------------------------------------
# autocast: conv3d runs in the autocast dtype, as aten's conv3d does (torch.library.register_autocast would pin
# one dtype at registration; this follows the region's, bf16 or fp16).


def _cast_for_autocast(value, device_type: str, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == device_type:
        return value if value.dtype == torch.float64 else value.to(dtype)
    return value


def _autocast_conv3d(device_type: str):
    def kernel(_dispatch_keys, *args):
        dtype = torch.get_autocast_dtype(device_type)
        with torch.autocast(device_type, enabled=False):
            return torch.ops.tconv3d.conv3d.default(*(_cast_for_autocast(a, device_type, dtype) for a in args))

    return kernel


_autocast_lib = torch.library.Library("tconv3d", "IMPL")
for _device_type, _dispatch_key in (("cuda", "AutocastCUDA"), ("cpu", "AutocastCPU")):
    _autocast_lib.impl("conv3d", _autocast_conv3d(_device_type), _dispatch_key, with_keyset=True)
