"""`python -m bench.vae_decode`: one video-VAE decode, stock diffusers vs converted by tconv3d.nn.convert, eager
and torch.compile'd: time and peak memory.

Each variant runs in a fresh process, so on CPU the peak is the rise of the process's resident high-water mark
over its first decode (with glibc told to map every tensor from 64 KiB up on its own, so that this tracks live
memory and repeats to 0.2 MB), and on CUDA torch's peak allocated bytes over a decode after a warm-up one.
CPU tensors run aten inside tconv3d's ops (no interpreter): what it measures there is the memory the layout
and padding copies cost, not the kernels' speed. Needs diffusers (`pip install ".[integrations]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("stock", "converted", "stock_compiled", "converted_compiled")


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def measure(model_name: str, variant: str, device: str, dtype: torch.dtype, scale: int, latent_shape) -> dict:
    """Decode once to warm up, then measure: peak memory of one decode and the median time of a few."""
    import tconv3d
    from bench.vaes import build_vae

    vae = build_vae(model_name, scale).eval().to(device=device, dtype=dtype)
    if variant.startswith("converted"):
        tconv3d.nn.convert(vae)
    decode = lambda z: vae.decode(z).sample  # noqa: E731
    if variant.endswith("compiled"):
        decode = torch.compile(decode)
    z = torch.randn(latent_shape, device=device, dtype=dtype)
    with torch.no_grad():
        if device == "cpu":  # the resident high-water mark only rises: take it over the first decode
            before = _rss_mb()
            out = decode(z)
            peak = _rss_mb() - before
        else:
            out = decode(z)  # warm-up: compile, config choice, first launches
        if device == "cuda":
            import triton

            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            decode(z)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            ms = triton.testing.do_bench(lambda: decode(z), warmup=5, rep=50, return_mode="median")
        else:
            times = []
            for _ in range(3):
                start = time.perf_counter()
                decode(z)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
    return {"variant": variant, "ms": round(ms, 2), "peak_mb": round(peak, 1), "output": list(out.shape)}


def main(argv=None) -> int:
    from bench.vaes import LATENT_CHANNELS

    parser = argparse.ArgumentParser(prog="python -m bench.vae_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hunyuan_video", choices=list(LATENT_CHANNELS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 on CUDA, float32 on CPU by default")
    parser.add_argument("--scale", type=int, default=4, help="channel width multiplier over the test config")
    parser.add_argument("--latent", default="1,4,3,16,16", help="latent shape N,C,T,H,W (C: the model's)")
    parser.add_argument("--variants", default="stock,converted", help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process measuring one variant
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    shape = [int(v) for v in args.latent.split(",")]
    shape[1] = LATENT_CHANNELS[args.model]
    if args.one:
        print(json.dumps(measure(args.model, args.one, args.device, dtype, args.scale, shape)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
        child = [sys.executable, "-m", "bench.vae_decode", "--one", variant, "--model", args.model,
                 "--device", args.device, "--dtype", str(dtype).removeprefix("torch."), "--scale", str(args.scale),
                 "--latent", ",".join(map(str, shape))]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # glibc keeps freed memory in its arenas, which makes the resident high-water mark depend on history;
        # tensors from 64 KiB up mapped and unmapped one by one make it the peak of live memory, run to run.
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1")
        result = subprocess.run(child, capture_output=True, text=True, env=env)
        if result.returncode != 0:
            print(result.stderr[-3000:], file=sys.stderr)
            return result.returncode
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    dtype_name = str(dtype).removeprefix("torch.")
    header = f"{args.model} decode, latent {shape}, {args.device} {dtype_name}, scale {args.scale}"
    print(header)
    print(f"{'variant':20s} {'ms':>10s} {'peak MB':>10s}  output")
    for row in rows:
        print(f"{row['variant']:20s} {row['ms']:10.2f} {row['peak_mb']:10.1f}  {row['output']}")
    if args.json:
        import diffusers
        import triton

        from bench.run import git_commit

        meta = {
            "setup": header, "device": args.device, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton.__version__, "diffusers": diffusers.__version__,
            "commit": git_commit(),
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
