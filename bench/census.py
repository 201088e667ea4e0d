"""`python -m bench.census`: every convolution of a converted video-VAE decode (or a MONAI 3D UNet's forward) and the
kernel a GPU would run it on, on a machine with no GPU.

    python -m bench.census --vae wan                    # diffusers' default config, a 17-frame 256 x 256 decode
    python -m bench.census --vae wan --latent 1,16,5,60,104 --device-name "NVIDIA H100 80GB HBM3"
    python -m bench.census --unet basic_unet            # MONAI's, 1 x 1 x 128^3 (--input N,C,D,H,W)
    python -m bench.census --unet unet --training       # a training step's: forward, input and weight gradients
    python -m bench.census --vae wan --training         # a decoder's fine-tuning step (its latent takes no gradient)
    python -m bench.census --vae wan --encode 1,3,17,256,256  # the VAE's encode of a video instead
    python -m bench.census --vae wan --timed-only       # as chosen from the rules a GPU has timed alone

It builds the VAE (bench.vaes, random weights), converts it (tconv3d.nn.convert) and decodes a latent on the meta
device: nothing is computed, each tconv3d conv3d call is seen by a dispatch mode and its geometry recorded. For
each distinct geometry it prints how many calls had it, the forward's config as that GPU model would choose it
(tconv3d.tune.choice.choose: its table, the nearest key's, or the heuristic), where that came from, the share of
its MMA work that is the convolution's (configs.mma_fill) and its share of the decode's convolution FLOPs; then
the FLOPs each kernel variant would run. A decode is inference: forwards only (a transposed conv's forward is the
input-gradient op: its rows say dgrad); a training step (`--training`: a UNet's, a VAE's decode or encode) adds the
backward's input gradients (dgrad; a transposed conv's: fwd) and weight gradients (wgrad). What it showed first
(bench/NOTES.md, "What the video VAE decodes run"): Wan's chunks after the first read cached frames, Mochi's and
HunyuanVideo's convs border H and W by replicate, and the heuristic kept both on the pointer kernels: 92-100% of
those decodes' FLOPs, until the H100 timed the Gluon kernel 1.7-2.8x faster on them (run 15), which the heuristic
now takes."""

from __future__ import annotations

import argparse
import collections

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

import tconv3d
from tconv3d.geometry import check_conv3d, check_input_grad, check_weight_grad
from tconv3d.kernels import conv_fwd
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import DTYPES_BY_NAME, ConvShape

from .vaes import CLASSES, DEFAULT_LATENTS, build_vae

# MONAI's 3D UNets at the sizes their tutorials train (`--unet`), for the census of one forward.
UNETS = {
    "unet": lambda nets: nets.UNet(3, 1, 3, channels=(16, 32, 64, 128, 256), strides=(2, 2, 2, 2), num_res_units=2),
    "basic_unet": lambda nets: nets.BasicUNet(3, 1, 3, features=(32, 32, 64, 128, 256, 32)),
    "dynunet": lambda nets: nets.DynUNet(
        3,
        1,
        3,
        kernel_size=[3] * 5,
        strides=[1, 2, 2, 2, 2],
        upsample_kernel_size=[2] * 4,
        filters=[32, 64, 128, 256, 320],
    ),
}


class _ConvGeometries(TorchDispatchMode):
    """Counts the (direction, geometry) of the tconv3d.conv3d calls ("fwd"), conv3d_input_grad calls ("dgrad": a
    transposed conv's forward, or a conv's backward) and conv3d_weight_grad calls ("wgrad") made inside it."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for direction, op, check in (("fwd", torch.ops.tconv3d.conv3d, check_conv3d),
                                     ("dgrad", torch.ops.tconv3d.conv3d_input_grad, check_input_grad),
                                     ("wgrad", torch.ops.tconv3d.conv3d_weight_grad, check_weight_grad)):  # fmt: skip
            if func is op.default:
                names = [argument.name for argument in func._schema.arguments]
                self.counts[direction, check(**dict(zip(names, args, strict=False)), **kwargs)] += 1
        return func(*args, **kwargs)


def model_geometries(
    converted: torch.nn.Module, run, input_shape, dtype: torch.dtype, training: bool = False
) -> collections.Counter:
    """(direction, geometry) -> calls, of `run(converted, x)` on an input x of `input_shape` (a UNet's forward, a
    VAE's decode of a latent or its encode of a video), the model converted and moved to the meta device; with
    `training`, a training step's: that, then the backward of its output's sum (the input takes no gradient, as a
    training batch, or a decoder's latent from a frozen encoder, does not)."""
    converted = converted.to(device="meta", dtype=dtype).train(training)
    with torch.set_grad_enabled(training), _ConvGeometries() as seen:
        out = run(converted, torch.empty(input_shape, dtype=dtype, device="meta"))
        if training:
            out.sum().backward()
    return seen.counts


def forward(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x)


def decoded(vae: torch.nn.Module, latent: torch.Tensor) -> torch.Tensor:
    return vae.decode(latent).sample


def encoded(vae: torch.nn.Module, video: torch.Tensor) -> torch.Tensor:
    return vae.encode(video).latent_dist.mean


def census(
    counts: collections.Counter,
    dtype: torch.dtype,
    device_name: str,
    sm_count: int,
    capability: int,
    timed_only: bool = False,
) -> tuple[list, collections.Counter]:
    """One row a (direction, geometry): (calls, direction, geometry, config, source, fill, share of the FLOPs),
    largest share first; and the FLOPs by variant. `timed_only`: the choice from the heuristic's timed rules alone
    (choice.choose), what it was before its untimed ones."""
    total = sum(calls * geom.flops() for (_, geom), calls in counts.items()) or 1
    rows, by_variant = [], collections.Counter()
    for (direction, geom), calls in counts.items():
        config, source = choice.choose(direction, geom, dtype, device_name, sm_count, capability, timed_only)
        share = calls * geom.flops() / total
        fill = configs.mma_fill(direction, geom, config, dtype.itemsize)
        rows.append((calls, direction, geom, config, source, fill, share))
        interior = interior_share(direction, geom, config)
        by_variant[_kernel(config)] += share * interior
        by_variant["pointer"] += share * (1 - interior)  # the border ring's launch
    return sorted(rows, key=lambda row: -row[-1]), by_variant


def interior_share(direction: str, geom, config) -> float:
    """The share of a launch's output a box kernel computes: all of it but for a forward or weight gradient bordered
    in H or W by another mode than zeros, whose border ring (the forward's one launch, the weight gradient's four
    strips) runs on the pointer kernel (conv_fwd.conv3d_fwd, conv_wgrad.conv3d_wgrad)."""
    if direction == "dgrad" or not conv_fwd.leaves_border_ring(geom, config):
        return 1.0
    _, h, w = geom.out_size
    return 1 - conv_fwd.ring_voxels(geom) / (h * w)


def _kernel(config) -> str:
    """The config's kernel: its variant, "-ws" for the warp-specialized Gluon kernel."""
    return config.variant + ("-ws" if config.gluon == 2 else "")


def timeable_shape(direction: str, geom, name: str, dtype_name: str) -> ConvShape | None:
    """A census row's problem as a bench case (tconv3d.tune.shapes.ConvShape) that bench.variants times against
    cuDNN (`--time`), or None where a case cannot say it: a second source along the channels (channels_after, a
    transposed conv's skip), the input gradient of zero padding that differs front and back (a causal conv's:
    cuDNN's forward and weight gradient read F.pad's copy, its input gradient pads both sides alike), or the input
    gradient of a decoder's layer (cached frames or borders: bench.variants times those forward and weight
    gradient)."""
    if geom.after_channels or geom.out_after_channels:
        return None
    if direction == "dgrad" and geom.padding[0::2] != geom.padding[1::2]:
        return None
    d, h, w = geom.in_size
    shape = ConvShape(
        name, geom.batch, geom.in_channels, geom.out_channels, (d - geom.prefix_frames, h, w), geom.kernel,
        geom.stride, geom.padding, geom.dilation, (dtype_name,), geom.groups, geom.prefix_frames, geom.padding_mode,
    )  # fmt: skip
    return None if shape.decoder_layer and direction == "dgrad" else shape


def timeable_rows(rows: list, dtype_name: str) -> list[tuple[int, ConvShape]]:
    """(index into `rows`, its bench case) of the census rows `--time` times (timeable_shape), named by index."""
    found = []
    for index, (_, direction, geom, *_) in enumerate(rows):
        shape = timeable_shape(direction, geom, f"row{index}", dtype_name)
        if shape is not None:
            found.append((index, shape))
    return found


def time_rows(rows: list, dtype_name: str, log=print) -> list[dict]:
    """Each timeable row's chosen kernels against cuDNN channels_last_3d on this CUDA device, through
    bench.variants.measure_case (each result checked against cuDNN in fp32 first; cuDNN convolves the
    concatenation of cached frames, and F.pad's copy for a border mode, as the stock model calls it): one dict a
    row, `ms` and `cudnn_ms` (None where untimed: not timeable, or failed)."""
    from .variants import measure_case

    timed = {}
    for index, shape in timeable_rows(rows, dtype_name):
        direction = rows[index][1]
        found: list[dict] = []
        measure_case(shape, dtype_name, direction, None, found.append, impls={"chosen"})
        by_impl = {row["impl"]: row for row in found}
        chosen, cudnn = by_impl.get("chosen", {}), by_impl.get("cudnn_cl3d", {})
        failed = chosen.get("failed") if chosen else "no chosen row"
        timed[index] = {"ms": chosen.get("ms"), "cudnn_ms": cudnn.get("ms"), "failed": failed}
        log(f"row {index:>3} {direction:5} {_geometry_text(rows[index][2])}: tconv3d {_ms(chosen.get('ms'))} ms, "
            f"cuDNN {_ms(cudnn.get('ms'))} ms" + (f" FAILED: {failed}" if failed else ""))  # fmt: skip
    out = []
    for index, (calls, direction, geom, config, *_, share) in enumerate(rows):
        row = {"calls": calls, "direction": direction, "geometry": _geometry_text(geom), "config": config.to_dict(),
               "flops_share": share, "ms": None, "cudnn_ms": None, "failed": None}  # fmt: skip
        out.append({**row, **timed.get(index, {})})
    return out


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def timed_totals(timed: list[dict]) -> dict:
    """The rows timed both ways: their calls times each's ms, summed (the model's convolutions, as far as they were
    timed), and the share of the model's convolution FLOPs they hold."""
    both = [row for row in timed if row["ms"] is not None and row["cudnn_ms"] is not None]
    return {
        "tconv3d_ms": sum(row["calls"] * row["ms"] for row in both),
        "cudnn_ms": sum(row["calls"] * row["cudnn_ms"] for row in both),
        "flops_share_timed": sum(row["flops_share"] for row in both),
        "rows_timed": len(both),
        "rows": len(timed),
    }


def _geometry_text(geom) -> str:
    k = "x".join(map(str, geom.kernel))
    s = "x".join(map(str, geom.stride))
    size = "x".join(map(str, geom.in_size))
    cached = f" +{geom.prefix_frames} cached" if geom.prefix_frames else ""
    if geom.after_channels or geom.out_after_channels:  # a second source along the channels: a skip connection
        cached += f" +{geom.after_channels or geom.out_after_channels} skip"
    modes = "" if set(geom.dim_modes) == {"zeros"} else f" {'/'.join(geom.dim_modes)}"
    return f"{geom.in_channels:>4} -> {geom.out_channels:<4} k{k} s{s} in {size}{cached}{modes}"


def build_parser() -> argparse.ArgumentParser:
    """The command line, also read by bench.precompile to compile what a `--time` run launches."""
    parser = argparse.ArgumentParser(prog="python -m bench.census", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vae", default="wan", choices=sorted(CLASSES))
    parser.add_argument("--latent", default=None, help="N,C,T,H,W (default: bench.vaes.DEFAULT_LATENTS)")
    parser.add_argument(
        "--encode",
        default=None,
        metavar="N,C,T,H,W",
        help="the VAE's encode of a video of this shape instead of its decode (1,3,17,256,256: 17 frames, 19 for "
        "Mochi's 6x time compression)",
    )
    parser.add_argument("--unet", default=None, choices=sorted(UNETS), help="a MONAI 3D UNet's forward instead")
    parser.add_argument("--input", default="1,1,128,128,128", help="N,C,D,H,W of --unet's input")
    parser.add_argument(
        "--training",
        action="store_true",
        help="a training step's convolutions: the forward (a UNet's, the VAE's decode or encode), then the "
        "backward of its output's sum: input and weight gradients",
    )
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES_BY_NAME))
    parser.add_argument("--device-name", default="NVIDIA H100 80GB HBM3", help="whose tuning table")
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--capability", type=int, default=90)
    parser.add_argument(
        "--timed-only",
        action="store_true",
        help="the choice from the heuristic's timed rules alone (as before its others)",
    )
    parser.add_argument(
        "--time",
        action="store_true",
        help="on a CUDA device (whose name, SMs and capability replace those above): time each row's chosen "
        "kernels against cuDNN channels_last_3d, and the model's convolutions in all",
    )
    parser.add_argument("--out", default=None, help="with --time: write the rows and totals here (JSON)")
    return parser


def model_counts(args) -> tuple[collections.Counter, str]:
    """The (direction, geometry) -> calls of the model `args` name (build_parser's), and a line saying which."""
    dtype = DTYPES_BY_NAME[args.dtype]
    if args.unet:
        from monai.networks import nets

        shape = tuple(int(n) for n in args.input.split(","))
        model, run, what = UNETS[args.unet](nets), forward, f"{args.unet}: input {shape}"
    elif args.encode:
        shape = tuple(int(n) for n in args.encode.split(","))
        model, run, what = build_vae(args.vae, scale=0), encoded, f"{args.vae}: encode of a video {shape}"
    else:
        shape = tuple(int(n) for n in args.latent.split(",")) if args.latent else DEFAULT_LATENTS[args.vae]
        model, run, what = build_vae(args.vae, scale=0), decoded, f"{args.vae}: latent {shape}"
    counts = model_geometries(tconv3d.nn.convert(model), run, shape, dtype, args.training)
    return counts, what + (", a training step" if args.training else "")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.time:
        if not torch.cuda.is_available():
            print("python -m bench.census --time times kernels: it needs a CUDA device")
            return 2
        device = torch.device("cuda")
        args.device_name, args.sms = torch.cuda.get_device_name(device), configs.multiprocessor_count(device)
        args.capability = configs.compute_capability(device)
        torch.backends.cudnn.benchmark = True
    dtype = DTYPES_BY_NAME[args.dtype]
    counts, what = model_counts(args)
    rows, by_variant = census(counts, dtype, args.device_name, args.sms, args.capability, args.timed_only)
    print(f"{what}, {sum(counts.values())} conv calls, {len(counts)} geometries; "
          f"{args.device_name} ({args.sms} SMs, sm_{args.capability}), {args.dtype}")  # fmt: skip
    for index, (calls, direction, geom, config, source, fill, share) in enumerate(rows):
        split = f" k{config.split_k}" if config.split_k > 1 else ""
        tile = f"{config.block_m}x{config.block_n}x{config.block_k}{split}"
        fill_text = "-" if fill is None else f"{100 * fill:.0f}%"
        interior = interior_share(direction, geom, config)
        ring = f" (ring {100 * (1 - interior):.0f}% pointer)" if interior < 1 else ""
        print(f"{index:>3} {calls:>4} x {_geometry_text(geom):58} {direction:5} {_kernel(config):10} {tile:14} "
              f"{source:9} fill {fill_text:>4} FLOPs {100 * share:5.1f}%{ring}")  # fmt: skip
    print("FLOPs by variant: " + ", ".join(f"{v} {100 * s:.0f}%" for v, s in by_variant.most_common()))
    known = [(share, fill) for *_, fill, share in rows if fill]
    if known:  # the MMA work the tiles do for each FLOP of the convolutions (1.0: no row, column or step wasted)
        work = sum(share / fill for share, fill in known) / sum(share for share, _ in known)
        print(f"MMA work per convolution FLOP: {work:.2f} (the {100 * sum(s for s, _ in known):.0f}% of FLOPs "
              f"whose fill is known)")  # fmt: skip
    if args.time:
        timed = time_rows(rows, args.dtype)
        totals = timed_totals(timed)
        print(f"timed {totals['rows_timed']} of {totals['rows']} rows ({100 * totals['flops_share_timed']:.0f}% of "
              f"the FLOPs): tconv3d {totals['tconv3d_ms']:.3f} ms, cuDNN {totals['cudnn_ms']:.3f} ms (calls x "
              f"each row's median)")  # fmt: skip
        slowest = sorted(
            (r for r in timed if r["ms"] is not None and r["cudnn_ms"] is not None),
            key=lambda r: r["calls"] * (r["cudnn_ms"] - r["ms"]),
        )[:5]
        for r in slowest:  # where the model loses most against cuDNN
            print(f"  {r['calls']:>3} x {r['geometry']:58} {r['direction']:5} {r['ms']:.3f} ms vs {r['cudnn_ms']:.3f}")
        if args.out:
            import json

            record = {"model": what, "device": args.device_name, "torch": torch.__version__,
                      "triton": triton.__version__, "dtype": args.dtype, "rows": timed, "totals": totals}  # fmt: skip
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
