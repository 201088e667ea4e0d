"""The float64 reference, the error measure, the tolerances and the random problems that the tests, the
self-check, the tuner and the benchmarks all judge tconv3d by."""

import contextlib
import math
import os
import sys
import threading

import torch
import torch.nn.functional as F

from . import settings
from .geometry import resolve_padding, triple

# Relative L2 error allowed against the float64 reference. fp16 and bf16 bounds come from rounding the result
# (and, for gradients, the operands of the second product) to 11 and 8 significant bits.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# fp32 with TF32 tensor-core products (torch.backends.cudnn.allow_tf32 = True): 10 significant bits per operand.
TF32_TOLERANCE = 5e-3


def tolerance(dtype: torch.dtype) -> float:
    """The bound for `dtype` under the current TF32 setting (tconv3d uses TF32 exactly when cuDNN may)."""
    if dtype == torch.float32 and settings.tf32_allowed():
        return TF32_TOLERANCE
    return TOLERANCE[dtype]


@contextlib.contextmanager
def exact_fp32():
    """cuDNN's convolutions without TF32 while inside: fp32 references take exact products. Through the
    per-operator precision (torch.backends.cudnn.conv.fp32_precision), which a user's own setting by either API
    leaves readable (settings.tf32_allowed)."""
    conv = torch.backends.cudnn.conv
    saved = conv.fp32_precision
    conv.fp32_precision = "ieee"
    try:
        yield
    finally:
        conv.fp32_precision = saved


# Exit status of a process that left a GPU kernel hanging (hang_guard): EX_TEMPFAIL, "run me again".
HUNG_EXIT = 75
# How long a checked candidate's first run may take before it counts as hung: the largest suite kernel runs in
# milliseconds; a kernel waiting on an mbarrier no one arrives at never finishes.
HANG_S = 60.0


@contextlib.contextmanager
def hang_guard(on_hang, seconds: float | None = None):
    """Run the block; if it has not finished after `seconds` (default HANG_S), call on_hang() (record what hung)
    and end the process with HUNG_EXIT. A kernel that never finishes cannot be stopped, nor the GPU used again,
    from its own process: only leaving it frees the GPU. Guard a synchronisation (torch.cuda.synchronize releases
    the GIL, so the timer's thread runs) and keep compiles outside the block. For command-line runs that their
    caller restarts (the tuner, bench.variants: they resume, skipping what hung), never inside a user's process."""
    seconds = HANG_S if seconds is None else seconds

    def expire():
        try:
            on_hang()
        finally:
            print(f"tconv3d: a kernel has not finished after {seconds:.0f} s: hung; exiting", file=sys.stderr)
            sys.stderr.flush()
            os._exit(HUNG_EXIT)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def random_conv_inputs(input_shape, weight_shape, dtype, device, bias: bool = False, generator=None):
    """A unit-variance input and a weight scaled by 1/sqrt(fan-in), both channels_last_3d, in `dtype`
    (and a unit-variance bias when asked): random data of realistic scale, never zeros. `generator`: torch's
    default one if None."""
    x = torch.randn(input_shape, device=device, generator=generator)
    x = x.to(dtype).contiguous(memory_format=torch.channels_last_3d)
    fan_in = math.prod(weight_shape[1:])
    w = (torch.randn(weight_shape, device=device, generator=generator) / fan_in**0.5).to(dtype)
    w = w.contiguous(memory_format=torch.channels_last_3d)
    if not bias:
        return x, w
    return x, w, torch.randn(weight_shape[0], device=device, generator=generator).to(dtype)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64. NaN or Inf in `actual` counts as infinitely wrong."""
    actual, expected = actual.double(), expected.double().to(actual.device)
    if not torch.isfinite(actual).all():
        return float("inf")
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def reference_conv3d(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1) -> torch.Tensor:
    """F.conv3d in float64 on upcast inputs; padding in any form tconv3d takes, 6 values included."""
    kernel = tuple(weight.shape[2:])
    stride, dilation = triple(stride, "stride"), triple(dilation, "dilation")
    df, db, ht, hb, wl, wr = resolve_padding(padding, kernel, stride, dilation)
    x64 = F.pad(x.double(), (wl, wr, ht, hb, df, db))
    return F.conv3d(x64, weight.double(), None if bias is None else bias.double(), stride, 0, dilation, groups)


def float64_errors(
    conv3d, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, generator=None
) -> dict[str, float]:
    """Relative L2 errors of `conv3d` (F.conv3d's signature: tconv3d.conv3d, say) in its output and gradients
    against float64 autograd of F.conv3d on the same inputs, under one random upstream gradient (from `generator`,
    torch's default one if None): {"output", "grad_input", "grad_weight"[, "grad_bias"]}. The caller hands in what it
    checks, so this module, which the tuner and the tests read, imports nothing above the geometry."""
    tensors = [x, weight] + ([bias] if bias is not None else [])
    ours = [t.detach().requires_grad_() for t in tensors]
    exact = [t.detach().double().requires_grad_() for t in tensors]
    ref = reference_conv3d(*exact[:2], exact[2] if bias is not None else None, stride, padding, dilation, groups)
    grad_out = torch.empty_like(ref).normal_(generator=generator)  # torch.randn_like's draw where generator is None
    ref.backward(grad_out)
    y = conv3d(*ours[:2], ours[2] if bias is not None else None, stride, padding, dilation, groups)
    grads = torch.autograd.grad(y, ours, grad_out.to(y.dtype))
    names = ["grad_input", "grad_weight", "grad_bias"][: len(ours)]
    errors = {"output": rel_l2(y, ref)}
    errors.update({name: rel_l2(g, e.grad) for name, g, e in zip(names, grads, exact, strict=True)})
    return errors
