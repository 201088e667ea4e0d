"""torch's own conv3d for tensors tconv3d has no kernel for (CPU without the interpreter, other devices).

Same contract as the Triton launchers: checked geometry in, channels_last_3d result out. Asymmetric padding,
which aten cannot express, and the padding modes other than zeros become an explicit F.pad on this path only.
"""

import torch
import torch.nn.functional as F

from .geometry import ConvGeometry
from .kernel_utils import fold_padding


def _pad_input(x: torch.Tensor, geom: ConvGeometry) -> torch.Tensor:
    df, db, ht, hb, wl, wr = geom.padding
    return F.pad(x, (wl, wr, ht, hb, df, db), mode="constant" if geom.padding_mode == "zeros" else geom.padding_mode)


def _as_ndhwc(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last_3d)


def conv3d_fwd(x, weight, bias, geom: ConvGeometry) -> torch.Tensor:
    if geom.is_symmetric and geom.padding_mode == "zeros":
        y = F.conv3d(x, weight, bias, geom.stride, geom.front_padding, geom.dilation)
    else:
        y = F.conv3d(_pad_input(x, geom), weight, bias, geom.stride, 0, geom.dilation)
    return _as_ndhwc(y)


def conv3d_dgrad(grad_out, weight, geom: ConvGeometry) -> torch.Tensor:
    df, db, ht, hb, wl, wr = geom.padding
    d, h, w = geom.in_size
    padded = (geom.batch, geom.in_channels, d + df + db, h + ht + hb, w + wl + wr)
    grad = torch.nn.grad.conv3d_input(padded, weight, grad_out, geom.stride, 0, geom.dilation)
    if geom.padding_mode != "zeros":
        return fold_padding(grad, geom)
    return _as_ndhwc(grad[:, :, df : df + d, ht : ht + h, wl : wl + w])


def conv3d_wgrad(grad_out, x, geom: ConvGeometry) -> torch.Tensor:
    grad = torch.nn.grad.conv3d_weight(
        _pad_input(x, geom), geom.weight_shape(), grad_out, geom.stride, 0, geom.dilation
    )
    return _as_ndhwc(grad)
