"""`python -m tconv3d`: check tconv3d against torch and, on a GPU, time both.

On a CUDA machine: a 3x3x3 bf16 convolution (default 1 x 128 -> 128 x 16 x 128 x 128, channels_last_3d),
forward and backward, tconv3d against cuDNN: error of each against an fp32 reference, median time, TFLOP/s.
On a CPU-only machine: the Triton kernels through the interpreter on a small shape (without Triton, torch's own
ops, which tconv3d runs there), error against float64.
Exits non-zero if any error is over its tolerance.
"""

import argparse
import os
import sys

import torch

from . import settings
from .functional import conv3d
from .geometry import DTYPES_BY_NAME, check_conv3d
from .testing import TOLERANCE, exact_fp32, float64_errors, random_conv_inputs, rel_l2


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m tconv3d", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES_BY_NAME), default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--channels", type=int, default=None, help="Cin = Cout (default 128 on GPU, 8 on CPU)")
    parser.add_argument("--size", default=None, help="DxHxW (default 16x128x128 on GPU, 4x6x8 on CPU)")
    return parser.parse_args(argv)


def _problem(args, device, channels, size):
    channels = args.channels or channels
    d, h, w = (int(s) for s in (args.size or size).split("x"))
    input_shape, weight_shape = (args.batch, channels, d, h, w), (channels, channels, 3, 3, 3)
    return random_conv_inputs(input_shape, weight_shape, DTYPES_BY_NAME[args.dtype], device, bias=True)


def _forward_and_backward(conv, x, weight, bias, grad_out):
    x, weight, bias = (t.detach().requires_grad_() for t in (x, weight, bias))
    y = conv(x, weight, bias, 1, 1)
    y.backward(grad_out)
    return y.detach(), x.grad, weight.grad, bias.grad


def _cpu_selfcheck(args) -> int:
    if settings.TRITON_MISSING:
        print(f"{settings.TRITON_MISSING}: tconv3d's ops run torch's own on every device, checked here on the CPU.")
    elif not settings.INTERPRET:
        # Triton picks interpreter or compiler when the kernels are defined: restart with the interpreter on.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "tconv3d", *sys.argv[1:]])
    else:
        print("No CUDA device: running tconv3d's Triton kernels through the Triton interpreter (TRITON_INTERPRET=1).")
    failed = False
    for name in ("fp32", args.dtype) if args.dtype != "fp32" else ("fp32",):
        args.dtype = name
        x, weight, bias = _problem(args, "cpu", channels=8, size="4x6x8")
        tol = TOLERANCE[x.dtype]
        print(f"\n{name}: input {tuple(x.shape)} channels_last_3d, 3x3x3, padding 1; tolerance {tol:g}")
        for label, err in float64_errors(conv3d, x, weight, bias, 1, 1).items():
            failed |= not err < tol
            print(f"  {label:<12} relative L2 error vs float64: {err:.2e}  {'ok' if err < tol else 'FAIL'}")
    print("\nTiming needs a CUDA device; on this machine only correctness is checked.")
    return 1 if failed else 0


def launch_paths() -> str:
    """One line on how this process launches tconv3d's kernels, with the installed Triton: the direct path
    (kernels/launch.py), its call past the compiled launcher's Python (launch._Past), and the Gluon kernels; or
    that it runs none (no Triton, a ROCm build of torch: settings.CUDA_BACKEND)."""
    if settings.TRITON_MISSING:
        return f"{settings.TRITON_MISSING}: tconv3d's ops run torch's own on this GPU"
    if settings.CUDA_BACKEND != "triton":
        return (
            f"a ROCm build of torch (HIP {torch.version.hip}): tconv3d's ops run torch's own on this GPU "
            "(its kernels are written for NVIDIA GPUs)"
        )
    import triton

    from .kernels import conv_gluon, launch

    direct = "on" if launch.OFF is None else f"off ({launch.OFF})"
    past = f"yes ({launch.CONVENTION})" if launch.WRAPPER is None else f"no ({launch.WRAPPER})"
    gluon = "yes" if conv_gluon.UNAVAILABLE is None else f"no ({conv_gluon.UNAVAILABLE})"
    return f"triton {triton.__version__}: direct launches {direct}; past the launcher's Python {past}; Gluon {gluon}"


def _gpu_benchmark(args) -> int:
    import triton.testing

    torch.backends.cudnn.benchmark = True
    x, weight, bias = _problem(args, "cuda", channels=128, size="16x128x128")
    geom = check_conv3d(x, weight, bias, 1, 1, 1, 1)
    grad_out = (
        torch.randn(geom.output_shape(), device="cuda").to(x.dtype).contiguous(memory_format=torch.channels_last_3d)
    )
    with exact_fp32():  # the fp32 reference, on the same rounded inputs
        reference = _forward_and_backward(
            torch.nn.functional.conv3d, *(t.float() for t in (x, weight, bias)), grad_out.float()
        )
    tol = TOLERANCE[x.dtype]
    print(f"{torch.cuda.get_device_name()}: input {tuple(x.shape)} {args.dtype} channels_last_3d, 3x3x3, padding 1")
    print(launch_paths())
    print(f"{'':<10}{'direction':<10}{'ms':>9}{'TFLOP/s':>9}  relative L2 error vs fp32 (out, dx, dw)")
    failed = False
    for name, conv in (("cudnn", torch.nn.functional.conv3d), ("tconv3d", conv3d)):
        results = _forward_and_backward(conv, x, weight, bias, grad_out)
        errors = [rel_l2(a, e) for a, e in zip(results[:3], reference[:3], strict=True)]
        failed |= name == "tconv3d" and not max(errors) < tol
        xs, ws, bs = (t.detach().requires_grad_() for t in (x, weight, bias))
        fwd_ms = triton.testing.do_bench(lambda conv=conv: conv(x, weight, bias, 1, 1), return_mode="median")
        y = conv(xs, ws, bs, 1, 1)
        bwd_ms = triton.testing.do_bench(
            lambda y=y, xs=xs, ws=ws: torch.autograd.grad(y, (xs, ws), grad_out, retain_graph=True),
            return_mode="median",
        )
        error_text = " ".join(f"{e:.1e}" for e in errors)
        print(f"{name:<10}{'fwd':<10}{fwd_ms:>9.3f}{geom.flops() / fwd_ms * 1e-9:>9.1f}  {error_text}")
        print(f"{'':<10}{'bwd':<10}{bwd_ms:>9.3f}{2 * geom.flops() / bwd_ms * 1e-9:>9.1f}")
    print(f"tolerance for tconv3d: {tol:g}: {'FAIL' if failed else 'ok'}")
    return 1 if failed else 0


def main(argv=None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    # Without Triton a GPU runs torch's own ops (cuDNN's): nothing of tconv3d's to time there
    timed = torch.cuda.is_available() and not settings.TRITON_MISSING
    return _gpu_benchmark(args) if timed else _cpu_selfcheck(args)


if __name__ == "__main__":
    sys.exit(main())
