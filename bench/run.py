"""python -m bench: tconv3d against cuDNN and torch.compile on the benchmark suite, on this GPU.

    python -m bench                                  # the whole suite, bf16 (fp16/fp32 where a case lists them)
    python -m bench --direction fwd --dtype bf16 --cases wan_dec_384a,unet_64 --merge

Per case and implementation: median ms (triton.testing.do_bench, which flushes L2 between runs), TFLOP/s, % of
the bf16 matmul peak measured in the same run, speedup over cuDNN channels_last_3d, peak memory, and tconv3d's
relative L2 error against float64; tconv3d and cuDNN channels_last_3d also replayed from a CUDA graph (the
launches without the host's time to issue them: a host-bound case shows as such). Then the scenarios: the
3-layer stack, (1,3,3) Conv3d vs Conv2d, causal padding, a UNet skip connection read in place, Wan's upsamplers
(nearest 2x then a conv: upsampled first, or the sub-pixel transposed conv), the converted models' norms against
torch's. Writes
bench/results/<device>.json, .md and .png (see bench/report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import functools
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
import triton.testing

import tconv3d
from tconv3d.testing import float64_errors, random_conv_inputs
from tconv3d.tune.shapes import DTYPES_BY_NAME, ConvShape, load_shape_set

from . import report

CL = torch.channels_last_3d
RESULTS_DIR = Path(__file__).parent / "results"
# Largest tensor (elements) for which the float64 error check runs on the full case; above, a replica.
ERROR_CHECK_ELEMENTS = 1 << 26
LAYOUT_KERNEL_WORDS = ("nhwctonchw", "nchwtonhwc", "permute", "transpose", "copy_kernel", "contiguous")


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


# Implementations also timed replayed from a CUDA graph: the launches without the host's time to issue them, so
# that a case bound by the host (issue 29) shows as such beside its eager time.
GRAPH_IMPLS = ("tconv3d", "cudnn_cl3d")


def on_side_stream(make):
    """make() run on a side stream that waits for the current one and is waited for after, and its result: PyTorch's
    capture recipe for what precedes a capture (warm-up calls; a forward whose backward is captured alone, since an
    autograd node keeps the stream it was made on, pytorch#164302)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        made = make()
    torch.cuda.current_stream().wait_stream(side)
    return made


def capture(fn, warmups: int = 3):
    """`fn` captured once in a CUDA graph, after `warmups` calls on a side stream (as capture wants: the first calls
    choose configs, compile and allocate): (the graph, fn's output in the graph's memory, MiB the capture took)."""
    on_side_stream(lambda: [fn() for _ in range(warmups)])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph, out, (torch.cuda.memory_allocated() - before) / 2**20


def graph_ms(fn) -> float:
    """Median ms of `fn` captured once in a CUDA graph (`capture`) and replayed."""
    graph, _, _ = capture(fn)
    try:
        return bench_ms(graph.replay)
    finally:
        del graph
        torch.cuda.empty_cache()


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, CHUNKS, REPEATS, BLOCK: tl.constexpr):
    """Each program sums REPEATS chunks of BLOCK int32s of x, chunk (program + r * 7) modulo CHUNKS at step r, and
    writes its BLOCK sums: reads of a buffer small enough to stay in L2."""
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for r in range(REPEATS):
        chunk = (pid + r * 7) % CHUNKS
        acc += tl.load(x_ptr + chunk * BLOCK + offs)
    tl.store(out_ptr + pid * BLOCK + offs, acc)


L2_READ_BLOCK = 4096  # int32s a program reads a step: 16 KB


def l2_read(x: torch.Tensor, programs: int, repeats: int) -> torch.Tensor:
    """[programs, L2_READ_BLOCK] sums of _l2_read_kernel over x (int32, a whole number of blocks)."""
    chunks, rest = divmod(x.numel(), L2_READ_BLOCK)
    if x.dtype != torch.int32 or rest or not chunks:
        raise ValueError(f"l2_read reads whole {L2_READ_BLOCK}-element int32 blocks, got {x.dtype} x {x.numel()}")
    out = torch.empty(programs, L2_READ_BLOCK, dtype=torch.int32, device=x.device)
    _l2_read_kernel[(programs,)](x, out, chunks, repeats, BLOCK=L2_READ_BLOCK, num_warps=8)
    return out


def l2_read_tbps(mib: int = 8, repeats: int = 400) -> float:
    """Bandwidth of reads that hit L2, TB/s: four programs an SM reading an L2-resident `mib` MiB buffer over and
    over (bench/NOTES.md, "What 64 columns cost": the implicit GEMMs' tap-shifted operands come from L2)."""
    x = torch.randint(0, 1 << 20, (mib << 18,), dtype=torch.int32, device="cuda")
    programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count
    ms = bench_ms(lambda: l2_read(x, programs, repeats))
    return programs * repeats * L2_READ_BLOCK * 4 / ms * 1e-9


# The bf16 matmuls the peak is read from, (m, n, k): the best of them is the run's peak. One shape read 716 and 789
# TFLOP/s in two invocations of one H200 session (bench/NOTES.md, forty-seventh session): a single reading depends
# on the clocks the GPU runs at when it is taken, so main() reads again after the cases and keeps the higher.
PEAK_SHAPES = ((8192, 8192, 8192), (16384, 8192, 16384))


def bf16_matmul_tflops(shapes=PEAK_SHAPES) -> list[float]:
    """TFLOP/s of torch's bf16 matmul (cuBLAS) at each (m, n, k) of `shapes`, random inputs."""
    readings = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=_cuda_generator())
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16, generator=_cuda_generator())
        readings.append(round(2 * m * n * k / bench_ms(lambda a=a, b=b: a @ b) * 1e-9, 1))
        del a, b
    return readings


def measure_peaks() -> dict:
    """The device's matmul peaks (bf16: the best of PEAK_SHAPES, each reading kept; and fp32 as TF32: the one fp32
    convolutions run at where cuDNN may use TF32), copy bandwidth and the bandwidth of reads that hit L2, measured
    in this run."""
    readings = bf16_matmul_tflops()
    n = 8192
    a32, b32 = (torch.randn(n, n, device="cuda", generator=_cuda_generator()) for _ in range(2))
    matmul = torch.backends.cuda.matmul
    saved, matmul.fp32_precision = matmul.fp32_precision, "tf32"
    try:
        tf32_ms = bench_ms(lambda: a32 @ b32)
    finally:
        matmul.fp32_precision = saved
    src = torch.empty(1 << 30, device="cuda", dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    return {
        "bf16_mm_tflops": max(readings),
        "bf16_mm_readings": readings,
        "tf32_mm_tflops": round(2 * n**3 / tf32_ms * 1e-9, 1),
        "copy_tbps": round(2 * src.numel() / copy_ms * 1e-9, 3),
        "l2_read_tbps": round(l2_read_tbps(), 2),
    }


def reread_bf16_peak(results: dict) -> None:
    """After a run's cases: read the bf16 matmul again, keep the higher peak, and quote the run's cases against
    their peaks again (peak_for: the 16-bit ones against it)."""
    peak = results["peak"]
    peak["bf16_mm_readings"] = peak.get("bf16_mm_readings", []) + bf16_matmul_tflops()
    peak["bf16_mm_tflops"] = max(peak["bf16_mm_readings"])
    for case in results["cases"]:
        for figures in case["impls"].values():
            if figures.get("tflops") is not None:
                figures["pct_of_peak"] = report.pct_of_peak(figures["tflops"], peak_for(peak, case["dtype"]))


def peak_for(peaks: dict, dtype_name: str) -> float | None:
    """The matmul peak a case in `dtype_name` is quoted against: TF32's for fp32 (tconv3d and cuDNN multiply fp32
    as TF32 where allowed, as they are by default), bf16's for the 16-bit dtypes. None where the run measured no
    such peak (results from before the TF32 peak was measured)."""
    return peaks.get("tf32_mm_tflops" if dtype_name == "fp32" else "bf16_mm_tflops")


def peak_memory_mb(fn) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _stock_conv(shape: ConvShape) -> torch.nn.Conv3d:
    pad = shape.padding
    if pad[0::2] != pad[1::2]:
        raise ValueError(f"{shape.name}: the stock baselines need symmetric padding, got {pad}")
    return torch.nn.Conv3d(
        shape.cin, shape.cout, shape.kernel, shape.stride, pad[0::2], shape.dilation, groups=shape.groups, bias=False
    )


# The cases' random data (and the peaks' matmuls', read again after the cases) comes from a generator of the bench's
# own, not CUDA's default one: H200 run 8's graphs step
# captured hunyuan_512's forward twice (tconv3d, cuDNN), both captures and replays fine, and the next torch.randn on
# the default generator raised "Offset increment outside graph capture encountered unexpectedly" (torch 2.11): the
# default generator, which every capture registers, was left in capture mode. Which capture did it is unknown:
# bench_case records it (`graph_left_rng_capturing`), and no case's inputs depend on that generator any more.
_generator = None


def _cuda_generator() -> torch.Generator:
    global _generator
    if _generator is None:
        _generator = torch.Generator(device="cuda")
        _generator.manual_seed(torch.initial_seed() % 2**63)
    return _generator


def _make_inputs(shape: ConvShape, dtype):
    return random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, "cuda", generator=_cuda_generator())


def _default_rng_usable() -> bool:
    """Whether CUDA's default generator still draws: False where a graph capture left it in capture mode."""
    try:
        torch.randn(1, device="cuda")
    except RuntimeError as error:
        if "outside graph capture" in str(error):
            return False
        raise
    return True


def _implementations(shape: ConvShape, dtype, impls):
    """name -> (forward callable taking x, the x and w it should be given)."""
    x, w = _make_inputs(shape, dtype)
    stride, padding, dilation = list(shape.stride), list(shape.padding), list(shape.dilation)
    out = {}
    if "tconv3d" in impls:
        out["tconv3d"] = (lambda x, w: tconv3d.conv3d(x, w, None, stride, padding, dilation, shape.groups), x, w)
    sym = shape.padding[0::2]
    if "cudnn_cl3d" in impls:
        out["cudnn_cl3d"] = (lambda x, w: F.conv3d(x, w, None, shape.stride, sym, shape.dilation, shape.groups), x, w)
    if "cudnn_ncdhw" in impls:
        out["cudnn_ncdhw"] = (
            lambda x, w: F.conv3d(x, w, None, shape.stride, sym, shape.dilation, shape.groups),
            x.contiguous(),
            w.contiguous(),
        )
    for name, mode in (("compile", "default"), ("compile_max_autotune", "max-autotune")):
        if name in impls:
            module = _stock_conv(shape).to("cuda", dtype).to(memory_format=CL)
            module.weight.data = w.clone()
            compiled = torch.compile(module, mode=mode)
            out[name] = (lambda x, w, compiled=compiled: compiled(x), x, module.weight)
    return out


def _direction_fn(forward, x, w, direction):
    """A no-argument callable doing one `direction` of the convolution, and the random upstream gradient."""
    if direction == "fwd":
        return lambda: forward(x, w)
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_() if not isinstance(w, torch.nn.Parameter) else w
    y = forward(x, w)
    grad_out = torch.empty_like(y).normal_(generator=_cuda_generator())
    if direction == "bwd":
        return lambda: torch.autograd.grad(y, (x, w), grad_out, retain_graph=True)
    return lambda: torch.autograd.grad(forward(x, w), (x, w), grad_out)


def _captured_fn(forward, x, w, direction, fn):
    """What the graph column captures of `direction`: `fn` itself, but for a backward alone, whose forward is made
    again on a side stream, as PyTorch's capture recipe has it. An autograd node keeps the stream it was made on,
    and a backward whose nodes were made on the default stream pulls the legacy stream into the capture
    (pytorch#164302): H200 runs 10 and 12, the first backward captured in the process failed (hunyuan_512's)."""
    if direction != "bwd":
        return fn
    return on_side_stream(lambda: _direction_fn(forward, x, w, direction))


def _replica(shape: ConvShape) -> ConvShape:
    """The case itself if float64 tensors of it fit the check budget, else the same layer on a smaller volume."""
    size = list(shape.size)
    while shape.batch * max(shape.cin, shape.cout) * math.prod(size) > ERROR_CHECK_ELEMENTS:
        i = size.index(max(size))
        size[i] = max(size[i] // 2, shape.kernel[i] * shape.dilation[i])
    return ConvShape(**{**shape.__dict__, "size": tuple(size)})


def tconv3d_error(shape: ConvShape, dtype, direction: str) -> float:
    """Largest relative L2 error of tconv3d's results for `direction` against float64 autograd of F.conv3d."""
    small = _replica(shape)
    x, w = _make_inputs(small, dtype)
    errors = float64_errors(
        tconv3d.conv3d, x, w, None, small.stride, small.padding, small.dilation, small.groups, _cuda_generator()
    )
    wanted = {"fwd": ["output"], "bwd": ["grad_input", "grad_weight"], "fwd+bwd": list(errors)}[direction]
    return max(errors[name] for name in wanted)


def bench_case(
    shape: ConvShape, dtype_name: str, direction: str, impls, peak_tflops: float | None, graphs: bool = True
) -> dict:
    dtype = DTYPES_BY_NAME[dtype_name]
    flops = shape.flops(direction)
    case = {
        "name": shape.name,
        "direction": direction,
        "dtype": dtype_name,
        "shape": {
            "input": list(shape.input_shape),
            "weight": list(shape.weight_shape),
            "stride": list(shape.stride),
            "padding": list(shape.padding),
            "dilation": list(shape.dilation),
            "groups": shape.groups,
        },
        "flops": flops,
        "min_bytes": report.min_bytes(shape, direction, torch.empty((), dtype=dtype).element_size()),
        "impls": {},
    }
    for name, (forward, x, w) in _implementations(shape, dtype, impls).items():
        try:
            fn = _direction_fn(forward, x, w, direction)
            ms = bench_ms(fn)
            case["impls"][name] = report.impl_figures(ms, flops, peak_tflops, peak_memory_mb(fn))
        except Exception as error:  # a baseline that cannot run a case is reported, not fatal
            case["impls"][name] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        if graphs and name in GRAPH_IMPLS:
            try:
                case["impls"][name]["graph_ms"] = round(graph_ms(_captured_fn(forward, x, w, direction, fn)), 5)
            except Exception as error:  # a capture that fails is a result too
                case["impls"][name]["graph_error"] = f"{type(error).__name__}: {error}"[:300]
            if not _default_rng_usable():  # see _generator: which capture leaves it so
                case["impls"][name]["graph_left_rng_capturing"] = True
        torch.cuda.empty_cache()
    if "tconv3d" in case["impls"] and "error" not in case["impls"]["tconv3d"]:
        case["impls"]["tconv3d"]["max_rel_err"] = tconv3d_error(shape, dtype, direction)
    return case


# ---------------------------------------------------------------------------------------------------------------
# scenarios


class _Stack(torch.nn.Module):
    def __init__(self, cin=8, hidden=64, cout=8):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Conv3d(cin, hidden, 3, padding=1, bias=False),
            torch.nn.Conv3d(hidden, hidden, 3, padding=1, bias=False),
            torch.nn.Conv3d(hidden, cout, 3, padding=1, bias=False),
        )

    def forward(self, x):
        return self.layers(x)


def count_layout_kernels(step) -> int:
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(any(word in name for word in LAYOUT_KERNEL_WORDS) for name in names)


def bench_stack(measured=None) -> dict:
    """The reported 3-layer stack: input 4 x 8 x 64 x 256 x 256, hidden 64, bf16, channels_last_3d; fwd+bwd step.
    The eager pair first (issue 28's bar), the compiled pair after (their compiles take most of the scenario's
    time); `measured(rows)`, where given, after each, so that a run cut off keeps what it timed."""
    x = torch.randn(4, 8, 64, 256, 256, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)
    x.requires_grad_()
    stock = _Stack().to("cuda", torch.bfloat16).to(memory_format=CL)
    ours = tconv3d.nn.convert(_Stack().to("cuda", torch.bfloat16))
    ours.load_state_dict(stock.state_dict())
    models = {
        "cudnn_eager": lambda: stock,
        "tconv3d_eager": lambda: ours,
        "compile": lambda: torch.compile(stock),
        "tconv3d_compiled": lambda: torch.compile(ours, fullgraph=True),
    }
    out = {}
    for name, build in models.items():
        model = build()
        grad_out = torch.randn(4, 8, 64, 256, 256, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)

        def step(model=model, grad_out=grad_out):
            torch.autograd.grad(model(x), [x, *model.parameters()], grad_out)

        out[name] = {"ms": round(bench_ms(step), 4), "layout_conversion_kernels": count_layout_kernels(step)}
        if measured is not None:
            measured(out)
    return out


def bench_conv2d_vs_conv3d() -> list[dict]:
    """(1,3,3) Conv3d on (8, C, 500, 64, 64) against Conv2d (3,3) on the reshaped (4000, C, 64, 64)."""
    rows = []
    for channels in (2, 64):
        for dtype_name in ("fp32", "bf16"):
            dtype = DTYPES_BY_NAME[dtype_name]
            x3 = torch.randn(8, channels, 500, 64, 64, device="cuda").to(dtype).contiguous(memory_format=CL)
            w3 = torch.randn(channels, channels, 1, 3, 3, device="cuda").to(dtype).contiguous(memory_format=CL)
            x2 = (
                torch.randn(4000, channels, 64, 64, device="cuda")
                .to(dtype)
                .contiguous(memory_format=torch.channels_last)
            )
            w2 = w3[:, :, 0].contiguous(memory_format=torch.channels_last)
            impls = {
                "cudnn_conv3d": (lambda x, w: F.conv3d(x, w, None, 1, (0, 1, 1)), x3, w3),
                "cudnn_conv2d": (lambda x, w: F.conv2d(x, w, None, 1, 1), x2, w2),
                "tconv3d": (lambda x, w: tconv3d.conv3d(x, w, None, 1, (0, 1, 1)), x3, w3),
            }
            for direction in ("fwd", "bwd"):
                row = {"name": f"c{channels}_{dtype_name}_{direction}"}
                for name, (forward, x, w) in impls.items():
                    row[f"{name}_ms"] = round(bench_ms(_direction_fn(forward, x, w, direction)), 4)
                rows.append(row)
            del x3, x2
            torch.cuda.empty_cache()
    return rows


CAUSAL_PADDING = (2, 0, 1, 1, 1, 1)  # bench_causal's: two frames in front along D, one each side in H and W
CAUSAL_MODES = ("zeros", "replicate")  # the VAEs' two


def causal_geometries(shape: ConvShape) -> dict:
    """bench_causal's layer as its launches see it, by border mode."""
    from tconv3d.geometry import conv_geometry

    return {mode: conv_geometry(shape.input_shape, shape.weight_shape, 1, CAUSAL_PADDING, 1, padding_mode=mode)
            for mode in CAUSAL_MODES}  # fmt: skip


def bench_causal(shapes: list[ConvShape]) -> list[dict]:
    """Causal padding (2,0 / 1,1 / 1,1) on wan_dec_384b, zeros and replicate borders (the VAEs' two): explicit
    F.pad then cuDNN channels_last_3d, against tconv3d's fused padding; time and peak memory, fwd and fwd+bwd."""
    shape = next(s for s in shapes if s.name == "wan_dec_384b")
    x, w = _make_inputs(shape, torch.bfloat16)
    df, db, ht, hb, wl, wr = CAUSAL_PADDING
    rows = []
    for mode in CAUSAL_MODES:
        pad_mode = "constant" if mode == "zeros" else mode
        impls = {
            "pad_then_cudnn": lambda x, w, m=pad_mode: F.conv3d(F.pad(x, (wl, wr, ht, hb, df, db), mode=m), w),
            "tconv3d": lambda x, w, m=mode: tconv3d.conv3d(x, w, None, 1, CAUSAL_PADDING, padding_mode=m),
        }
        for direction in ("fwd", "fwd+bwd"):
            row = {"name": f"wan_dec_384b_causal_{mode}_{direction}"}
            for name, forward in impls.items():
                fn = _direction_fn(forward, x, w, direction)
                row[f"{name}_ms"] = round(bench_ms(fn), 4)
                row[f"{name}_peak_mb"] = round(peak_memory_mb(fn), 1)
            rows.append(row)
    return rows


# A UNet decoder level's first conv: the upsampled features and the encoder's skip connection concatenated along C.
# (name, batch, channels of each, spatial size, output channels)
# (name, batch, channels of each source, size, output channels, transposed): a 3x3x3 conv at stride 1, padding 1,
# or a MONAI UNet up conv (3x3x3 transposed, stride 2, padding 1, output_padding 1).
SKIP_LAYERS = [
    ("unet_skip_64", 1, 64, (64, 64, 64), 64, False),
    ("unet_skip_32", 2, 32, (96, 96, 96), 32, False),
    ("unet_up_transposed_64", 1, 64, (48, 48, 48), 32, True),
]


_FORCED_MEMOS: dict[str, dict] = {}


@contextlib.contextmanager
def kernels_forced(variant: str):
    """Inside, tconv3d's launches choose as TCONV3D_KERNELS=`variant` would, from a memo of their own (the process's
    choices are left as they were, and a timing loop inside chooses once)."""
    from tconv3d import settings
    from tconv3d.tune import choice

    saved = settings.KERNELS, choice._memo
    settings.KERNELS, choice._memo = variant, _FORCED_MEMOS.setdefault(variant, {})
    try:
        yield
    finally:
        settings.KERNELS, choice._memo = saved


def _forced(variant: str, forward):
    def run(*tensors):
        with kernels_forced(variant):
            return forward(*tensors)

    return run


def skip_geometries(batch: int, channels: int, size, cout: int, transposed: bool = False) -> dict:
    """A SKIP_LAYERS conv's geometries by the direction that launches them: the forward and the weight gradient read
    [x, skip] in place (channels_after), the input gradient is the concatenation's. A transposed up conv's forward
    alone: the input gradient of the stride-2 conv it transposes, reading the skip after x's channels
    (out_after_channels)."""
    from tconv3d.geometry import conv_geometry

    if transposed:  # stride 2, padding 1, output_padding 1: twice the size
        geom = conv_geometry((batch, cout, *(2 * s for s in size)), (2 * channels, cout, 3, 3, 3), 2, 1, 1)
        return {"dgrad": dataclasses.replace(geom, out_after_channels=channels)}
    weight = (cout, 2 * channels, 3, 3, 3)
    in_place = conv_geometry((batch, channels, *size), weight, 1, 1, 1, after_channels=channels)
    return {"fwd": in_place, "dgrad": conv_geometry((batch, 2 * channels, *size), weight, 1, 1, 1), "wgrad": in_place}


def bench_skip() -> list[dict]:
    """A UNet decoder's skip connection: torch.cat along C then cuDNN channels_last_3d, against tconv3d reading the
    two in place (channels_after), bf16, 3x3x3 (a conv, or MONAI UNet's transposed up conv, with its bias); time and
    peak memory, fwd and fwd+bwd (the gradients of both inputs, the weight and the bias). Both also as
    TCONV3D_KERNELS=pointer runs them (`tconv3d_pointer`): the sm_90 heuristic takes the Gluon kernel for the forward
    and the weight gradient reading the skip (configs.heuristic_config) on the timings of one-source layers. The
    transposed conv also with its bias added after the op (`tconv3d_bias_after`, as conv_transpose3d did before
    the input-gradient kernels took it in their epilogue): the gain of that fusion, in the same run."""

    def activation(batch, channels, size):
        t = torch.randn(batch, channels, *size, device="cuda", dtype=torch.bfloat16)
        return t.contiguous(memory_format=torch.channels_last_3d).requires_grad_()

    up = {"stride": 2, "padding": 1, "output_padding": 1}
    impls = {
        False: {
            "cat_then_cudnn": lambda x, skip, w: F.conv3d(torch.cat([x, skip], dim=1), w, padding=1),
            "tconv3d": lambda x, skip, w: tconv3d.conv3d(x, w, padding=1, channels_after=skip),
            "tconv3d_pointer": _forced(
                "pointer", lambda x, skip, w: tconv3d.conv3d(x, w, padding=1, channels_after=skip)
            ),
        },
        True: {
            "cat_then_cudnn": lambda x, skip, w, b: F.conv_transpose3d(torch.cat([x, skip], dim=1), w, b, **up),
            "tconv3d": lambda x, skip, w, b: tconv3d.conv_transpose3d(x, w, b, **up, channels_after=skip),
            "tconv3d_pointer": _forced(
                "pointer", lambda x, skip, w, b: tconv3d.conv_transpose3d(x, w, b, **up, channels_after=skip)
            ),
            "tconv3d_bias_after": lambda x, skip, w, b: tconv3d.conv_transpose3d(
                x, w, None, **up, channels_after=skip
            ).add_(b.view(1, -1, 1, 1, 1)),
        },
    }
    rows = []
    for name, batch, channels, size, cout, transposed in SKIP_LAYERS:
        tensors = (activation(batch, channels, size), activation(batch, channels, size))
        shape = (2 * channels, cout, 3, 3, 3) if transposed else (cout, 2 * channels, 3, 3, 3)
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) / (54 * channels) ** 0.5
        tensors += (w.contiguous(memory_format=torch.channels_last_3d).requires_grad_(),)
        if transposed:  # its bias (MONAI's up convolutions have one)
            tensors += (torch.randn(cout, device="cuda", dtype=torch.bfloat16).requires_grad_(),)
        for direction in ("fwd", "fwd+bwd"):
            row = {"name": f"{name}_{direction}"}
            for impl, forward in impls[transposed].items():
                grad = torch.randn_like(forward(*tensors)) if direction == "fwd+bwd" else None
                fn = functools.partial(_skip_step, forward, tensors, grad)
                row[f"{impl}_ms"] = round(bench_ms(fn), 4)
                row[f"{impl}_peak_mb"] = round(peak_memory_mb(fn), 1)
            rows.append(row)
        del tensors, w
        torch.cuda.empty_cache()
    return rows


def _skip_step(forward, tensors, grad):
    """One forward (and, given the upstream gradient `grad`, its backward to every tensor) of bench_skip."""
    y = forward(*tensors)
    if grad is not None:
        torch.autograd.grad(y, tensors, grad)


# The norms of the models tconv3d converts, on a channels_last_3d activation as a converted model hands them one:
# (name, kind, batch, channels, (D, H, W)); kind "group_silu" is GroupNorm(32 groups) then SiLU (a video VAE's
# decoder block: HunyuanVideo's, CogVideoX's), "instance" MONAI's UNets' InstanceNorm3d, "batch" a BatchNorm3d in
# training alone, "batch_relu" one then ReLU (MONAI's DenseNet and HighResNet layers: convert fuses the ReLU into
# the norm), "instance_prelu" MONAI UNet's ADN block (InstanceNorm3d, Dropout(0.0), PReLU: convert fuses the PReLU,
# its weight's gradient in the norm's backward), "rms" the Wan VAE's RMS norm (diffusers' WanRMS_norm: needs
# diffusers).
NORM_LAYERS = [
    ("hunyuan_gn_silu_512", "group_silu", 1, 512, (5, 64, 64)),
    ("hunyuan_gn_silu_128", "group_silu", 1, 128, (17, 256, 256)),
    ("unet_instance_32", "instance", 2, 32, (96, 96, 96)),
    ("unet_instance_prelu_32", "instance_prelu", 2, 32, (96, 96, 96)),
    ("unet_batch_64", "batch", 2, 64, (64, 64, 64)),
    ("densenet_batch_256", "batch", 4, 256, (16, 16, 16)),
    ("densenet_batch_relu_128", "batch_relu", 4, 128, (32, 32, 32)),
    ("wan_rms_384", "rms", 1, 384, (4, 64, 64)),
]


def norm_modules(kind: str, channels: int, device, dtype=torch.float32) -> dict:
    """NORM_LAYERS' kind as torch's modules (`torch`: what a stock model runs) and as `tconv3d.nn.convert` makes
    them (`tconv3d`), holding the same random affine parameters, in training mode; each a callable of x."""
    stock = {
        "group_silu": lambda: torch.nn.Sequential(torch.nn.GroupNorm(32, channels), torch.nn.SiLU()),
        "instance": lambda: torch.nn.Sequential(torch.nn.InstanceNorm3d(channels, affine=True)),
        "batch": lambda: torch.nn.Sequential(torch.nn.BatchNorm3d(channels)),
        "batch_relu": lambda: torch.nn.Sequential(torch.nn.BatchNorm3d(channels), torch.nn.ReLU(inplace=True)),
        "instance_prelu": lambda: torch.nn.Sequential(
            torch.nn.InstanceNorm3d(channels, affine=True), torch.nn.Dropout(0.0), torch.nn.PReLU()
        ),
        "rms": lambda: torch.nn.Sequential(_wan_rms_norm(channels)),
    }[kind]().to(device, dtype)
    with torch.no_grad():
        for parameter in stock.parameters():
            parameter.normal_()
    return {"torch": stock, "tconv3d": tconv3d.nn.convert(copy.deepcopy(stock))}


def norm_layers_at_hand(layers) -> list:
    """The rows of `layers` (NORM_LAYERS') whose modules this environment can build: an "rms" row needs diffusers
    (the bench's other scenarios do not)."""
    has_diffusers = importlib.util.find_spec("diffusers") is not None
    return [row for row in layers if row[1] != "rms" or has_diffusers]


def _wan_rms_norm(channels: int) -> torch.nn.Module:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    return WanRMS_norm(channels, images=False)


def norm_case(kind: str, batch: int, channels: int, size, device) -> tuple[torch.Tensor, dict]:
    """A NORM_LAYERS row's input and modules as bench_norms times them: a bf16 model's (`model.to(torch.bfloat16)`:
    parameters and activations bf16; torch's CUDA GroupNorm refuses fp32 parameters on a bf16 input, H200 run 8),
    channels_last_3d in."""
    x = torch.randn(batch, channels, *size, device=device, dtype=torch.bfloat16)
    return x.contiguous(memory_format=CL).requires_grad_(), norm_modules(kind, channels, device, x.dtype)


def bench_norms(layers=None) -> list[dict]:
    """NORM_LAYERS (norm_case: bf16, channels_last_3d in): torch's norm modules against tconv3d's, fwd and fwd+bwd
    (the input's and the parameters' gradients); time, peak memory, and the effective bandwidth of tconv3d's (the
    bytes its passes move: forward, x read twice and y written; a backward after it, x and dy read twice and dx
    written)."""
    rows = []
    for name, kind, batch, channels, size in norm_layers_at_hand(layers or NORM_LAYERS):
        x, modules = norm_case(kind, batch, channels, size, "cuda")
        steps = norm_steps(x, modules)
        for direction in ("fwd", "fwd+bwd"):
            row = {"name": f"{name}_{direction}"}
            for impl in modules:
                fn = steps[impl, direction]
                row[f"{impl}_ms"] = round(bench_ms(fn), 4)
                row[f"{impl}_peak_mb"] = round(peak_memory_mb(fn), 1)
            moved = x.numel() * x.element_size() * (3 if direction == "fwd" else 8)
            row["tconv3d_tbps"] = round(moved / row["tconv3d_ms"] / 1e9, 2)
            row["speedup"] = round(row["torch_ms"] / row["tconv3d_ms"], 2)
            rows.append(row)
        del x, modules
        torch.cuda.empty_cache()
    return rows


def norm_steps(x, modules: dict) -> dict:
    """{(impl, direction): fn} of norm_case's `modules`, what bench_norms times: "fwd" one forward of x, "fwd+bwd"
    one forward and the backward to x and the module's parameters along a random gradient."""
    steps = {}
    for impl, module in modules.items():
        inputs = (x, *module.parameters())
        grad = torch.randn_like(module(x))
        for direction, g in (("fwd", None), ("fwd+bwd", grad)):
            steps[impl, direction] = functools.partial(_norm_step, module, x, inputs, g)
    return steps


def _norm_step(module, x, inputs, grad):
    """One forward of a norm module (and, given `grad`, its backward to `inputs`)."""
    y = module(x)
    if grad is not None:
        torch.autograd.grad(y, inputs, grad)


# Wan's decoder upsamplers at its default config (bench.census --vae wan): nearest 2x in H and W, then a 3x3 Conv2d
# on the frames; a chunk of 4 frames. (name, batch, channels in, frames, height, width, channels out)
SUBPIXEL_LAYERS = [
    ("wan_up_384", 1, 384, 4, 64, 64, 192),
    ("wan_up_192", 1, 192, 4, 128, 128, 96),
]


def subpixel_geometries(batch: int, cin: int, frames: int, height: int, width: int, cout: int) -> dict:
    """The launches' geometries of bench_subpixel's tconv3d rows by direction: the sub-pixel form's transposed conv
    (its forward the input-gradient op, its input gradient a stride-2 forward, its weight gradient), and the
    upsample-first form's frame conv over the upsampled size (a forward, both gradients)."""
    from tconv3d.geometry import conv_geometry

    transposed = conv_geometry((batch, cout, frames, 2 * height, 2 * width), (cin, cout, 1, 4, 4), (1, 2, 2),
                               (0, 1, 1), 1)  # fmt: skip
    upsampled = conv_geometry((batch, cin, frames, 2 * height, 2 * width), (cout, cin, 1, 3, 3), 1, (0, 1, 1), 1)
    return {"subpixel": {"dgrad": transposed, "fwd": transposed, "wgrad": transposed},
            "upsample_first": {"fwd": upsampled, "dgrad": upsampled, "wgrad": upsampled}}  # fmt: skip


def bench_subpixel() -> list[dict]:
    """Wan's upsamplers (SUBPIXEL_LAYERS), bf16: diffusers' way on cuDNN (the frames as a batch, nearest 2x in
    float32 and cast back, a channels_last Conv2d: `interp_then_cudnn`), tconv3d writing the upsampled input then
    convolving it (`tconv3d_upsample_first`: repeat_nearest, frame_conv; what convert ran before the sub-pixel form),
    and tconv3d's sub-pixel form (`tconv3d`: upsampled_frame_conv, one transposed conv of the input with 4 x 4
    taps); time and peak memory, fwd and fwd+bwd (the gradients of the input, the weight and the bias)."""
    from torch import nn

    from tconv3d.nn.modules import repeat_nearest
    from tconv3d.nn.video_vaes import frame_conv, upsampled_frame_conv

    def interp_then_cudnn(x, conv):
        b, c, t, h, w = x.shape
        frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        up = F.interpolate(frames.float(), scale_factor=2.0, mode="nearest-exact").to(x.dtype)
        y = conv(up.contiguous(memory_format=torch.channels_last))
        return y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)

    impls = {
        "interp_then_cudnn": interp_then_cudnn,
        "tconv3d_upsample_first": lambda x, conv: frame_conv(conv, repeat_nearest(x, (1, 2, 2))),
        "tconv3d": lambda x, conv: upsampled_frame_conv(conv, x),
    }
    rows = []
    for name, batch, cin, frames, height, width, cout in SUBPIXEL_LAYERS:
        x = torch.randn(batch, cin, frames, height, width, device="cuda", dtype=torch.bfloat16)
        x = x.contiguous(memory_format=CL).requires_grad_()
        conv = nn.Conv2d(cin, cout, 3, padding=1).to(device="cuda", dtype=torch.bfloat16)
        conv = conv.to(memory_format=torch.channels_last)  # as convert leaves it
        tensors = (x, conv.weight, conv.bias)
        for direction in ("fwd", "fwd+bwd"):
            row = {"name": f"{name}_{direction}"}
            for impl, forward in impls.items():
                run = functools.partial(forward, x, conv)
                grad = torch.randn_like(run()) if direction == "fwd+bwd" else None
                fn = functools.partial(_subpixel_step, run, tensors, grad)
                row[f"{impl}_ms"] = round(bench_ms(fn), 4)
                row[f"{impl}_peak_mb"] = round(peak_memory_mb(fn), 1)
            rows.append(row)
        del x, conv, tensors
        torch.cuda.empty_cache()
    return rows


def _subpixel_step(run, tensors, grad):
    """One forward of bench_subpixel (and, given `grad`, its backward to the input, the weight and the bias)."""
    if grad is None:
        with torch.no_grad():
            run()
        return
    torch.autograd.grad(run(), tensors, grad)


# ---------------------------------------------------------------------------------------------------------------


def plan_cases(shapes: list[ConvShape], dtype: str, directions, names=None) -> list[tuple[ConvShape, str, str]]:
    """(shape, dtype, direction) to measure: bf16 for every case, fp16/fp32 where a case lists them."""
    plan = []
    for shape in shapes:
        if names and shape.name not in names:
            continue
        shape.require_plain()
        dtypes = shape.dtypes if dtype == "all" else [d for d in shape.dtypes if d == dtype]
        plan += [(shape, d, direction) for d in dtypes for direction in directions]
    return plan


def git_commit() -> str:
    """HEAD of this checkout, or TCONV3D_COMMIT where the tree travelled without .git (the GPU machine)."""
    if os.environ.get("TCONV3D_COMMIT"):
        return os.environ["TCONV3D_COMMIT"]
    try:
        root = Path(__file__).parent.parent
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The command line, also read by bench.precompile to compile what a run with the same arguments launches."""
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="bench", help="a shipped shape set or a JSON file in its format")
    parser.add_argument("--dtype", default="all", choices=["all", *DTYPES_BY_NAME], help="all: each case's dtypes")
    parser.add_argument("--direction", default="all", choices=["all", *report.DIRECTIONS])
    parser.add_argument(
        "--impls", default=",".join(report.IMPLS), help="comma-separated subset of " + ",".join(report.IMPLS)
    )
    parser.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    parser.add_argument(
        "--scenarios", default="stack,conv2d,causal,skip,subpixel,norms", help="comma-separated, or 'none'"
    )
    parser.add_argument(
        "--graphs", action=argparse.BooleanOptionalAction, default=True,
        help="also time " + " and ".join(GRAPH_IMPLS) + " replayed from a CUDA graph (the launches without the host)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--merge", action="store_true", help="fold into the existing results file instead of replacing it"
    )
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench needs a CUDA device: it times tconv3d against cuDNN on the GPU.")
        return 2
    torch.backends.cudnn.benchmark = True
    shapes = load_shape_set(args.suite)
    directions = report.DIRECTIONS if args.direction == "all" else (args.direction,)
    impls = tuple(args.impls.split(","))
    plan = plan_cases(shapes, args.dtype, directions, set(args.cases.split(",")) if args.cases else None)
    peak = measure_peaks()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "commit": git_commit(),
        "date": datetime.date.today().isoformat(),
        "peak": peak,
        "cases": [],
    }
    for index, (shape, dtype_name, direction) in enumerate(plan, start=1):
        case = bench_case(shape, dtype_name, direction, impls, peak_for(peak, dtype_name), args.graphs)
        results["cases"].append(case)
        ratio = report.speedup(case)
        tconv3d_ms = case["impls"].get("tconv3d", {}).get("ms")
        gain = f"{ratio:.2f}x" if ratio else "-"
        print(
            f"[{index}/{len(plan)}] {shape.name} {dtype_name} {direction}: tconv3d {tconv3d_ms} ms, {gain}", flush=True
        )
        # Saved after every case, so a run cut off at its time limit keeps what it measured.
        report.write_results(results, args.out, merge_existing=args.merge or index > 1, json_only=True)
    if plan:
        reread_bf16_peak(results)
    scenarios = set() if args.scenarios == "none" else set(args.scenarios.split(","))
    if "stack" in scenarios:

        def measured(rows):  # saved after each of its models, as the cases are
            results["stack"] = rows
            report.write_results(results, args.out, merge_existing=args.merge or bool(plan), json_only=True)

        bench_stack(measured)
    if "conv2d" in scenarios:
        results["conv2d_vs_conv3d"] = bench_conv2d_vs_conv3d()
    if "causal" in scenarios:
        results["causal"] = bench_causal(shapes)
    if "skip" in scenarios:
        results["skip"] = bench_skip()
    if "subpixel" in scenarios:
        results["subpixel"] = bench_subpixel()
    if "norms" in scenarios:
        results["norms"] = bench_norms()
    paths = report.write_results(results, args.out, merge_existing=args.merge)
    print(paths["md"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
