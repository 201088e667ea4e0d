"""python -m bench.host_overhead: the host's time per layer call, tconv3d against nn.Conv3d (issue 19).

First the host CPU's own speed at a few steps every launch path takes (host_speed: Python, a view, an
allocation), the yardstick for setting one host's figures against another's. On a tiny input the convolution
itself is nearly free, so what is timed is the Python and dispatch around it: nn.Conv3d, tconv3d.nn.Conv3d,
tconv3d.conv3d and torch.ops.tconv3d.conv3d, under no_grad and with autograd recording (inputs that require grad;
forward only), then the backward of nn.Conv3d and tconv3d.nn.Conv3d (one retained forward, gradients to input,
weight and bias). On CPU tconv3d runs torch's own conv3d inside its op (the
aten path) unless TRITON_INTERPRET=1; on CUDA the Triton kernel runs and the GPU is synchronised only once per
timing loop, so the figure is the host's issue time whenever the kernel is shorter than it.

Then the launch path alone: each direction's launcher (argument preparation, descriptors, grid) with every
Triton kernel replaced by a stand-in that launches nothing, pointer variant against TMA variant, on a bf16
64-channel 4x16x16 layer (runs on CPU: the launchers need no GPU to build a launch). Then Triton's side of
the same launches: JITFunction.run against the direct path (issue 29), the kernels compiled for sm_90 and each
launcher a stand-in, so both stop at the driver; and the compiled launcher's own Python (Triton's CudaLauncher and
tensor-descriptor wrapper) against the direct path's way past it (launch._Past), around stand-ins for the C launch
and the map encode. Last, whole layers as the H100 runs them (the configs
choice.choose gives that device, compiled for sm_90, launches stopping at the driver): a forward and a backward
of the suite's host-bound cases with call plans (tconv3d/plans.py) and without, taking turns in one loop; and the
forward of a layer with a second source on the pointer kernels (a skip connection's channels, cached frames),
its tensors at other addresses every call, as a decoder's are; and converted norm modules' forward and training
step (bench.run's norm kinds: GroupNorm+SiLU, InstanceNorm3d, BatchNorm3d alone and with its ReLU, Wan's RMS
norm) the same way. tests/gpu/host_overhead.py runs host_speed, triton_launch (for real and stopped) and
plan_replay on a GPU machine's host, beside that GPU's real launches.

    python -m bench.host_overhead [--device cpu|cuda] [--calls 1000] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

import tconv3d
from bench.run import git_commit
from tconv3d.geometry import check_conv3d
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_tma, conv_wgrad, split_k
from tconv3d.kernels.config import KernelConfig

CL = torch.channels_last_3d
SHAPE = (1, 4, 2, 3, 3)  # the tiny input: Cin 4, a 2x3x3 volume


def per_call_us(fns: dict, calls: int, rounds: int = 15) -> dict:
    """{name: the median over `rounds` of the mean host time of one call, in microseconds}. The functions take
    turns within each round, so that a shared VM's drifting speed moves all of them alike and their ratios hold
    (timed one after another, single figures moved 10-30% between runs, issue 19)."""
    for fn in fns.values():
        for _ in range(min(calls, 200)):  # warm-up: config choice, first compile, caches
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


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
            results[mode] = per_call_us(calls_of, calls)
    # The backward of one forward (retained), to the input, weight and bias: the autograd engine and the gradient
    # launches.
    x = torch.randn(SHAPE, device=device).contiguous(memory_format=CL).requires_grad_()
    backward_of = {}
    for name, layer in (("nn.Conv3d", stock), ("tconv3d.nn.Conv3d", ours)):
        y = layer(x)
        grad = torch.randn_like(y)
        backward_of[name] = lambda y=y, grad=grad, layer=layer: torch.autograd.grad(
            y, (x, layer.weight, layer.bias), grad, retain_graph=True
        )
    results["backward"] = per_call_us(backward_of, calls)
    return results


class _NoLaunch:
    """A kernel stand-in: the launcher builds its grid and arguments as for a real launch; nothing runs."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


KERNELS = (
    (conv_fwd, "_conv3d_fwd_kernel"), (conv_dgrad, "_conv3d_dgrad_kernel"), (conv_wgrad, "_conv3d_wgrad_kernel"),
    (split_k, "_sum_splits_kernel"), (conv_tma, "_conv3d_tma_kernel"), (conv_tma, "_conv3d_wgrad_tma_kernel"),
)  # fmt: skip


@contextlib.contextmanager
def _kernels_stubbed():
    saved = [(module, name, getattr(module, name)) for module, name in KERNELS]
    try:
        for module, name, _ in saved:
            setattr(module, name, _NoLaunch())
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


def _python_steps(layer, table: dict, key: tuple, steps: int = 100) -> int:
    """`steps` times what a launch path does most between its tensor calls: a call, attribute reads, a dict
    lookup, a type test, a tuple built."""
    found = 0
    for _ in range(steps):
        found += _python_step(layer, table, key)
    return found


def _python_step(layer, table: dict, key: tuple) -> int:
    stride, padding = layer.stride, layer.padding
    entry = table.get((key, stride, padding))
    return len((stride, padding, entry)) if isinstance(key, tuple) else 0


def host_speed(calls: int, device: str = "cpu") -> dict:
    """Microseconds this host's CPU takes for a few steps every launch path takes, timed in turns: 100 steps of
    Python (_python_steps), and torch's dispatch of a view, a stride query and an allocation of 64 elements on the
    CPU; on "cuda" also an allocation from the caching allocator, the launch of aten's add of 64 elements and a
    query of the current stream. The same figures from two hosts say how far the same stubbed launch path's times
    should differ on them by their CPUs alone (the H200's host times ran 3-10x this VM's stubbed launches)."""
    layer, t = torch.nn.Conv3d(1, 1, 1), torch.empty(64)
    table = {((1, 2), layer.stride, layer.padding): "config"}
    steps = {
        "python, 100 steps": lambda: _python_steps(layer, table, (1, 2)),
        "Tensor.view": lambda: t.view(8, 8),
        "Tensor.stride": lambda: t.stride(),
        "torch.empty cpu": lambda: torch.empty(64),
    }
    if device == "cuda":
        u = torch.ones(64, device="cuda")
        steps |= {
            "torch.empty cuda": lambda: torch.empty(64, device="cuda"),
            "torch.add cuda": lambda: torch.add(u, u),
            "torch.cuda.current_stream": lambda: torch.cuda.current_stream(),
        }
    return per_call_us(steps, calls)


# The launch-path layer (launch_path, triton_launch, launcher_past): bf16, 1 x 64 x 4 x 16 x 16, 64 -> 64 channels,
# 3x3x3, padding 1, on 64 x 64 x 32 tiles split in two along the reduction.
LAYER_INPUT, LAYER_WEIGHT = (1, 64, 4, 16, 16), (64, 64, 3, 3, 3)
LAYER_POINTER = KernelConfig(64, 64, 32, 4, 3, split_k=2)
LAYER_TMA = dataclasses.replace(LAYER_POINTER, tma_box_w=16)


def _layer(device: str = "cpu"):
    """The launch-path layer's input, output gradient and weight (random, NDHWC, bf16 on `device`) and geometry."""
    cl = dict(device=device, dtype=torch.bfloat16, memory_format=CL)
    x, grad_out = torch.randn(LAYER_INPUT).to(**cl), torch.randn(LAYER_INPUT).to(**cl)
    w = torch.randn(LAYER_WEIGHT).to(**cl)
    return x, grad_out, w, check_conv3d(x, w, None, 1, 1, 1, 1)


def launch_path(calls: int) -> dict:
    """Host time of one launch per direction, pointer and TMA variants, with the kernels stubbed out."""
    x, grad_out, w, geom = _layer()
    configs = {"pointer": LAYER_POINTER, "tma": LAYER_TMA}
    launchers = {
        "fwd": lambda config: conv_fwd.conv3d_fwd(x, w, None, None, geom, config),
        "dgrad": lambda config: conv_dgrad.conv3d_dgrad(grad_out, w, geom, config),
        "wgrad": lambda config: conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, config),
    }
    launches = {
        (direction, name): lambda launch=launch, config=config: launch(config)
        for direction, launch in launchers.items()
        for name, config in configs.items()
    }
    with _kernels_stubbed():
        times = per_call_us(launches, calls)
    return {direction: {name: times[direction, name] for name in configs} for direction in launchers}


def triton_launch(calls: int, device: str = "cpu") -> dict:
    """Host time of Triton's side of one launch, per kernel: JITFunction.run against the direct path
    (tconv3d/kernels/launch.py), on the launch-path layer's calls. On "cpu" both stop at the driver (the kernels
    compiled for sm_90, each compiled kernel's launcher a stand-in; inspect.compile.stubbed_launches); on "cuda"
    they launch on the GPU (the layer's kernels take a few microseconds there, so the host's time is what is
    timed): issue 29's per-launch host time, and on the same host, less the stubbed figure, what the launch itself
    costs past Triton's and tconv3d's Python."""
    from tconv3d.inspect.compile import stubbed_launches
    from tconv3d.kernels import conv_gluon, group_norm, launch

    if launch.OFF is not None:
        return {"off": launch.OFF}
    x, grad_out, w, geom = _layer(device)
    captured = []

    def capturing(kernel, grid, *args, **kwargs):
        captured.append((kernel, grid, args, kwargs))
        return launch.launch(kernel, grid, *args, **kwargs)

    modules = (conv_fwd, conv_dgrad, conv_wgrad, conv_tma, conv_gluon, group_norm)
    saved = [(module, module.launch) for module in modules]
    times = {}
    with stubbed_launches(90) if device == "cpu" else contextlib.nullcontext():
        try:
            for module in modules:
                module.launch = capturing
            conv_fwd.conv3d_fwd(x, w, None, None, geom, LAYER_POINTER)
            conv_fwd.conv3d_fwd(x, w, None, None, geom, LAYER_TMA)
            conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, LAYER_POINTER)
        finally:
            for module, original in saved:
                module.launch = original
        for kernel, grid, args, kwargs in captured:
            # what launch() hands run (`_distances` is launch's own)
            kwargs = {"enable_fp_fusion": launch.FP_FUSION, **{k: v for k, v in kwargs.items() if k != "_distances"}}
            paths = {
                "run": lambda k=kernel, g=grid, a=args, kw=kwargs: k.run(*a, grid=g, warmup=False, **kw),
                "direct": lambda k=kernel, g=grid, a=args, kw=kwargs: launch.launch(k, g, *a, **kw),
            }
            name = kernel.__name__.strip("_").removesuffix("_kernel")
            times[name] = {"arguments": len(args) + len(kwargs), **per_call_us(paths, calls)}
    return times


def launcher_past(calls: int) -> dict:
    """Host time of the compiled launcher's side of a launch (issue 29), per kernel: Triton's own CudaLauncher.__call__
    and tensor-descriptor wrapper against launch._Past, which calls the C launch past them, for the launch-path
    layer's TMA and Gluon forwards (compiled for sm_90). Both call a stand-in for the C launch, and the driver's map
    encode is a stand-in too (no driver here; on a GPU each map's encode, some microseconds, is what _Past keeps
    across launches on top). Checked first: both hand the stand-in the same arguments."""
    import types

    from triton.backends.nvidia import driver as nvidia
    from triton.runtime import driver as triton_driver

    from tconv3d.inspect.compile import stubbed_launches
    from tconv3d.kernels import launch

    if launch.WRAPPER is not None:
        return {"off": launch.WRAPPER}
    x, _, w, geom = _layer()
    tma = dataclasses.replace(LAYER_TMA, split_k=1)
    launched = {}
    with stubbed_launches(90, []) as record:
        for name, config in (("tma fwd", tma), ("gluon fwd", dataclasses.replace(tma, gluon=1))):
            record.clear()
            conv_fwd.conv3d_fwd(x, w, None, None, geom, config)
            (compiled, _), = list(launch._compiled.values())[-1:]  # fmt: skip
            launched[name] = (compiled, record[-1][1])
    utils = types.SimpleNamespace(fill_tma_descriptor=lambda *a: "map", fill_tma_descriptor_tiled=lambda *a: "map")
    saved_driver, triton_driver._active = triton_driver._active, types.SimpleNamespace(utils=utils)
    times = {}
    try:
        for name, (compiled, handed) in launched.items():
            (grid_0, grid_1, grid_2, stream, _, packed), values = handed[:6], handed[9:]  # values: past the hooks
            calls_made = []

            def c_launch(*args, calls_made=calls_made):  # records the first two launches: the check below
                if len(calls_made) < 2:
                    calls_made.append(args)

            runner = object.__new__(nvidia.CudaLauncher)
            metas = getattr(compiled.metadata, "tensordesc_meta", None)
            runner.launch = nvidia.wrap_handle_tensordesc(c_launch, compiled.src.signature, metas)
            runner.global_scratch_size = runner.profile_scratch_size = 0
            runner.global_scratch_align = runner.profile_scratch_align = 1
            runner.num_ctas, runner.launch_cooperative_grid, runner.launch_pdl = 1, False, False
            runner.arg_annotations, runner.kernel_signature, runner.gsan_enabled = (), b"", False
            stand = types.SimpleNamespace(run=runner, function=0, packed_metadata=packed)
            past = launch._past_of(runner, nvidia)
            if past is None:
                times[name] = {"refused": "launch._past_of took no _Past for this kernel"}
                continue
            paths = {
                "wrapper": lambda r=runner, g=(grid_0, grid_1, grid_2, stream), p=packed, v=values: r(*g, 0, p, None,
                                                                                                      None, None, *v),
                "past": lambda p=past, s=stand, g=(grid_0, grid_1, grid_2, stream), v=values: p(s, *g, v),
            }  # fmt: skip
            paths["wrapper"](), paths["past"]()
            if len({repr(call) for call in calls_made}) != 1:
                raise AssertionError(f"{name}: _Past handed the C launch other arguments than Triton's wrapper")
            times[name] = {"arguments": len(values), **per_call_us(paths, calls)}
    finally:
        triton_driver._active = saved_driver
    return times


# tests/gpu/host_overhead.py's layers, timed there with real launches: the suite's host-bound cases.
GPU_CASES = (("unet_320", "bf16"), ("down_s2", "bf16"), ("hunyuan_512", "bf16"), ("hunyuan_512", "fp16"))


def gpu_launches(device) -> list:
    """What tests/gpu/host_overhead.py launches on `device` (a CUDA device, or bench.precompile's posing_as), as
    (direction, geometry, dtype, config): GPU_CASES' chosen configs in each direction, and triton_launch's three
    launches of the launch-path layer. bench/precompile.py compiles them ahead of a GPU session's host stage."""
    from tconv3d.tune import choice
    from tconv3d.tune.shapes import DTYPES_BY_NAME, load_shape_set

    shapes = {s.name: s for s in load_shape_set("bench")}
    launches = []
    for name, dtype_name in GPU_CASES:
        geom, dtype = shapes[name].geometry(), DTYPES_BY_NAME[dtype_name]
        launches += [(d, geom, dtype, choice.pick_config(d, geom, dtype, device)) for d in ("fwd", "dgrad", "wgrad")]
    geom, bf16 = _layer("meta")[3], torch.bfloat16
    return [*launches, ("fwd", geom, bf16, LAYER_POINTER), ("fwd", geom, bf16, LAYER_TMA),
            ("wgrad", geom, bf16, LAYER_POINTER)]  # fmt: skip


# The suite's host-bound layers; "+bias" adds a bias to the layer (its gradient among the backward's launches).
PLAN_CASES = ("unet_320", "unet_320+bias", "down_s2", "hunyuan_512", "resnext3d_g32_256")
H100 = ("NVIDIA H100 80GB HBM3", 132, 90)  # choice.choose's device name, SMs and capability


@contextlib.contextmanager
def _as_on(kernels: str, device: tuple = H100):
    """Inside, CPU tensors launch as CUDA ones do, at the configs choice.choose gives `device` (its name, SMs and
    capability: the H100 unless named) under the variant setting `kernels` (as TCONV3D_KERNELS), the kernels
    compiled for that capability and stopping at the driver; yields `refusals`, which names why each plan of the
    calls since the last `refusals` was refused (and forgets them)."""
    from tconv3d import plans, settings
    from tconv3d.inspect.compile import stubbed_launches
    from tconv3d.tune import choice

    def chosen(direction, geom, dtype, _device, run):
        config, _ = choice.choose(direction, geom, dtype, *device)
        return choice.force_variant(direction, geom, dtype, config, kernels, True), f"{device[0]}, {kernels}"

    def refusals() -> dict:
        memo, choice._memo = choice._memo, {}
        return {k[1]: str(e) for k, e in memo.items() if k[0] is plans._PLAN and type(e) is not plans.Plan}

    saved = settings.CPU_BACKEND, choice._select_with_source, choice._memo
    settings.CPU_BACKEND, choice._select_with_source, choice._memo = "triton", chosen, {}
    try:
        with stubbed_launches(device[2]):
            yield refusals
    finally:
        settings.CPU_BACKEND, choice._select_with_source, choice._memo = saved


def plan_replay(calls: int, cases=PLAN_CASES, device: tuple = H100) -> dict:
    """Host time of a bf16 layer's forward (tconv3d.conv3d) and backward (torch.autograd.grad to input and weight,
    and bias where the case asks for one) at the configs of `device` (_as_on's: the H100 unless named), with the
    kernels compiled for its capability and stopping at the driver, with call plans and without (plans.bypassed): {case:
    {fwd|bwd: {"plans": us, "no_plans": us}}}, plus why a plan was refused where one was."""
    from tconv3d import settings
    from tconv3d.kernels import launch
    from tconv3d.testing import random_conv_inputs
    from tconv3d.tune.shapes import load_shape_set

    if launch.OFF is not None:
        return {"off": launch.OFF}
    shapes = {s.name: s for s in load_shape_set("bench")}
    results = {}
    with _as_on(settings.KERNELS, device) as refusals:
        for name in cases:
            shape = shapes[name.removesuffix("+bias")]
            x, w = random_conv_inputs(shape.input_shape, shape.weight_shape, torch.bfloat16, "cpu")
            b = torch.randn(w.shape[0], dtype=torch.bfloat16, requires_grad=True) if "+bias" in name else None
            x, w = x.requires_grad_(), w.requires_grad_()
            args = list(shape.stride), list(shape.padding), list(shape.dilation), shape.groups
            y = tconv3d.conv3d(x, w, b, *args)
            grad = torch.randn_like(y)
            forward = lambda x=x, w=w, b=b, args=args: tconv3d.conv3d(x, w, b, *args)  # noqa: E731
            leaves = (x, w) if b is None else (x, w, b)
            backward = lambda leaves=leaves, y=y, g=grad: torch.autograd.grad(  # noqa: E731
                y, leaves, g, retain_graph=True
            )
            results[name] = _with_and_without_plans({"fwd": forward, "bwd": backward}, calls, refusals)
    return results


def _with_and_without_plans(fns: dict, calls: int, refusals) -> dict:
    """{direction: {"plans": us, "no_plans": us}} of each of `fns` by direction, timed in turns with call plans and
    without (plans.bypassed), and "refused": why a plan was refused, where one was (`refusals`, _as_on's)."""
    from tconv3d import plans

    turns = {}
    for direction, fn in fns.items():
        turns[direction, True], turns[direction, False] = fn, plans.bypassed()(fn)
    times = per_call_us(turns, calls)
    found = {d: {"plans": times[d, True], "no_plans": times[d, False]} for d in fns}
    if refused := refusals():
        found["refused"] = refused
    return found


# The norms of bench.run's NORM_LAYERS at sizes the host bounds (name, kind, batch, channels, (D, H, W))
NORM_CASES = (
    ("gn_silu_512", "group_silu", 1, 512, (5, 8, 8)),
    ("instance_32", "instance", 2, 32, (4, 8, 8)),
    ("instance_prelu_32", "instance_prelu", 2, 32, (4, 8, 8)),
    ("batch_256", "batch", 4, 256, (4, 4, 4)),
    ("batch_relu_128", "batch_relu", 4, 128, (4, 4, 4)),
    ("wan_rms_384", "rms", 1, 384, (2, 8, 8)),
)


def norm_replay(calls: int, cases=NORM_CASES) -> dict:
    """Host time of a converted bf16 norm module's forward and training step (forward, then torch.autograd.grad
    to the input and the parameters; BatchNorm3d's running statistics moved) on the kernels compiled for sm_90 and
    stopping at the driver, with call plans and without: {case: {fwd|step: {"plans": us, "no_plans": us}}}."""
    from bench.run import norm_case, norm_layers_at_hand, norm_steps
    from tconv3d.kernels import launch

    if launch.OFF is not None:
        return {"off": launch.OFF}
    results = {}
    with _as_on("auto") as refusals:
        for name, kind, batch, channels, size in norm_layers_at_hand(cases):
            x, modules = norm_case(kind, batch, channels, size, "cpu")  # bench_norms' input and modules
            steps = norm_steps(x, {"tconv3d": modules["tconv3d"]})
            fns = {"fwd": steps["tconv3d", "fwd"], "step": steps["tconv3d", "fwd+bwd"]}
            results[name] = _with_and_without_plans(fns, calls, refusals)
    return results


# Layers reading a second source on the pointer kernels (launch.Distance), bf16: (input shape, Cout, padding, the
# source's keyword, its shape)
SECOND_SOURCE_CASES = {
    "skip 32+32": ((1, 32, 8, 16, 16), 32, (1, 1, 1), "channels_after", (1, 32, 8, 16, 16)),
    "causal 64, 2 frames": ((1, 64, 4, 16, 16), 64, (0, 0, 1, 1, 1, 1), "frames_before", (1, 64, 2, 16, 16)),
}


def second_source_replay(calls: int, sets: int = 8) -> dict:
    """Host time of a forward (no_grad) of each SECOND_SOURCE_CASES layer on the pointer kernels at the H100's
    tiles, kernels stopping at the driver, its input and second source taken in turn from `sets` pairs allocated
    apart (a distance that changes every call): {case: {"plans": us, "no_plans": us}}, and why a plan was refused
    where one was."""
    from tconv3d import plans
    from tconv3d.kernels import launch

    if launch.OFF is not None:
        return {"off": launch.OFF}
    cl = dict(dtype=torch.bfloat16, memory_format=CL)
    results = {}
    with _as_on("pointer") as refusals, torch.no_grad():
        for name, (shape, cout, padding, keyword, second) in SECOND_SOURCE_CASES.items():
            c_in = shape[1] + (second[1] if keyword == "channels_after" else 0)
            w = torch.randn(cout, c_in, 3, 3, 3).to(**cl)
            pairs = [(torch.randn(shape).to(**cl), torch.randn(second).to(**cl)) for _ in range(sets)]
            turn = iter(range(1 << 62))

            def forward(w=w, pairs=pairs, turn=turn, padding=padding, keyword=keyword):
                x, source = pairs[next(turn) % len(pairs)]
                return tconv3d.conv3d(x, w, None, padding=padding, **{keyword: source})

            results[name] = per_call_us({"plans": forward, "no_plans": plans.bypassed()(forward)}, calls)
            if refused := refusals():
                results[name]["refused"] = refused
    return results


# Layers bordered by a mode that reads input voxels, bf16: (input shape, Cout, padding, mode). Their input gradient
# is written over the bordered geometry (in float32) and its borders folded onto the planes they read: in-place sums
# on the host side, which a plan replays among its launches.
BORDER_CASES = {
    "causal replicate 64": ((1, 64, 4, 16, 16), 64, (2, 0, 1, 1, 1, 1), "replicate"),
    "reflect 64": ((1, 64, 4, 16, 16), 64, (1, 1, 1, 1, 1, 1), "reflect"),
}


def border_replay(calls: int) -> dict:
    """Host time of each BORDER_CASES layer's forward and backward (torch.autograd.grad to input and weight) at the
    H100's configs, kernels stopping at the driver, with call plans and without: {case: {fwd|bwd: {"plans": us,
    "no_plans": us}}}, and why a plan was refused where one was."""
    from tconv3d import settings
    from tconv3d.kernels import launch

    if launch.OFF is not None:
        return {"off": launch.OFF}
    cl = dict(dtype=torch.bfloat16, memory_format=CL)
    results = {}
    with _as_on(settings.KERNELS) as refusals:
        for name, (shape, cout, padding, mode) in BORDER_CASES.items():
            x = torch.randn(shape).to(**cl).requires_grad_()
            w = torch.randn(cout, shape[1], 3, 3, 3).to(**cl).requires_grad_()
            y = tconv3d.conv3d(x, w, None, padding=padding, padding_mode=mode)
            grad = torch.randn_like(y)
            forward = lambda x=x, w=w, p=padding, m=mode: tconv3d.conv3d(x, w, None, padding=p, padding_mode=m)  # noqa: E731
            backward = lambda x=x, w=w, y=y, g=grad: torch.autograd.grad(y, (x, w), g, retain_graph=True)  # noqa: E731
            results[name] = _with_and_without_plans({"fwd": forward, "bwd": backward}, calls, refusals)
    return results


def _print_plan_rows(results: dict) -> None:
    """plan_replay's or norm_replay's figures, a line a case: each direction's time with plans / without."""
    for name, times in results.items():
        if name == "off":
            print(f"direct path off: {times}")
            continue
        cells = [f"{d} {t['plans']:7.1f} / {t['no_plans']:7.1f} ({t['plans'] / t['no_plans']:4.2f}x)"
                 for d, t in times.items() if d != "refused"]  # fmt: skip
        print(f"{name:20s} {'   '.join(cells)}" + (f"   refused: {times['refused']}" if "refused" in times else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timing loop (15 loops per figure)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    speed = host_speed(args.calls, args.device)
    print("this host's CPU, us a step: " + ", ".join(f"{name} {us:.2f}" for name, us in speed.items()))
    results = measure(args.device, args.calls)
    loops = f"median of 15 interleaved loops of {args.calls} calls"
    print(f"host time per call, us (device {args.device}, input {SHAPE}, {loops})")
    print(f"{'':28s} {'no_grad':>9s} {'ratio':>6s} {'autograd':>9s} {'ratio':>6s}")
    for name in results["no_grad"]:
        cells = []
        for mode in ("no_grad", "autograd"):
            us = results[mode][name]
            cells.append(f"{us:9.1f} {us / results[mode]['nn.Conv3d']:5.2f}x")
        print(f"{name:28s} {' '.join(cells)}")
    for name, us in results["backward"].items():
        print(f"{name + ' backward':28s} {us:9.1f} {us / results['backward']['nn.Conv3d']:5.2f}x")
    launches = launch_path(args.calls)
    print("\nlaunch path alone, kernels stubbed, us per launch (bf16 1x64x4x16x16, 3x3x3, stride 1)")
    for direction, times in launches.items():
        extra = times["tma"] - times["pointer"]
        print(f"{direction:6s} pointer {times['pointer']:6.1f}  tma {times['tma']:6.1f}  tma extra {extra:+6.1f}")
    direct = triton_launch(args.calls)
    print("\nTriton's side of a launch, stopping at the driver (sm_90 compile), us per launch")
    if "off" in direct:
        print(f"direct path off: {direct['off']}")
    for name, t in direct.items():
        if name != "off":
            print(f"{name:22s} run {t['run']:6.1f}  direct {t['direct']:6.1f}  direct/run {t['direct'] / t['run']:5.2f}"
                  f"  ({t['arguments']} arguments)")  # fmt: skip
    past = launcher_past(args.calls)
    print("\nthe compiled launcher's side: Triton's launcher and wrapper against launch._Past, both around stand-ins")
    print("for the C launch and the map encode (sm_90 compile), us per launch")
    for name, t in past.items():
        if name == "off" or "refused" in t:
            print(f"{name:22s} {t if name == 'off' else t['refused']}")
            continue
        ratio = t["past"] / t["wrapper"]
        print(f"{name:22s} wrapper {t['wrapper']:6.1f}  past {t['past']:6.1f}  past/wrapper {ratio:5.2f}"
              f"  ({t['arguments']} arguments)")  # fmt: skip
    replays = plan_replay(max(1, args.calls // 10))
    print("\nwhole layers at the H100's configs, kernels stopping at the driver, us per call: call plans on / off")
    _print_plan_rows(replays)
    norms = norm_replay(max(1, args.calls // 10))
    print("\nconverted bf16 norm modules (bench.run's kinds), kernels stopping at the driver, us per call: call")
    print("plans on / off")
    _print_plan_rows(norms)
    borders = border_replay(max(1, args.calls // 10))
    print("\nlayers bordered by replicate or reflect, read in place (H100 tiles, stopping at the driver), us per")
    print("call: call plans on / off")
    _print_plan_rows(borders)
    sources = second_source_replay(max(1, args.calls // 10))
    print("\na second source on the pointer kernels, at other addresses every call (H100 tiles, stopping at the")
    print("driver), forward, us per call: call plans on / off")
    for name, t in sources.items():
        if name == "off":
            print(f"direct path off: {t}")
            continue
        refused = f"   refused: {t['refused']}" if "refused" in t else ""
        print(f"{name:20s} fwd {t['plans']:7.1f} / {t['no_plans']:7.1f} ({t['plans'] / t['no_plans']:4.2f}x){refused}")
    if args.json is not None:
        meta = {
            "device": args.device, "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
            "triton": triton.__version__, "commit": git_commit(), "input": SHAPE, "calls": args.calls,
        }  # fmt: skip
        results = {**meta, "host_speed_us": speed, "us_per_call": results, "launch_us": launches,
                   "triton_launch_us": direct, "launcher_past_us": past, "plan_replay_us": replays,
                   "norm_replay_us": norms, "border_replay_us": borders, "second_source_us": sources}  # fmt: skip
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
