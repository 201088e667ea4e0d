"""Tilings for the three kernels as data: the tuning key, the search space and its pruning, the heuristics and
the variants' eligibility. The bottom of the tuning layer: the tables, the tuner and the choice (choice.py) read
it; the config type itself lives with the kernels (tconv3d/kernels/config.py)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, replace

import torch

from ..geometry import DTYPE_NAMES, ConvGeometry
from ..kernels import conv_gluon
from ..kernels.config import (
    DIRECTIONS,
    GROUPED_TAP_COLUMNS,
    HALO_BOX_FRAMES,
    HALO_FRAMES,
    HALO_KD,
    MIN_TILE,
    GemmView,
    KernelConfig,
    channel_blocks,
    destination_dtype,
    gathered_tiles,
    gemm_view,
    grouped_taps_fit,
    half_tail,
    off_gluon,
    packed_channels,
    packs_out_taps,
    packs_taps,
    reduction_steps,
    split_rows,
    w_tap_columns,
    w_tap_outputs,
    w_tap_tiles,
    wgrad_half_tails,
)
from ..kernels.conv_fwd import border_widths
from ..kernels.conv_tma import MAX_PHASES, wgrad_tma_patches
from ..kernels.tensors import cdiv, next_power_of_2
from ..kernels.utils import exact_products

# fp32 accumulator registers one thread may hold before the compiler spills.
MAX_ACC_PER_THREAD = 128
# The fewest registers a thread of the packed weight gradient's loops holds (tconv3d.inspect: 128 to 231).
PACKED_WGRAD_REGISTERS = 128
# Largest fp32 split-K workspace the weight gradient may allocate (splits x Cout x taps x Cin x 4 bytes).
WGRAD_WORKSPACE_BYTES = 256 * 2**20
# The forward's and input gradient's (splits x their output x 4 bytes): they split only small grids, and each
# split's partial is written and read back once, traffic the split must win back.
SPLIT_WORKSPACE_BYTES = 64 * 2**20
# Reduction steps (BLOCK_K each) a forward or input-gradient split keeps at least, so its pipeline fills.
MIN_SPLIT_STEPS = 8
# Output tiles from which a forward or input gradient fills every GPU without splitting: the tuner does not try
# splits there.
SPLIT_TILES_BELOW = 1024


# ---------------------------------------------------------------------------------------------------------------
# tuning key


@dataclass(frozen=True, order=True)
class TuningKey:
    """What a tuned config is keyed by: direction, dtype, channels per group, kernel, stride, dilation, the GEMM
    size as log2 of the output voxel count N*Do*Ho*Wo, rounded down, and the number of groups (written only
    when above 1, so the keys of ungrouped problems read as they always have)."""

    direction: str
    dtype: str
    cin: int
    cout: int
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    dilation: tuple[int, int, int]
    log2_voxels: int
    groups: int = 1

    def __str__(self) -> str:
        def dims(t):
            return "x".join(str(v) for v in t)

        groups = f"/g={self.groups}" if self.groups != 1 else ""
        return (
            f"{self.direction}/{self.dtype}/cin={self.cin}/cout={self.cout}/k={dims(self.kernel)}"
            f"/s={dims(self.stride)}/d={dims(self.dilation)}/m=2^{self.log2_voxels}{groups}"
        )

    @classmethod
    def parse(cls, text: str) -> TuningKey:
        try:
            direction, dtype, *named = text.split("/")
            values = dict(part.split("=", 1) for part in named)

            def dims(name):
                triple = tuple(int(v) for v in values[name].split("x"))
                if len(triple) != 3:
                    raise ValueError(name)
                return triple

            key = cls(
                direction=direction,
                dtype=dtype,
                cin=int(values["cin"]),
                cout=int(values["cout"]),
                kernel=dims("k"),
                stride=dims("s"),
                dilation=dims("d"),
                log2_voxels=int(values["m"].removeprefix("2^")),
                groups=int(values.get("g", 1)),
            )
        except (KeyError, ValueError) as error:
            raise ValueError(f"malformed tuning key {text!r} ({error})") from None
        if direction not in DIRECTIONS or dtype not in DTYPE_NAMES.values():
            raise ValueError(f"malformed tuning key {text!r}: unknown direction or dtype")
        return key

    def same_family(self, other: TuningKey) -> bool:
        """Keys whose configs can stand in for each other: all but channels and size agree."""
        return (self.direction, self.dtype, self.kernel, self.stride, self.dilation, self.groups) == (
            other.direction,
            other.dtype,
            other.kernel,
            other.stride,
            other.dilation,
            other.groups,
        )

    def distance(self, other: TuningKey) -> float:
        return (
            abs(math.log2(self.cin / other.cin))
            + abs(math.log2(self.cout / other.cout))
            + abs(self.log2_voxels - other.log2_voxels)
        )


def tuning_key(direction: str, geom: ConvGeometry, dtype: torch.dtype) -> TuningKey:
    return TuningKey(
        direction=direction,
        dtype=DTYPE_NAMES[dtype],
        cin=geom.group_in_channels,
        cout=geom.group_out_channels,
        kernel=tuple(geom.kernel),
        stride=tuple(geom.stride),
        dilation=tuple(geom.dilation),
        log2_voxels=max(geom.output_voxels, 1).bit_length() - 1,
        groups=geom.groups,
    )


# How far a tuned key may be from a problem and still lend it its config: channels within 2x each way and the
# voxel count within 4x. Further away the heuristic does better: on the first H100 run a table holding only
# 192- and 384-channel keys lent their 128x128 tiles to a 16-64-channel UNet and doubled its step time.
NEAR_CHANNEL_RATIO = 2
NEAR_LOG2_VOXELS = 2
# A nearest key's entry whose tiles fill less than this share of what the heuristic's fill of the problem's MMA
# (mma_fill) gives way to the heuristic: its tiles were sized for another layer's channels. H200 runs 8 and 10,
# unet_32 on stack_64's tiles: the weight gradient's 64 x 64 at fill 0.25 against the heuristic's 0.96 ran 3.409 ms
# against 1.110 (lent: 0.42x cuDNN); the forward's and input gradient's 128 x 64 halo tiles at fill 0.50 against
# 1.00 ran 1.087 and 0.890 ms against the heuristic's 1.241 and 1.241. Half the heuristic's fill was no loss there,
# a quarter was: the line between them.
NEAR_FILL_RATIO = 0.4


def nearest_key(key: TuningKey, candidates) -> TuningKey | None:
    """The closest key of the same family within the near bounds, or None (then the heuristic decides)."""

    def near(k: TuningKey) -> bool:
        return (
            key.same_family(k)
            and max(k.cin / key.cin, key.cin / k.cin) <= NEAR_CHANNEL_RATIO
            and max(k.cout / key.cout, key.cout / k.cout) <= NEAR_CHANNEL_RATIO
            and abs(k.log2_voxels - key.log2_voxels) <= NEAR_LOG2_VOXELS
        )

    family = [k for k in candidates if near(k)]
    return min(family, key=lambda k: (key.distance(k), str(k))) if family else None


# ---------------------------------------------------------------------------------------------------------------
# search space

SEARCH_SPACE = {
    "fwd": dict(
        block_m=(64, 128, 256),
        block_n=(16, 32, 64, 128, 256),
        block_k=(16, 32, 64, 128),
        num_warps=(4, 8),
        num_stages=(2, 3, 4, 5),
        group_m=(8,),
        split_k=(1, 2, 4, 8, 16),
    ),
    "wgrad": dict(
        block_m=(16, 32, 64, 128, 256),
        block_n=(16, 32, 64, 128, 256),
        block_k=(32, 64, 128),
        num_warps=(4, 8),
        num_stages=(2, 3, 4),
        group_m=(1,),
        split_k=(1, 2, 4, 8, 16, 32, 64, 128),
    ),
}
SEARCH_SPACE["dgrad"] = SEARCH_SPACE["fwd"]


def operand_intensity(direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int) -> float | None:
    """The convolution's FLOPs per byte of the two operands its tiles read, a model of its traffic from L2: each
    program reads its block_m rows and block_n columns over the whole reduction, the input's tap-shifted rows once
    a tap (the implicit GEMM reuses nothing across taps), a tap_group program its rows once for its taps. Elements
    a box fetches past a tensor's edge, L2 misses and split-K partials are not counted. Times the bandwidth of
    reads that hit L2 (bench's `l2_read_tbps`) it bounds the launch's TFLOP/s: a 128x64 tile reads
    (128 + 64) x 2 bytes a row of the reduction for 2 x 128 x 64 FLOPs, 42.7 a byte, 299 TFLOP/s at 7 TB/s
    (bench/NOTES.md, "What 64 columns cost"). A forward with its W taps as columns (config.w_tap_columns) reads each
    tile's rows, halo included, once for all its W taps; halo tiles (halo_d) read 4 frames of rows for the 3 taps
    along D of 2 frames, 69.8 a byte at 128x64. None for the direct (depthwise) kernels, which are no GEMM."""
    if config.direct:
        return None
    view = gemm_view(direction, geom, bool(config.tma_box_w))
    if w_tap_columns(direction, geom) and not config.tma_box_w:
        # per (kd, kh) tap and reduced channel: each tile's block_m rows, once a column tile; the real columns
        voxels, channels = w_tap_outputs(direction, geom)
        real = channels * geom.kernel[2]  # (channel, W tap) pairs
        tiles_m, tiles_n = w_tap_tiles(direction, geom, config)
        read = tiles_m * config.block_m * tiles_n + real * tiles_m
        return 2 * voxels * real / (element_size * read) if read else 0.0
    taps, group = view.grid_taps, max(1, config.tap_group)
    tiles_m, tiles_n = cdiv(view.rows, config.block_m), cdiv(view.cols, config.block_n // group)
    # Per row of the reduction (its length, taps and an input gradient's live taps included, cancels out): each
    # column tile's programs read the rows, once a tap group; each row tile's, the columns of every tap.
    rows_read = view.rows * tiles_n * cdiv(taps, group)
    cols_read = view.cols * tiles_m * taps
    if config.halo_d:  # HALO_BOX_FRAMES frames of rows for the HALO_KD taps of HALO_FRAMES frames; the columns of
        # every tap once a pair of row tiles (halo_eligible)
        rows_read = view.rows * tiles_n * taps * HALO_BOX_FRAMES / (HALO_FRAMES * HALO_KD)
        cols_read = view.cols * cdiv(tiles_m, HALO_FRAMES) * taps
    return 2 * view.rows * view.cols * taps / (element_size * (rows_read + cols_read))


def mma_fill(direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int = 2) -> float | None:
    """The share of a launch's MMA work that is the convolution's: its real FLOPs over what its tiles compute. Each
    program computes a block_m x block_n tile over its whole reduction in block_k steps (the Gluon kernels' last
    row or column block half as wide where half_tail and wgrad_half_tails say so, for operands of `element_size`
    bytes): the pointer kernels' rows
    and columns over the GEMM's (gemm_view; (tap, channel) pairs where they pack them), the box kernels' patches
    (tma_box) over the volume's H x W (each phase's at a stride), one tap a step or a program, block_k of a source's
    channels a step (tap_group taps' blocks side by side in the weight gradient); a forward with its W taps as
    columns (config.w_tap_columns), its tiles' rows over the outputs they write and their columns over the real (output
    channel, W tap) pairs. 1.0 where the tiles divide the
    problem; the 8-channel stack layer's weight gradient on the TMA kernel, one tap of 8 channels in 128 columns a
    program: 0.06 (bench/NOTES.md). None for the direct (depthwise) kernels, which are no GEMM."""
    if config.direct:
        return None

    def share(real: int, block: int, half: bool = False) -> float:  # half: the last block half as wide
        return real / (cdiv(real, block) * block - (block // 2 if half else 0)) if real else 1.0

    def patches(size: tuple, stride: tuple, voxels: int) -> float:  # a box kernel's patches over H x W
        rows, width = config.tma_box(voxels)
        h, w = (cdiv(n, s) for n, s in zip(size[1:], stride[1:], strict=True))
        return share(h, rows) * share(w, width)

    box = bool(config.tma_box_w)
    view = gemm_view(direction, geom, box)
    packed = packs_taps(direction, geom) and not box
    if direction == "wgrad":
        group = max(1, config.tap_group)
        halves = wgrad_half_tails(config, view.rows, geom.group_in_channels, element_size)  # Gluon's alone
        if packed:
            columns = share(view.cols, config.block_n)
        else:
            columns = share(geom.group_in_channels, config.block_n // group, halves[1])
        voxels = patches(geom.out_size, (1, 1, 1), config.block_k) if box else share(view.reduction, config.block_k)
        taps = 1.0 if packed or view.grid_taps == 1 else share(geom.taps, group)  # or the rows pack them
        return share(view.rows, config.block_m, halves[0]) * columns * voxels * taps
    cols = share(view.cols, config.block_n, half_tail(config, view.cols, element_size))
    voxels, written = w_tap_outputs(direction, geom)
    if w_tap_columns(direction, geom) and not box and voxels:
        # each tile writes block_m - halo of its rows; of its columns, KW taps of each channel
        tiles_m, tiles_n = w_tap_tiles(direction, geom, config)
        rows = voxels / (tiles_m * config.block_m)
        cols = written * geom.kernel[2] / (tiles_n * config.block_n)
    elif not box:
        rows = share(view.rows, config.block_m)
    elif direction == "fwd":
        rows = patches(geom.out_size, (1, 1, 1), config.block_m)
    else:  # the input gradient's patches lie in one phase of grad_in
        rows = patches(geom.in_size, geom.stride, config.block_m)
    if packed:
        reduction = share(view.reduction, config.block_k)
    else:  # one tap a step, block_k channels of one source
        channels = geom.group_out_channels if direction == "dgrad" else geom.group_in_channels
        after = geom.out_after_channels if direction == "dgrad" else geom.after_channels
        blocks = channel_blocks(geom, config.block_k, direction) if after else cdiv(channels, config.block_k)
        reduction = channels / (blocks * config.block_k)
    return rows * cols * reduction


def split_workspace_bytes(direction: str, geom: ConvGeometry, config: KernelConfig) -> int:
    """About the bytes of fp32 partial sums `config`'s split-K allocates (splits x the GEMM's output, kernels/
    split_k.py): 0 unsplit. What the tuner weighs between candidates of the same time (tuner.search)."""
    if config.split_k <= 1:
        return 0
    view = gemm_view(direction, geom, bool(config.tma_box_w))
    return config.split_k * view.rows * view.cols * view.grid_taps * view.groups * 4


def _pow2_at_least(n: int) -> int:
    return max(MIN_TILE, next_power_of_2(max(int(n), 1)))


def ring_bytes(config: KernelConfig, element_size: int) -> int:
    """The shared memory of a launch's operand ring: stages x (rows + columns) x depth, in elements of that size."""
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * element_size


def keep(direction: str, config: KernelConfig, geom: ConvGeometry, dtype: torch.dtype, smem_bytes: int) -> bool:
    """Prune a candidate: no tile larger than the problem's next power of two, pipeline buffers within shared
    memory, the accumulator within registers, and 8 warps only for tiles big enough to feed them."""
    view = gemm_view(direction, geom, bool(config.tma_box_w))
    if config.block_m > _pow2_at_least(view.rows) or config.block_n > _pow2_at_least(view.cols):
        return False
    if config.block_k > _pow2_at_least(view.reduction):
        return False
    if direction == "wgrad":
        if config.split_k > cdiv(view.reduction, config.block_k):
            return False
        if split_workspace_bytes(direction, geom, config) > WGRAD_WORKSPACE_BYTES:
            return False
    elif config.split_k > 1 and config.split_k > _max_k_split(direction, geom, config):
        return False
    if ring_bytes(config, torch.empty((), dtype=dtype).element_size()) > smem_bytes:
        return False
    threads = 32 * config.num_warps
    if config.block_m * config.block_n > MAX_ACC_PER_THREAD * threads:
        return False
    return not (config.num_warps == 8 and config.block_m * config.block_n < 64 * 128)


def candidates(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, smem_bytes: int, tma: bool = False, gluon: bool = False
) -> list[KernelConfig]:
    """The pruned search space; with `tma` (an sm_90+ target) and an eligible problem, each config's TMA twin
    too, and with `gluon` (sm_90 with a Triton whose Gluon the kernel is written for) the Gluon twins of the
    tiles it takes (the persistent ones also swapped, swapped_twin and swapped_wgrad_twin, or with taps grouped,
    grouped_taps_twin), so tuning tables choose the variant per key.
    Depthwise problems search the direct kernels' tiles."""
    if direct_eligible(direction, geom):
        return _direct_candidates(direction, geom)
    space = SEARCH_SPACE[direction]
    configs = (KernelConfig(**dict(zip(space, values, strict=True))) for values in itertools.product(*space.values()))
    kept = [c for c in configs if keep(direction, c, geom, dtype, smem_bytes)]
    twins = []
    if tma and tma_eligible(direction, geom, dtype):
        twins += list(dict.fromkeys(with_tma(c, geom, direction, rows) for c in kept for rows in (False, True)))
    if gluon and gluon_eligible(direction, geom, dtype):
        twins += [with_gluon(c, geom, direction) for c in kept if gluon_takes(c)]
        specialized = [with_gluon(c, geom, direction, specialized=True) for c in kept if gluon_takes(c)]
        element = torch.empty((), dtype=dtype).element_size()
        specialized += [t for t in (swapped_twin(c, direction) for c in specialized) if t]  # swapped, then grouped
        specialized += [t for t in (grouped_taps_twin(c, direction, element, smem_bytes) for c in specialized) if t]
        if direction == "wgrad":  # few output channels: transposed, the taps' input channels on the wgmma's rows
            # (from every kept tile: unswapped, their 32 rows of output channels are too few for the Gluon kernel)
            transposed = (swapped_wgrad_twin(with_gluon(c, geom, direction, specialized=True), geom) for c in kept)
            specialized += list(dict.fromkeys(t for t in transposed if t))
        dst_size = destination_dtype(direction, geom, dtype).itemsize
        twins += [c for c in specialized if _persistent_fits(c, element, direction, smem_bytes, dst_size)]
    return kept + twins


def _persistent_fits(
    config: KernelConfig, element_size: int, direction: str, smem_bytes: int, dst_size: int | None = None
) -> bool:
    """Whether a persistent Gluon config's rings (and epilogue tile of `dst_size`-byte elements) fit `smem_bytes`."""
    return conv_gluon.persistent_shared_bytes(config, element_size, direction == "wgrad", dst_size) <= smem_bytes


def fit_destination(direction: str, geom: ConvGeometry, dtype: torch.dtype, config: KernelConfig) -> KernelConfig:
    """`config` with its ring fitted to an epilogue tile wider than its operands' (destination_dtype: a 16-bit
    input gradient of a bordered layer is written in float32 before its fold). A persistent Gluon config, whose
    epilogue tile lives beside its ring, keeps as many programs an SM as its operand-wide tile let it hold, its
    ring shortened (down to 2 stages) as far as that takes; where no ring is short enough, one program, its ring as
    deep as fits (up to 8); where not even 2 stages fit, the TMA kernel on its tiles (off_gluon). Other configs as
    they are (split-K partial sums are float32 whatever the destination: persistent_shared_bytes counts them)."""
    element = dtype.itemsize
    wide = destination_dtype(direction, geom, dtype).itemsize
    if config.gluon != 2 or wide == element or config.split_k > 1:
        return config
    programs = max(conv_gluon.resident_programs(config, element, False), 1)  # what the operand-wide tile let it hold
    for stages in range(config.num_stages, 1, -1):  # as many programs, a shorter ring
        shorter = replace(config, num_stages=stages)
        if conv_gluon.resident_programs(shorter, element, False, wide) >= programs:
            return shorter
    fits = [s for s in range(2, 9) if conv_gluon.resident_programs(replace(config, num_stages=s), element, False, wide)]
    return replace(config, num_stages=max(fits)) if fits else off_gluon(config)


def _direct_channels(direction: str, geom: ConvGeometry) -> int:
    """The channels a direct kernel's block runs over: the weight gradient's output channels, the forward's and
    the input gradient's input channels (conv_depthwise)."""
    return geom.out_channels if direction == "wgrad" else geom.in_channels


def _direct_candidates(direction: str, geom: ConvGeometry) -> list[KernelConfig]:
    """The depthwise direct kernels' tiles: voxels x channels, warps, and the weight gradient's splits; no tile
    wider than the channels' next power of two, at most 64 fp32 accumulators per thread."""
    channels = _direct_channels(direction, geom)
    splits = (1, 2, 4, 8, 16, 32, 64) if direction == "wgrad" else (1,)
    found = []
    for block_m, block_c, warps, split in itertools.product((32, 64, 128), (16, 32, 64, 128), (4, 8), splits):
        if block_c > _pow2_at_least(channels) or block_m * block_c > 64 * 32 * warps:
            continue
        found.append(KernelConfig(block_m, block_c, MIN_TILE, warps, 1, group_m=1, split_k=split, direct=1))
    return found


# ---------------------------------------------------------------------------------------------------------------
# heuristics


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_power_of_2(max(int(n), 1))))


@functools.lru_cache(maxsize=64)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _most_programs_per_sm(block_m, block_n, block_k, num_warps, stages, dtype) -> int:
    """The most programs of a tiling one SM can hold, by the pipeline's shared memory and the threads alone
    (registers, which only lower it, are not known before compiling), on a Hopper/Ampere-class SM."""
    element = torch.empty((), dtype=dtype).element_size()
    # Triton may keep as few as stages - 1 operand buffers (it does for fp32 at 2 stages).
    smem = max(1, stages - 1) * (block_m + block_n) * block_k * element + 1024
    return max(1, min(228 * 1024 // smem, 2048 // (32 * num_warps)))


def _max_split(view: GemmView, block_k: int) -> int:
    """Splits that keep at least 8 reduction steps each and the fp32 workspace within its bound."""
    by_steps = cdiv(view.reduction, block_k) // 8
    by_workspace = WGRAD_WORKSPACE_BYTES // (view.rows * view.cols * view.grid_taps * view.groups * 4)
    return max(1, min(by_steps, by_workspace))


def _wave_filling_split(
    tiles: int, most_per_sm: int, sm_count: int, max_split: int, splits_of, min_fill: float = 0.75
) -> int:
    """The fewest splits that keep the last wave of equal-length programs at least `min_fill` busy whatever
    number of them, up to `most_per_sm`, an SM turns out to hold (2.05 waves leave a third of the device idle
    in the third). Where no split does, the one whose worst case is best."""

    def fill(split: int, per_sm: int) -> float:
        waves = tiles * splits_of(split) / (per_sm * sm_count)
        return waves / math.ceil(waves)

    if tiles == 0:  # an empty batch
        return 1
    best, best_fill = max_split, 0.0
    for split in range(1, max_split + 1):
        worst = min(fill(split, per_sm) for per_sm in range(1, most_per_sm + 1))
        if worst >= min_fill:
            return split
        if worst > best_fill:
            best, best_fill = split, worst
    return best


def _max_k_split(direction: str, geom: ConvGeometry, config: KernelConfig) -> int:
    """The most splits a forward or input gradient may take with `config`'s tiles: none where its tiles fill
    any GPU (SPLIT_TILES_BELOW), else as many as keep MIN_SPLIT_STEPS steps each and the workspace in bounds."""
    view = gemm_view(direction, geom)
    if cdiv(view.rows, config.block_m) * cdiv(view.cols, config.block_n) * view.groups >= SPLIT_TILES_BELOW:
        return 1
    by_steps = reduction_steps(direction, geom, config) // MIN_SPLIT_STEPS
    by_workspace = SPLIT_WORKSPACE_BYTES // max(1, view.rows * view.cols * view.groups * 4)
    return max(1, min(by_steps, by_workspace))


def small_grid_split(direction: str, geom: ConvGeometry, config: KernelConfig, sm_count: int) -> int:
    """Splits of a forward or input gradient whose tiles leave SMs idle (unet_320's forward: 48 programs on
    132 SMs): enough for about two programs per SM, within _max_k_split. 1 where the tiles alone reach every SM, and
    where there are none (an empty batch)."""
    view = gemm_view(direction, geom)
    tiles = cdiv(view.rows, config.block_m) * cdiv(view.cols, config.block_n) * view.groups
    if tiles == 0 or tiles >= sm_count:
        return 1
    return max(1, min(cdiv(2 * sm_count, tiles), _max_k_split(direction, geom, config)))


def direct_eligible(direction: str, geom: ConvGeometry) -> bool:
    """Problems the depthwise direct kernels run: one input channel per group; for the forward and the weight
    gradient with zeros padding and one source (the input gradient's launcher borders other modes first)."""
    return geom.is_depthwise and (direction == "dgrad" or (geom.padding_mode == "zeros" and not geom.prefix_frames))


def direct_config(direction: str, geom: ConvGeometry, sm_count: int, interpreter: bool = False) -> KernelConfig:
    """Tiles of the depthwise direct kernels: 64 voxels x 64 channels (128-byte rows of 16-bit channels per load)
    on a GPU, fewer channels where there are fewer; the weight gradient split until its programs fill the SMs
    about four times over, keeping at least 8 tile steps per split. Under the interpreter, few large tiles."""
    channels = _direct_channels(direction, geom)
    voxels = geom.input_voxels if direction == "dgrad" else geom.output_voxels
    block_c = _pow2_clamp(channels, MIN_TILE, 64)
    # The input gradient reads each tap's channels x multiplier (or gathers each multiple), with a mask a tap: 16
    # voxels a program, where 32 and 64 spilled somewhere when it gathered (multiplier 2, fp32, sm_80 and sm_90).
    block_m = _pow2_clamp(voxels, MIN_TILE, 512) if interpreter else 16 if direction == "dgrad" else 64
    split_k = 1
    if direction == "wgrad":
        tiles = cdiv(channels, block_c) * geom.taps
        split_k = 2 if interpreter else max(1, min(cdiv(4 * sm_count, tiles), cdiv(voxels, 8 * block_m)))
    warps = 4 if direction == "dgrad" else 8
    return KernelConfig(block_m, block_c, MIN_TILE, warps, 1, group_m=1, split_k=split_k, direct=1)


def heuristic_config(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, sm_count: int, capability: int = 0, timed_only: bool = False
) -> KernelConfig:
    """The heuristic's tiles, as the direct kernels for depthwise problems and, on sm_90+ (capability >= 90), as a
    box variant where the hardware has timed one against the pointer kernels (tests/gpu_logs/NVIDIA_H200/
    run1_e382175, bench/NOTES.md), on the same tiles:
    - in fp16/bf16 on sm_90, the warp-specialized Gluon kernel where it takes the tiles (gluon_takes): it beat the
      TMA kernel in all three directions of wan_dec_384b (1.10-1.23x) and unet_320's weight gradient (2.2x), and
      the pointer kernels in down_s2's strided input and weight gradients (3.7x, 1.4x); with the forward's and
      input gradient's tiles the H100 timed faster (_persistent_tiles);
    - else the TMA kernel for the input and weight gradients at stride 1 (unet_320's input gradient: 2x the pointer
      kernel's speed on the H200);
    - neither for a forward off Gluon: the Triton TMA forward (its A through registers) won only on the large
      layer the Gluon kernel now runs, and lost on a strided one (down_s2: 0.56x the pointer kernel), one split over
      its reduction to fill a small grid (unet_320: 0.50x) and 64-row tiles (hunyuan_512 on the H100: 0.310 ms,
      the tuned pointer config 0.234).
    A problem whose reduction or columns pack (tap, channel) pairs (packs_taps: fewer than 16 channels a tap; the
    weight gradient's packs_out_taps) keeps the pointer kernel, the only one that packs them, and so does a forward
    (input gradient) of fewer than 16 output (input) channels whose W taps are its columns (config.w_tap_columns).
    A forward reading frames_before or bordered in H or W (its interior on a box kernel, its border ring on the
    pointer kernel) takes the Gluon kernel as a plain one does (timed on the H100); the other directions of such
    problems, and the gradients of a problem reading channels_after (each step's box from one of two descriptors),
    stay on the pointer kernels until a GPU has timed them (but for the untimed rules below), a tuning table or
    TCONV3D_KERNELS aside; a border mode along D alone leaves the box loops as they are.
    Nine rules rest on the timings of other layers, not yet of the layers they move (`timed_only` leaves them out:
    bench.variants' row of what the heuristic chose before them): a forward or input gradient of fewer voxels than
    128 for each SM takes 128-row tiles on the Gluon kernel where they fill the SMs well enough (_gluon_rows), and
    where they do not, the split one-warpgroup Gluon tiles (small_grid_twin: hunyuan_512's and unet_320's forwards
    and input gradients, the suite's worst, ran at 9-40% of the peak on the pointer and Triton TMA kernels, whose
    Gluon twins keep both operands in shared memory and one wgmma group in flight; the Triton TMA kernel waits for
    each; a forward reading a second source, Wan's cached-frame layers of few tiles, its blocks among the split
    steps; but not a forward bordered in H or W: LTX-2's reflect layers of few tiles ran their interior so and their
    border ring in the same splits 1.5-3.4x slower than the pointer kernel alone, H200 run 5); a
    forward reading channels_after, unbordered in H and W, takes the Gluon kernel as a plain one does (its second
    descriptor one more predicated copy a step, issued by the producer warp; its values matched float64 on the
    H200, run 1's tests/test_gluon.py), where MONAI's BasicUNet and DynUNet ran 25-39% of their FLOPs on the
    pointer kernel (their decoders' convolutions of the concatenation, at 32 to 128 channels); and an input gradient
    reading channels_after after grad_out's channels (a transposed conv of a concatenation: MONAI UNet's up convs,
    13% of its forward's FLOPs on the pointer kernel) takes the Gluon kernel as a plain one does, each source's
    channels in whole steps (whole_steps_twin); a Gluon weight gradient of at most 32 output channels is
    computed transposed, 2-4 taps' input channels on the wgmma's rows (swapped_wgrad_tiles: MONAI UNet's 16-channel
    level filled 16 of the 64 rows a wgmma takes, 9.6% of a training step's FLOPs at a quarter of the MMA's work);
    a weight gradient reading channels_after takes the Gluon tiles of a plain one of its wider source, one launch
    a source (BasicUNet's and DynUNet's decoder convs, 13-15% of their training steps' FLOPs); and a weight gradient
    reading frames_before or bordered in H or W takes the Gluon kernel as a plain one does, its border ring on the
    pointer kernel (a video VAE decoder's fine-tuning step: 15-38% of its FLOPs, bench.census --training); the
    persistent Gluon weight gradient's split is refitted to the programs the kernel runs and to its partials'
    traffic (persistent_wgrad_split: hunyuan_512 and Wan's 384-channel layers unsplit, 81 and 46 MB of fp32
    partials fewer); and a problem whose channels are not 16-divisible (multiples of 8 in 16 bits, of 4 in fp32)
    takes the tiles of a plain one (_heuristic_tiles' `boxes`: its steps as deep as leave fewest slots of a tap
    empty) where those run on a box kernel as high in the order pointer, Triton TMA, Gluon as its own do: the
    pointer kernels gather such channels element by element, and their tiles (64 x 32 x 32 forwards and input
    gradients, 32-deep weight gradients: gathered_tiles) are what the box launches inherited (r45_216_160's
    forward: 64 x 32 x 32 -> 128 x 128 x 32 on the Gluon kernel; 41 of 426 sm_90 launches of the random and awkward
    sets, no spill); such a problem's pointer launches (a ring, TMA-less tensors) keep gathered_tiles."""
    plain = _heuristic_choice(direction, geom, dtype, sm_count, capability, timed_only, boxes=False)
    if timed_only or (geom.group_in_channels % 16 == 0 and geom.group_out_channels % 16 == 0):
        return plain  # (16-divisible channels: `boxes` changes no tile)
    boxed = _heuristic_choice(direction, geom, dtype, sm_count, capability, timed_only, boxes=True)
    rank = lambda config: bool(config.tma_box_w) + bool(config.gluon)  # noqa: E731  (pointer, TMA, Gluon)
    return boxed if boxed.tma_box_w and rank(boxed) >= rank(plain) else plain


def _heuristic_choice(
    direction: str,
    geom: ConvGeometry,
    dtype: torch.dtype,
    sm_count: int,
    capability: int,
    timed_only: bool,
    boxes: bool,
) -> KernelConfig:
    """heuristic_config's choice from the tiles _heuristic_tiles gives with `boxes`."""
    if direct_eligible(direction, geom):
        return direct_config(direction, geom, sm_count)
    config = _heuristic_tiles(direction, geom, dtype, sm_count, boxes=boxes)
    if w_tap_columns(direction, geom):
        # (channel, W tap) columns over W-extended rows are the pointer kernels' (config.w_tap_columns): a decoder's
        # conv to 3 channels reads each (kd, kh) tap's input rows once for its three W taps, where the box kernels
        # read them once a tap (last_cout3's forward: 9 loads of 192 bytes a voxel, not 27; fill 41%, not 14%;
        # inspect, sm_90 bf16; the stem's input gradient: 54%, not 19%). H100 run 15: last_cout3's forward 0.621 ms
        # against 1.383 on the Gluon kernel (1.27x cuDNN), stack_in8's input gradient 13.26 against 16.91.
        return config
    if packs_taps(direction, geom) or (direction == "wgrad" and packs_out_taps(geom)):
        # The packed tiles' columns are (tap, channel) pairs, the pointer kernel's; a box kernel's are one tap's
        # input channels a program: the 8-channel stack layer's 27 x 8 = 216 pairs fill 2 x 128 columns, where the
        # TMA kernel on the same tiles ran 27 programs of 128 columns with 8 of them real (16x the MMA work, 27x
        # the programs; python -m tconv3d.inspect --shapes stack: 54 waves against 6). Its forward reduces over
        # (tap, channel) pairs as rows of a step: 8.52 ms on the pointer kernel (fill 96%), 13.45 on the Gluon
        # kernel's 16-deep steps, 8 of them real (H100 run 15); the input gradient of 8 output channels mirrors it.
        return config
    borders = geom.dim_modes[1:] != ("zeros", "zeros") and direction != "dgrad"  # the interior and ring
    second_source = geom.out_after_channels > 0 if direction == "dgrad" else geom.prefix_frames or geom.after_channels
    # The video VAE decoders' forwards, reading cached frames (Wan) or bordered by replicate (HunyuanVideo, Mochi),
    # ran 1.7-2.8x faster on the warp-specialized Gluon kernel than on the pointer kernels (H100 run 15: 0.569 ms
    # against 1.571, 1.765 against 3.831, 2.946 against 4.888); their gradients and channels_after are not timed
    # (a channels_after forward takes the Gluon kernel all the same, but with timed_only: see the docstring).
    timed = direction == "fwd" and (not geom.after_channels or not (timed_only or borders))
    # A transposed conv of a concatenation (MONAI UNet's up convs: an input gradient reading the skip connection in
    # place after grad_out's channels) takes the Gluon kernel as a plain input gradient does, not with timed_only.
    after_dgrad = direction == "dgrad" and geom.out_after_channels > 0 and not timed_only
    if capability < TMA_MIN_CAPABILITY or not tma_eligible(direction, geom, dtype):
        return config
    if direction == "wgrad" and geom.after_channels and not timed_only:
        # A weight gradient reading channels_after (a UNet decoder's conv of [upsampled, skip]) runs one box launch
        # a source, each a plain weight gradient into its columns (conv_wgrad._launch): the tiles a plain one of
        # the wider source's channels takes, where those are the Gluon kernel's (BasicUNet's 32 + 32 -> 32 at
        # 128^3, 13% of its training step's FLOPs, ran the pointer kernel).
        source = replace(geom, in_channels=max(geom.channel_sources), after_channels=0)
        tiles = _heuristic_choice(direction, source, dtype, sm_count, capability, timed_only, boxes)
        if tiles.gluon:
            return tiles
    gluon = capability == GLUON_CAPABILITY and dtype in (torch.float16, torch.bfloat16)
    gluon = gluon and gluon_eligible(direction, geom, dtype)
    # A weight gradient reading frames_before or bordered in H or W (a video VAE decoder's fine-tuning step: Wan's,
    # CogVideoX's and EasyAnimate's cached frames, HunyuanVideo's, Mochi's and LTX-2's borders, 15-38% of those
    # steps' FLOPs) takes the Gluon kernel as a plain one does, its interior so and its border ring on the pointer
    # kernel, as the forwards of the same layers do (timed); not with timed_only, nor off the Gluon kernel.
    decoder_wgrad = direction == "wgrad" and gluon and not geom.after_channels and not timed_only
    if (second_source or borders) and not (timed or after_dgrad or decoder_wgrad):
        return config
    strided = tuple(geom.stride) != (1, 1, 1)
    if gluon and not timed_only and not (direction == "fwd" and strided):
        config = _gluon_rows(direction, geom, dtype, config, sm_count, boxes)
        # A forward bordered in H or W of too few tiles even at 128 rows stays on the pointer kernel: LTX-2's
        # reflect layers ran their interior on small_grid_twin's tiles and their border ring beside it 1.5x and
        # 3.4x slower than the pointer kernel alone (H200 run 5: ltx2_dec_256_reflect 0.302 against 0.204 ms,
        # ltx2_dec_512_reflect 0.389 against 0.113).
        if config.block_m == 64 and not borders:
            # too few tiles even at 128 rows: one-warpgroup tiles, the reduction split (a second source's blocks
            # among the split steps)
            small = small_grid_twin(direction, geom, config, sm_count, dtype.itemsize)
            if small is not None:
                return whole_steps_twin(direction, geom, small, dtype.itemsize) or small
    if direction == "fwd" and (strided or config.split_k > 1):
        return config
    if gluon and gluon_takes(config):
        persistent = with_gluon(config, geom, direction, specialized=True)
        if direction == "wgrad" and not timed_only:  # few output channels: the taps on the wgmma's rows
            persistent = swapped_wgrad_tiles(geom, persistent, sm_count, dtype.itemsize) or persistent
        persistent = _persistent_tiles(direction, geom, persistent, sm_count, dtype.itemsize)
        if direction != "wgrad" and not timed_only:
            persistent = _halo_tiles(direction, geom, persistent, dtype.itemsize)
        if direction == "wgrad" and not timed_only:  # the split refitted to the persistent programs
            persistent = replace(persistent, split_k=persistent_wgrad_split(geom, persistent, sm_count, dtype.itemsize))
        return persistent
    if after_dgrad:  # off the Gluon kernel: the pointer one (the Triton TMA one reading two sources is not timed)
        return config
    if strided or direction == "fwd":
        return config
    if direction == "wgrad":
        # The one-stage tiles of an unaligned fp32 weight gradient (without `boxes`: timed_only's) are the pointer
        # kernel's (gathered_tiles): its TMA twin keeps its ring of two, as before (one stage: 5-11% longer loops,
        # sm_90, 36 -> 20 and 64 -> 40).
        config = replace(config, num_stages=max(config.num_stages, 2))
    return with_tma(config, geom, direction)


def _halo_tiles(direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int) -> KernelConfig:
    """A forward's or input gradient's persistent 128x64 tile, unsplit and unswapped (a plain layer of 64 columns:
    unet_64, the stack's 64-channel layer, MONAI UNets' 64-channel levels) as halo tiles on one program an SM, 32
    channels a step on a 4-stage ring (halo_twin's `programs=1`, where halo_eligible): on the H200 (run 5, the tuner
    over stack_64's keys) they ran its forward 1.38x (6.27 against 8.68 ms) and its input gradient 1.45x (5.95
    against 8.60) faster than this tile, and 1.08x and 1.10x faster than the halo tiles at two programs an SM. `config`
    elsewhere: other tiles of halo tiles are untimed (unet_32's 32 columns, where the shared-memory model says they
    gain nothing)."""
    if (config.block_m, config.block_n, config.split_k, config.swap_ab) != (128, 64, 1, 0):
        return config
    return halo_twin(direction, geom, config, element_size, programs=1) or config


# The least share of its last round of tiles over the SMs (tiles / SMs over its round-up) at which a forward or input
# gradient of few voxels runs 128-row tiles on the persistent Gluon kernel rather than 64-row ones off it
# (_gluon_rows). Where both fill the SMs the Gluon kernel ran the decoders' layers 1.7-2.8x faster than the pointer
# kernel (H100 run 15: 0.569 ms against 1.571, 1.765 against 3.831, 2.946 against 4.888), and its 128x128 and
# 256x128 tiles 70-92% of the matmul peak where 64-row pointer tiles ran 33-45% (hunyuan_512's forward, run 17: 37%):
# a round two-thirds busy still leaves the Gluon kernel ahead by that margin.
GLUON_ROWS_MIN_FILL = 2 / 3


def _gluon_rows(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, config: KernelConfig, sm_count: int, boxes: bool
) -> KernelConfig:
    """The heuristic's 64-row forward or input-gradient tiles (`config`: fewer voxels than 128 for each SM) as
    128-row ones, unsplit, where those tiles, row blocks times column blocks, fill their last round over the SMs
    at least GLUON_ROWS_MIN_FILL (one program an SM): tiles the Gluon kernel takes (64 rows on 8 warps it does not),
    so such layers leave the pointer kernel (the Triton TMA one for the input gradient). Counting the rows alone
    kept Wan's 384-channel layers at 2 x 64 x 64 after 2 cached frames (192 tiles of 128 x 128, 1.45 rounds: 11% of
    its decode's FLOPs), HunyuanVideo 1.5's 1024-channel ones at 9 x 32 x 32 (576 tiles, 4.4 rounds) and Mochi's
    768-channel ones off it. Otherwise `config`: a grid of fewer tiles splits its reduction over 64-row ones
    (small_grid_split), which heuristic_config then runs on small_grid_twin's Gluon tiles where the layer is plain.
    `boxes`: _heuristic_tiles'."""
    if direction == "wgrad" or config.block_m != 64:
        return config
    wide = replace(_heuristic_tiles(direction, geom, dtype, sm_count, wide_rows=True, boxes=boxes), split_k=1)
    if wide.block_m != 128 or not gluon_takes(wide):
        return config
    view = gemm_view(direction, geom)
    rounds = cdiv(view.rows, wide.block_m) * cdiv(view.cols, wide.block_n) * view.groups / sm_count
    return wide if rounds and rounds / math.ceil(rounds) >= GLUON_ROWS_MIN_FILL else config  # none: an empty batch


# How much faster a 256x128 swapped tile computes than two 128x128 ones, persistent on the H100 (wan_dec_384b,
# 2026-11-26: forward 1.23x, input gradient 1.18x; the lesser).
WIDE_TILE_GAIN = 1.18


def _persistent_tiles(
    direction: str, geom: ConvGeometry, config: KernelConfig, sm_count: int, element_size: int
) -> KernelConfig:
    """The persistent Gluon kernels' tiles from the heuristic's, as timed on the H100 (bench.variants,
    tests/gpu_logs/NVIDIA_H100_80GB_HBM3/run12_1739e47, run13_1739e47, run15_84dc0b7 and run17_9ab2ef8):
    - the forward's and input gradient's 128x128 -> 256x128 with the operands swapped (one m64n256 wgmma a
      warpgroup, less shared-memory traffic a FLOP) where its rounds of tiles over the SMs, each WIDE_TILE_GAIN
      faster a FLOP, end sooner than the 128x128 ones: wan_dec_384b's forward 69.6% -> 85.5% of the matmul peak
      (1.23x), its input gradient 1.18x; a layer of few tiles keeps 128x128 (half as many tiles fill fewer SMs);
    - a 128-row tile of at most 64 columns on one warpgroup instead of two, where that runs two programs an SM
      (one's epilogue and next tile under the other's wgmmas): unet_64's forward 1.18x, input gradient 1.20x;
    - a forward's and input gradient's taps of 96 channels in three whole 32-deep steps, not two 64-deep ones
      half empty (whole_steps_twin): wan_dec_96_cached's forward 3.414 -> 2.515 ms (1.36x, run 15), wan_dec_96's
      input gradient 3.774 -> 2.629 (1.44x, run 17);
    - the deepest ring that keeps the programs an SM (deepest_ring) where more boxes in flight timed faster: the
      forward's and input gradient's one-warpgroup tiles at two programs an SM (unet_64: 0.328 -> 0.310 ms and
      0.327 -> 0.310) and the weight gradient's 8-warp tiles at one (wan_dec_384b: 2.033 -> 1.854 ms, 1.10x); not
      the weight gradient's one-warpgroup tiles (unet_64: 0.340 -> 0.373) nor the 128x128 forward (run 12: within
      1%).
    The weight gradient's taps grouped to 256 columns lost (wan_dec_384b 2.183 ms, unet_64 0.410): not taken."""
    if direction == "wgrad":
        if config.num_warps == 8 and conv_gluon.programs_an_sm(config, element_size, weight_grad=True) == 1:
            return deepest_ring(config, element_size, direction)
        return config
    if config.split_k > 1:
        return config
    if (config.block_m, config.block_n) == (128, 128):
        view = gemm_view(direction, geom)
        tall = replace(config, block_m=256, swap_ab=1)
        rounds = [cdiv(cdiv(view.rows, rows) * cdiv(view.cols, 128), sm_count) for rows in (128, 256)]
        if rounds[1] * 2 / WIDE_TILE_GAIN < rounds[0] and gluon_takes(tall):
            config = tall
    if config.num_warps == 8 and config.block_m == 128 and config.block_n <= 64:
        one = replace(config, num_warps=4)
        if gluon_takes(one) and conv_gluon.programs_an_sm(one, element_size, weight_grad=False) == 2:
            config = one
    whole = whole_steps_twin(direction, geom, config, element_size)
    if whole is not None:
        return whole
    if config.num_warps == 4 and conv_gluon.programs_an_sm(config, element_size, weight_grad=False) == 2:
        return deepest_ring(config, element_size, direction)
    return config


# The persistent Gluon weight gradient's split model (persistent_wgrad_split), for an H100-class sm_90 GPU: the wgmma
# FLOP/s an SM reaches on a weight-gradient tile (85% of the matmul peak measured on the H100, 775 TFLOP/s over its
# 132 SMs: wan_dec_384a's Gluon forward ran 86.5%, run 17), the DRAM bytes/s an fp32 partial moves at (HBM3: 3.35
# peak; an H200's 4.8 only makes splits cheaper), what each (tile, split) unit adds to its program's time (its ring's
# first fills and its fp32 tile stored from registers) and what a split adds once (the sum pass: a launch and its tail).
WGRAD_SM_FLOPS = 5.0e12
WGRAD_DRAM_BYTES = 3.0e12
WGRAD_UNIT_SECONDS = 2e-6
WGRAD_SUM_SECONDS = 5e-6
# The leaner split within the model's error: the fewest splits whose modeled time is at most this much the best's.
WGRAD_LEANER_WITHIN = 1.05


def persistent_wgrad_split(geom: ConvGeometry, config: KernelConfig, sm_count: int, element_size: int) -> int:
    """The split of the persistent Gluon weight gradient's reduction (its output patches) for `config`'s tiles: by a
    model of what a split buys and costs, not by a share of the last round's SMs kept busy. The kernel runs
    programs_an_sm programs an SM, each walking (tile, split) units num_programs apart, so its time is its busiest
    program's: ceil(units / programs) units, each 1 / splits of a tile's MMA work at the SM's rate shared by its
    programs, plus WGRAD_UNIT_SECONDS. A split also writes splits fp32 copies of the weight and the sum pass reads
    them back and writes the gradient (WGRAD_DRAM_BYTES, WGRAD_SUM_SECONDS). Of the splits within
    WGRAD_LEANER_WITHIN of the best modeled time, the fewest: they hold the least workspace.

    The former rule (_wave_filling_split: the fewest splits leaving the last round three quarters busy at one to
    `most` programs an SM, `most` the pointer kernel's bound from shared memory, up to 3 for these tiles) split
    layers of many tiles whose rounds a split does not shorten and whose weights are large: hunyuan_512's 432 tiles
    of 128 x 128 (3.3 rounds) 3 ways, 81 MB of fp32 partials for a 14 MB gradient whose reduction is 80 patches;
    wan_dec_384a's and b's 243 (1.84 rounds: 2 whatever the split up to 6) 3 ways, 46 MB; and split the few tiles
    of narrow layers past the point where more rounds of shorter units gain anything (down_s2: 34 ways, 29 MB for a
    0.8 MB gradient, where 9 fill one round at two programs an SM)."""
    view = gemm_view("wgrad", geom, True)
    group = max(config.tap_group, 1)
    tiles = cdiv(geom.taps, group) * cdiv(geom.group_out_channels, config.block_m) * geom.groups
    tiles *= cdiv(geom.group_in_channels, config.block_n // group)
    patches = wgrad_tma_patches(geom, config)
    if patches == 0:  # an empty batch: nothing to split
        return 1
    per_sm = conv_gluon.programs_an_sm(config, element_size, weight_grad=True)
    tile_seconds = 2 * config.block_m * config.block_n * config.block_k * patches * per_sm / WGRAD_SM_FLOPS
    weight = geom.out_channels * geom.taps * geom.group_in_channels
    modeled = {}  # splits -> seconds
    for asked in range(1, _max_split(view, config.block_k) + 1):
        splits = cdiv(patches, split_rows(patches, asked, 1))
        rounds = math.ceil(tiles * splits / (per_sm * sm_count))
        seconds = rounds * (tile_seconds / splits + WGRAD_UNIT_SECONDS)
        if splits > 1:
            seconds += (2 * splits * weight * 4 + weight * element_size) / WGRAD_DRAM_BYTES + WGRAD_SUM_SECONDS
        modeled.setdefault(splits, seconds)
    best = min(modeled.values())
    return min(splits for splits, seconds in modeled.items() if seconds <= best * WGRAD_LEANER_WITHIN)


def deepest_ring(config: KernelConfig, element_size: int, direction: str) -> KernelConfig:
    """Persistent `config` with the most stages, up to 8, whose shared memory still fits as many programs an SM as
    it has now (conv_gluon.resident_programs)."""
    weight_grad = direction == "wgrad"
    deepest, now = config, conv_gluon.resident_programs(config, element_size, weight_grad)
    for stages in range(config.num_stages + 1, 9):
        deeper = replace(config, num_stages=stages)
        if conv_gluon.resident_programs(deeper, element_size, weight_grad) != now:
            break
        deepest = deeper
    return deepest


def small_grid_twin(
    direction: str, geom: ConvGeometry, config: KernelConfig, sm_count: int, element_size: int
) -> KernelConfig | None:
    """The persistent Gluon forward's or input gradient's tiles for a layer of few output tiles and a long reduction
    (hunyuan_512: 320 tiles of 64x128 over 13,824 input elements a voxel; unet_320: 48): 64 rows on one warpgroup, so
    that two programs share an SM (persistent_programs_per_sm), as many columns as the layer has up to 128, 128 bytes of
    channels deep, its reduction split (into fp32 partials, summed after) so that the last round of (tile, split) units
    over the SMs is at least three quarters busy (_wave_filling_split), within _max_k_split. `config`: the heuristic's,
    whose other settings it keeps. None for the weight gradient (its own split fills the SMs), where the tiles alone
    fill them (SPLIT_TILES_BELOW) or no split may be taken, and where the kernel does not take the tiles. The sm_90
    heuristic's for such layers (heuristic_config; a second source's blocks are among the split steps; not with
    timed_only, bench.variants' timed_only row, nor for a forward bordered in H or W by another mode than zeros,
    whose interior so beside its border ring on the pointer kernel in the same splits ran LTX-2's reflect layers
    1.5-3.4x slower than the pointer kernel alone on the H200, run 5)."""
    if direction == "wgrad":
        return None
    view = gemm_view(direction, geom)
    block_n = _pow2_clamp(view.cols, MIN_TILE, 128)
    depth = 128 // element_size  # 128-byte rows a step: 64 16-bit channels, 32 fp32 ones
    tile = replace(config, block_m=64, block_n=block_n, block_k=_pow2_clamp(view.reduction, MIN_TILE, depth),
                   num_warps=4, num_stages=max(config.num_stages, 3), split_k=1, swap_ab=0, tap_group=0)  # fmt: skip
    tile = with_gluon(tile, geom, direction, specialized=True)
    most = _max_k_split(direction, geom, tile)
    if not gluon_takes(tile) or most == 1:
        return None
    tiles = cdiv(view.rows, tile.block_m) * cdiv(view.cols, tile.block_n) * view.groups
    per_sm = conv_gluon.programs_an_sm(replace(tile, split_k=2), element_size, weight_grad=False)
    split = _wave_filling_split(tiles, per_sm, sm_count, most, splits_of=lambda split: split)
    return replace(tile, split_k=split) if split > 1 else None


def whole_steps_twin(
    direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int
) -> KernelConfig | None:
    """The persistent Gluon forward's or input gradient's `config` with reduction steps half as deep where a tap's
    channels fill whole steps only so: Wan's 96-channel decoder layers read a tap in two 64-deep steps, the second
    half empty (mma_fill 0.56 with 96 columns of 128), and in three full 32-deep ones (0.75: 1.33x less MMA work),
    on a ring twice as deep (the same bytes in flight) or the deepest that keeps the programs an SM it has. With two
    sources along the channels each fills steps of its own (config.channel_blocks): MONAI UNet's up conv of 32 + 32
    channels reads a tap in two 64-deep steps, each half empty, and in two full 32-deep ones. None elsewhere: the
    weight gradient (it reduces over voxels), other kernels, sources that fill their steps already or not half
    ones."""
    sources = geom.out_channel_sources if direction == "dgrad" else geom.channel_sources
    sources = [channels for channels in sources if channels]  # with one source: its channels (groups == 1 here)
    half = config.block_k // 2
    if direction == "wgrad" or config.gluon != 2 or half < MIN_TILE:
        return None
    if all(channels % config.block_k == 0 for channels in sources) or any(channels % half for channels in sources):
        return None
    programs = conv_gluon.programs_an_sm(config, element_size, weight_grad=False)
    for stages in range(min(8, 2 * config.num_stages), config.num_stages - 1, -1):
        twin = replace(config, block_k=half, num_stages=stages)
        if conv_gluon.resident_programs(twin, element_size, weight_grad=False) == programs:
            return twin
    return None


def vector_runs(direction: str, geom: ConvGeometry, dtype: torch.dtype) -> bool:
    """Whether `direction`'s packed channels a tap (config.packed_channels) make 16-byte runs in 16 bits
    (utils.channel_run's RUN, as dense tensors have it), which the packed weight gradient's heuristic tiles take 32
    voxels deep."""
    return dtype != torch.float32 and packed_channels(direction, geom) * dtype.itemsize % 16 == 0


def _heuristic_tiles(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, sm_count: int, wide_rows: bool = False, boxes: bool = False
) -> KernelConfig:
    """A sound default, checked by compiling every suite problem for sm_90 and sm_80 (tests/test_static_compile.py):
    128-wide output tiles where the problem fills them, 64-deep reductions (32 for fp32 to keep the pipeline's
    shared memory in bounds), 8 warps from 64x128 up, small tiles where channel counts defeat vector loads; the
    weight gradient split so that its programs fill whole waves. `wide_rows`: a forward's or input gradient's
    128-row tiles however few voxels (_gluon_rows), where its channels take the plain tiles. `boxes`: tiles for a
    box kernel (TMA or Gluon), whose operands arrive as whole boxes: the rules for channels not 16-divisible, which
    keep the pointer kernels' element-by-element gathers from spilling (gathered_tiles), do not apply, and a 16-bit
    reduction of such channels steps 32 deep where 64 would leave more of a tap's slots empty."""
    view = gemm_view(direction, geom)
    k_cap = 32 if dtype == torch.float32 else 64
    stages = 2 if dtype == torch.float32 else 3
    if direction == "wgrad":
        # At least 64 rows (Cout): Hopper's wgmma works on 64-row tiles; 32-row ones fall back to mma.sync.
        block_m = _pow2_clamp(view.rows, 64, 128)
        block_n = _pow2_clamp(view.cols, MIN_TILE, 128)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        block_k = k_cap
        if packs_taps(direction, geom):
            # Packed columns gather x per (voxel, pair), each with its own address and bounds: 16 voxels a step
            # (32 spilled at 128x128 under triton 3.6, 64 for Cin = 1 under 3.9), one stage for fp32.
            block_k, stages = MIN_TILE, 1 if dtype == torch.float32 else stages
            num_warps = 8 if block_n == 128 else num_warps  # at most 8 gathered elements per thread
            if vector_runs(direction, geom, dtype) and block_m == 64:
                # each tap's channels of a voxel one 16-byte vector (utils.channel_run): 32 voxels a step on 4
                # warps, 255 instructions a step where 16 on 8 warps took 128 (stack_in8, sm_90 bf16 under 3.9:
                # 510 issue cycles an SM for 256 of wgmma, 3.6: 740 for 256, where 16 deep took 1024 and 976)
                block_k, num_warps = 32, 4
        elif packs_out_taps(geom):
            # (tap, output channel) pairs gathered from grad_out per (pair, voxel): 32 voxels a step on 8 warps,
            # 16 gathered elements a thread, for 3 to 4 instructions a (voxel, tap) (sm_90 bf16, 128x128: 336 a step
            # under triton 3.6, 446 under 3.9; fp32 and sm_80 without spills; 64 voxels spilled under 3.6).
            block_k, num_warps = 32, 8 if block_m * block_n >= 64 * 128 else 4
        elif not boxes:  # channels not 16-divisible, gathered element by element: within what that holds
            plain = KernelConfig(block_m, block_n, block_k, num_warps, stages)
            gathered = gathered_tiles(direction, geom, plain, dtype.itemsize)
            block_k, num_warps, stages = gathered.block_k, gathered.num_warps, gathered.num_stages
        tiles = cdiv(view.rows, block_m) * cdiv(view.cols, block_n) * view.grid_taps * view.groups
        most = _most_programs_per_sm(block_m, block_n, block_k, num_warps, stages, dtype)
        if packs_taps(direction, geom):
            # The packed columns' gathers hold 128-231 registers a thread (inspect: first_cin3's and stack_in8's
            # tiles, sm_80 and sm_90, 3.6 and 3.9): at most 2 programs an SM on 8 warps, 4 on 4, where the
            # shared memory alone would allow 8 (first_cin3: 1786 splits, 71 MB of fp32 partials for a 41 KB
            # gradient; 198 at this bound, 7.8 MB).
            most = min(most, 65536 // (PACKED_WGRAD_REGISTERS * 32 * num_warps))
        fill = 0.75
        if packs_out_taps(geom):
            # ~160-230 registers a thread at 128 x 128 (inspect: sm_80 and sm_90, 3.6 and 3.9): one program an SM
            # on 8 warps; 94-128 at 128 x 64 in 16 bits (stack_out8's; fp32 176-190 under 3.6) and on 4 warps: two.
            # Whatever the shared memory would allow; whole waves of them at one program an SM and at two
            # (last_cout3: 132 splits, where six programs an SM asked for 1201, 37 MB of fp32 partials for 4 MB;
            # stack_out8: 132 splits of 2 tiles, one wave at two programs an SM where one left half of them idle).
            most, fill = (1 if num_warps == 8 and block_m * block_n > 128 * 64 else 2), 1.0
        if view.reduction == 0:  # an empty batch: nothing to split
            return KernelConfig(block_m, block_n, block_k, num_warps, stages, group_m=8, split_k=1)
        split_k = _wave_filling_split(
            tiles, most, sm_count, _max_split(view, block_k),
            splits_of=lambda split: cdiv(view.reduction, split_rows(view.reduction, split, block_k)), min_fill=fill,
        )  # fmt: skip
        return KernelConfig(block_m, block_n, block_k, num_warps, stages, group_m=8, split_k=split_k)
    if packs_taps(direction, geom):
        # (tap, channel) pairs gathered element by element, each with its own address and bounds: 16 a step
        # wastes no more of a 27 x 3 = 81 long reduction than 32 would (96 slots either way); wider steps, more
        # than 8 gathered elements per thread, and fp32 pipelines spill (python -m tconv3d.inspect, Cin = 1
        # and 2, triton 3.6 and 3.9).
        block_m = 128 if view.rows >= 128 * sm_count else 64
        # The input gradient gathers the weight per pair too, and in 16 bits as wide: 128 x 128 spilled 16 bytes on
        # sm_80 under triton 3.6 until the gathered tiles' threads ran along the pairs (utils.gather_tile), and
        # spills nothing now, sm_80 and sm_90, 3.6 and 3.9 (last_cout3's, the decoders' conv to 3 channels: 211-222
        # registers, one program an SM as at 64 columns, 153-170 instructions a step as at 64, for half the tiles,
        # each gathering grad_out's pairs once). fp32's keeps 32 columns: 64 spill nothing either, but hold one
        # program an SM where 32 hold two (stack_out8, sm_90), and these loops wait on their gathers.
        widest = (32 if direction == "dgrad" else 64) if dtype == torch.float32 else 128
        block_n = _pow2_clamp(view.cols, MIN_TILE, widest)
        # Where each tap's channels make one 16-byte run (8 in 16 bits; utils.channel_run) the pairs move as
        # vectors straight into shared memory, at this same 16-deep step on 8 warps: the H100 (run 18) timed it
        # 1.08x faster than 32 deep on 4 warps (stack_in8's forward, stack_out8's input gradient) at ~11% of the
        # peak either way, far under what issue allows (35% and 100%, sm_90 bf16): latency-bound loops, and
        # two programs an SM both ways (102 registers x 256 threads, 190 x 128) hold twice the warps at 16 deep.
        if view.cols % 16 and view.cols > MIN_TILE:
            # the columns' channels not 16-divisible (44 output channels of a 12-channel input, an input gradient of
            # 36 from 6): the weight gathered element by element too, and 64 x 64, 64 x 128 and 128 x 64 spilled
            # 112-1976 bytes a thread (sm_90 and sm_80, 16 and 32 bits, triton 3.6 and 3.9); 64 x 32 none
            block_m, block_n = 64, min(block_n, 32)
        num_warps = 8 if block_m == 128 or block_m * block_n >= 64 * 128 else 4
        return KernelConfig(block_m, block_n, MIN_TILE, num_warps, 1 if dtype == torch.float32 else 3, group_m=8)
    if view.reduction % 16 and view.reduction > MIN_TILE and not boxes:
        # Channel strides Triton cannot prove 16-divisible. When the gather went element by element anything above
        # 64 x 16 x 16 spilled; with the channels loaded as runs (utils.unseen_run) and the rows split in int32
        # (WIDE_ROWS), 64 x 32 x 32 spills nowhere (75 forwards and 73 input gradients, random and awkward
        # problems, bf16 and fp32, sm_90 and sm_80, triton 3.9) and its rounds of programs issue 0.67x the
        # forwards' instructions of 64 x 16 x 16 (geomean; 0.31-1.01x) and 0.56x the input gradients' (0.30-1.32x:
        # the worst a stride-phase one of 108 -> 16 channels, 3-4 live taps a phase). 64 columns spilled 8 bytes in
        # four forwards (sm_80) and cost up to 1.22x where few tiles fill the SMs. fp32 keeps one stage: two spilled
        # six input gradients.
        block_n = _pow2_clamp(view.cols, MIN_TILE, 32)
        return KernelConfig(64, block_n, 32, 4, 1 if dtype == torch.float32 else 3, group_m=8)
    block_n = _pow2_clamp(view.cols, MIN_TILE, 64 if dtype == torch.float32 else 128)
    # The weight's rows (output channels forward, input channels backward) not 16-divisible: its tile gathered
    # element by element, and 64 x 64 and wider, and 128 x 32, spilled 368-2376 bytes a thread (40, 54, 56, 72 and
    # 108 channels, 12 from 20, of 60 random problems, sm_90 and sm_80, 16 and 32 bits, triton 3.9); 64 x 32 none.
    unaligned_cols = view.cols % 16 != 0 and view.cols > MIN_TILE and not boxes  # (one column tile: packed forms')
    if unaligned_cols:
        block_n = min(block_n, 32)
    # fp32 operands: 128x128 tiles spill on sm_80 (mma.sync needs more registers than wgmma's accumulators), and
    # so do 128 x 16 ones on 4 warps (8 bytes, triton 3.6 and 3.9: a conv to 3 channels): 64 rows there.
    narrow_fp32 = dtype == torch.float32 and block_n == MIN_TILE
    wide = view.rows >= 128 * sm_count or wide_rows
    block_m = 128 if wide and not narrow_fp32 and not unaligned_cols else 64
    # 8 warps from 64x128 up: 4 warps holding 64 accumulators each plus the gather's addresses spill on sm_80,
    # and so do 64-row 8-warp tiles 64 deep (a pointwise input-grad).
    num_warps = 8 if block_m * block_n >= 64 * 128 else 4
    # 64x64 tiles on 4 warps 64 deep spill 8 bytes on sm_80 too (a 64-channel forward of few rows: resnext3d_g32_256
    # as coarse groups, kernels/grouped.py; triton 3.9): 32 deep there, as for 64-row 8-warp tiles.
    shallow = block_m == 64 and (num_warps == 8 or block_n == 64)
    block_k = _pow2_clamp(view.reduction, MIN_TILE, 32 if shallow else k_cap)
    if boxes and dtype.itemsize == 2 and view.reduction % 16 and block_k == 64:
        # A box kernel's steps of a tap's channels, which no step fills (multiples of 8, not 16): 32 deep where that
        # leaves fewer slots empty (216: 7 x 32 = 224, not 4 x 64 = 256; 72: 96, not 128), on a ring twice as deep
        # (the same bytes in flight), as whole_steps_twin takes Wan's 96 channels in whole 32-deep steps.
        sources = geom.out_channel_sources if direction == "dgrad" else geom.channel_sources
        slots = lambda depth: sum(cdiv(channels, depth) * depth for channels in sources)  # noqa: E731
        if slots(block_k // 2) < slots(block_k):
            block_k, stages = block_k // 2, 2 * stages
    config = KernelConfig(block_m, block_n, block_k, num_warps, stages, group_m=8)
    return replace(config, split_k=small_grid_split(direction, geom, config, sm_count))


def interpreter_config(direction: str, geom: ConvGeometry) -> KernelConfig:
    """The Triton interpreter runs programs one by one, paying per operation rather than per element: few,
    large tiles are fastest there. Two wgrad splits keep the split-K reduction exercised."""
    if direct_eligible(direction, geom):
        return direct_config(direction, geom, 1, interpreter=True)
    view = gemm_view(direction, geom)
    if direction == "wgrad":
        block_m = _pow2_clamp(view.rows, MIN_TILE, 64)
        block_n = _pow2_clamp(view.cols, MIN_TILE, 64)
        block_k = _pow2_clamp(cdiv(view.reduction, 2), MIN_TILE, 1024)
        return KernelConfig(block_m, block_n, block_k, num_warps=4, num_stages=1, split_k=2)
    block_m = _pow2_clamp(view.rows, MIN_TILE, 512)
    block_n = _pow2_clamp(view.cols, MIN_TILE, 64)
    block_k = _pow2_clamp(view.reduction, MIN_TILE, 64)
    return KernelConfig(block_m, block_n, block_k, num_warps=4, num_stages=1)


# The TMA variant needs Hopper's tensor memory accelerator.
TMA_MIN_CAPABILITY = 90


@functools.lru_cache(maxsize=16)
def compute_capability(device: torch.device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def tma_eligible(direction: str, geom: ConvGeometry, dtype: torch.dtype) -> bool:
    """Problems the TMA variant runs: channel rows (input and output) that are whole 16-byte units, as TMA boxes
    need (Cin, Cout multiples of 8 for 16-bit dtypes, of 4 for fp32), except the forward's output, which the
    kernel stores from registers where its rows are not (a decoder's last conv to 3 channels: its input and weight
    boxes are whole rows of Cin); at strides whose phase views in H and W (conv_tma.phase_descriptors: of the input
    forward and in the weight gradient, of the input gradient) number at most MAX_PHASES and are not empty.
    Dilation and asymmetric padding are coordinate offsets; along D, so are a border mode and frames_before. A
    second channel source (channels_after) is a second descriptor, each channel block read from one of the two: the
    forward and weight gradient at stride 1 in H and W, the input gradient (grad_output's second source, a
    transposed conv's skip connection) at any stride, each source's rows whole 16-byte units."""
    size = torch.finfo(dtype).bits // 8
    aligned = geom.in_channels * size % 16 == 0 and (direction == "fwd" or geom.out_channels * size % 16 == 0)
    # each source's rows, read by descriptors of their own: the input's (the input gradient's is the
    # concatenation's), grad_output's and its channels_after's for the input gradient
    sources = geom.out_channel_sources if direction == "dgrad" else geom.channel_sources
    aligned = aligned and all(channels * size % 16 == 0 for channels in sources)
    _, s_h, s_w = geom.stride
    # The input gradient computes the padded (or concatenated) input's gradient anyway; the forward and the
    # weight gradient read the input itself: a box is one frame deep, so along D any border mode and frames_before
    # in front (at stride 1 in H and W: frames_before has no phase views) are a frame coordinate
    # (conv_tma.source_frame), while a box's rows in H and W read zeros past the edges, the TMA unit's border.
    _, mode_h, mode_w = geom.dim_modes
    second_source = geom.prefix_frames or geom.after_channels
    runs = direction == "dgrad" or (mode_h == mode_w == "zeros" and (not second_source or s_h * s_w == 1))
    # Another mode in H or W: the forward and the weight gradient at stride 1 there compute (reduce over) the
    # interior on the box kernels and the border on the pointer kernel (conv_fwd.interior_part), where an interior
    # is left.
    if direction != "dgrad" and not runs and s_h == s_w == 1:
        runs = interior_left(geom)
    _, h, w = geom.in_size
    strided = s_h * s_w <= MAX_PHASES and h >= s_h and w >= s_w
    # A box reaching past a group's channels would read the next group's (only the tensor's edge reads zeros).
    return runs and aligned and strided and geom.groups == 1


def interior_left(geom: ConvGeometry) -> bool:
    """Whether a stride-1 forward has output voxels, in H and W, whose taps all stay inside the input in each of
    those dimensions whose border reads input voxels (another mode than zeros)."""
    _, h_out, w_out = geom.out_size
    top, bottom, left, right = border_widths(geom)
    return h_out > top + bottom and w_out > left + right


# The TMA variant's box is a patch of output rows up to 16 voxels wide, or one row of all block_m voxels (block_k
# for the weight gradient): a row box lands in shared memory as the 2-D GEMM operand itself, and the compiled loop
# keeps both operands there (no LDSM; the input gradient's and weight gradient's wgmma then wait at depth 1), where
# a patch's 5-D box goes through registers (python -m tconv3d.inspect, triton 3.6, wan_dec_384b at 128x128x64).
# A row box wastes what the volume's rows leave of its last box: the heuristic takes it where they fill 90%.
ROW_BOX_MIN_FILL = 0.9
PATCH_BOX_W = 16


def _row_width(geom: ConvGeometry, direction: str) -> int:
    """W of the volume a direction's boxes walk: the output's, or the (bordered) input's for the input gradient."""
    return geom.border_geometry().in_size[2] if direction == "dgrad" else geom.out_size[2]


def tma_box_widths(config: KernelConfig, geom: ConvGeometry, direction: str) -> tuple[int, int]:
    """(patch width, row width) of `config`'s TMA box: the block_m voxels of output (forward) or input-gradient
    (dgrad) rows, or the weight gradient's block_k reduction voxels."""
    voxels = config.block_k if direction == "wgrad" else config.block_m
    return min(voxels, PATCH_BOX_W, next_power_of_2(max(_row_width(geom, direction), 1))), voxels


def row_box_fill(config: KernelConfig, geom: ConvGeometry, direction: str) -> float:
    """The share of a row box's voxels that lie inside the volume's rows."""
    width, voxels = _row_width(geom, direction), tma_box_widths(config, geom, direction)[1]
    return width / (cdiv(width, voxels) * voxels) if width else 0.0


def with_tma(config: KernelConfig, geom: ConvGeometry, direction: str, rows: bool | None = None) -> KernelConfig:
    """`config`'s tiles for the TMA variant: a row box (`rows`), a patch, or (rows=None) the row box where the
    volume's rows fill it at least ROW_BOX_MIN_FILL, else the patch."""
    patch, row = tma_box_widths(config, geom, direction)
    if rows is None:
        rows = row > patch and row_box_fill(config, geom, direction) >= ROW_BOX_MIN_FILL
    return replace(config, tma_box_w=row if rows else patch)


# The Gluon kernel (kernels/conv_gluon.py) is wgmma code: Hopper only, not sm_100 and later.
GLUON_CAPABILITY = 90


def gluon_eligible(direction: str, geom: ConvGeometry, dtype: torch.dtype) -> bool:
    """Problems the Gluon kernels run, where this Triton has them: the TMA variant's problems (tma_eligible), in
    16-bit dtypes, and the fp32 forward and input gradient where TF32 products are allowed (utils.exact_products, as
    cuDNN's): wgmma reads fp32 operands only as TF32 and only K-major, which the forward's boxes are (channels
    innermost) and the input gradient's are over a transposed copy of the weight; both weight-gradient boxes run
    their reduction over voxels, not innermost, and would need the activations transposed."""
    if dtype == torch.float32:
        runs = direction != "wgrad" and not exact_products(dtype)
    else:
        runs = dtype in (torch.bfloat16, torch.float16)
    return conv_gluon.UNAVAILABLE is None and runs and tma_eligible(direction, geom, dtype)


def gluon_takes(config: KernelConfig) -> bool:
    """Tiles the Gluon kernel compiles: wgmma's 16-row atoms on every warp along its M, at most 256 columns (its
    N), a ring of at least two stages. With swap_ab the wgmma's M is block_n and its N block_m. Grouped taps
    (tap_group): warp-specialized, whole swizzle rows a tap (GROUPED_TAP_COLUMNS)."""
    rows, cols = config.mma_tile
    return rows >= 16 * config.num_warps and cols <= 256 and config.num_stages >= 2 and grouped_taps_fit(config)


def grouped_taps_twin(
    config: KernelConfig, direction: str, element_size: int = 2, smem_bytes: int | None = None
) -> KernelConfig | None:
    """The warp-specialized Gluon weight gradient's `config` with as many taps a tile (tap_group 2 or 4) as make its
    columns 256 (m64n256 from 2 x 128 or 4 x 64 input channels), each tap's input channels as before; given
    `smem_bytes`, its ring as deep as fits them, at most as deep as `config`'s (a stage of 256 columns holds twice
    the operand bytes: the heuristic's 128 x 128 tiles at 7 stages become 4, where their twin at 7 was dropped as
    too large and never timed: wan_dec_192's on the H200). None elsewhere (other directions, other kernels, tiles
    already 256 wide, transposed ones: swapped_wgrad_twin's)."""
    group = 256 // config.block_n
    if direction != "wgrad" or config.gluon != 2 or config.swap_ab or group not in (2, 4):
        return None
    twin = replace(config, block_n=256, tap_group=group)
    if smem_bytes is not None:
        while twin.num_stages > 2 and not _persistent_fits(twin, element_size, direction, smem_bytes):
            twin = replace(twin, num_stages=twin.num_stages - 1)
    return twin


def channel_taps_twin(config: KernelConfig, geom: ConvGeometry, direction: str) -> KernelConfig | None:
    """The warp-specialized Gluon weight gradient's `config` with its block_n columns made of 2 or 4 taps' blocks of
    c input channels, c the largest power of two dividing Cin (at least GROUPED_TAP_COLUMNS, at most half the
    columns), where one tap's Cin leaves its last column block partly empty and no half tile takes it
    (wgrad_half_tails): Wan's 96 channels in 128 columns are 4 taps of 32 (27 of 28 slots: fill 0.75 -> 0.96 along
    the columns), not 96 of 128. None elsewhere."""
    cin = geom.group_in_channels
    if direction != "wgrad" or config.gluon != 2 or config.swap_ab or config.tap_group > 1 or cin % config.block_n == 0:
        return None
    if wgrad_half_tails(config, geom.group_out_channels, cin, 2)[1]:
        return None
    per_tap = min(cin & -cin, config.block_n // 2)
    group = config.block_n // per_tap
    if per_tap < GROUPED_TAP_COLUMNS or group not in (2, 4):
        return None
    return replace(config, tap_group=group)


def swapped_twin(config: KernelConfig, direction: str) -> KernelConfig | None:
    """The Gluon forward's or input gradient's `config` with its operands swapped (swap_ab), where that gives the
    wgmma a wider N than it has unswapped (block_m voxels over block_n columns) and the kernel takes it: the
    tiles a 384-channel layer needs for m64n256 (256 voxels x 128 columns). None elsewhere (the weight gradient's
    is swapped_wgrad_twin)."""
    if direction == "wgrad" or not config.gluon or config.block_m <= config.block_n:
        return None
    twin = replace(config, swap_ab=1)
    return twin if gluon_takes(twin) else None


def halo_eligible(direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int) -> bool:
    """Whether the warp-specialized Gluon forward or input gradient with `config`'s tiles may run halo tiles
    (halo_d): HALO_FRAMES output frames of one patch a tile, each K step one box of the HALO_BOX_FRAMES source frames
    they read at one (kh, kw) tap and channel block, and the HALO_KD weight boxes of that tap along D, every (frame,
    kd) pair's wgmma reading its frame of the box as a slice of shared memory. So the source comes from L2 once for
    the three kd taps of two frames (4 frames of box for 6 frame-taps) instead of once a tap: the operands' FLOPs a
    byte (operand_intensity) go from 2RC / (R + C) to 12RC / (4R + 3C), 42.7 -> 69.8 a 16-bit byte at 128 x 64, the
    narrow layers' bound (bench/NOTES.md, "What 64 columns cost"). It takes: stride 1 (the input gradient's is a
    forward of grad_out, its taps flipped) and no dilation along D (the frames of a box are consecutive), KD =
    HALO_KD (4 frames of box, a power of two), zeros along D and no frames_before (no frame of a box is remapped), a
    source of at least HALO_BOX_FRAMES frames (a box no longer than the tensor), an output stored by TMA (whole
    16-byte rows), one group, 16-bit operands (not yet compiled or emulated as TF32), one tap a tile, whole (no half
    tail); swapped (swap_ab) too, each frame's tile transposed."""
    if direction == "wgrad" or element_size != 2:
        return False
    source_frames = geom.in_size[0] if direction == "fwd" else geom.out_size[0]
    columns = geom.out_channels if direction == "fwd" else geom.in_channels
    return (
        config.gluon == 2
        and config.tap_group <= 1
        and tuple(geom.stride) == (1, 1, 1)
        and geom.kernel[0] == HALO_KD
        and geom.dilation[0] == 1
        and geom.dim_modes[0] == "zeros"
        and not geom.prefix_frames
        and source_frames >= HALO_BOX_FRAMES
        and geom.groups == 1
        and columns * element_size % 16 == 0
        and not half_tail(config, columns, element_size)
    )


# A halo tile's HALO_FRAMES fp32 accumulators, registers a thread, at most: 2 x 64 compile without spills on one
# warpgroup at two programs an SM (128 x 64, 128 registers) and on two at one (128 x 128, 168); 2 x 128 (256 x 128 on
# 8 warps) spilled 1.5 KB a thread under triton 3.6 and 3.9.
HALO_ACCUMULATOR_REGISTERS = 128


def halo_twin(
    direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int, programs: int | None = None
) -> KernelConfig | None:
    """`config` with halo tiles (halo_eligible), on the deepest ring of at least two stages that keeps the programs
    an SM it has (the two accumulators a tile count against the one-warpgroup tiles' registers), its reduction steps
    halved where a stage of the 4-frame box and three weight boxes would not fit twice; else on one program an SM.
    `programs` = 1: on one program an SM whatever `config` has, the deepest ring of steps at most 32 channels deep
    that fits (4 stages of 45 KB at 128 x 64 against two programs' 2 each: what a deeper ring gains where the second
    program's wgmmas do not cover the first's waits on its loads). None where the launch may not take halo tiles or
    no ring fits, or where the tile's HALO_FRAMES accumulators would not fit in HALO_ACCUMULATOR_REGISTERS a thread."""
    if not halo_eligible(direction, geom, config, element_size):
        return None
    if HALO_FRAMES * config.block_m * config.block_n > HALO_ACCUMULATOR_REGISTERS * 32 * config.num_warps:
        return None
    if programs is None:
        programs = conv_gluon.programs_an_sm(config, element_size, weight_grad=False)
        depths = [config.block_k, config.block_k // 2]
    else:  # steps at most 32 channels deep, so that the ring holds more of them
        depths = [min(config.block_k, 32)]
    for wanted in sorted({programs, 1}, reverse=True):
        for block_k in [depth for depth in depths if depth >= MIN_TILE]:
            for stages in range(8, 1, -1):
                twin = replace(config, halo_d=HALO_FRAMES, block_k=block_k, num_stages=stages)
                if conv_gluon.resident_programs(twin, element_size, weight_grad=False) == wanted:
                    return twin
    return None


# The swapped weight gradient's rows (wgmma M): this many taps' input channels a tile, on two warpgroups.
SWAPPED_WGRAD_ROWS = 128


def swapped_wgrad_twin(config: KernelConfig, geom: ConvGeometry) -> KernelConfig | None:
    """The warp-specialized Gluon weight gradient's `config` transposed (swap_ab) for a layer of at most 32 output
    channels, which fill half or less of the 64 rows a wgmma takes unswapped (unet_32: 32 of 64; MONAI UNet's
    16-channel level: 16 of 64): Cout on the wgmma's N (block_m its next power of two, 16 at least) and taps of the
    tile's c = 16, 32 or 64 input channels side by side on its M (tap_group, at most 4), SWAPPED_WGRAD_ROWS rows on
    8 warps, or half as many taps where that wastes fewer taps past the kernel's last (9 taps: 2 x 5 = 10 slots, not
    4 x 3 = 12) and keeps a warpgroup's 64 rows (16 channels: 4 taps on 4 warps); its split, box and ring as
    `config`'s. The grad_out box is read once for all the taps. None elsewhere."""
    per_tap = config.block_n
    if config.gluon != 2 or config.swap_ab or config.tap_group > 1 or geom.group_out_channels > 32:
        return None
    if per_tap not in (16, 32, 64) or geom.group_in_channels < per_tap:
        return None
    most = min(SWAPPED_WGRAD_ROWS // per_tap, 4)
    groups = [g for g in (most, most // 2) if per_tap * g >= 64]
    group = max(groups, key=lambda g: (geom.taps / (cdiv(geom.taps, g) * g), g))
    rows = per_tap * group
    twin = replace(config, block_m=_pow2_clamp(geom.group_out_channels, MIN_TILE, 32), block_n=rows,
                   num_warps=rows // 16, swap_ab=1, tap_group=group if group > 1 else 0)  # fmt: skip
    return twin if gluon_takes(twin) else None


def swapped_wgrad_tiles(
    geom: ConvGeometry, config: KernelConfig, sm_count: int, element_size: int
) -> KernelConfig | None:
    """The heuristic's weight gradient of at most 32 output channels (`config`: its persistent Gluon tiles) as
    swapped_wgrad_twin's transposed tiles, its split refitted to them: the twin keeps a split sized for one tap's tiles
    (27 for a 3x3x3 conv), and its tap groups are fewer (7 of 4 taps: unet_32's 7 x 66 = 462 units, 3.5 rounds of
    132). The fewest splits whose last round over the SMs is at least SWAPPED_WGRAD_FILL busy (_wave_filling_split),
    at the programs an SM the twin runs (conv_gluon.programs_an_sm). None where the twin is (swapped_wgrad_twin)."""
    twin = swapped_wgrad_twin(config, geom)
    if twin is None:
        return None
    return replace(twin, split_k=persistent_wgrad_split(geom, twin, sm_count, element_size))


def own_twins(direction: str, geom: ConvGeometry, config: KernelConfig, dtype: torch.dtype, smem_bytes: int) -> list:
    """`config`'s own Gluon twins, those that fit `smem_bytes`: its tile swapped (swapped_twin; the weight gradient's,
    swapped_wgrad_twin), a forward's as halo tiles (halo_twin) or with its taps grouped (grouped_taps_twin; the
    weight gradient's whole channel blocks,
    channel_taps_twin; a transposed weight gradient's, its one-tap tile unswapped on 64 rows: off_gluon's, on the
    Gluon kernel). They differ from it in tile dimensions, so a
    tuner that times the candidates nearest a default (tuner.nearest_candidates) would not reach them (unet_32's
    transposed weight gradient is 7 doublings from the default; the 24th nearest, 7), and its split may be one the
    space does not hold."""
    if not config.gluon:
        return []
    element = torch.empty((), dtype=dtype).element_size()
    found = [swapped_twin(config, direction), grouped_taps_twin(config, direction, element, smem_bytes)]
    halo = halo_twin(direction, geom, config, element)
    deep = halo_twin(direction, geom, config, element, programs=1)
    found += [halo, halo and not halo.swap_ab and swapped_twin(halo, direction), deep if deep != halo else None]
    if direction == "wgrad":
        found += [swapped_wgrad_twin(config, geom), channel_taps_twin(config, geom, direction)]
        if config.swap_ab:  # the heuristic's transposed tile (swapped_wgrad_tiles): one tap's, unswapped, beside it
            found.append(replace(off_gluon(config), gluon=config.gluon))
    dst_size = destination_dtype(direction, geom, dtype).itemsize
    return [t for t in found if t and _persistent_fits(t, element, direction, smem_bytes, dst_size)]


def with_gluon(config: KernelConfig, geom: ConvGeometry, direction: str, specialized: bool = False) -> KernelConfig:
    """`config`'s tiles on the Gluon kernel: the TMA variant's patch, and a ring of at least two stages (wgmma
    tiles want at least 64 rows a warpgroup: `gluon_takes` says which tiles fit); `specialized`: persistent, with
    a warp-specialized TMA producer (gluon = 2)."""
    tiled = with_tma(config, geom, direction, rows=False)  # the 5-D patch: compile-checked, reshaped in smem
    return replace(tiled, gluon=2 if specialized else 1, num_stages=max(tiled.num_stages, 2))


def default_config(direction: str, geom: ConvGeometry, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The config used where no table speaks: the heuristic on a GPU, large tiles under the interpreter."""
    if device.type != "cuda":
        return interpreter_config(direction, geom)
    return heuristic_config(direction, geom, dtype, multiprocessor_count(device), compute_capability(device))
