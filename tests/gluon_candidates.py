"""Every Gluon config the tuner would time on an H100 for layers of the bench suite, through the Gluon emulator
(tests/gluon_emulator.py), against float64: each layer at its own channels, kernel, stride and padding over a
volume one or two tiles wide, the config's tile, ring depth, split and form (pipelined and warp-specialized, 5
SMs for the persistent one so that its programs walk several tiles) as the tuner would run it.

    python tests/gluon_candidates.py --cases down_s2,last_cout3 [--directions fwd,dgrad] [--dtype bf16]

fp32 runs as TF32 (on by default in torch, as cuDNN's): the forward and the input gradient; the weight gradient
has no Gluon config in fp32.

Seconds to minutes a layer and direction on a CPU: a tool for changes to conv_gluon.py (and the tuner's space), not
a test. Exits 1 if any config fails."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the split-K reduction and the fallbacks run on the interpreter

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch
from gluon_emulator import emulating

from tconv3d.geometry import check_conv3d
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_gluon, conv_wgrad
from tconv3d.testing import rel_l2, tolerance
from tconv3d.tune import choice, configs, shapes
from tconv3d.tune.shapes import DTYPES_BY_NAME
from tconv3d.tune.tuner import CANDIDATES_PER_KEY, nearest_candidates

CL = torch.channels_last_3d
H100_SMS, H100_SMEM = 132, 232448


def gluon_configs(direction: str, shape, dtype: torch.dtype) -> list:
    """The Gluon configs an H100 tuning run would time for the layer (the heuristic's default and its nearest
    candidates), those tiles forced to Gluon as TCONV3D_KERNELS=gluon would, and each in both forms."""
    geom = shape.geometry()
    found = configs.candidates(direction, geom, dtype, H100_SMEM, tma=True, gluon=True)
    default = configs.heuristic_config(direction, geom, dtype, H100_SMS, configs.GLUON_CAPABILITY)
    twins = configs.own_twins(direction, geom, default, dtype, H100_SMEM)
    planned = [default, *nearest_candidates(found, default, CANDIDATES_PER_KEY, twins)]
    planned += [choice.force_variant(direction, geom, dtype, c, "gluon", True) for c in planned]
    gluon = [c for c in planned if c.gluon]
    # the other form, where there is one: a weight gradient's grouped or transposed tiles are warp-specialized only
    other = [
        dataclasses.replace(c, gluon=3 - c.gluon)
        for c in gluon
        if not (c.tap_group > 1 or (c.swap_ab and direction == "wgrad"))
    ]
    return list(dict.fromkeys(gluon + other))


def check(direction: str, shape, dtype: torch.dtype, config, seed: int) -> float:
    """The relative L2 error of `direction` under `config` on the layer over a small volume."""
    rows = config.block_k if direction == "wgrad" else config.block_m
    box_h, box_w = config.tma_box(rows)
    (kd, kh, kw), (sd, sh, sw) = shape.kernel, shape.stride
    size = (sd + kd - 1, sh * (box_h + 1) + kh - 1, sw * (box_w + 1) + kw - 1)
    torch.manual_seed(seed)
    x = torch.randn(1, shape.cin, *size, dtype=dtype).contiguous(memory_format=CL)
    fan_in = shape.cin // shape.groups * kd * kh * kw
    w = (torch.randn(shape.cout, shape.cin // shape.groups, kd, kh, kw) / fan_in**0.5).to(dtype)
    w = w.contiguous(memory_format=CL)
    b = torch.randn(shape.cout, dtype=dtype)
    p = list(shape.padding)
    geom = check_conv3d(x, w, b, list(shape.stride), p, list(shape.dilation), shape.groups)
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    padded = torch.nn.functional.pad(x64, (p[4], p[5], p[2], p[3], p[0], p[1]))
    ref = torch.nn.functional.conv3d(padded, w64, b.double(), shape.stride, 0, shape.dilation, shape.groups)
    grad_out = torch.randn(ref.shape, dtype=dtype).contiguous(memory_format=CL)
    ref.backward(grad_out.double())
    if direction == "fwd":
        return rel_l2(conv_fwd.conv3d_fwd(x, w, b, None, geom, config), ref)
    if direction == "dgrad":
        return rel_l2(conv_dgrad.conv3d_dgrad(grad_out, w, geom, config), x64.grad)
    return rel_l2(conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, config), w64.grad)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma-separated bench cases (default: all)")
    parser.add_argument("--directions", default="fwd,dgrad,wgrad")
    parser.add_argument(
        "--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="fp32: as TF32, not the weight gradient"
    )
    args = parser.parse_args(argv)
    if conv_gluon.UNAVAILABLE is not None:
        print(conv_gluon.UNAVAILABLE)
        return 1
    names = [n for n in args.cases.split(",") if n]
    layers = {s.name: s for s in shapes.load_shape_set("bench")}
    dtype = DTYPES_BY_NAME[args.dtype]
    failed = 0
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(conv_gluon, "_multiprocessors", lambda device: 5)
    with emulating(monkeypatch) as emulator:
        for name in names or list(layers):
            for direction in args.directions.split(","):
                found, start, bad = gluon_configs(direction, layers[name], dtype), time.time(), []
                for seed, config in enumerate(found):
                    try:
                        error = check(direction, layers[name], dtype, config, seed)
                    except Exception as fault:  # a fault of the emulator's (hazard, deadlock) or the kernel's
                        error = f"{type(fault).__name__}: {fault}"
                    if not isinstance(error, float) or not error < tolerance(dtype):
                        bad.append((config, error))
                print(f"{name:18s} {direction:5s} {len(found):3d} Gluon configs, {len(bad)} failed, "
                      f"{time.time() - start:5.0f} s", flush=True)  # fmt: skip
                for config, error in bad:
                    print(f"    {config}: {error}", flush=True)
                failed += len(bad)
    monkeypatch.undo()
    print(f"{emulator.programs} programs emulated; {failed} configs failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
