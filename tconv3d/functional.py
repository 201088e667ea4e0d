"""tconv3d.conv3d: the functional entry, with torch.nn.functional.conv3d's names, order and meaning."""

import torch

from . import ops, settings
from .geometry import check_conv3d, conv_arguments, conv_transpose_arguments
from .kernels.config import DIRECTIONS

if settings.TRITON_MISSING is None:
    from .tune import choice


def conv3d(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", frames_before=None,
    channels_after=None,
) -> torch.Tensor:  # fmt: skip
    """Conv3d on channels_last_3d (NDHWC) tensors with Triton implicit-GEMM kernels, differentiable.

    Arguments mean what they mean in `torch.nn.functional.conv3d`. `padding` may also be 6 ints
    (d_front, d_back, h_top, h_bottom, w_left, w_right), e.g. (2, 0, 1, 1, 1, 1) for a causal video conv.
    `padding_mode` ("zeros", "replicate", "reflect" or "circular", or three of them for (d, h, w), e.g.
    ("replicate", "zeros", "zeros")) means F.pad(input, padding, mode=...) per dimension followed by an unpadded
    convolution, done inside the kernels: no padded copy of the input is made.
    `frames_before` (N, C, P, H, W), e.g. a video VAE's cached frames, precedes the input along D as if
    torch.cat([frames_before, input], dim=2) were convolved (padding applies to that concatenation), read in
    place by the kernels; it gets a gradient like the input.
    `channels_after` (N, C2, D, H, W), e.g. a UNet decoder's skip connection, follows the input's channels as if
    torch.cat([input, channels_after], dim=1) were convolved (the weight has both inputs' channels), read in place
    by the pointer and TMA kernels (no concatenated copy; the other kernels concatenate it first); it gets a
    gradient like the input. It cannot be given with frames_before.
    An unbatched (C, D, H, W) input gives an unbatched output, as in F.conv3d.
    Input in any memory format is accepted (channels_last_3d is read in place, others are converted once);
    the output is always channels_last_3d. A weight not in channels_last_3d is converted on every call:
    keep it channels_last_3d (as `tconv3d.nn.Conv3d` does) to avoid that copy.
    """
    if isinstance(input, torch.Tensor) and input.dim() == 4:  # F.conv3d's unbatched (C, D, H, W) form
        second = (unbatched(frames_before, "frames_before"), unbatched(channels_after, "channels_after"))
        return conv3d(input[None], weight, bias, stride, padding, dilation, groups, padding_mode, *second)[0]
    stride, padding, dilation, padding_mode = conv_arguments(
        input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after
    )
    return ops.call_conv3d(
        input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after
    )


def unbatched(second, name: str):
    """A second source (`name`: frames_before, channels_after) of an unbatched (C, D, H, W) input, as the batch of
    one the op takes: unbatched too (torch.cat of the two would refuse a 5-D one)."""
    if isinstance(second, torch.Tensor):
        if second.dim() != 4:
            raise ValueError(
                f"{name} of an unbatched (C, D, H, W) input must be unbatched too, got shape {tuple(second.shape)}"
            )
        return second[None]
    return second


def conv_transpose3d(
    input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1, *, channels_after=None
) -> torch.Tensor:
    """ConvTranspose3d on channels_last_3d tensors, with torch.nn.functional.conv_transpose3d's names, order and
    meaning; weight is (Cin, Cout, kd, kh, kw). It is the input gradient of the convolution it transposes, so it
    runs that op (`torch.ops.tconv3d.conv3d_input_grad`: its kernel is split by stride phase, so no work goes to
    inserted zeros; its gradients are the forward and weight-gradient kernels), the bias added in the kernels'
    epilogue. The output is channels_last_3d.
    `channels_after` (N, C2, D, H, W), e.g. a UNet decoder's skip connection, follows the input's channels as if
    torch.cat([input, channels_after], dim=1) were the input (weight has both inputs' channels as its Cin), read in
    place by the pointer, TMA and Gluon kernels (the packed small-channel and grouped ones concatenate it first);
    it gets a gradient like the input."""
    if isinstance(input, torch.Tensor) and input.dim() == 4:  # unbatched (C, D, H, W)
        args = (stride, padding, output_padding, groups, dilation)
        return conv_transpose3d(
            input[None], weight, bias, *args, channels_after=unbatched(channels_after, "channels_after")
        )[0]
    output_shape, stride, padding, dilation, groups, surplus = conv_transpose_arguments(
        input, weight, bias, stride, padding, output_padding, groups, dilation, channels_after
    )
    if any(surplus):
        # The convolution this transposes has outputs past the input's end (output_padding of a stride or more):
        # they are zeros, written here, a copy in this rare form only (it needs a dilation larger than the stride).
        if channels_after is not None:
            input, channels_after = torch.cat([input, channels_after], dim=1), None
        input = torch.nn.functional.pad(input, (0, surplus[2], 0, surplus[1], 0, surplus[0]))
    return ops.call_conv3d_input_grad(
        input, weight, output_shape, stride, padding, dilation, "zeros", groups, channels_after, bias
    )


def explain(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", channels_after=None,
    frames_before=None,
) -> dict:  # fmt: skip
    """What a conv3d call with these arguments would run, per direction ("fwd", "dgrad", "wgrad"): {"variant":
    "gluon", "tma", "pointer", "direct" or "aten", "config": the KernelConfig (None for aten), "source": where the
    config came from ("table", "nearest", "heuristic", "first-use tuning", "interpreter"; "aten" where the ops run
    torch's own: CPU tensors without the interpreter, no Triton, ROCm)}, and for a pointer launch of few channels
    "form": the small-channel form it runs (config.pointer_form: "tap_pairs", "out_tap_rows" or "w_tap_columns").
    With TCONV3D_KERNELS=gluon where the Gluon kernel cannot run, "gluon_unavailable" says why; with
    TCONV3D_INDUCTOR_KERNELS=1, "inductor" says whether torch.compile hands the launch to Inductor or why not.
    It launches nothing (first-use tuning, if enabled, happens on the first real call: reported as its source).
    With `channels_after` (a second channel source), "reads_in_place" says whether the forward's and weight
    gradient's launches read it where it lies or concatenate it first; `frames_before` is conv3d's (the TMA and
    Gluon variants need its base and strides 16-byte aligned, as the input's). A grouped problem run as
    block-diagonal groups of more (kernels/grouped.py) reports its configs for those, "block_diagonal": how many
    of its groups each coarse one holds, and "weight_in_place": whether the kernel reads the weight's blocks where
    they lie (the forward and input gradient; else the call builds the block-diagonal weight) or stores the weight
    gradient's (else it computes the coarse gradient and copies its diagonal blocks). Arguments the op would
    refuse raise as it would, on every path."""
    arguments = (input, weight, bias, stride, padding, dilation, groups, padding_mode, channels_after, frames_before)
    if settings.runs_triton(input):
        return choice.explain(*arguments)
    check_conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after)
    return {direction: {"variant": "aten", "config": None, "source": "aten"} for direction in DIRECTIONS}
