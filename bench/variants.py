"""python -m bench.variants: the kernel variants against each other and against cuDNN, per layer, in one run.

    python -m bench.variants --cases wan_dec_384b,hunyuan_512 --dtype bf16 --out bench/results/variants.json

For each case and direction (fwd; dgrad: the input gradient; wgrad: the weight gradient) it launches tconv3d's
launcher directly with each variant's config: the chosen one (table or heuristic) forced to pointer, to TMA (its
choice of box, and both the 16-wide patch and the one-row box) and to Gluon (also on a wide Hopper GEMM tile with 8
warps, 128x256x64 where the columns fill 256-wide tiles, else 256x128x64, and both with the warp-specialized TMA
producer; the forward's and input gradient's 256x128x64 also with its operands swapped, so that each wgmma is
m64n256; the weight gradient's with its taps grouped to 256 columns; the chosen warp-specialized tiles also on the
deepest ring that fits; where a forward's or input gradient's tiles are few, 64-row tiles on one warpgroup with the
reduction split; where a tap's channels fill only half-deep steps, those), and split-K against none where the grid
leaves SMs idle. It checks each result against cuDNN in fp32 first (a variant that is wrong is reported as such and
not timed), then times it with triton.testing.do_bench (median, L2 flushed) beside cuDNN on channels_last_3d tensors
and the matmul peak measured in the same run (bf16's; TF32's for fp32). It answers the question bench/NOTES.md
predicts before a GPU session: how much of the matmul peak each variant reaches.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tconv3d import testing
from tconv3d.geometry import check_conv3d, split_padding_mode
from tconv3d.inspect.compile import ARCHS, arch_of, compile_ahead
from tconv3d.kernels import conv_gluon, grouped
from tconv3d.kernels.config import packs_taps, w_tap_columns
from tconv3d.kernels.conv_dgrad import conv3d_dgrad
from tconv3d.kernels.conv_fwd import conv3d_fwd
from tconv3d.kernels.conv_wgrad import conv3d_wgrad
from tconv3d.testing import exact_fp32, hang_guard, random_conv_inputs, rel_l2, tolerance
from tconv3d.tune import choice, configs
from tconv3d.tune.shapes import DTYPES_BY_NAME, ConvShape, load_shape_set

from .run import bench_ms, measure_peaks, peak_for

CL = torch.channels_last_3d
# The layers that decide issue 28 first (the largest, the small grid, the strided one): a run cut short keeps them.
DEFAULT_CASES = "wan_dec_384b,unet_320,down_s2,hunyuan_512,wan_dec_384a,wan_dec_192,hunyuan_128,cogvideo_256,unet_64"
# Where --cases are looked up.
SHAPE_SETS = ("bench", "stack", "decoders", "unets", "awkward")
HOPPER_TILES = (configs.KernelConfig(128, 256, 64, 8, 3), configs.KernelConfig(256, 128, 64, 8, 3))


def wide_tile(direction: str, geom, chosen: configs.KernelConfig) -> configs.KernelConfig:
    """The wide Hopper tile that wastes no columns: 128x256 where the GEMM's columns are a multiple of 256, else
    256x128 (on the H200, 128x256 ran 0.63-0.75x of 128x128 on a 384-channel layer: its second column tile was half
    empty). The weight gradient keeps the chosen split of its reduction (one 128x256 tile a program was 1.2 waves
    of wan_dec_384b's weight gradient unsplit)."""
    wide, tall = HOPPER_TILES
    tile = wide if configs.gemm_view(direction, geom).cols % wide.block_n == 0 else tall
    return dataclasses.replace(tile, split_k=chosen.split_k if direction == "wgrad" else 1)


# The row of the persistent kernel's tiles run at one program an SM where it would run two.
ONE_PROGRAM_PER_SM = "gluon_ws_1_sm"
# The row of the forward's and input gradient's 256x128 tile with its operands swapped (swap_ab).
SWAPPED = "gluon_ws_256x128_swapped"
# The rows of a narrow layer's (at most 64 columns) forward and input gradient with the operands swapped: the chosen
# persistent tile swapped (128x64 on one warpgroup: m64n128, two programs an SM), and 256 voxels x 64 columns on one
# warpgroup (m64n256, one program an SM): less shared-memory traffic a FLOP than the m64n64 the chosen tile issues.
NARROW_SWAPPED = "gluon_ws_chosen_swapped"
NARROW_TALL_SWAPPED = "gluon_ws_256x64_swapped"
# The row of the weight gradient's persistent tiles with their taps grouped (tap_group).
GROUPED_TAPS = "gluon_ws_grouped_taps"
# The row of the weight gradient's persistent tiles made of several taps' whole channel blocks where one tap's input
# channels leave a column block partly empty (configs.channel_taps_twin: Wan's 96 as 4 taps of 32 in 128 columns).
CHANNEL_TAPS = "gluon_ws_channel_taps"
# The row of the chosen persistent tiles on the deepest ring that fits (deepest_ring).
DEEP_RING = "gluon_ws_deep_ring"
# The row of the chosen persistent tiles on one warpgroup where that fits two programs an SM and the chosen two
# warpgroups fit one: one program's epilogue and next-tile setup under the other's wgmmas.
TWO_PER_SM = "gluon_ws_two_per_sm"
# The row of a forward's or input gradient's few tiles on one warpgroup with the reduction split to fill the SMs
# (configs.small_grid_twin: hunyuan_512, unet_320).
SMALL_GRID = "gluon_ws_small_grid"
# The row of a weight gradient of few output channels (32 or fewer) computed transposed: the taps' input channels on
# the wgmma's rows, Cout on its columns (configs.swapped_wgrad_twin: unet_32's 32 of 64 rows -> 27 of 28 taps).
SWAPPED_WGRAD = "gluon_ws_swapped_wgrad"
# The row of a small-channel pointer forward's or input gradient's tiles (packed (tap, channel) pairs of 16-byte runs,
# or W taps as columns) on the deepest ring within half an SM's shared memory (pointer_deep_ring).
POINTER_DEEP_RING = "pointer_deep_ring"
# The row of what the choice is from the rules a GPU has timed alone (choice.choose's timed_only: a tuned table's
# entry where it stands, else the heuristic's), where one of the heuristic's untimed rules moved a launch: a few-voxel
# layer's 64-row tiles off the Gluon kernel (configs._gluon_rows), a small grid's split tiles off it
# (configs.small_grid_twin; the pointer kernel, the Triton TMA one for an input gradient), a forward reading
# channels_after on the pointer kernel, a persistent weight gradient's split before its refit
# (configs.persistent_wgrad_split).
TIMED_ONLY = "timed_only"
# The row of the forward's chosen persistent tiles as halo tiles (configs.halo_twin: two output frames a tile, the
# input frames of the three taps along D loaded once as one box, each wgmma reading its frame as a slice).
HALO = "gluon_ws_halo"
HALO_SWAPPED = "gluon_ws_halo_swapped"  # and each frame's tile transposed (m64n128 at 128 voxels x 64 columns)
HALO_DEEP = "gluon_ws_halo_deep"  # and on one program an SM, its ring deeper (configs.halo_twin's programs=1)
# The row of the chosen persistent tiles in reduction steps half as deep where a tap's channels fill whole steps
# only so (configs.whole_steps_twin: 96 channels in three 32-deep steps, not two 64-deep ones, the second half empty).
WHOLE_STEPS = "gluon_ws_whole_steps"


def case_shapes(names: list[str]) -> list[ConvShape]:
    """The cases of these names, from the shape sets bench.variants knows (SHAPE_SETS: the bench suite, the
    reported stack's layers, whose 8-channel ones no suite holds, the decoders', the UNets' and the awkward set's);
    a name two sets share is one shape."""
    known: dict[str, ConvShape] = {}
    for set_name in SHAPE_SETS:
        for shape in load_shape_set(set_name):
            if known.setdefault(shape.name, shape) != shape:
                raise ValueError(f"case {shape.name!r} differs between the shape sets {SHAPE_SETS}")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"unknown case(s) {unknown}; the shape sets {SHAPE_SETS} have {sorted(known)}")
    return [known[name] for name in names]


def case_dtypes(items: list[str], dtypes: str) -> list[tuple[ConvShape, str]]:
    """(case, dtype) pairs in the order asked: `name` in each of `dtypes` (comma-separated), `name@dtype` in that
    dtype alone (one layer in fp32 beside a bf16 run, e.g. unet_64@fp32: TF32 on the Gluon kernel)."""
    named = [item.partition("@") for item in items]
    pairs = []
    for shape, (name, _, own) in zip(case_shapes([name for name, _, _ in named]), named, strict=True):
        for dtype_name in [own] if own else dtypes.split(","):
            if dtype_name not in DTYPES_BY_NAME:
                raise ValueError(
                    f"unknown dtype {dtype_name!r} for case {name!r}; expected one of {list(DTYPES_BY_NAME)}"
                )
            pairs.append((shape, dtype_name))
    return pairs


def case_directions(shape: ConvShape, directions: str) -> list[str]:
    """The directions of `directions` (comma-separated) a case is timed in: a video VAE decoder's layer as a
    converted decode calls it (the `decoders` set: reading cached frames, or bordered in a mode other than zeros) in
    the forward, as inference runs it, and the weight gradient, as training one runs it (the input gradient of
    cached frames is the concatenation's, which the op splits: not timed here)."""
    return [d for d in directions.split(",") if d != "dgrad" or not shape.decoder_layer]


def wanted(impls: set | None, case: str, name: str) -> bool:
    """Whether variant row `name` of `case` is asked for: every row where `impls` is None, else the rows it names,
    bare (every case's) or as `case:row` (that case's alone)."""
    return impls is None or name in impls or f"{case}:{name}" in impls


def pointer_deep_ring(
    direction: str, geom, config: configs.KernelConfig, dtype: torch.dtype
) -> configs.KernelConfig | None:
    """A 16-bit small-channel pointer forward's or input gradient's `config` (its reduction packed (tap, channel)
    pairs of 16-byte runs, or its columns (channel, W tap) pairs) with the deepest ring, at most 8 stages, whose
    buffers fit half an SM's shared memory: the stack's 8-channel layers' loops ran at 6-12% of the peak on the H100
    (run 18) where issue allowed 35-100%, so each tile waits on its gathers; their registers (94-173 a thread,
    inspect) hold two programs an SM at 3 stages already. None elsewhere, or where the ring is that deep already."""
    if direction == "wgrad" or config.variant != "pointer" or dtype == torch.float32 or config.num_stages < 2:
        return None
    vectors = packs_taps(direction, geom) and configs.vector_runs(direction, geom, dtype)
    if not (vectors or w_tap_columns(direction, geom)):
        return None
    stage = (config.block_m + config.block_n) * config.block_k * dtype.itemsize
    stages = min(8, (HALF_SM_SHARED_MEMORY - 1024) // stage)
    return dataclasses.replace(config, num_stages=stages) if stages > config.num_stages else None


# What two programs an SM may each hold of an H100's or H200's shared memory (228 KB a multiprocessor).
HALF_SM_SHARED_MEMORY = 114 * 1024


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
    if packs_taps(direction, geom):
        # the packed loops at the other of the two depths the H100 compared on 16-byte runs (bench/NOTES.md, "Fourth
        # H100 session"): 16 deep on 8 warps (the forward's and input gradient's) and 32 on 4 (the weight gradient's)
        pointer = found["pointer"]
        if pointer.block_k == 32:
            found["packed_16deep"] = dataclasses.replace(pointer, block_k=16, num_warps=8)
        elif (
            pointer.block_k == 16
            and pointer.block_m * pointer.block_n < 128 * 128
            and configs.vector_runs(direction, geom, dtype)
        ):
            found["packed_32deep"] = dataclasses.replace(pointer, block_k=32, num_warps=4)
    deep = pointer_deep_ring(direction, geom, found["pointer"], dtype)
    if deep is not None:
        found[POINTER_DEEP_RING] = deep
    sm_count, capability = configs.multiprocessor_count(device), configs.compute_capability(device)
    if configs.heuristic_config(direction, geom, dtype, sm_count, capability, timed_only=True) != (
        configs.heuristic_config(direction, geom, dtype, sm_count, capability)
    ):  # an untimed rule moved it: what the choice was before, a tuned entry included
        name = torch.cuda.get_device_name(device)
        found[TIMED_ONLY] = choice.choose(direction, geom, dtype, name, sm_count, capability, timed_only=True)[0]
    if direction != "wgrad":  # split-K against none where the grid leaves SMs idle (unet_320)
        split = configs.small_grid_split(direction, geom, chosen, sm_count)
        if chosen.split_k > 1:
            found["unsplit"] = dataclasses.replace(chosen, split_k=1)
        elif split > 1:
            found["split_k"] = dataclasses.replace(chosen, split_k=split)
    if gluon_runs and configs.gluon_eligible(direction, geom, dtype):
        found["gluon"] = choice.force_variant(direction, geom, dtype, chosen, "gluon", gluon_runs=True)
        wide = wide_tile(direction, geom, chosen)
        name = f"{wide.block_m}x{wide.block_n}"
        found[f"gluon_{name}"] = configs.with_gluon(wide, geom, direction)
        # persistent, with the warp-specialized TMA producer
        found["gluon_ws"] = dataclasses.replace(found["gluon"], gluon=2)
        found[f"gluon_ws_{name}"] = configs.with_gluon(wide, geom, direction, specialized=True)
        # 256 voxels x 128 columns with the operands swapped: one m64n256 wgmma a warpgroup where 128x128 and
        # 256x128 issue m64n128 (bench/NOTES.md: the shared-memory reads that predicts the gain from)
        tall = dataclasses.replace(HOPPER_TILES[1], split_k=1)
        swapped = configs.swapped_twin(configs.with_gluon(tall, geom, direction, specialized=True), direction)
        if swapped is not None:
            found[SWAPPED] = swapped
        # a narrow layer's forward and input gradient swapped: the chosen tiles, and 256x64 on one warpgroup
        narrow = found["gluon_ws"]
        if direction != "wgrad" and not narrow.swap_ab and configs.gemm_view(direction, geom).cols <= 64:
            for name, tile in ((NARROW_SWAPPED, narrow), (NARROW_TALL_SWAPPED, dataclasses.replace(
                    narrow, block_m=256, block_n=64, num_warps=4, split_k=1))):  # fmt: skip
                twin = configs.swapped_twin(tile, direction)
                if twin is not None:
                    found[name] = twin
        # a layer of few output tiles: 64-row tiles on one warpgroup, two programs an SM, the reduction split
        small = configs.small_grid_twin(
            direction, geom, chosen, configs.multiprocessor_count(device), dtype.itemsize
        )  # fmt: skip
        if small is not None and small != chosen:
            found[SMALL_GRID] = small
        # two output frames a tile reading the input once for the three taps along D (the narrow layers' L2 bound)
        halo = configs.halo_twin(direction, geom, found["gluon_ws"], dtype.itemsize)
        if halo is not None:
            found[HALO] = halo
            swapped = None if halo.swap_ab else configs.swapped_twin(halo, direction)
            if swapped is not None:
                found[HALO_SWAPPED] = swapped
            deep = configs.halo_twin(direction, geom, found["gluon_ws"], dtype.itemsize, programs=1)
            if deep is not None and deep != halo:
                found[HALO_DEEP] = deep
        # 96 channels a tap in three full 32-deep steps instead of two 64-deep ones, the second half empty
        whole = configs.whole_steps_twin(direction, geom, found["gluon_ws"], dtype.itemsize)
        if whole is not None:
            found[WHOLE_STEPS] = whole
        # the weight gradient's chosen persistent tiles with their taps grouped to 256 columns (one wgmma across
        # two taps of 128 input channels, or four of 64), at the chosen split, its ring as deep as fits
        grouped = configs.grouped_taps_twin(found["gluon_ws"], direction, dtype.itemsize, ARCHS[90].smem_per_block)
        if grouped is not None:
            found[GROUPED_TAPS] = grouped
        channel_taps = configs.channel_taps_twin(found["gluon_ws"], geom, direction)
        if channel_taps is not None:
            found[CHANNEL_TAPS] = channel_taps
        # a weight gradient of few output channels transposed, the taps' input channels filling the wgmma's rows: the
        # twin of the unswapped tiles, its split kept (the tuner's candidate; the heuristic's own, its split
        # refitted, is `chosen`, and the unswapped tiles then `timed_only`'s)
        transposed = None
        if direction == "wgrad":
            plain = found["gluon_ws"]
            if plain.swap_ab and TIMED_ONLY in found:
                plain = choice.force_variant(direction, geom, dtype, found[TIMED_ONLY], "gluon", gluon_runs=True)
                plain = dataclasses.replace(plain, gluon=2)
            transposed = configs.swapped_wgrad_twin(plain, geom)
        if transposed is not None:
            found[SWAPPED_WGRAD] = transposed
        # the chosen persistent tiles on the deepest ring that leaves the programs an SM as they are: what more
        # boxes in flight gain (latency) where the tiles themselves gain nothing (shared-memory bandwidth)
        deep = configs.deepest_ring(found["gluon_ws"], dtype.itemsize, direction)
        if deep.num_stages > found["gluon_ws"].num_stages:
            found[DEEP_RING] = deep
        # where the persistent kernel runs two programs an SM (one-warpgroup tiles that fit twice), the same tiles
        # at one program an SM: what the second program gains (bench/NOTES.md predicts it)
        if conv_gluon.programs_an_sm(found["gluon_ws"], dtype.itemsize, direction == "wgrad") == 2:
            found[ONE_PROGRAM_PER_SM] = found["gluon_ws"]
        elif found["gluon_ws"].num_warps == 8:  # and the other way round (bench/NOTES.md, "Between two tiles")
            one = dataclasses.replace(found["gluon_ws"], num_warps=4)
            if configs.gluon_takes(one) and conv_gluon.programs_an_sm(one, dtype.itemsize, direction == "wgrad") == 2:
                found[TWO_PER_SM] = one
    return found


def problem(shape: ConvShape, dtype: torch.dtype, direction: str, device: torch.device) -> tuple:
    """(the geometry its kernels run, launch(config), cuDNN's call, its fp32 reference as a call) of one case and
    direction on random channels_last_3d inputs. A decoder's layer (the `decoders` set: case_directions) is a
    forward or a weight gradient: reading cached frames (frames_before), tconv3d reads them in place where cuDNN
    convolves them concatenated in front of the input (the concatenation made once, outside its timing); with a
    border mode, tconv3d reads the border in place where cuDNN convolves the input padded by F.pad, as the stock
    VAEs call it (the pad in its timing)."""
    if shape.decoder_layer and direction == "dgrad":
        raise ValueError(f"{shape.name} is a decoder's layer (cached frames or borders): no input gradient here")
    x, w = random_conv_inputs(shape.input_shape, shape.weight_shape, dtype, device)
    stride, padding, dilation = list(shape.stride), list(shape.padding), list(shape.dilation)
    cached = None
    if shape.frames_before:
        cached = torch.randn(shape.frames_before_shape, device=device).to(dtype).contiguous(memory_format=CL)
    geom = check_conv3d(
        x, w, None, stride, padding, dilation, shape.groups, shape.padding_mode, frames_before=cached
    )  # fmt: skip
    conv_args = (shape.stride, shape.padding[0::2], shape.dilation, shape.groups)
    # A grouped problem of few channels a group runs coarse, on block-diagonal weights (kernels/grouped.py): its
    # launch is the coarse kernel with the weight's expansion where its kernel does not read the blocks in place
    # (or the gradient's diagonal) timed in.
    coarse = grouped.coarsened(geom)
    on_coarse = functools.partial(grouped.on_coarse, geom, coarse)
    # What cuDNN convolves: the cached frames concatenated in front of x, and (a border mode) padded by F.pad
    source = x if cached is None else torch.cat([cached, x], dim=2).contiguous(memory_format=CL)
    padded, source_args = cudnn_padding(shape)
    if direction == "fwd":
        launch = lambda config: on_coarse(  # noqa: E731
            lambda x, w, **diagonal: conv3d_fwd(x, w, None, cached, coarse, config, **diagonal), x, w
        )
        cudnn = lambda: F.conv3d(padded(source), w, None, *source_args)  # noqa: E731
        exact = lambda: F.conv3d(padded(source.float()), w.float(), None, *source_args)  # noqa: E731
        return coarse, launch, cudnn, exact
    grad_out = torch.randn(geom.output_shape(), device=device).to(dtype).contiguous(memory_format=CL)
    if direction == "dgrad":
        launch = lambda config: on_coarse(  # noqa: E731
            lambda g, w, **diagonal: conv3d_dgrad(g, w, coarse, config, **diagonal), grad_out, w
        )
        cudnn = lambda: torch.nn.grad.conv3d_input(x.shape, w, grad_out, *conv_args)  # noqa: E731
        exact = lambda: torch.nn.grad.conv3d_input(x.shape, w.float(), grad_out.float(), *conv_args)  # noqa: E731
        return coarse, launch, cudnn, exact
    launch = lambda config: on_coarse(  # noqa: E731
        lambda g, x, **diagonal: conv3d_wgrad(g, x, cached, coarse, config, **diagonal), grad_out, x
    )
    cudnn = lambda: torch.nn.grad.conv3d_weight(padded(source), w.shape, grad_out, *source_args)  # noqa: E731
    exact = lambda: torch.nn.grad.conv3d_weight(  # noqa: E731
        padded(source.float()), w.shape, grad_out.float(), *source_args
    )
    return coarse, launch, cudnn, exact


def cudnn_padding(shape: ConvShape) -> tuple:
    """(what cuDNN's calls do to the input first, their conv args) for `shape`'s padding as the stock models have
    it done: zeros alike front and back inside the convolution, the rest by one F.pad copy a mode (a border mode's,
    or zeros front and back unlike: a causal conv's, as constant), the dimensions it pads unpadded in the conv."""
    modes, front, back = split_padding_mode(shape.padding_mode), shape.padding[0::2], shape.padding[1::2]
    inside = [f if mode == "zeros" and f == b else 0 for mode, f, b in zip(modes, front, back, strict=True)]
    copies: dict[str, list] = {}  # F.pad mode -> its pads, in F.pad's order: (W front, W back, H ..., D ...)
    for dim in range(3):
        if inside[dim] or not (front[dim] or back[dim]):
            continue
        pads = copies.setdefault("constant" if modes[dim] == "zeros" else modes[dim], [0] * 6)
        pads[4 - 2 * dim : 6 - 2 * dim] = front[dim], back[dim]

    def padded(t: torch.Tensor) -> torch.Tensor:
        for mode, pads in copies.items():
            t = F.pad(t, pads, mode=mode)
        return t

    return padded, (shape.stride, inside, shape.dilation, shape.groups)


def launch_once(shape: ConvShape, dtype_name: str, direction: str, impls: set | None, device: torch.device) -> list:
    """Launch each variant of one case and direction once (those `impls` names: wanted), unchecked and
    untimed, for a profiler watching the process (bench/gpu_session.sh's profile stage runs Nsight Compute over
    this); returns the (impl, config) launched, in order."""
    dtype = DTYPES_BY_NAME[dtype_name]
    geom, launch, _, _ = problem(shape, dtype, direction, device)
    launched = []
    for name, config in variant_configs(direction, geom, dtype, device).items():
        if not wanted(impls, shape.name, name):
            continue
        if name == ONE_PROGRAM_PER_SM:
            _one_program_per_sm(launch, config)
        else:
            launch(config)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        launched.append((name, config))
    return launched


def measure_case(
    shape: ConvShape,
    dtype_name: str,
    direction: str,
    peak_tflops: float | None,
    emit,
    done: dict[str, dict] | None = None,
    compiled=lambda launch: None,
    impls: set | None = None,
    l2_read_tbps: float | None = None,
) -> None:
    """Check, then time, each variant of one case and direction, handing each row to `emit` as it comes. `done`:
    the rows a hung run left of this case (by impl), not measured again; the variant that hung has one already.
    Each variant's first run waits on the GPU under testing.hang_guard: one that never finishes is emitted as
    hung, and the process exits with HUNG_EXIT for its caller to run it again with --resume. `compiled(launch)`
    waits for a launch being compiled ahead (inspect.compile.compile_ahead). `impls`: the variant rows to measure
    (wanted). Each variant's row also holds the share of its MMA work that is the convolution's (`fill`,
    configs.mma_fill) and, with `l2_read_tbps` measured, the TFLOP/s its operands' reads from L2 allow
    (`l2_bound_tflops`: configs.operand_intensity times that bandwidth), so a narrow layer's row says which bound
    it sits at."""
    dtype, device, done = DTYPES_BY_NAME[dtype_name], torch.device("cuda"), done or {}
    geom, launch, cudnn, exact = problem(shape, dtype, direction, device)
    with exact_fp32():
        reference = exact()
    flops = 2 * geom.output_voxels * geom.out_channels * geom.taps * geom.group_in_channels
    where = dict(case=shape.name, dtype=dtype_name, direction=direction)

    def timed(row: dict, ms: float) -> dict:
        tflops = flops / ms * 1e-9
        return {**row, "ms": ms, "tflops": tflops, "pct_peak": 100 * tflops / peak_tflops if peak_tflops else None,
                "speedup_vs_cudnn": cudnn_ms / ms}  # fmt: skip

    cudnn_ms = done["cudnn_cl3d"]["ms"] if "cudnn_cl3d" in done else bench_ms(cudnn)
    if "cudnn_cl3d" not in done:
        emit(timed({"impl": "cudnn_cl3d", "config": None, "error": None, **where}, cudnn_ms))
    measured: dict[tuple, dict] = {}  # a variant whose config (and launch) another already has is not rerun
    for name, config in variant_configs(direction, geom, dtype, device).items():
        if name in done or not wanted(impls, shape.name, name):
            continue
        one_per_sm = name == ONE_PROGRAM_PER_SM
        if (config, one_per_sm) in measured:
            same = measured[config, one_per_sm]
            emit({**same, "impl": name, "same_as": same["impl"]})
            continue
        row = {"impl": name, "config": config.to_dict(), "variant": config.variant, **where}
        row["fill"] = configs.mma_fill(direction, geom, config, dtype.itemsize)
        intensity = configs.operand_intensity(direction, geom, config, dtype.itemsize)
        if intensity is not None and l2_read_tbps:
            row["l2_bound_tflops"] = intensity * l2_read_tbps
        if one_per_sm:
            row["programs_per_sm"] = 1
            run = lambda config=config: _one_program_per_sm(launch, config)  # noqa: E731
        else:
            compiled((direction, shape.geometry(), dtype, config))  # as planned_launches planned it
            run = lambda config=config: launch(config)  # noqa: E731
        try:
            result = run()  # compiled and launched; then the GPU's part, guarded
            with hang_guard(lambda row=row: emit({**row, "failed": f"hung: no result after {testing.HANG_S:.0f} s"})):
                torch.cuda.synchronize()
            error = rel_l2(result, reference)
        except Exception as failure:  # a variant that cannot run this problem: a result, not a crash
            row["failed"] = f"{type(failure).__name__}: {failure}"[:300]
        else:
            row["error"] = error
            if error > tolerance(dtype):
                row["failed"] = f"relative L2 error {error:.2e} above {tolerance(dtype):.0e}"
            else:
                row = timed(row, bench_ms(run))
        measured[config, one_per_sm] = row
        emit(row)


def _one_program_per_sm(launch, config):
    with conv_gluon.programs_per_sm_at_most(1):
        return launch(config)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[dict], header: bool = True) -> str:
    title = (
        f"{'case':14} {'dtype':5} {'dir':5} {'impl':14} {'variant':8} {'ms':>8} {'TFLOP/s':>8} {'%peak':>6} "
        f"{'vs cuDNN':>8} {'fill':>5} {'L2 bound':>8}"
    )
    lines = [title, "-" * len(title)] if header else []
    for r in rows:
        start = f"{r['case']:14} {r['dtype']:5} {r['direction']:5} {r['impl']:14} {r.get('variant', '-'):8}"
        if "failed" in r:
            lines.append(f"{start} FAILED: {r['failed']}")
        else:
            fill = "-" if r.get("fill") is None else f"{100 * r['fill']:.0f}%"
            bound = "-" if r.get("l2_bound_tflops") is None else f"{r['l2_bound_tflops']:.0f}"
            lines.append(
                f"{start} {r['ms']:>8.3f} {r['tflops']:>8.1f} {_pct(r.get('pct_peak')):>6} "
                f"{r['speedup_vs_cudnn']:>7.2f}x {fill:>5} {bound:>8}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line, also read by bench.precompile to compile what a run with the same arguments launches."""
    parser = argparse.ArgumentParser(prog="python -m bench.variants", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        default=DEFAULT_CASES,
        help="comma-separated case names (the bench suite's, the stack's layers, the decoders', the unets', the "
        "awkward set's), each in every --dtype "
        "or, as name@dtype, in that one",
    )
    parser.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    parser.add_argument("--directions", default="fwd,dgrad,wgrad", help="comma-separated: fwd, dgrad, wgrad")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    parser.add_argument(
        "--impls", default=None, help="comma-separated variant rows to launch, each `row` or `case:row` (default: all)"
    )
    parser.add_argument(
        "--launch-only",
        action="store_true",
        help="launch each variant once, unchecked and untimed, no cuDNN or peak: for a profiler watching the process",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep --out's rows and peak, measure only what they lack (after a run that exited 75: a variant hung)",
    )
    parser.add_argument(
        "--compile-workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
        help="processes compiling the variants ahead of their timing (1: each compiled when it first runs)",
    )  # fmt: skip
    return parser


def planned_launches(cases: list[tuple[ConvShape, str]], directions: str, impls: set | None, device) -> list:
    """Every variant launch of a run over `cases` (case_dtypes), in the order it times them: (direction, geometry,
    dtype, config), the geometry the problem's (a grouped one's config its coarse geometry's: kernels/grouped.py)."""
    return [
        (direction, shape.geometry(), DTYPES_BY_NAME[dtype_name], config)
        for shape, dtype_name in cases
        for direction in case_directions(shape, directions)
        for name, config in variant_configs(
            direction, shape.launched_geometry(), DTYPES_BY_NAME[dtype_name], device
        ).items()
        if wanted(impls, shape.name, name)
    ]


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.variants times kernels: it needs a CUDA device")
        return 2
    if args.resume and not args.out:
        parser.error("--resume needs --out")
    torch.backends.cudnn.benchmark = True
    try:
        cases = case_dtypes(args.cases.split(","), args.dtype)  # in the order asked: a run cut short keeps the first
    except ValueError as error:
        parser.error(str(error))
    impls = set(args.impls.split(",")) if args.impls else None
    if args.launch_only:
        for shape, dtype_name in cases:
            for direction in case_directions(shape, args.directions):
                for name, config in launch_once(shape, dtype_name, direction, impls, torch.device("cuda")):
                    print(f"launched {shape.name} {dtype_name} {direction} {name} {config.to_dict()}", flush=True)
        return 0
    previous = json.loads(args.out.read_text()) if args.resume and args.out.is_file() else {}
    peaks, rows = previous.get("peaks") or measure_peaks(), previous.get("rows", [])
    print(f"device {torch.cuda.get_device_name()}, bf16 matmul peak {peaks['bf16_mm_tflops']} TFLOP/s, TF32 "
          f"{peaks.get('tf32_mm_tflops', '-')}, L2 reads {peaks.get('l2_read_tbps', '-')} TB/s; "
          f"gluon: {conv_gluon.UNAVAILABLE or 'available'}; {len(rows)} rows resumed", flush=True)  # fmt: skip
    print(table([]), flush=True)

    device, compiled, shutdown = torch.device("cuda"), (lambda launch: None), (lambda: None)
    if args.compile_workers > 1:  # every variant of every case, in the order they will be timed
        planned = planned_launches(cases, args.directions, impls, device)
        compiled, shutdown = compile_ahead(planned, arch_of(device), args.compile_workers)

    def emit(row: dict) -> None:  # each row as it comes: a run cut short, or one that hung, keeps what it measured
        print(table([row], header=False), flush=True)
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps({"peaks": peaks, "rows": rows}, indent=1) + "\n")

    try:
        for shape, dtype_name in cases:
            for direction in case_directions(shape, args.directions):
                where = (shape.name, dtype_name, direction)
                done = {r["impl"]: r for r in rows if (r["case"], r["dtype"], r["direction"]) == where}
                peak = peak_for(peaks, dtype_name)
                measure_case(shape, dtype_name, direction, peak, emit, done, compiled, impls, peaks.get("l2_read_tbps"))
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
