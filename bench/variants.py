"""python -m bench.variants: the kernel variants against each other and against cuDNN, per layer, in one run.

    python -m bench.variants --cases wan_dec_384b,hunyuan_512 --dtype bf16 --out bench/results/variants.json

For each case and direction (fwd; dgrad: the input gradient; wgrad: the weight gradient) it launches
tconv3d's launcher directly with each variant's config: the chosen one (table or heuristic) forced to pointer,
to TMA (its choice of box, and both the 16-wide patch and the one-row box) and to Gluon (also on the Hopper GEMM
tile 128x256x64 with 8 warps, and both with the warp-specialized TMA producer), and split-K against none where
the grid leaves SMs idle. It checks each result against cuDNN in fp32 first (a variant that is wrong is
reported as such and not timed), then times it with triton.testing.do_bench (median, L2 flushed) beside cuDNN
on channels_last_3d tensors and the bf16 matmul peak measured in the same run. It answers the question
bench/NOTES.md predicts before a GPU session: how much of the matmul peak each variant reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tconv3d.geometry import check_conv3d
from tconv3d.kernels import conv_gluon
from tconv3d.kernels.conv_dgrad import conv3d_dgrad
from tconv3d.kernels.conv_fwd import conv3d_fwd
from tconv3d.kernels.conv_wgrad import conv3d_wgrad
from tconv3d.testing import exact_fp32, random_conv_inputs, rel_l2, tolerance
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import DTYPES_BY_NAME, ConvShape, load_shape_set

from .run import bench_ms, measure_peaks

CL = torch.channels_last_3d
# The layers that decide issue 28 first (the largest, the small grid, the strided one): a run cut short keeps them.
DEFAULT_CASES = "wan_dec_384b,unet_320,down_s2,hunyuan_512,wan_dec_384a,wan_dec_192,hunyuan_128,cogvideo_256,unet_64"
HOPPER_TILE = configs.KernelConfig(128, 256, 64, 8, 3)


def variant_configs(direction: str, geom, dtype, device) -> dict[str, configs.KernelConfig]:
    """name -> config: the chosen one, and each variant the problem and this device can run."""
    chosen = choice.pick_config(direction, geom, dtype, device)
    gluon_runs = choice._gluon_runs(device)
    found = {"chosen": chosen, "pointer": choice.force_variant(direction, geom, dtype, chosen, "pointer")}
    if configs.tma_eligible(direction, geom, dtype) and configs.compute_capability(device) >= 90:
        found["tma"] = choice.force_variant(direction, geom, dtype, chosen, "tma")
        # Both TMA boxes on the chosen tiles: the 16-wide patch and the one-row box (bench/NOTES.md predicts them).
        found["tma_patch"] = configs.with_tma(found["pointer"], geom, direction, rows=False)
        found["tma_rows"] = configs.with_tma(found["pointer"], geom, direction, rows=True)
    if direction != "wgrad":  # split-K against none where the grid leaves SMs idle (unet_320)
        split = configs.small_grid_split(direction, geom, chosen, configs.multiprocessor_count(device))
        if chosen.split_k > 1:
            found["unsplit"] = dataclasses.replace(chosen, split_k=1)
        elif split > 1:
            found["split_k"] = dataclasses.replace(chosen, split_k=split)
    if gluon_runs and configs.gluon_eligible(direction, geom, dtype):
        found["gluon"] = choice.force_variant(direction, geom, dtype, chosen, "gluon", gluon_runs=True)
        found["gluon_128x256"] = configs.with_gluon(HOPPER_TILE, geom, direction)
        # persistent, with the warp-specialized TMA producer
        found["gluon_ws"] = dataclasses.replace(found["gluon"], gluon=2)
        found["gluon_ws_128x256"] = configs.with_gluon(HOPPER_TILE, geom, direction, specialized=True)
    return found


def measure_case(shape: ConvShape, dtype_name: str, direction: str, peak_tflops: float) -> list[dict]:
    dtype, device = DTYPES_BY_NAME[dtype_name], torch.device("cuda")
    x, w = random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, device)
    stride, padding, dilation = list(shape.stride), list(shape.padding), list(shape.dilation)
    geom = check_conv3d(x, w, None, stride, padding, dilation, shape.groups)
    conv_args = (shape.stride, shape.padding[0::2], shape.dilation, shape.groups)
    if direction == "fwd":
        launch = lambda config: conv3d_fwd(x, w, None, None, geom, config)  # noqa: E731
        cudnn = lambda: F.conv3d(x, w, None, *conv_args)  # noqa: E731
        with exact_fp32():
            reference = F.conv3d(x.float(), w.float(), None, *conv_args)
    else:
        grad_out = torch.randn(geom.output_shape(), device=device).to(dtype).contiguous(memory_format=CL)
        if direction == "dgrad":
            launch = lambda config: conv3d_dgrad(grad_out, w, geom, config)  # noqa: E731
            cudnn = lambda: torch.nn.grad.conv3d_input(x.shape, w, grad_out, *conv_args)  # noqa: E731
            with exact_fp32():
                reference = torch.nn.grad.conv3d_input(x.shape, w.float(), grad_out.float(), *conv_args)
        else:
            launch = lambda config: conv3d_wgrad(grad_out, x, None, geom, config)  # noqa: E731
            cudnn = lambda: torch.nn.grad.conv3d_weight(x, w.shape, grad_out, *conv_args)  # noqa: E731
            with exact_fp32():
                reference = torch.nn.grad.conv3d_weight(x.float(), w.shape, grad_out.float(), *conv_args)
    flops = 2 * geom.output_voxels * geom.out_channels * geom.taps * geom.group_in_channels
    rows = []
    cudnn_ms = bench_ms(cudnn)
    rows.append({"impl": "cudnn_cl3d", "ms": cudnn_ms, "config": None, "error": None})
    for name, config in variant_configs(direction, geom, dtype, device).items():
        row = {"impl": name, "config": config.to_dict(), "variant": config.variant}
        try:
            error = rel_l2(launch(config), reference)
        except Exception as failure:  # a variant that cannot run this problem: a result, not a crash
            rows.append({**row, "failed": f"{type(failure).__name__}: {failure}"[:300]})
            continue
        row["error"] = error
        if error > tolerance(dtype):
            rows.append({**row, "failed": f"relative L2 error {error:.2e} above {tolerance(dtype):.0e}"})
            continue
        rows.append({**row, "ms": bench_ms(lambda config=config: launch(config))})
    for row in rows:
        if "ms" in row:
            row["tflops"] = flops / row["ms"] * 1e-9
            row["pct_peak"] = 100 * row["tflops"] / peak_tflops
            row["speedup_vs_cudnn"] = cudnn_ms / row["ms"]
        row.update(case=shape.name, dtype=dtype_name, direction=direction)
    return rows


def table(rows: list[dict], header: bool = True) -> str:
    title = (
        f"{'case':14} {'dtype':5} {'dir':5} {'impl':14} {'variant':8} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'vs cuDNN':>8}"
    )
    lines = [title, "-" * len(title)] if header else []
    for r in rows:
        start = f"{r['case']:14} {r['dtype']:5} {r['direction']:5} {r['impl']:14} {r.get('variant', '-'):8}"
        if "failed" in r:
            lines.append(f"{start} FAILED: {r['failed']}")
        else:
            lines.append(
                f"{start} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['pct_peak']:>6.1f} {r['speedup_vs_cudnn']:>7.2f}x"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=DEFAULT_CASES, help="comma-separated case names of the bench suite")
    parser.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--directions", default="fwd,dgrad,wgrad", help="comma-separated: fwd, dgrad, wgrad")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.variants times kernels: it needs a CUDA device")
        return 2
    torch.backends.cudnn.benchmark = True
    wanted = args.cases.split(",")
    shapes = [s for s in load_shape_set("bench") if s.name in wanted]
    peaks = measure_peaks()
    print(f"device {torch.cuda.get_device_name()}, bf16 matmul peak {peaks['bf16_mm_tflops']} TFLOP/s; "
          f"gluon: {conv_gluon.UNAVAILABLE or 'available'}", flush=True)  # fmt: skip
    rows = []
    print(table([]), flush=True)
    for shape in shapes:  # each case's rows as they come: a run cut short by its time limit still shows them
        for dtype_name in args.dtype.split(","):
            for direction in args.directions.split(","):
                measured = measure_case(shape, dtype_name, direction, peaks["bf16_mm_tflops"])
                print(table(measured, header=False), flush=True)
                rows += measured
                if args.out:
                    args.out.write_text(json.dumps({"peaks": peaks, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
