"""tconv3d.conv3d: the functional entry, with torch.nn.functional.conv3d's names, order and meaning."""

import torch

from .geometry import conv_arguments


def conv3d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros") -> torch.Tensor:
    """Conv3d on channels_last_3d (NDHWC) tensors with Triton implicit-GEMM kernels, differentiable.

    Arguments mean what they mean in `torch.nn.functional.conv3d`. `padding` may also be 6 ints
    (d_front, d_back, h_top, h_bottom, w_left, w_right), e.g. (2, 0, 1, 1, 1, 1) for a causal video conv.
    `padding_mode` ("zeros", "replicate", "reflect" or "circular") means F.pad(input, padding, mode=padding_mode)
    followed by an unpadded convolution, done inside the kernels: no padded copy of the input is made.
    Input in any memory format is accepted (channels_last_3d is read in place, others are converted once);
    the output is always channels_last_3d. A weight not in channels_last_3d is converted on every call:
    keep it channels_last_3d (as `tconv3d.nn.Conv3d` does) to avoid that copy.
    """
    stride, padding, dilation = conv_arguments(input, weight, bias, stride, padding, dilation, groups, padding_mode)
    return torch.ops.tconv3d.conv3d(input, weight, bias, stride, padding, dilation, groups, padding_mode)
