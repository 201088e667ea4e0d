"""torch's 3-D resampling kernels on channels_last_3d activations against NCDHW ones, and tconv3d's replacements
(bench/NOTES.md, "Nearest upsampling of channels_last_3d activations on CUDA"): nearest 2x upsampling
(tconv3d.nn.modules.repeat_nearest), the 2x2x2 average pool (block_mean), and trilinear 2x upsampling (MAISI's
and SegResNet's decoders: tconv3d's upsample_linear op, kernels/resample.py). Forward and backward, median times
(do_bench), and the bytes an ideal pass moves over that time. Each replacement is checked against torch's values
first.

    python tests/gpu/resample.py --out resample.json     # on a GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
import triton.testing

from tconv3d.nn.modules import block_mean, repeat_nearest, upsample_linear
from tconv3d.testing import rel_l2

CL = torch.channels_last_3d
# A decoder level: 64 channels at 64^3 (up: to 128^3), bf16.
SHAPE = (1, 64, 64, 64, 64)


def _ops():
    """name -> (function of x, output voxels over input voxels)."""
    return {
        "nearest2x/torch": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), 8),
        "nearest2x/tconv3d": (lambda x: repeat_nearest(x, (2, 2, 2)), 8),
        "trilinear2x/torch": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), 8),
        "trilinear2x/tconv3d": (lambda x: upsample_linear(x, (2, 2, 2)), 8),
        "avgpool2/torch": (lambda x: F.avg_pool3d(x, 2), 1 / 8),
        "avgpool2/tconv3d": (lambda x: block_mean(x, (2, 2, 2)), 1 / 8),
    }


def _median_ms(fn) -> float:
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=5, rep=40)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name, fn, ratio, x, backward: bool) -> dict:
    x = x.detach().requires_grad_(backward)
    out = fn(x)
    grad = torch.randn_like(out)  # in the output's layout, as the layer after would hand it back
    if backward:
        ms = _median_ms(lambda: torch.autograd.grad(out, x, grad, retain_graph=True))
    else:
        with torch.no_grad():
            ms = _median_ms(lambda: fn(x))
    ideal_bytes = x.numel() * x.element_size() * (1 + ratio)  # read one side once, write the other once
    return {"op": name, "layout": "channels_last_3d" if x.is_contiguous(memory_format=CL) else "ncdhw",
            "pass": "backward" if backward else "forward", "ms": round(ms, 4),
            "GB/s": round(ideal_bytes / ms / 1e6, 1),
            "out_channels_last": fn(x.detach()).is_contiguous(memory_format=CL)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (small, float32)")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    cpu = args.device == "cpu"
    shape = (1, 8, 8, 8, 8) if cpu else SHAPE
    x = torch.randn(shape, device=args.device, dtype=torch.float32 if cpu else torch.bfloat16)
    layouts = {"ncdhw": x, "channels_last_3d": x.contiguous(memory_format=CL)}
    ops = _ops()
    # The replacements first: torch's values (nearest bit for bit, the mean up to its sum's order).
    cl = layouts["channels_last_3d"]
    checks = {
        "nearest2x": torch.equal(ops["nearest2x/tconv3d"][0](cl), ops["nearest2x/torch"][0](cl)),
        "avgpool2_rel_l2": rel_l2(ops["avgpool2/tconv3d"][0](cl).float(), ops["avgpool2/torch"][0](cl).float()),
        "trilinear2x_rel_l2": rel_l2(*(ops[f"trilinear2x/{side}"][0](cl).float() for side in ("tconv3d", "torch"))),
    }
    rows = []
    for name, (fn, ratio) in ops.items():
        for layout, t in layouts.items():
            if name.endswith("tconv3d") and layout == "ncdhw":
                continue
            for backward in (False, True):
                rows.append(measure(name, fn, ratio, t, backward))
    device = "cpu" if cpu else torch.cuda.get_device_name()
    result = {"device": device, "torch": torch.__version__, "shape": shape, "dtype": str(x.dtype), "checks": checks,
              "rows": rows}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"checks: {checks}")
    print(f"{'op':20s} {'layout':17s} {'pass':9s} {'ms':>8s} {'GB/s':>8s}  out CL")
    for row in rows:
        print(f"{row['op']:20s} {row['layout']:17s} {row['pass']:9s} {row['ms']:8.3f} {row['GB/s']:8.1f}  "
              f"{row['out_channels_last']}")  # fmt: skip
    close = checks["avgpool2_rel_l2"] < 1e-2 and checks["trilinear2x_rel_l2"] < 1e-2  # bf16's rounding
    return 0 if checks["nearest2x"] and close else 1


if __name__ == "__main__":
    raise SystemExit(main())
