"""What the compiler makes of the trilinear upsampling kernels (tconv3d/kernels/resample.py) on a machine without a
GPU: registers, spills and shared memory of the forward and input-gradient launches, per architecture, dtype,
channel count and factors (`python -m tconv3d.inspect` covers the convolutions only).

    python -m bench.resample_compile [--arch 90,80]
"""

from __future__ import annotations

import argparse

import torch
import triton

from tconv3d.inspect.compile import KernelReport, _meta, compile_only, read_reports
from tconv3d.kernels.resample import upsample_linear_bwd, upsample_linear_fwd

SIZE = (16, 32, 32)  # an input's D, H, W


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="90,80")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"{'arch':>4} {'dtype':9} {'C':>4} {'factors':9} {'kernel':4} {'regs':>4} {'spill B':>7} {'smem B':>6}")
    for arch in (int(a) for a in args.arch.split(",")):
        for dtype in (torch.bfloat16, torch.float32):
            for channels in (3, 64, 256):
                for factors in ((2, 2, 2), (2, 1, 1)):
                    launches: list = []
                    with compile_only(arch, launches):
                        upsample_linear_fwd(_meta((1, channels, *SIZE), dtype), factors)
                        out = [n * f for n, f in zip(SIZE, factors, strict=True)]
                        upsample_linear_bwd(_meta((1, channels, *out), dtype), (1, channels, *SIZE), factors)
                    reports = [KernelReport(name, grid, warps, shared_bytes=k.metadata.shared, tensor_maps=maps,
                                            compile_s=s, cubin=k.asm["cubin"])
                               for name, grid, warps, k, s, maps in launches]  # fmt: skip
                    read_reports(reports)
                    for report in reports:
                        row = report.to_dict()
                        kind = "fwd" if "fwd" in row["kernel"] else "bwd"
                        print(f"{arch:>4} {str(dtype)[6:]:9} {channels:>4} {factors!s:9} {kind:4} "
                              f"{row['registers']:>4} {row['spill_bytes']:>7} {row['shared_bytes']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
