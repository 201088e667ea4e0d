"""The float64 reference, the error measure and the tolerances that the tests, the self-check and the
benchmarks all judge tconv3d by."""

import torch
import torch.nn.functional as F

from .geometry import resolve_padding, triple

# Relative L2 error allowed against the float64 reference. fp16 and bf16 bounds come from rounding the result
# (and, for gradients, the operands of the second product) to 11 and 8 significant bits.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# fp32 with TF32 tensor-core products (torch.backends.cudnn.allow_tf32 = True): 10 significant bits per operand.
TF32_TOLERANCE = 5e-3


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64. NaN or Inf in `actual` counts as infinitely wrong."""
    actual, expected = actual.double(), expected.double().to(actual.device)
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def reference_conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1) -> torch.Tensor:
    """F.conv3d in float64 on upcast inputs; padding in any form tconv3d takes, 6 values included."""
    kernel = tuple(weight.shape[2:])
    stride, dilation = triple(stride, "stride"), triple(dilation, "dilation")
    df, db, ht, hb, wl, wr = resolve_padding(padding, kernel, stride, dilation)
    x64 = F.pad(x.double(), (wl, wr, ht, hb, df, db))
    return F.conv3d(x64, weight.double(), None if bias is None else bias.double(), stride, 0, dilation)
