"""What the device's own Triton made of each kernel the bench suite launches: registers, spills, shared memory,
MMA instruction and load kinds, read off the compiled kernels themselves (run on a CUDA machine).

    python3 tests/gpu/kernel_report.py --out report.json [--cases wan_dec_384a,unet_32] [--dtypes bf16,fp32]

Each case runs forward, input-grad and weight-grad once with the config tconv3d would choose; every launch is
recorded through a wrapper around JITFunction.run, which returns the CompiledKernel it launched. The JSON is
the hardware side of the comparison with the static compile report made without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.runtime.jit import JITFunction

import tconv3d
from tconv3d.inspect.compile import read_cubin
from tconv3d.testing import random_conv_inputs
from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set


def record_launches():
    """Wrap JITFunction.run so that each launch appends (kernel name, constexprs, CompiledKernel)."""
    launches = []
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        meta = {k: v for k, v in kwargs.items() if isinstance(v, int | bool | str)}
        launches.append((self.__name__, meta, grid, kernel))
        return kernel

    JITFunction.run = run
    return launches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default="wan_dec_384a,hunyuan_128,unet_32,unet_aniso,down_s2,first_cin3")
    parser.add_argument("--dtypes", default="bf16,fp32")
    args = parser.parse_args(argv)
    launches = record_launches()
    wanted = set(args.cases.split(","))
    records = []
    for shape in load_shape_set("bench"):
        if shape.name not in wanted:
            continue
        for dtype_name in args.dtypes.split(","):
            dtype = DTYPES_BY_NAME[dtype_name]
            x, w = random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, "cuda")
            x.requires_grad_()
            w.requires_grad_()
            start = len(launches)
            y = tconv3d.conv3d(x, w, None, shape.stride, shape.padding, shape.dilation)
            torch.autograd.grad(y, (x, w), torch.randn_like(y))
            torch.cuda.synchronize()
            for name, meta, grid, kernel in launches[start:]:
                records.append(
                    {
                        "case": shape.name,
                        "dtype": dtype_name,
                        "kernel": name,
                        "meta": meta,
                        "grid": list(grid),
                        **read_cubin(kernel.asm["cubin"]),
                        "registers": kernel.n_regs,  # as the driver loaded it
                        "spills": kernel.n_spills,
                        "shared_bytes": kernel.metadata.shared,
                    }
                )
            del x, w, y
    args.out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"{'case':14} {'dtype':5} {'kernel':22} {'tile':12} {'w/s':5} {'regs':>4} {'spill':>5} {'smem':>6} mma")
    for r in records:
        m = r["meta"]
        tile = f"{m.get('BLOCK_M', '')}x{m.get('BLOCK_N', '')}x{m.get('BLOCK_K', '')}" if "BLOCK_M" in m else "-"
        print(
            f"{r['case']:14} {r['dtype']:5} {r['kernel']:22} {tile:12} "
            f"{m.get('num_warps', '')}/{m.get('num_stages', '')} {r['registers']:>4} {r['spills']:>5} "
            f"{r['shared_bytes']:>6} {r.get('mma', '?')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
