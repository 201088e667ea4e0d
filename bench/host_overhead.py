"""python -m bench.host_overhead: the host's time per layer call, tconv3d against nn.Conv3d (issue 19).

On a tiny input the convolution itself is nearly free, so what is timed is the Python and dispatch around it:
nn.Conv3d, tconv3d.nn.Conv3d, tconv3d.conv3d and torch.ops.tconv3d.conv3d, under no_grad and with autograd
recording (inputs that require grad; forward only). On CPU tconv3d runs torch's own conv3d inside its op (the
aten path) unless TRITON_INTERPRET=1; on CUDA the Triton kernel runs and the GPU is synchronised only once per
timing loop, so the figure is the host's issue time whenever the kernel is shorter than it.

    python -m bench.host_overhead [--device cpu|cuda] [--calls 2000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import tconv3d

CL = torch.channels_last_3d
SHAPE = (1, 4, 2, 3, 3)  # the tiny input: Cin 4, a 2x3x3 volume


def per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over `repeats` loops of the mean host time of one call, in microseconds."""
    for _ in range(min(calls, 200)):  # warm-up: config choice, first compile, caches
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def measure(device: str, calls: int) -> dict:
    torch.manual_seed(0)
    stock = torch.nn.Conv3d(4, 4, 3, padding=1).to(device).to(memory_format=CL)
    ours = tconv3d.nn.convert(torch.nn.Sequential(torch.nn.Conv3d(4, 4, 3, padding=1)))[0].to(device)
    ours.load_state_dict(stock.state_dict())
    w, b = ours.weight, ours.bias
    results = {}
    for mode in ("no_grad", "autograd"):
        x = torch.randn(SHAPE, device=device).contiguous(memory_format=CL).requires_grad_(mode == "autograd")
        calls_of = {
            "nn.Conv3d": lambda x=x: stock(x),
            "tconv3d.nn.Conv3d": lambda x=x: ours(x),
            "tconv3d.conv3d": lambda x=x: tconv3d.conv3d(x, w, b, 1, 1),
            "torch.ops.tconv3d.conv3d": lambda x=x: torch.ops.tconv3d.conv3d(x, w, b, [1] * 3, [1] * 6, [1] * 3, 1),
        }
        with torch.set_grad_enabled(mode == "autograd"):
            results[mode] = {name: round(per_call_us(fn, calls), 2) for name, fn in calls_of.items()}
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = measure(args.device, args.calls)
    print(f"host time per call, us (device {args.device}, input {SHAPE}, {args.calls} calls x 5, median)")
    print(f"{'':28s} {'no_grad':>9s} {'ratio':>6s} {'autograd':>9s} {'ratio':>6s}")
    for name in results["no_grad"]:
        cells = []
        for mode in ("no_grad", "autograd"):
            us = results[mode][name]
            cells.append(f"{us:9.1f} {us / results[mode]['nn.Conv3d']:5.2f}x")
        print(f"{name:28s} {' '.join(cells)}")
    if args.json is not None:
        meta = {"device": args.device, "torch": torch.__version__, "input": SHAPE, "calls": args.calls}
        args.json.write_text(json.dumps({**meta, "us_per_call": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
