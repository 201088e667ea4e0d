"""tconv3d.nn.Conv3d, a drop-in nn.Conv3d on tconv3d's kernels, and tconv3d.nn.convert to swap it into a model."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from .geometry import SUPPORTED_DTYPES, resolve_padding, triple

logger = logging.getLogger("tconv3d")

_CL = torch.channels_last_3d


class Conv3d(nn.Conv3d):
    """`torch.nn.Conv3d` running `torch.ops.tconv3d.conv3d`: same constructor, parameters, state_dict and repr.

    The weight is kept channels_last_3d, (Cout, kd, kh, kw, Cin) in memory, so no call copies it: it is converted
    in place on the same Parameter at construction, after `.to()`/`.cuda()`/`.half()` and the like, and on the
    first forward after anything else replaced its storage. Every padding_mode runs inside the kernels: 'zeros'
    masks the border, 'replicate', 'reflect' and 'circular' remap its loads, and no padded input is made.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.groups != 1:
            raise NotImplementedError(f"groups={self.groups} is not supported yet; tconv3d runs groups=1 only")
        self._keep_weight_channels_last()

    def _keep_weight_channels_last(self) -> None:
        weight = self.weight
        if not weight.is_contiguous(memory_format=_CL):
            with torch.no_grad():
                weight.data = weight.data.contiguous(memory_format=_CL)

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half() ... may hand back a new weight storage in another layout.
        module = super()._apply(fn, recurse)
        self._keep_weight_channels_last()
        return module

    def _op_padding(self) -> tuple[int, ...]:
        """The 6-value padding the op takes."""
        return resolve_padding(self.padding, self.kernel_size, self.stride, self.dilation)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._keep_weight_channels_last()
        return torch.ops.tconv3d.conv3d(
            input, self.weight, self.bias, list(self.stride), list(self._op_padding()), list(self.dilation),
            self.groups, self.padding_mode,
        )  # fmt: skip


class CausalConv3d(Conv3d):
    """The causal Conv3d of video VAEs in one fused call: time padded on the front only, (kd - 1) * dilation_d
    frames, so frame t sees frames t - kd + 1 .. t; space padded symmetrically, (k - 1) * dilation / 2 on each
    side (odd kernels). `padding_mode` ("replicate" by default, as most VAEs pad; "zeros" too) says what the
    border reads, inside the kernel: no padded copy of the input is made.

    Parameters and state_dict are those of an `nn.Conv3d` of the same shape, so a checkpoint of a VAE's own
    causal conv module (which holds such a Conv3d, typically as `.conv`) loads into it after the prefix is
    renamed.
    """

    def __init__(
        self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, padding_mode="replicate",
        device=None, dtype=None,
    ):  # fmt: skip
        kernel, dilation3 = triple(kernel_size, "kernel_size"), triple(dilation, "dilation")
        for k, name in zip(kernel[1:], "hw", strict=True):
            if k % 2 == 0:
                raise ValueError(f"CausalConv3d pads space symmetrically: kernel_size in {name} must be odd, got {k}")
        super().__init__(
            in_channels, out_channels, kernel, stride, padding=0, dilation=dilation3, bias=bias,
            padding_mode=padding_mode, device=device, dtype=dtype,
        )  # fmt: skip
        self.causal_padding = (
            (kernel[0] - 1) * dilation3[0], 0,
            (kernel[1] - 1) * dilation3[1] // 2, (kernel[1] - 1) * dilation3[1] // 2,
            (kernel[2] - 1) * dilation3[2] // 2, (kernel[2] - 1) * dilation3[2] // 2,
        )  # fmt: skip

    def _op_padding(self) -> tuple[int, ...]:
        return self.causal_padding

    def extra_repr(self) -> str:
        return super().extra_repr() + f", causal_padding={self.causal_padding}"


def _unsupported_reason(module: nn.Conv3d) -> str | None:
    if type(module) is not nn.Conv3d:
        return f"it is a {type(module).__qualname__}, a subclass of nn.Conv3d whose forward may differ"
    if module.groups != 1:
        return f"groups={module.groups} (tconv3d runs groups=1 only)"
    if module.weight.dtype not in SUPPORTED_DTYPES:
        return f"its weight is {module.weight.dtype} (tconv3d runs float16, bfloat16 and float32)"
    return None


def convert(model: nn.Module, filter: Callable[[str, nn.Conv3d], bool] | None = None) -> nn.Module:
    """Swap every eligible `nn.Conv3d` in `model` for `tconv3d.nn.Conv3d`, in place, and return `model`.

    Each layer keeps its identity and its Parameters (the module's class is changed and its weight made
    channels_last_3d in place), so an optimizer built before the call keeps working and outputs stay the same.
    `filter(qualified_name, module)` returning False leaves a layer alone. Layers tconv3d cannot run (groups > 1,
    float64 weights, subclasses of nn.Conv3d with their own forward) are left as they are, each reported by a
    warning on the "tconv3d" logger, with its name and the reason. Nothing outside `model` is patched.
    """
    converted = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Conv3d) or isinstance(module, Conv3d):
            continue
        if filter is not None and not filter(name, module):
            continue
        reason = _unsupported_reason(module)
        if reason is not None:
            logger.warning("tconv3d.nn.convert left %s as it is: %s", name or type(module).__name__, reason)
            continue
        module.__class__ = Conv3d
        module._keep_weight_channels_last()
        converted += 1
    logger.info("tconv3d.nn.convert swapped %d Conv3d layer(s)", converted)
    return model
