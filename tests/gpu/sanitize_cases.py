"""Every kernel family on small awkward problems, forward and backward, for compute-sanitizer (tests/gpu/memcheck.sh).

    python3 tests/gpu/sanitize_cases.py [--quick] [--family NAME[,NAME...]] [--list]

Families: the pointer kernels (odd channels, stride 2, dilation, causal 6-value padding, 1x3x3, a Cin=3 stem on the
packed small-channel path, Cout = 3 and 5 on the out-pairs weight gradient and the forward's W-tap columns, Cin = 2
and 3 on the input gradient's, W dilated to the taps' longest reach), the TMA kernels (patch and one-row boxes,
stride-2 phase views, asymmetric padding with dilation), the Gluon kernels software-pipelined and persistent
warp-specialized (sm_90 with a Triton they are written for) and as halo tiles, split-K in the forward and input
gradient (pointer, TMA and Gluon), depthwise and grouped convolution, the padding modes inside the kernels,
`frames_before`, ConvTranspose3d, the NDHWC GroupNorm and rms_norm, and trilinear upsampling (upsample_linear). Each
variant is forced where the problem allows it. Every result is also checked against float64, so a run that touches
no bad memory also computed the right thing; the last line is one row per family.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

import tconv3d
from tconv3d import settings
from tconv3d.kernels.config import off_gluon
from tconv3d.testing import float64_errors, random_conv_inputs, tolerance
from tconv3d.tune import choice, configs

CL = torch.channels_last_3d
DEVICE = "cuda"  # --device cpu: the same problems through Triton's interpreter (TRITON_INTERPRET=1), the script's check

# (N, Cin, Cout, (D, H, W), kernel, stride, padding, dilation)
POINTER = [
    (2, 3, 17, (5, 7, 9), 3, 1, 1, 1),  # Cin = 3: the packed (tap, channel) reduction
    (1, 17, 33, (7, 6, 9), 3, 2, 1, 1),
    (1, 5, 6, (5, 6, 7), 3, 1, (2, 0, 1, 1, 1, 1), 1),
    (2, 24, 20, (4, 9, 7), (1, 3, 3), (1, 2, 2), (0, 1, 1), 1),
    (1, 4, 5, (9, 8, 10), 3, 1, 2, 2),
    (2, 20, 3, (5, 7, 9), 3, 1, 1, 1),  # Cout = 3: the weight gradient's (tap, output channel) rows
    (1, 18, 5, (4, 6, 7), (3, 3, 5), 1, (1, 1, 2), 1),  # 45 taps: their bits in int64
    # W taps as columns reaching 8 voxels (config.W_TAPS_MAX_HALO): the forward's (Cout = 2), the input gradient's
    # (Cin = 2); Cin = 3 above and Cout = 3 and 5 take them at a reach of 2 and 4
    (1, 20, 2, (4, 5, 19), (1, 3, 3), 1, (0, 1, 4), (1, 1, 4)),
    (1, 2, 20, (4, 5, 19), (1, 3, 3), 1, (0, 1, 4), (1, 1, 4)),
]
# 16-byte channel rows: what the TMA and Gluon kernels take.
BOXED = [
    (2, 16, 24, (5, 7, 9), 3, 1, 1, 1),  # borders on every side, sizes no box divides
    (1, 16, 32, (3, 4, 128), 3, 1, 1, 1),  # rows that fill a one-row box
    (1, 16, 32, (7, 9, 10), 3, 2, 1, 1),  # stride 2: phase views
    (1, 8, 16, (6, 9, 13), 3, 1, (2, 0, 1, 1, 3, 2), (1, 1, 2)),  # causal, asymmetric, dilated
]


@contextlib.contextmanager
def choosing(kernels: str = "auto", adjust=None):
    """Run with TCONV3D_KERNELS=`kernels`, each chosen config passed through `adjust` (a split, the
    warp-specialized twin), from a fresh choice; yields the list of configs the launches were given."""
    saved_kernels, saved_select, chosen = settings.KERNELS, choice._select, []

    def select(direction, geom, dtype, device, run):
        config = saved_select(direction, geom, dtype, device, run)
        chosen.append(config if adjust is None else adjust(direction, geom, config))
        return chosen[-1]

    settings.KERNELS, choice._select = kernels, select
    choice._memo.clear()
    try:
        yield chosen
    finally:
        settings.KERNELS, choice._select = saved_kernels, saved_select
        choice._memo.clear()


def split_three(direction, geom, config):
    return config if direction == "wgrad" else dataclasses.replace(config, split_k=3)


def pipelined(direction, geom, config):
    """The pipelined Gluon kernel (gluon = 1) on the chosen warp-specialized config's tiles (off_gluon: one tap's
    columns, unswapped where the weight gradient's were transposed), where it compiles them: with Gluon forced the
    heuristic gives the warp-specialized kernel nearly everywhere, so H200 run 7's memcheck of this family ran
    gluon = 2 in 3 of its 4 problems."""
    if config.gluon != 2:
        return config
    plain = dataclasses.replace(off_gluon(config), gluon=1)
    return plain if configs.gluon_takes(plain) else config


def warp_specialized(direction, geom, config):
    return dataclasses.replace(config, gluon=2) if config.gluon else config


def halo_tiles(direction, geom, config):
    """The warp-specialized twin as halo tiles (configs.halo_twin) where the launch may take them."""
    config = warp_specialized(direction, geom, config)
    return (config.gluon and configs.halo_twin(direction, geom, config, 2)) or config


def conv_errors(case, dtype, groups: int = 1) -> list[float]:
    n, cin, cout, size, kernel, stride, padding, dilation = case
    k = (kernel,) * 3 if isinstance(kernel, int) else kernel
    x, w, b = random_conv_inputs((n, cin, *size), (cout, cin // groups, *k), dtype, DEVICE, bias=True)
    return list(float64_errors(tconv3d.conv3d, x, w, b, stride, padding, dilation, groups).values())


def autograd_errors(ours, reference, *tensors) -> list[float]:
    """Relative L2 errors of ours(*tensors) and its gradients against reference() on float64 copies."""
    from tconv3d.testing import rel_l2

    mine = [t.detach().requires_grad_() for t in tensors]
    exact = [t.detach().double().requires_grad_() for t in tensors]
    expected = reference(*exact)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    got = ours(*mine)
    grads = torch.autograd.grad(got, mine, grad_out.to(got.dtype))
    return [rel_l2(got, expected)] + [rel_l2(g, e.grad) for g, e in zip(grads, exact, strict=True)]


def padding_mode_errors(mode, dtype) -> list[float]:
    x, w, b = random_conv_inputs((1, 16, 5, 6, 7), (16, 16, 3, 3, 3), dtype, DEVICE, bias=True)
    pads = (2, 0, 1, 1, 1, 1)  # d_front, d_back, h_top, h_bottom, w_left, w_right
    modes = (mode,) * 3 if isinstance(mode, str) else mode

    def reference(x, w, b):
        for axis, m in enumerate(modes):  # F.pad per dimension (D, H, W), in that dimension's mode
            spec = [0] * 6  # F.pad's order: W, H, D
            spec[2 * (2 - axis)], spec[2 * (2 - axis) + 1] = pads[2 * axis], pads[2 * axis + 1]
            x = F.pad(x, spec, mode="constant" if m == "zeros" else m)
        return F.conv3d(x, w, b)

    ours = lambda x, w, b: tconv3d.conv3d(x, w, b, 1, pads, padding_mode=mode)  # noqa: E731
    return autograd_errors(ours, reference, x, w, b)


def frames_before_errors(dtype) -> list[float]:
    x, w, b = random_conv_inputs((1, 16, 4, 6, 7), (24, 16, 3, 3, 3), dtype, DEVICE, bias=True)
    cache = torch.randn(1, 16, 2, 6, 7, device=DEVICE).to(dtype).contiguous(memory_format=CL)
    pads = (0, 0, 1, 1, 1, 1)
    ours = lambda x, w, b, c: tconv3d.conv3d(x, w, b, 1, pads, frames_before=c)  # noqa: E731
    reference = lambda x, w, b, c: F.conv3d(F.pad(torch.cat([c, x], 2), (1, 1, 1, 1)), w, b)  # noqa: E731
    return autograd_errors(ours, reference, x, w, b, cache)


def transpose_errors(dtype) -> list[float]:
    x, w = random_conv_inputs((1, 16, 3, 5, 4), (16, 24, 3, 3, 3), dtype, DEVICE)  # weight (Cin, Cout, k...)
    b = torch.randn(24, device=DEVICE).to(dtype)
    args = (2, 1, 1)  # stride, padding, output_padding
    ours = lambda x, w, b: tconv3d.conv_transpose3d(x, w, b, *args)  # noqa: E731
    reference = lambda x, w, b: F.conv_transpose3d(x, w, b, *args)  # noqa: E731
    return autograd_errors(ours, reference, x, w, b)


def channels_after_errors(dtype, transposed: bool) -> list[float]:
    """A skip connection read in place: a conv of torch.cat([x, skip], 1) (the forward's, weight gradient's second
    source) or, transposed, MONAI UNet's up conv of it (the input gradient's, in grad_output); channels that
    straddle a 16-channel block."""
    x = torch.randn(1, 20, 3, 5, 4, device=DEVICE).to(dtype).contiguous(memory_format=CL)
    skip = torch.randn(1, 12, 3, 5, 4, device=DEVICE).to(dtype).contiguous(memory_format=CL)
    if transposed:
        w = (torch.randn(32, 24, 3, 3, 3, device=DEVICE) / 16).to(dtype).contiguous(memory_format=CL)
        ours = lambda x, skip, w: tconv3d.conv_transpose3d(x, w, None, 2, 1, 1, channels_after=skip)  # noqa: E731
        reference = lambda x, skip, w: F.conv_transpose3d(torch.cat([x, skip], 1), w, None, 2, 1, 1)  # noqa: E731
    else:
        w = (torch.randn(24, 32, 3, 3, 3, device=DEVICE) / 16).to(dtype).contiguous(memory_format=CL)
        ours = lambda x, skip, w: tconv3d.conv3d(x, w, None, 1, 1, channels_after=skip)  # noqa: E731
        reference = lambda x, skip, w: F.conv3d(torch.cat([x, skip], 1), w, None, 1, 1)  # noqa: E731
    return autograd_errors(ours, reference, x, skip, w)


def norm_errors(dtype, activation, skip=False) -> list[float]:
    """GroupNorm of 48 channels in 6 groups; with `skip`, of 44 channels and a skip connection's 4 read in place
    (channels_after: the last group spans both sources)."""
    x = torch.randn(2, 48, 3, 5, 7, device=DEVICE).to(dtype).contiguous(memory_format=CL)
    weight, bias = torch.randn(48, device=DEVICE).to(dtype), torch.randn(48, device=DEVICE).to(dtype)
    norm = tconv3d.nn.GroupNorm(6, 48, activation=activation).to(DEVICE)

    def ours(x, weight, bias):
        sources = (x[:, :44].contiguous(memory_format=CL), x[:, 44:].contiguous(memory_format=CL)) if skip else (x,)
        return torch.func.functional_call(norm, {"weight": weight, "bias": bias}, sources)

    def reference(x, weight, bias):
        y = F.group_norm(x, 6, weight, bias, norm.eps)
        return F.silu(y) if activation else y

    return autograd_errors(ours, reference, x, weight, bias)


def rms_norm_errors(dtype, activation, clamp) -> list[float]:
    """The rms_norm kernels on 1,030 channels (a row wider than 1,024, one row a program) with a zero voxel."""
    x = torch.randn(1, 1030, 2, 3, 5, device=DEVICE).to(dtype)
    x[0, :, 0, 0, 0] = 0
    x = x.contiguous(memory_format=CL)
    weight, bias = torch.randn(1030, device=DEVICE).to(dtype), torch.randn(1030, device=DEVICE).to(dtype)
    eps = 1e-12 if clamp else 1e-6

    def ours(x, weight, bias):
        return torch.ops.tconv3d.rms_norm(x, weight, bias, eps, activation, clamp)

    def reference(x, weight, bias):
        if clamp:  # F.normalize(x) * sqrt(C), eps scaled to match
            y = F.normalize(x, dim=1, eps=eps * 1030**0.5) * 1030**0.5
        else:
            y = F.rms_norm(x.movedim(1, -1), (1030,), eps=eps).movedim(-1, 1)
        y = y * weight.view(1, -1, 1, 1, 1) + bias.view(1, -1, 1, 1, 1)
        return F.silu(y) if activation == "silu" else y

    return autograd_errors(ours, reference, x, weight, bias)


def resample_errors(dtype, factors) -> list[float]:
    """upsample_linear on 130 channels (two channel blocks a voxel), an axis of one voxel and an odd one."""
    x = torch.randn(2, 130, 1, 3, 5, device=DEVICE).to(dtype).contiguous(memory_format=CL)

    def ours(x):
        return torch.ops.tconv3d.upsample_linear(x, list(factors))

    def reference(x):
        return F.interpolate(x, scale_factor=[float(f) for f in factors], mode="trilinear")

    return autograd_errors(ours, reference, x)


@dataclasses.dataclass
class Problem:
    label: str
    dtype: torch.dtype
    errors: object  # () -> list of relative L2 errors (output, then gradients)
    kernels: str = "auto"  # TCONV3D_KERNELS while it runs
    adjust: object = None  # each chosen config passed through this (choosing)
    ran: object = lambda configs: True  # whether the configs the launches were given are the family's


def every(test):
    return lambda configs: bool(configs) and all(test(c) for c in configs)


# The families, in families()' order: memcheck.sh shares them out over parallel sanitizer processes from this list.
FAMILIES = ("pointer", "tma", "gluon", "gluon_ws", "halo", "split_k", "depthwise", "grouped", "padding_modes",
            "frames_before", "conv_transpose", "channels_after", "group_norm", "rms_norm", "resample")  # fmt: skip


def families() -> dict[str, list[Problem]]:
    """name -> its problems; a family the device or its Triton cannot run has none."""
    device = torch.device(DEVICE)
    gluon = choice._gluon_runs(device)
    tma = (
        settings.INTERPRET if device.type == "cpu" else configs.compute_capability(device) >= configs.TMA_MIN_CAPABILITY
    )
    bf16, both = torch.bfloat16, (torch.bfloat16, torch.float32)
    depthwise, grouped = (2, 24, 24, (5, 7, 9), 3, 1, 1, 1), (1, 16, 32, (5, 6, 7), 3, 1, 1, 1)
    modes = ("replicate", "reflect", "circular", ("replicate", "zeros", "circular"))
    return {
        "pointer": [Problem(f"{c} {d}", d, lambda c=c, d=d: conv_errors(c, d), "pointer",
                            ran=every(lambda c: not c.tma_box_w)) for d in both for c in POINTER],
        "tma": [Problem(f"{c}", bf16, lambda c=c: conv_errors(c, bf16), "tma", ran=every(lambda c: c.variant == "tma"))
                for c in BOXED if tma],
        "gluon": [Problem(f"{c}", bf16, lambda c=c: conv_errors(c, bf16), "gluon", pipelined,
                          every(lambda c: c.gluon == 1)) for c in BOXED if gluon],
        "gluon_ws": [Problem(f"{c}", bf16, lambda c=c: conv_errors(c, bf16), "gluon", warp_specialized,
                             every(lambda c: c.gluon == 2)) for c in BOXED if gluon],
        # two frames a tile (forward and input gradient): the borders on every side, and causal, dilated in W
        "halo": [Problem(f"{c}", bf16, lambda c=c: conv_errors(c, bf16), "gluon", halo_tiles,
                         lambda configs: any(c.halo_d for c in configs)) for c in (BOXED[0], BOXED[3]) if gluon],
        "split_k": [Problem(f"{k} {BOXED[0]}", bf16, lambda: conv_errors(BOXED[0], bf16), k, split_three,
                            lambda configs, k=k: any(c.split_k == 3 and c.variant == k for c in configs))
                    for k, runs in (("pointer", True), ("tma", tma), ("gluon", gluon)) if runs],
        "depthwise": [Problem(f"{depthwise} {d}", d, lambda d=d: conv_errors(depthwise, d, 24),
                              ran=every(lambda c: c.direct)) for d in both],
        "grouped": [Problem(f"{grouped} groups 4 {d}", d, lambda d=d: conv_errors(grouped, d, 4)) for d in both],
        "padding_modes": [Problem(f"{m}", bf16, lambda m=m: padding_mode_errors(m, bf16)) for m in modes],
        "frames_before": [Problem("2 cached frames", bf16, lambda: frames_before_errors(bf16))],
        "conv_transpose": [Problem("stride 2", bf16, lambda: transpose_errors(bf16))],
        "channels_after": [Problem(f"{'transposed ' * t}skip", bf16, lambda t=t: channels_after_errors(bf16, t))
                           for t in (False, True)],
        "group_norm": [Problem(f"{d} {a}", d, lambda d=d, a=a: norm_errors(d, a)) for d in both
                       for a in (None, "silu")]
        + [Problem("bf16 silu skip (channels_after)", bf16, lambda: norm_errors(bf16, "silu", skip=True))],
        "rms_norm": [Problem(f"{d} {a}{' clamp' * c}", d, lambda d=d, a=a, c=c: rms_norm_errors(d, a, c))
                     for d in both for a, c in (("none", True), ("silu", False))],
        "resample": [Problem(f"{d} x{f}", d, lambda d=d, f=f: resample_errors(d, f))
                     for d in both for f in ((2, 2, 2), (2, 1, 1))],
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the first problem of each family (racecheck)")
    parser.add_argument("--family", default=None, help="comma-separated families (default: all)")
    parser.add_argument("--list", action="store_true", help="print the families and their problems, run nothing")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the kernels through the interpreter")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    found = families()
    assert tuple(found) == FAMILIES, (tuple(found), FAMILIES)
    wanted = list(found) if args.family is None else args.family.split(",")
    unknown = [name for name in wanted if name not in found]
    if unknown:
        parser.error(f"unknown famil{'y' if len(unknown) == 1 else 'ies'} {unknown}; there are {list(found)}")
    summary, failures = [], 0
    for name in wanted:
        problems, failed, started = found[name][:1] if args.quick else found[name], 0, time.monotonic()
        for problem in problems:
            if args.list:
                print(f"{name}: {problem.label}")
                continue
            with choosing(problem.kernels, problem.adjust) as configs:
                errors = problem.errors()
            ok = max(errors) < tolerance(problem.dtype)  # fp32: TF32's bound where cuDNN may use TF32 (the default)
            forced = problem.ran(configs)
            failed += not (ok and forced)
            verdict = ("ok" if ok else "FAIL") + ("" if forced else f" (FAIL: not the family's kernels: {configs})")
            print(f"{name} {problem.label}: errors {' '.join(f'{e:.1e}' for e in errors)} {verdict}", flush=True)
        ran = f"{len(problems) - failed}/{len(problems)} ok" if problems else "not run on this device"
        summary.append(f"{name} {ran} ({time.monotonic() - started:.0f} s)")
        failures += failed
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    print("; ".join(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
