"""Where the small suite cases lose time in eager mode: the kernel alone (its launcher with the chosen config)
against the whole op (tconv3d.conv3d, autograd), the op under torch.compile(fullgraph=True) (what a compiled
model pays per tconv3d call: issue 29), once as an op call ("compiled") and once with TCONV3D_INDUCTOR_KERNELS's
path, Inductor launching the kernel itself ("inductor"; the same as "compiled" where the launch is on TMA or Gluon
kernels, which stay op calls), and the host's time to issue each; the op's forward and backward again without
call plans (tconv3d/plans.py: each call the whole path). And what Triton's launcher spends encoding one
TMA descriptor (cuTensorMapEncodeTiled), which it does for every descriptor of every launch (2-5 a TMA or Gluon
launch): the saving a cache of encoded maps would buy. And a VAE decoder's GroupNorm with its SiLU at two sizes,
forward and backward, with call plans and without; the op's host time past the launcher's Python wrapper
(kernels/launch.py's _Past, triton 3.6) and through it. For each backward, conv and norm: the host synchronisations
one call makes and a profiler trace by host and device time; last, whether each conv backward captures in a CUDA
graph (H200 runs 9 and 10: a norm backward's host time 10x its stubbed launches', hunyuan_512's backward refused
by a capture). And the norms scenario's host-bound rows as bench times them (converted modules, BatchNorm3d's
among them), with the host's time and a trace of tconv3d's training step. And what of the host's time is the CPU
and what is CUDA (launch_costs): single launches for real and stopped at the driver on this host (issue 29's
per-launch figure), two layers' real host time beside their stubbed one, this CPU's speed at a few steps.

    python tests/gpu/host_overhead.py --out host_overhead.json     # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing

import tconv3d
from bench import host_overhead as host_bench
from tconv3d import plans
from tconv3d.kernels import launch
from tconv3d.kernels.conv_dgrad import conv3d_dgrad
from tconv3d.kernels.conv_fwd import conv3d_fwd
from tconv3d.kernels.conv_wgrad import conv3d_wgrad
from tconv3d.testing import random_conv_inputs
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set

CASES = host_bench.GPU_CASES  # bench/precompile.py compiles their kernels ahead (bench.host_overhead.gpu_launches)
# GroupNorms (32 groups, bf16, affine, SiLU) of a video VAE decoder's latent-sized and mid levels
NORM_SHAPES = ((1, 128, 5, 32, 32), (1, 256, 9, 64, 64))


def host_us(fn, calls: int = 200) -> float:
    """Microseconds the host takes to issue one call, the GPU kept busy enough not to throttle it."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * issued / calls


# CUtensorMapDataType's bf16, CUtensorMapSwizzle's 128 bytes (cuda.h).
_TMA_BF16, _SWIZZLE_128B = 9, 3


def encode_us(calls: int = 2000) -> float | str:
    """Microseconds Triton's launcher takes to encode one tensor map (its driver utils' fill_tma_descriptor, 3.6,
    or fill_tma_descriptor_tiled, 3.7 on): a 5-D bf16 map of an NDHWC activation [2, 8, 16, 16, 320] in
    [1, 1, 8, 16, 64] boxes with the 128-byte swizzle, as a TMA forward's input. Why not, where it cannot."""
    x = torch.empty(2, 8, 16, 16, 320, device="cuda", dtype=torch.bfloat16)
    utils = triton.runtime.driver.active.utils
    fill = getattr(utils, "fill_tma_descriptor_tiled", None) or getattr(utils, "fill_tma_descriptor", None)
    if fill is None:
        return "this Triton's driver utils have no tensor-map encoder by the names known"
    args = (x.data_ptr(), _SWIZZLE_128B, 2, _TMA_BF16, [1, 1, 8, 16, 64], list(x.shape), list(x.stride()), 0)
    try:
        fill(*args)
    except Exception as error:  # another signature: say so, measure the rest
        return f"{type(error).__name__}: {error}"[:200]
    start = time.perf_counter()
    for _ in range(calls):
        fill(*args)
    return 1e6 * (time.perf_counter() - start) / calls


def measure(name: str, dtype_name: str) -> dict:
    shape = next(s for s in load_shape_set("bench") if s.name == name)
    dtype, geom = DTYPES_BY_NAME[dtype_name], shape.geometry()
    x, w = random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, "cuda")
    g = torch.randn(geom.output_shape(), device="cuda").to(dtype).contiguous(memory_format=torch.channels_last_3d)
    pick = {d: choice.pick_config(d, geom, dtype, x.device) for d in ("fwd", "dgrad", "wgrad")}
    kernels = {
        "fwd": lambda: conv3d_fwd(x, w, None, None, geom, pick["fwd"]),
        "dgrad": lambda: conv3d_dgrad(g, w, geom, pick["dgrad"]),
        "wgrad": lambda: conv3d_wgrad(g, x, None, geom, pick["wgrad"]),
    }
    op = lambda: tconv3d.conv3d(x, w, None, shape.stride, shape.padding, shape.dilation)  # noqa: E731
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = tconv3d.conv3d(xg, wg, None, shape.stride, shape.padding, shape.dilation)
    bwd = lambda: torch.autograd.grad(y, (xg, wg), g, retain_graph=True)  # noqa: E731
    ms = {k: triton.testing.do_bench(f, return_mode="median") for k, f in kernels.items()}
    ms["op_fwd"] = triton.testing.do_bench(op, return_mode="median")
    ms["op_bwd"] = triton.testing.do_bench(bwd, return_mode="median")
    op_whole, bwd_whole = plans.bypassed()(op), plans.bypassed()(bwd)  # the same calls, no call plans (plans.py)
    ms["op_fwd_no_plans"] = triton.testing.do_bench(op_whole, return_mode="median")
    ms["op_bwd_no_plans"] = triton.testing.do_bench(bwd_whole, return_mode="median")
    compiled = torch.compile(op, fullgraph=True)
    compiled()  # compiles
    ms["compiled_fwd"] = triton.testing.do_bench(compiled, return_mode="median")
    # Another function (dynamo caches per code object), traced with the setting on: the graph holds the kernels.
    handed_over = lambda: tconv3d.conv3d(x, w, None, shape.stride, shape.padding, shape.dilation)  # noqa: E731
    refusal = choice.inductor_refusal("fwd", geom, x, w)
    tconv3d.settings.INDUCTOR_KERNELS = True
    try:
        inductor = torch.compile(handed_over, fullgraph=True)
        inductor()  # compiles
    finally:
        tconv3d.settings.INDUCTOR_KERNELS = False
    ms["inductor_fwd"] = triton.testing.do_bench(inductor, return_mode="median")
    us = {
        "launcher_fwd": host_us(kernels["fwd"]), "op_fwd": host_us(op), "op_bwd": host_us(bwd),
        "compiled_fwd": host_us(compiled), "inductor_fwd": host_us(inductor),
        "op_fwd_no_plans": host_us(op_whole), "op_bwd_no_plans": host_us(bwd_whole),
    }  # fmt: skip
    past, launch.WRAPPER = launch.WRAPPER, "timed through the launcher's wrapper"  # the launches as before _Past
    try:
        us["op_fwd_wrapper"], us["op_bwd_wrapper"] = host_us(op), host_us(bwd)
    finally:
        launch.WRAPPER = past
    us["past_wrapper"] = past is None
    return {"case": name, "dtype": dtype_name, "configs": {k: str(v) for k, v in pick.items()}, "ms": ms,
            "host_us": us, "inductor_refusal": refusal, "launcher_profile": profiled(kernels["fwd"]),
            "bwd_synchronizes": synchronizing(bwd), "bwd_trace": traced(bwd)}  # fmt: skip


def launch_costs(rows: list) -> dict:
    """Issue 29's per-launch host time on this GPU, and what of a layer's host time is the CUDA launch's own: the
    launch-path layer's launches (bench.host_overhead.triton_launch) through Triton's run and the direct path, for
    real and stopping at the driver on this host's CPU; `rows`' first two bf16 cases' forward and backward on the
    kernels this device chooses, stopping at the driver (bench.host_overhead.plan_replay: what a CPU machine's
    stubs time), beside their real host time (measure()'s op_fwd and op_bwd); and this host's CPU at a few steps
    every launch takes (host_speed), against which this VM's stubbed figures scale. Real less stubbed, on one host:
    what the launch costs past the Python (driver calls, descriptors, allocations on the GPU). Each part reports
    its error in its place."""
    found = {}
    device = (torch.cuda.get_device_name(), configs.multiprocessor_count(torch.device("cuda")),
              configs.compute_capability(torch.device("cuda")))  # fmt: skip
    cases = [r["case"] for r in rows if r["dtype"] == "bf16"][:2]
    parts = {
        "host_speed_us": lambda: host_bench.host_speed(1000, "cuda"),
        "launch_us": lambda: host_bench.triton_launch(300, "cuda"),
        "launch_stubbed_us": lambda: host_bench.triton_launch(300, "cpu"),
        "layers_stubbed_us": lambda: host_bench.plan_replay(50, cases, device),
        "host_speed_after_us": lambda: host_bench.host_speed(1000, "cuda"),  # a host's speed drifts: both ends
    }
    for name, part in parts.items():
        try:
            found[name] = part()
        except Exception as error:  # one part's failure leaves the others measured
            found[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        print("measured:", json.dumps({name: found[name]}), flush=True)
    found["layers_us"] = {r["case"]: {"fwd": r["host_us"]["op_fwd"], "bwd": r["host_us"]["op_bwd"]} for r in rows
                          if r["case"] in cases and r["dtype"] == "bf16"}  # fmt: skip
    return found


def print_launch_costs(found: dict) -> None:
    """launch_costs' figures: a line a launch (real, stubbed, the difference of the direct paths) and a layer."""
    real, stubbed = found["launch_us"], found["launch_stubbed_us"]
    print("per launch, us of host time: Triton's run / the direct path, launched here; stopping at the driver here;"
          " direct launched less direct stopped")  # fmt: skip
    for name, t in real.items():
        s = stubbed.get(name)
        if name in ("off", "error") or not isinstance(s, dict):
            print(f"{name:22s} {t}  stubbed: {s}")
            continue
        print(f"{name:22s} {t['run']:6.1f} / {t['direct']:6.1f}   {s['run']:6.1f} / {s['direct']:6.1f}   "
              f"{t['direct'] - s['direct']:+6.1f}")  # fmt: skip
    replays = found["layers_stubbed_us"]
    for case, real_us in found["layers_us"].items():
        stub = {d: t["plans"] for d, t in replays.get(case, {}).items() if d in ("fwd", "bwd")}
        cells = [
            f"{d} {real_us[d]:6.0f} launched, {us:6.1f} stopped ({real_us[d] - us:+5.0f})" for d, us in stub.items()
        ]
        print(f"{case} bf16 with call plans, us of host time: {'; '.join(cells) or replays}")
    for when in ("", "_after"):
        speed = found[f"host_speed{when}_us"]
        print(f"this host's CPU{when.replace('_', ' ')}, us a step: "
              + ", ".join(f"{k} {v:.2f}" for k, v in speed.items() if k != "error")
              + (f" ({speed['error']})" if "error" in speed else ""))  # fmt: skip


def launcher_states() -> list[str]:
    """How each kernel the direct path has compiled launches, one line each: past Triton's launcher wrapper
    (launch._Past) or through it, and why. H200 run 11: the profile of a direct forward showed the wrapper's
    `inner` and CudaLauncher.__call__ at every launch; launch_compiled took Triton's empty hook chains for hooks
    set (mended since: launch._hook_set)."""
    from triton import knobs

    hooks = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    lines = [f"launch.WRAPPER: {launch.WRAPPER}; launch hooks set: {[launch._hook_set(h) for h in hooks]}"]
    for compiled, _ in list(launch._compiled.values()):
        runner = compiled.run
        past = compiled.__dict__.get("_tconv3d_past", "never asked")
        inner = getattr(getattr(runner, "launch", None), "__code__", None)
        lines.append(
            f"  {compiled.name}: past={type(past).__name__ if past not in (False, 'never asked') else past} "
            f"launcher={type(runner).__name__} scratch={getattr(runner, 'global_scratch_size', '?')}"
            f"/{getattr(runner, 'profile_scratch_size', '?')} wrapped={inner.co_name if inner else 'C launch'}"
        )
    return lines


CAPTURE_RECIPES = ("default_stream", "side_stream", "whole_step")


def capture_errors(device: str = "cuda") -> dict:
    """Whether each of CASES' backward captures in a CUDA graph, cuDNN's (F.conv3d) first, then tconv3d's, each by
    three recipes: {"impl case dtype recipe": None, or the error}, in the order tried. H200 runs 10 and 11: the
    first backward capture of a process failed (hunyuan_512's in the bench, unet_320's here), later ones passed,
    and test_plans' capture (its leaves first used on the default stream) failed with cudaErrorStreamCaptureImplicit:
    an autograd node keeps the stream it was made on (pytorch#164302). The recipes: `default_stream`, the forward
    made on the default stream and the backward captured (the bench's graph column); `side_stream`, the leaves first
    used and the forward made on a side stream (PyTorch's recipe); `whole_step`, forward and backward captured
    together. Inputs are drawn on the CPU: a failed capture can leave CUDA's default generator in capture mode."""
    from bench import run

    errors = {}
    for impl, conv in (("cudnn", torch.nn.functional.conv3d), ("tconv3d", tconv3d.conv3d)):
        for name, dtype_name in CASES:
            shape = next(s for s in load_shape_set("bench") if s.name == name)
            for recipe in CAPTURE_RECIPES:
                key = f"{impl} {name} {dtype_name} {recipe}"
                try:
                    _capture_backward(run, conv, shape, DTYPES_BY_NAME[dtype_name], recipe, device)
                    errors[key] = None
                except Exception as error:  # the finding
                    errors[key] = f"{type(error).__name__}: {error}"[:300]
    return errors


def _capture_backward(run, conv, shape, dtype, recipe: str, device: str) -> None:
    """One backward of `conv` on `shape` captured by `recipe` (capture_errors), through bench.run (`run`)."""
    x, w = (t.to(device) for t in random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, "cpu"))
    padding = shape.padding if conv is tconv3d.conv3d else shape.padding[0::2]  # the bench's cases are symmetric
    args = (None, shape.stride, padding, shape.dilation)
    g = torch.randn(conv(x, w, *args).shape).to(device, dtype).contiguous(memory_format=torch.channels_last_3d)
    x, w = x.requires_grad_(), w.requires_grad_()
    if recipe == "whole_step":
        run.capture(lambda: torch.autograd.grad(conv(x, w, *args), (x, w), g))
        return
    forward = lambda: conv(x, w, *args)  # noqa: E731
    y = run.on_side_stream(forward) if recipe == "side_stream" else forward()
    run.capture(lambda: torch.autograd.grad(y, (x, w), g, retain_graph=True))


def profiled(fn, calls: int = 200, top: int = 15) -> list[str]:
    """Where the host's time to issue `fn` goes: cProfile over `calls` calls, the `top` functions by own time, one
    line each (calls, own us a call of fn, cumulative us a call of fn, function). H200 run 6: a Gluon launch's
    launcher cost 130-170 us of host time where the same launch, stopped at the driver on a CPU machine, costs 40
    (unet_320's split forward): this says whether Python or the launch itself holds the rest."""
    import cProfile
    import pstats

    fn()
    torch.cuda.synchronize()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    profile.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:top]  # (file, line, name) -> (cc, nc, tt, ct)
    return [
        f"{nc:6d} {1e6 * tt / calls:8.1f} {1e6 * ct / calls:8.1f}  {Path(file).name}:{line}({name})"
        for (file, line, name), (cc, nc, tt, ct, callers) in rows
    ]


def measure_norm(shape) -> dict:
    """The GroupNorm op of `shape` forward, and backward through autograd, with call plans and without: ms and the
    host's us a call (three launches each way since the statistics fold on the device, the backward four)."""
    cl = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(shape, **cl).contiguous(memory_format=torch.channels_last_3d)
    w, b = torch.randn(shape[1], **cl), torch.randn(shape[1], **cl)
    op = lambda: tconv3d.ops.call_group_norm(x, w, b, 32, 1e-6, "silu")  # noqa: E731
    xg, wg, bg = (t.detach().requires_grad_() for t in (x, w, b))
    y = tconv3d.ops.call_group_norm(xg, wg, bg, 32, 1e-6, "silu")[0]
    g = torch.randn_like(y)
    bwd = lambda: torch.autograd.grad(y, (xg, wg, bg), g, retain_graph=True)  # noqa: E731
    calls = {"fwd": op, "bwd": bwd, "fwd_no_plans": plans.bypassed()(op), "bwd_no_plans": plans.bypassed()(bwd)}
    saved = tconv3d.ops.call_group_norm(xg, wg, bg, 32, 1e-6, "silu")[1:]  # mean, rstd

    @torch.no_grad()  # as autograd's engine calls it
    def direct():
        return torch.ops.tconv3d.group_norm_backward(g, xg, *saved, wg, bg, 32, "silu")

    calls["bwd_op_alone"] = direct  # the backward op without autograd's engine around it
    return {"shape": list(shape), "ms": {k: triton.testing.do_bench(f, return_mode="median") for k, f in calls.items()},
            "host_us": {k: host_us(f) for k, f in calls.items()},
            "bwd_synchronizes": synchronizing(bwd), "bwd_trace": traced(bwd)}  # fmt: skip


# bench.run's NORM_LAYERS rows the host bounds (H200 run 12: forward+backward 0.61x and 0.20x torch's, a backward
# of about 0.6 and 1.0 ms whatever the size)
NORM_MODULE_ROWS = ("hunyuan_gn_silu_512", "densenet_batch_256")


def measure_norm_modules(names=NORM_MODULE_ROWS) -> list[dict]:
    """The bench's norm scenario rows `names` (bench.run.norm_case: converted modules, bf16, training) timed as it
    times them, torch's and tconv3d's, forward and forward+backward, with the host's us a call; for tconv3d's
    step, its host synchronisations and a profiler trace."""
    from bench import run

    rows = []
    for name, kind, batch, channels, size in run.NORM_LAYERS:
        if name not in names:
            continue
        x, modules = run.norm_case(kind, batch, channels, size, "cuda")
        row = {"name": name, "ms": {}, "host_us": {}}
        steps = run.norm_steps(x, modules)
        for (impl, direction), fn in steps.items():
            row["ms"][f"{impl}_{direction}"] = triton.testing.do_bench(fn, return_mode="median")
            row["host_us"][f"{impl}_{direction}"] = host_us(fn)
        step = steps["tconv3d", "fwd+bwd"]
        row["step_synchronizes"], row["step_trace"] = synchronizing(step), traced(step)
        rows.append(row)
    return rows


def synchronizing(fn) -> list[str]:
    """The host synchronisations one call of `fn` makes (torch's sync debug mode: a read of device memory to the
    host, a blocking copy), one line each: a call that waits for the GPU every time is bound by its kernels' queue,
    not its own Python. H200 run 9: a GroupNorm backward's host time was 606 us where its launches, stubbed on a
    CPU machine, cost 61 (the forward: 92 against 36, a convolution's backward 229 against 84)."""
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [str(w.message).splitlines()[0][:160] for w in caught]


def traced(fn, calls: int = 20, top: int = 12) -> list[str]:
    """Where `calls` calls of `fn` spend their time by torch.profiler: the `top` entries by host time and by device
    time (name, calls a call of fn, host us, device us a call of fn), so that a slow backward shows whether its
    host or a kernel of its holds it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    lines = []
    for label, attr in (("host", "self_cpu_time_total"), ("device", "self_device_time_total")):
        lines.append(f"by {label} time:")
        for e in sorted(events, key=lambda e: -getattr(e, attr, 0.0))[:top]:
            lines.append(f"  {e.key[:60]:60s} {e.count / calls:5.1f} {e.self_cpu_time_total / calls:8.1f} "
                         f"{getattr(e, 'self_device_time_total', 0.0) / calls:8.1f}")  # fmt: skip
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    # Each measurement's figures printed as it ends (a call cut at its limit keeps them in its log), the norms first
    norms, rows = [], []
    for shape in NORM_SHAPES:
        norms.append(measure_norm(shape))
        print("measured:", json.dumps(norms[-1]), flush=True)
    modules = measure_norm_modules()
    for r in modules:
        print("measured:", json.dumps({k: v for k, v in r.items() if k != "step_trace"}), flush=True)
    for name, dtype in CASES:
        rows.append(measure(name, dtype))
        print("measured:", json.dumps({k: v for k, v in rows[-1].items() if k != "launcher_profile"}), flush=True)
    encode = encode_us()
    launchers = launcher_states()
    costs = launch_costs(rows)  # before the captures: a failed capture can leave the process unfit to launch
    captures = capture_errors()
    if args.out is not None:
        found = {"device": torch.cuda.get_device_name(), "rows": rows, "group_norms": norms, "norm_modules": modules,
                 "tensor_map_encode_us": encode, "launchers": launchers, "launch_costs": costs,
                 "backward_captures": captures}  # fmt: skip
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    print(f"{'case':12s} {'dtype':5s} {'fwd':>7s} {'op_fwd':>7s} {'compiled':>8s} {'inductor':>8s} {'dgrad':>7s} "
          f"{'wgrad':>7s} {'op_bwd':>7s}  host us: launcher op_fwd compiled inductor op_bwd; without call plans: "
          "op_fwd op_bwd ms, op_fwd op_bwd host us")  # fmt: skip
    for r in rows:
        m, u = r["ms"], r["host_us"]
        note = f"  (op call: {r['inductor_refusal'][:40]})" if r["inductor_refusal"] else ""
        print(f"{r['case']:12s} {r['dtype']:5s} {m['fwd']:7.3f} {m['op_fwd']:7.3f} {m['compiled_fwd']:8.3f} "
              f"{m['inductor_fwd']:8.3f} {m['dgrad']:7.3f} {m['wgrad']:7.3f} {m['op_bwd']:7.3f}  "
              f"{u['launcher_fwd']:6.0f} {u['op_fwd']:6.0f} {u['compiled_fwd']:8.0f} {u['inductor_fwd']:8.0f} "
              f"{u['op_bwd']:6.0f}; {m['op_fwd_no_plans']:7.3f} {m['op_bwd_no_plans']:7.3f} "
              f"{u['op_fwd_no_plans']:6.0f} {u['op_bwd_no_plans']:6.0f}{note}")  # fmt: skip
    print("GroupNorm + SiLU, bf16: ms fwd bwd, host us fwd bwd; without call plans: the same")
    for r in norms:
        m, u = r["ms"], r["host_us"]
        print(
            f"{'x'.join(map(str, r['shape'])):18s} {m['fwd']:7.3f} {m['bwd']:7.3f} {u['fwd']:6.0f} {u['bwd']:6.0f}; "
            f"{m['fwd_no_plans']:7.3f} {m['bwd_no_plans']:7.3f} {u['fwd_no_plans']:6.0f} {u['bwd_no_plans']:6.0f}"
        )
    for r in norms:
        u = r["host_us"]
        print(
            f"GroupNorm {'x'.join(map(str, r['shape']))} backward: op alone {u['bwd_op_alone']:.0f} us host, "
            f"{r['ms']['bwd_op_alone']:.3f} ms; host synchronisations a call: {len(r['bwd_synchronizes'])}"
        )
        print("\n".join(r["bwd_synchronizes"][:5] + r["bwd_trace"]))
    for r in modules:
        m, u = r["ms"], r["host_us"]
        cells = "  ".join(f"{k} {m[k]:.3f} ms {u[k]:.0f} us" for k in m)
        print(f"norm module {r['name']}: {cells}; tconv3d's step: host synchronisations {len(r['step_synchronizes'])}")
        print("\n".join(r["step_synchronizes"][:5] + r["step_trace"]))
    for r in rows:
        u = r["host_us"]
        print(f"{r['case']} {r['dtype']}: host us with plans, past the launcher's wrapper ({u['past_wrapper']}) "
              f"fwd {u['op_fwd']:.0f} bwd {u['op_bwd']:.0f}; through it fwd {u['op_fwd_wrapper']:.0f} "
              f"bwd {u['op_bwd_wrapper']:.0f}")  # fmt: skip
    for r in rows:
        print(f"{r['case']} {r['dtype']} backward: host synchronisations a call: {len(r['bwd_synchronizes'])}")
        print("\n".join(r["bwd_synchronizes"][:5] + r["bwd_trace"]))
    print("\n".join(launchers))
    print_launch_costs(costs)
    for key, error in captures.items():
        print(f"{key}: backward captured in a CUDA graph: {error or 'ok'}")
    print(f"one tensor map encoded by Triton's launcher: {encode if isinstance(encode, str) else f'{encode:.2f} us'}")
    for r in rows[:2]:
        print(f"{r['case']} {r['dtype']}: the forward launcher's host time by function (calls, own us, cumulative us)")
        print("\n".join(r["launcher_profile"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
