"""tconv3d.nn.Conv3d, a drop-in nn.Conv3d on tconv3d's kernels, and tconv3d.nn.convert to swap it into a model."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .geometry import SUPPORTED_DTYPES, resolve_padding

logger = logging.getLogger("tconv3d")

_CL = torch.channels_last_3d


class Conv3d(nn.Conv3d):
    """`torch.nn.Conv3d` running `torch.ops.tconv3d.conv3d`: same constructor, parameters, state_dict and repr.

    The weight is kept channels_last_3d, (Cout, kd, kh, kw, Cin) in memory, so no call copies it: it is converted
    in place on the same Parameter at construction, after `.to()`/`.cuda()`/`.half()` and the like, and on the
    first forward after anything else replaced its storage. padding_mode 'zeros' is done by masks in the kernel;
    'reflect', 'replicate' and 'circular' pad the input with F.pad first, as nn.Conv3d does.
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

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._keep_weight_channels_last()
        if self.padding_mode != "zeros":
            input = F.pad(input, self._reversed_padding_repeated_twice, mode=self.padding_mode)
            padding = [0, 0, 0]
        else:
            padding = list(resolve_padding(self.padding, self.kernel_size, self.stride, self.dilation))
        return torch.ops.tconv3d.conv3d(
            input, self.weight, self.bias, list(self.stride), padding, list(self.dilation), self.groups
        )


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
