"""`python -m bench.vae_decode`: one video-VAE decode, stock diffusers vs converted by tconv3d.nn.convert, eager
and torch.compile'd: time and peak memory (also MAISI's CT autoencoder, `--model maisi`, and Kandinsky 6 SR's 4x
latent upscaler as a decode, `--model kandinsky6_upscaler`, and Kandinsky 5's KVAE, `--model kvae`: bench.vaes).

Variants: stock, converted, stock_compiled, converted_compiled (torch.compile, the ops as calls),
converted_inductor (torch.compile with TCONV3D_INDUCTOR_KERNELS=1: Inductor launches the kernels) and, on CUDA,
converted_graph (the decode captured in a CUDA graph and replayed: its time, the graph pool's size as its peak,
and whether a replay on a new latent equals an eager decode bit for bit), and converted_upsample_first (converted,
with Wan's, CogVideoX's, HunyuanVideo's and EasyAnimate's upsamplers writing their nearest 2x before their conv, as
before the sub-pixel forms of tconv3d.nn.video_vaes.upsampled_frame_conv, upsampled_causal_conv and
upsampled_kept_causal_conv: the A/B of that change).
`--training` times a decoder fine-tuning step instead (the decode, then the backward of one fixed random output
gradient into every parameter): time, peak memory of the step, the parameter gradients' norm (stock's and
converted's agree) and, converted on CUDA, the kernels of all three directions; converted_graph refuses it.
`--scale 0` builds diffusers' default configs (the released models' sizes) and decodes bench.vaes.DEFAULT_LATENTS (17
frames of 256 x 256; Mochi 19).

The eager variants also report where one decode's time goes (`breakdown_ms`): the convolutions (a VAE's conv
wrapper counts as its conv), the norms, the activation modules (a SiLU fused into a converted norm is the norm's)
and the rest, each module's own time (a module's children are theirs), from CUDA events around every such module's
forward (perf_counter on CPU) in one more decode. On CUDA the converted decode also reports which kernels its
convolutions launched (`kernels`: "fwd/gluon", "fwd/tma", "fwd/pointer" counts).

Each variant runs in a fresh process, so on CPU the peak is the rise of the process's resident high-water mark
over its first decode (with glibc told to map every tensor from 64 KiB up on its own, so that this tracks live
memory and repeats to 0.2 MB), and on CUDA torch's peak allocated bytes over a decode after a warm-up one.
CPU tensors run aten inside tconv3d's ops (no interpreter): what it measures there is the memory the layout
and padding copies cost, not the kernels' speed. Needs diffusers (`pip install ".[integrations]"`).
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("stock", "converted", "stock_compiled", "converted_compiled", "converted_inductor", "converted_graph",
            "converted_upsample_first")  # fmt: skip
ACTIVATIONS = (torch.nn.SiLU, torch.nn.GELU, torch.nn.ReLU, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.Mish,
               torch.nn.Tanh, torch.nn.Sigmoid)  # fmt: skip


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def categories(model: torch.nn.Module) -> dict[int, str]:
    """id(module) -> "conv", "norm" or "activation" for the modules `breakdown` times."""
    from tconv3d.nn.audit import _layers

    found = {id(watched): "conv" for _, watched, _ in _layers(model)}
    for module in model.modules():
        if id(module) in found:
            continue
        if isinstance(module, ACTIVATIONS):
            found[id(module)] = "activation"
        elif "norm" in type(module).__name__.lower():  # GroupNorm, RMS_norm, RMSNorm, CogVideoXSpatialNorm3D, ...
            found[id(module)] = "norm"
    return found


def breakdown(model: torch.nn.Module, run, device: str) -> dict[str, float]:
    """Milliseconds of one `run()` by category (see the module's docstring): the timeline is cut at every timed
    module's entry and exit, and each piece goes to the innermost timed module running then ("other" outside
    all of them)."""
    cuda = device == "cuda"

    def now():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    marks, stack, handles = [], [], []

    def enter(category, module, args):
        stack.append(category)
        marks.append((now(), category))

    def leave(module, args, output):
        stack.pop()
        marks.append((now(), stack[-1] if stack else "other"))

    modules = {id(m): m for m in model.modules()}
    for key, category in categories(model).items():
        handles.append(modules[key].register_forward_pre_hook(functools.partial(enter, category)))
        handles.append(modules[key].register_forward_hook(leave))
    try:
        marks.append((now(), "other"))
        run()
        marks.append((now(), None))
    finally:
        for handle in handles:
            handle.remove()
    if cuda:
        torch.cuda.synchronize()
    totals = dict.fromkeys(("conv", "norm", "activation", "other"), 0.0)
    for (start, category), (end, _) in itertools.pairwise(marks):
        totals[category] += start.elapsed_time(end) if cuda else (end - start) * 1e3
    return {key: round(value, 3) for key, value in totals.items()}


def kernel_variants(run) -> dict[str, int]:
    """ "direction/variant" -> launches, over one call of `run`: which kernels tconv3d's choice gave a converted
    model's convolutions ("fwd/gluon", "fwd/tma", "fwd/pointer", ...; nothing on the aten path, where no kernel
    launches). A video VAE's causal convs read cached frames or border modes along D: this shows whether they reached
    the TMA and Gluon kernels the table holds for their shapes."""
    from tconv3d.tune import choice

    counts = collections.Counter()
    real = choice.launch_config

    def counted(direction, geom, *tensors, **options):  # run=, channels_after=
        config = real(direction, geom, *tensors, **options)
        counts[f"{direction}/{config.variant}"] += 1
        return config

    choice.launch_config = counted
    try:
        run()
    finally:
        choice.launch_config = real
    return dict(sorted(counts.items()))


def measure(model_name: str, variant: str, device: str, dtype: torch.dtype, scale: int, latent_shape,
            training: bool = False) -> dict:  # fmt: skip
    """Decode once to warm up, then measure: peak memory of one decode and the median time of a few. `training`:
    a decoder fine-tuning step instead of a decode (the decode, then the backward of a fixed random gradient of
    its output into every parameter; parameter gradients dropped before each step)."""
    import tconv3d
    from bench.vaes import build_vae

    vae = build_vae(model_name, scale, dtype=dtype).eval().to(device=device, dtype=dtype)
    if variant.startswith("converted"):
        tconv3d.nn.convert(vae)
    if variant == "converted_upsample_first":  # the resamplers' nearest 2x written, then their conv (no sub-pixel)
        tconv3d.nn.subpixel.SUBPIXEL = False
    decode = lambda z: getattr(out := vae.decode(z), "sample", out)  # noqa: E731 (MONAI's answer a tensor)
    if variant.endswith(("compiled", "inductor")):
        tconv3d.settings.INDUCTOR_KERNELS = variant.endswith("inductor")  # read when the graph is traced
        decode = torch.compile(decode)
    z = torch.randn(latent_shape, device=device, dtype=dtype)
    if training:
        return _measure_training(vae, variant, decode, z)
    if variant.endswith("graph"):
        return _measure_graph(variant, decode, z)
    with torch.no_grad():
        out, peak, ms = _peak_and_time(lambda: decode(z), device, warmup=5)
        row = {"variant": variant, "ms": round(ms, 2), "peak_mb": round(peak, 1), "output": list(out.shape)}
        if not variant.endswith(("compiled", "inductor")):  # hooks would break the compiled graph
            row["breakdown_ms"] = breakdown(vae, lambda: decode(z), device)
        if variant == "converted" and device == "cuda":
            row["kernels"] = kernel_variants(lambda: decode(z))
    return row


def _peak_and_time(run, device: str, warmup: int, before_peak=None) -> tuple:
    """run()'s output, its peak memory in MB and its median time in ms. CPU: the peak is the resident high-water
    mark's rise over the first call (it only rises), the time the median of 3 calls after it. CUDA: a warm-up call
    (compile, config choice, first launches), `before_peak` (what the warm-up left that a call does not keep),
    the peak allocated over one call above what was allocated before it, then do_bench's median."""
    if device == "cpu":
        before = _rss_mb()
        out = run()
        peak = _rss_mb() - before
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return out, peak, statistics.median(times) * 1e3
    import triton

    run()
    if before_peak is not None:
        before_peak()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out, peak, triton.testing.do_bench(run, warmup=warmup, rep=50, return_mode="median")


def _measure_training(vae, variant: str, decode, z: torch.Tensor) -> dict:
    """measure's training step: time (median), peak memory of a step over what the model and the latent hold, the
    parameter gradients' norm (stock's and converted's agree to their precision: a check that both ran the same
    step) and, converted on CUDA, the kernels its convolutions launched in all three directions."""
    if variant.endswith("graph"):
        raise SystemExit("--training: converted_graph captures decodes only")
    device = z.device.type
    parameters = [p for p in vae.parameters() if p.requires_grad]
    gradient = {}  # the output's gradient, drawn once; laid out as the output is (stock's NCDHW, converted's NDHWC)

    def drop_gradients():
        for p in parameters:
            p.grad = None

    def step():
        drop_gradients()
        out = decode(z)
        if "out" not in gradient:
            drawn = torch.randn(out.shape, generator=torch.Generator(z.device).manual_seed(0), device=z.device)
            gradient["out"] = torch.empty_like(out).copy_(drawn)  # the same values, in the output's layout
        out.backward(gradient["out"])
        return out

    out, peak, ms = _peak_and_time(step, device, warmup=3, before_peak=drop_gradients)
    norm = torch.stack([p.grad.double().norm() for p in parameters if p.grad is not None]).norm().item()
    row = {"variant": variant, "training": True, "ms": round(ms, 2), "peak_mb": round(peak, 1),
           "output": list(out.shape), "parameter_gradient_norm": norm}  # fmt: skip
    if variant == "converted" and device == "cuda":
        row["kernels"] = kernel_variants(step)
    return row


def _measure_graph(variant: str, decode, z: torch.Tensor) -> dict:
    """The decode captured in a CUDA graph (after two eager decodes on a side stream, as a capture needs), replayed:
    median replay time, the memory the capture took (the graph's pool: the peak of a replay, which allocates
    nothing), and whether a replay on a new latent equals an eager decode of it bit for bit."""
    import triton

    from bench.run import capture

    if z.device.type != "cuda":
        raise SystemExit("converted_graph needs a CUDA device")
    with torch.no_grad():
        static_z = z.clone()
        graph, static_out, pool = capture(lambda: decode(static_z), warmups=2)
        fresh = torch.randn_like(z)
        static_z.copy_(fresh)
        graph.replay()
        equal = torch.equal(static_out, decode(fresh))
        ms = triton.testing.do_bench(graph.replay, warmup=5, rep=50, return_mode="median")
    return {"variant": variant, "ms": round(ms, 2), "peak_mb": round(pool, 1), "output": list(static_out.shape),
            "replay_equals_eager": equal}  # fmt: skip


def main(argv=None) -> int:
    from bench.vaes import DEFAULT_LATENTS, LATENT_CHANNELS, LATENT_UPSCALERS, MORE_VAES, VOLUME_AUTOENCODERS

    others = {**VOLUME_AUTOENCODERS, **LATENT_UPSCALERS, **MORE_VAES}
    latent_channels = {**LATENT_CHANNELS, **{name: v[0] for name, v in others.items()}}
    default_latents = {**DEFAULT_LATENTS, **{name: v[1] for name, v in others.items()}}
    parser = argparse.ArgumentParser(prog="python -m bench.vae_decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hunyuan_video", choices=list(latent_channels))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None,
                        help="on CUDA bfloat16 (MAISI's: float16), on CPU float32 by default")  # fmt: skip
    parser.add_argument("--scale", type=int, default=4,
                        help="channel width multiplier over the test config; 0: diffusers' default config")  # fmt: skip
    parser.add_argument("--latent", default=None,
                        help="latent shape N,C,T,H,W (C: the model's); default 1,C,3,16,16, or with --scale 0 "
                             "bench.vaes.DEFAULT_LATENTS")  # fmt: skip
    parser.add_argument("--variants", default="stock,converted", help="comma-separated subset of " + ",".join(VARIANTS))
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--training", action="store_true",
                        help="a decoder fine-tuning step (decode + backward) instead of a decode")  # fmt: skip
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process measuring one variant
    args = parser.parse_args(argv)
    native = others[args.model][2] if args.model in others else torch.bfloat16
    dtype = getattr(torch, args.dtype) if args.dtype else native if args.device == "cuda" else torch.float32
    if args.latent is None and args.scale == 0:
        shape = list(default_latents[args.model])
    else:
        shape = [int(v) for v in (args.latent or "1,4,3,16,16").split(",")]
        shape[1] = default_latents[args.model][1] if args.scale == 0 else latent_channels[args.model]
    if args.one:
        print(json.dumps(measure(args.model, args.one, args.device, dtype, args.scale, shape, args.training)))
        return 0
    rows = []
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}")
        child = [sys.executable, "-m", "bench.vae_decode", "--one", variant, "--model", args.model,
                 "--device", args.device, "--dtype", str(dtype).removeprefix("torch."), "--scale", str(args.scale),
                 "--latent", ",".join(map(str, shape)), *(["--training"] if args.training else [])]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # glibc keeps freed memory in its arenas, which makes the resident high-water mark depend on history;
        # tensors from 64 KiB up mapped and unmapped one by one make it the peak of live memory, run to run.
        env.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_ARENA_MAX="1")
        result = subprocess.run(child, capture_output=True, text=True, env=env)
        if result.returncode != 0:  # a result, not the end: the other variants still run
            print(result.stderr[-3000:], file=sys.stderr)
            rows.append({"variant": variant, "failed": result.stderr.strip().splitlines()[-1:] or ["(no output)"]})
            continue
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
    dtype_name = str(dtype).removeprefix("torch.")
    what = "training step (decode + backward)" if args.training else "decode"
    header = f"{args.model} {what}, latent {shape}, {args.device} {dtype_name}, scale {args.scale}"
    print(header)
    print(f"{'variant':20s} {'ms':>10s} {'peak MB':>10s}  output")
    for row in rows:
        if "failed" in row:
            print(f"{row['variant']:20s} FAILED: {row['failed'][0]}")
            continue
        replay = f"  replay equals eager: {row['replay_equals_eager']}" if "replay_equals_eager" in row else ""
        norm = f"  parameter gradients' norm {row['parameter_gradient_norm']:.6g}" if row.get("training") else ""
        print(f"{row['variant']:20s} {row['ms']:10.2f} {row['peak_mb']:10.1f}  {row['output']}{replay}{norm}")
        if "breakdown_ms" in row:
            print(" " * 21 + " / ".join(f"{key} {value:.2f}" for key, value in row["breakdown_ms"].items()) + " ms")
        if row.get("kernels"):
            print(" " * 21 + "kernels: " + ", ".join(f"{key} {count}" for key, count in row["kernels"].items()))
    if args.json:
        import importlib.metadata

        import triton

        from bench.run import git_commit

        library = "monai" if args.model in VOLUME_AUTOENCODERS else "diffusers"
        meta = {
            "setup": header, "device": args.device, "cpu": platform.processor() or platform.machine(),
            "torch": torch.__version__, "triton": triton.__version__, library: importlib.metadata.version(library),
            "commit": git_commit(),
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
            f.write("\n")
    return 1 if any("failed" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
