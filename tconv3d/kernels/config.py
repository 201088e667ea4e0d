"""What a kernel launch is told: the tiling config (`KernelConfig`), and the implicit GEMM each direction computes
(`GemmView`, the small-channel packing, the weight gradient's split rows). The launchers read these; which config
a problem gets is chosen above the kernels (tconv3d/tune/)."""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import asdict, dataclass, fields, replace

from ..geometry import ConvGeometry
from .tensors import at_least_float32, cat_channels, cdiv, ndhwc, unit_channels

DIRECTIONS = ("fwd", "dgrad", "wgrad")

# tl.dot needs every tile dimension to be at least 16.
MIN_TILE = 16
# A grouped weight-gradient tile's taps (tap_group) land in column slices of one buffer, swizzled as each tap's box
# is (the box's row bytes, up to 128: TMA's 32-, 64- and 128-byte swizzles); a slice must hold whole swizzle rows
# (the compiler refuses narrower ones), and a 16-bit box of 16 channels has 32-byte rows: 16 channels a tap. (Until
# 2026-11-27 the buffer was swizzled 128 bytes wide whatever the box, so a tap took 64 channels; until 2026-11-28
# the configs asked for 32.)
GROUPED_TAP_COLUMNS = 16
# The output frames of a Gluon forward or input-gradient tile that reads its source frames once for all the taps
# along D (halo_d): with KD = 3 its box is 4 frames, a power of two as boxes and shared-memory buffers must be.
HALO_FRAMES = 2
HALO_KD = 3
HALO_BOX_FRAMES = HALO_FRAMES + HALO_KD - 1
# Elements per program of the elementwise pass that adds weight-gradient split-K partials.
SPLIT_SUM_BLOCK = 1024
# The per-channel sums of a conv's output gradient (its bias gradient, split_k.channel_sums): a program's tile of
# voxels x channels, and the most programs along the voxels (each then one row of fp32 partials).
CHANNEL_SUM_TILE = 4096
CHANNEL_SUM_PROGRAMS = 512


# Fields a pointer config leaves at 0 and a table entry may omit.
OPTIONAL_FIELDS = ("tma_box_w", "direct", "gluon", "swap_ab", "tap_group", "halo_d")


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1
    # The TMA variant (configs.tma_eligible): the width of its box in voxels (a patch of block_m / tma_box_w rows of
    # tma_box_w voxels, block_k / tma_box_w for the weight gradient; one row when they are equal); 0 is the pointer
    # variant.
    tma_box_w: int = 0
    # 1: the depthwise direct kernels (conv_depthwise.py), block_m voxels x block_n channels a program, block_k
    # unused, split_k splits of the weight gradient's voxels.
    direct: int = 0
    # 1: the Gluon kernel (conv_gluon.py, sm_90) on the TMA variant's patch, num_stages its ring depth; 2: the same
    # persistent, with a warp-specialized one-warp TMA producer.
    gluon: int = 0
    # 1: the Gluon forward or input gradient computes each tile transposed, block_n columns x block_m voxels (the
    # weight box as wgmma's A, the voxel box as its B), so one wgmma spans the block_m voxels: m64n256 at 256
    # voxels, where a 384-channel layer's 128 columns would otherwise cap it at m64n128 (conv_gluon's docstring).
    swap_ab: int = 0
    # 2 or 4 (0: one): the Gluon weight gradient's tile is that many taps' input-channel blocks side by side,
    # block_n / tap_group channels each, so that one wgmma spans them (m64n256 from two taps of 128 channels) and
    # each grad_out box is loaded once for all of them; warp-specialized (gluon 2) only.
    tap_group: int = 0
    # 2 (0: off): the Gluon forward's or stride-1 input gradient's tile is that many output frames of the same patch,
    # and each K step loads one box of the halo_d + KD - 1 source frames they read and the weight boxes of all KD taps
    # along D, each frame of the box read by the wgmmas of every (output frame, kd) pair that needs it: the source
    # read from L2 once for the KD taps along D instead of once a tap (configs.halo_eligible); warp-specialized
    # (gluon 2) only.
    halo_d: int = 0

    @property
    def mma_tile(self) -> tuple[int, int]:
        """(rows, columns) of a tile as the Gluon kernel's wgmma computes it, its M and N: (block_m, block_n), or
        (block_n, block_m) with swap_ab."""
        return (self.block_n, self.block_m) if self.swap_ab else (self.block_m, self.block_n)

    @property
    def variant(self) -> str:
        return "direct" if self.direct else "gluon" if self.gluon else "tma" if self.tma_box_w else "pointer"

    def tma_box(self, voxels: int) -> tuple[int, int]:
        """(rows, width) of the TMA box over `voxels` (block_m; the weight gradient's block_k)."""
        if not self.tma_box_w or voxels % self.tma_box_w:
            raise ValueError(f"tma_box_w {self.tma_box_w} does not divide a box of {voxels} voxels: {self}")
        return voxels // self.tma_box_w, self.tma_box_w

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in OPTIONAL_FIELDS:
            if not data[name]:
                del data[name]  # pointer configs read as they did before these fields existed
        return data

    @classmethod
    def from_dict(cls, data) -> KernelConfig:
        """A config from a table entry; ValueError naming the problem if it is not one the kernels can run."""
        if not isinstance(data, dict):
            raise ValueError(f"a config must be an object, got {data!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown}")
        config = cls(**data)
        for name in names:
            value = getattr(config, name)
            lowest = 0 if name in OPTIONAL_FIELDS else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                kind = "a positive int" if lowest else "an int >= 0"
                raise ValueError(f"{name} must be {kind}, got {value!r}")
        if config.direct > 1 or (config.direct and config.tma_box_w):
            raise ValueError(f"direct is 0 or 1, and a direct config has no TMA box: {config}")
        if config.gluon > 2 or (config.gluon and not config.tma_box_w):
            raise ValueError(f"gluon is 0, 1 or 2, and a gluon config has a TMA box (tma_box_w): {config}")
        if config.swap_ab > 1 or (config.swap_ab and not config.gluon):
            raise ValueError(f"swap_ab is 0 or 1, and only a gluon config swaps its operands: {config}")
        if config.tap_group not in (0, 1, 2, 4) or (config.tap_group > 1 and config.gluon != 2):
            raise ValueError(f"tap_group is 0, 1, 2 or 4, and only a warp-specialized gluon config has it: {config}")
        if config.halo_d not in (0, HALO_FRAMES) or (config.halo_d and (config.gluon != 2 or config.tap_group > 1)):
            raise ValueError(
                f"halo_d is 0 or {HALO_FRAMES}, and only a warp-specialized gluon config of one tap a tile has it: "
                f"{config}"
            )
        if config.tap_group > 1 and config.block_n // config.tap_group < GROUPED_TAP_COLUMNS:
            raise ValueError(f"a tap_group config has {GROUPED_TAP_COLUMNS}+ columns a tap: {config}")
        rows, cols = config.mma_tile
        if config.gluon and (rows < 16 * config.num_warps or cols > 256 or config.num_stages < 2):
            raise ValueError(
                f"a gluon config needs block_m >= 16 x warps, block_n <= 256 (block_n and block_m with swap_ab), "
                f"2+ stages: {config}"
            )
        box = config.tma_box_w
        if box and (box & (box - 1) or (config.block_m % box and config.block_k % box)):
            raise ValueError(f"tma_box_w must be a power of two dividing block_m or block_k, got {config}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(config, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if min(config.block_m, config.block_n, config.block_k) < MIN_TILE:
            raise ValueError(f"every block must be at least {MIN_TILE}, got {config}")
        if max(config.block_m, config.block_n, config.block_k) > 512 or config.num_warps > 16:
            raise ValueError(f"blocks above 512 or more than 16 warps are out of range: {config}")
        if config.num_stages > 8:
            raise ValueError(f"num_stages must be at most 8, got {config.num_stages}")
        return config


def grouped_taps_fit(config: KernelConfig) -> bool:
    """Whether `config`'s taps a tile (tap_group) are ones the Gluon weight gradient takes: one tap, or 2 or 4 on
    the warp-specialized kernel (gluon 2) with GROUPED_TAP_COLUMNS+ input channels each."""
    return config.tap_group <= 1 or (config.gluon == 2 and config.block_n // config.tap_group >= GROUPED_TAP_COLUMNS)


# The swizzle rows of a 16-bit operand box whose rows are 128 bytes or more: a half tile's slices hold whole ones.
SWIZZLE_BYTES = 128


def _half_block(block: int, channels: int, element_size: int) -> bool:
    """Whether `channels` leave their last `block` at most half full, that half whole swizzle rows of
    `element_size`-byte elements (a slice of a shared-memory view at offset 0)."""
    rest, half = channels % block, block // 2
    return 0 < rest <= half and half * element_size >= SWIZZLE_BYTES


def half_tail(config: KernelConfig, columns: int, element_size: int) -> bool:
    """Whether the Gluon forward's or input gradient's last column block runs as a half tile (conv_gluon,
    HALF_TAIL): `columns` (Cout forward, Cin input gradient) leave it at most half its block_n columns, so it
    computes those from the first half of each weight box, half the MMA work (192 channels: 128 + 64, not 128 +
    128). Only where the half is whole swizzle rows of the boxes of `element_size`-byte elements (a slice of a
    shared-memory view at offset 0) and, with swap_ab, whole warpgroups' 64 rows."""
    if not config.gluon or not _half_block(config.block_n, columns, element_size):
        return False
    return not config.swap_ab or config.block_n // 2 % 64 == 0


def wgrad_half_tails(config: KernelConfig, c_out: int, c_in: int, element_size: int) -> tuple[bool, bool]:
    """(rows, columns): whether the warp-specialized Gluon weight gradient's last Cout block (its rows) and last Cin
    block (its columns) run as half tiles (conv_gluon, HALF_M_TAIL and HALF_N_TAIL), as half_tail does for the
    forward: 192 channels in 128-row and 128-column blocks are 128 + 64 each. One tap a tile, unswapped; the rows'
    half whole warpgroups' 64."""
    if config.gluon != 2 or config.swap_ab or config.tap_group > 1:
        return False, False
    rows = _half_block(config.block_m, c_out, element_size) and config.block_m // 2 % 64 == 0
    return rows, _half_block(config.block_n, c_in, element_size)


def off_gluon(config: KernelConfig) -> KernelConfig:
    """`config` without what only the Gluon kernels have: gluon, swap_ab, halo_d, and tap_group (the tile back to one
    tap's columns). A transposed weight gradient's (swap_ab with fewer than 64 rows of output channels: a swapped
    forward's or input gradient's block_m, its voxels, is 128+) back to the 64 rows wgmma takes, on one warpgroup:
    the unswapped tile the heuristic gives such a layer (configs._heuristic_tiles; 32 rows ran mma.sync)."""
    block_n = config.block_n // config.tap_group if config.tap_group > 1 else config.block_n
    block_m, warps = config.block_m, config.num_warps
    if config.swap_ab and block_m < 64:
        block_m, warps = 64, 4
    return replace(config, gluon=0, swap_ab=0, tap_group=0, halo_d=0, block_m=block_m, block_n=block_n, num_warps=warps)


def pointer_tiles(config: KernelConfig, direction: str, geom: ConvGeometry, element_size: int) -> KernelConfig:
    """A box config's tiles on the pointer kernel: for the border of a box launch whose border in H or W reads input
    voxels (the forward's and the weight gradient's ring: conv_fwd.interior_part), and for a launch whose tensors
    TMA cannot describe (choice.launch). The box config off the box kernels (off_gluon: one tap's columns where the
    Gluon weight gradient grouped taps; no box), split as it is, at most 128 rows, on 8 warps from 64 x 128 up: the
    pointer forward of the 256x128 swapped tile's strips spilled 24 bytes on sm_90 (hunyuan_dec_128_replicate,
    bf16), the ring of small_grid_twin's 64x128x64 tile on 4 warps 472 (ltx2_dec_256_reflect; 190 registers on 8, no
    spill), the input gradient of the Gluon kernel's 128x64x64 one-warpgroup tile 56 (a stride-2 transposed conv of
    64 + 64 channels); within gathered_tiles where the pointer kernel gathers `geom`'s channels element by element."""
    block_m = min(config.block_m, 128)
    warps = max(config.num_warps, 8) if block_m * config.block_n >= 64 * 128 else config.num_warps
    tiles = replace(off_gluon(config), block_m=block_m, tma_box_w=0, num_warps=warps)
    return gathered_tiles(direction, geom, tiles, element_size)


def gathered_tiles(direction: str, geom: ConvGeometry, config: KernelConfig, element_size: int) -> KernelConfig:
    """Pointer tiles `config` within what the pointer kernels hold where they gather a problem's channels element by
    element (channels not 16-divisible: strides Triton cannot prove 16-divisible), as the heuristic's own tiles for
    such problems are (configs._heuristic_tiles): a forward or input gradient at most 64 x 32 on 4 warps, its
    reduction steps as deep as they were (a bordered forward's ring takes its box launch's steps and splits):
    python -m tconv3d.inspect compiled the random and awkward sets' 157 such forwards and input gradients that TMA
    takes at 64 x 32 x 64 (16 bits) and 64 x 32 x 32 (fp32, one and two stages), sm_90 and sm_80, without a spill;
    of those sets' 71 sm_90 box launches that differ from timed_only's, the box tiles on the pointer kernel spilled
    480 bytes in two (stride-2 input gradients of 72 -> 216 and 136 -> 24 channels at 128 x 128 x 32, 255
    registers), these tiles in none. A weight gradient of 64 x 64 and more: 32 voxels deep on 8 warps (fp32's 64 x
    64: 4 warps, one stage), the heuristic's tiles for it. Packed forms (packs_taps, packs_out_taps) and
    w_tap_columns' tiles are the heuristic's own: `config` as it is."""
    if packs_taps(direction, geom) or w_tap_columns(direction, geom) or (direction == "wgrad" and packs_out_taps(geom)):
        return config
    if direction == "wgrad":
        unaligned = geom.group_in_channels % 16 or geom.group_out_channels % 16
        if not unaligned or config.block_m * config.block_n < 64 * 64:
            return config
        # grad_out and x gathered element by element, their addresses in registers. 16-bit 64 x 64 x 64 on 4 warps
        # spilled 104-1136 bytes a thread (sm_90 and sm_80, triton 3.6 and 3.9: 36 -> 20, 44 -> 12, 56 -> 3
        # channels, 255 registers, ~3100 instructions a step), on 8 still 48 under 3.6; 32 deep on 8 warps: 128-172
        # registers, no spill. fp32 (32 deep already) takes 8 warps from 64 x 128 (4 spilled there, sm_90 and sm_80)
        # and keeps 4 at 64 x 64 (8 spilled 8-24 bytes on sm_80 where 4 spilled 0-8). With its channels loaded as
        # runs (utils.unseen_run) fp32's 64 x 64 x 32 sits at ptxas's 128 registers on sm_80: on 2 stages 36 -> 20
        # spilled 8 bytes (3 local accesses outside the loop), on 3 40 -> 16 and 1 -> 12 did; on 1 none of the 17
        # such random and awkward problems spills (sm_80 and sm_90; their loops -20% to +1%, issue ceilings -1% to
        # +19%). One stage waits on each step's loads; the 4-5 programs an SM its registers allow hide them (a GPU
        # has not timed it).
        four = element_size == 4 and config.block_m * config.block_n <= 64 * 64
        return replace(
            config, block_k=min(config.block_k, 32), num_warps=4 if four else 8,
            num_stages=1 if four else config.num_stages,
        )  # fmt: skip
    view = gemm_view(direction, geom)
    if not any(n % 16 and n > MIN_TILE for n in (view.reduction, view.cols)):
        return config
    return replace(config, block_m=64, block_n=min(config.block_n, 32), num_warps=4)


# Channel counts below which a kernel packs (tap, channel) pairs into its reduction (fwd, dgrad) or its columns
# (wgrad) instead of spending a whole 16-wide MMA step per tap on a few channels (the Cin = 3 stem: 3 of 16).
PACK_TAPS_BELOW = 16


def packed_channels(direction: str, geom: ConvGeometry) -> int:
    """The channels `direction` walks per tap, which its small-channel form packs with the taps (fwd: Cin reduced,
    dgrad: Cout reduced, wgrad: Cin as columns)."""
    return geom.group_out_channels if direction == "dgrad" else geom.group_in_channels


def packs_taps(direction: str, geom: ConvGeometry) -> bool:
    """Whether `direction` runs its small-channel form: its packed_channels are fewer than one MMA step and the
    kernel has more than one tap; not a weight gradient that packs its output channels instead (packs_out_taps)."""
    if direction == "wgrad" and packs_out_taps(geom):
        return False
    return packed_channels(direction, geom) < PACK_TAPS_BELOW and geom.taps > 1


def packs_out_taps(geom: ConvGeometry) -> bool:
    """Whether the weight gradient runs its few-output-channel form (conv_wgrad's out-pairs kernel): fewer output
    channels than one MMA step, 2 to 63 taps (a bit a tap), unit stride, zeros borders, one source; and enough
    input channels that its columns would not pack them, or, in one group, no more output channels than input
    ones (the (tap, channel) pairs it gathers are then no more than the packed columns' would be). Its rows are
    (tap, output channel) pairs, reduced over input voxels: a decoder's conv to 3 channels fills 81 of 128 rows,
    where one tap a program filled 3 of 64. MONAI UNet's 3 -> 3 conv at 128^3 in the packed columns' form: 132 warp
    instructions a voxel, fill 3%; in this one: 52, fill 12% (inspect, sm_90 bf16, triton 3.9)."""
    c_in, c_out = geom.group_in_channels, geom.group_out_channels
    few_in = c_in < PACK_TAPS_BELOW
    return (
        c_out < PACK_TAPS_BELOW
        and 1 < geom.taps < 64
        and (not few_in or (geom.groups == 1 and c_out <= c_in))
        and tuple(geom.stride) == (1, 1, 1)
        and geom.dim_modes == ("zeros", "zeros", "zeros")
        and not geom.prefix_frames
        and not geom.after_channels
    )


# A forward's or input gradient's W taps as columns (w_tap_columns) reach this far along W past a tile's outputs at
# most: a tile of block_m >= 16 rows keeps at least half of them as outputs.
W_TAPS_MAX_HALO = 8


def w_tap_columns(direction: str, geom: ConvGeometry) -> int:
    """The W taps a column tile of the pointer forward or input gradient holds per column channel (their W_TAPS:
    KW's next power of two), or 0 where it runs one tap a step. A forward of fewer output channels than one MMA
    step (an input gradient: of fewer input channels) whose reduced channels are not packed with taps (packs_taps),
    2+ taps along W at stride 1 in W (the input gradient: unit stride), reaching at most W_TAPS_MAX_HALO voxels:
    its columns are (channel, W tap) pairs, its reduction the (kd, kh) taps' channels, each of its rows a voxel of
    a row extended by the taps' reach (w_tap_halo), read once for all the W taps; the epilogue adds each voxel's W
    taps from the rows that hold them. A decoder's conv to 3 channels reads its input a third as often as one tap
    a step did, and computes 9 real columns of 16, not 3; so does the input gradient of a conv from 3 channels."""
    if direction not in ("fwd", "dgrad"):
        return 0
    columns = w_tap_outputs(direction, geom)[1]
    kw, dil_w = geom.kernel[2], geom.dilation[2]
    if columns >= PACK_TAPS_BELOW or kw < 2 or (kw - 1) * dil_w > W_TAPS_MAX_HALO or packs_taps(direction, geom):
        return 0
    if geom.stride[2] != 1 or (direction == "dgrad" and tuple(geom.stride) != (1, 1, 1)):
        return 0
    return 1 << (kw - 1).bit_length()


def w_tap_halo(geom: ConvGeometry) -> int:
    """How far along W a voxel's W taps reach past it: the rows a W_TAPS tile holds beyond its outputs."""
    return (geom.kernel[2] - 1) * geom.dilation[2]


def w_tap_outputs(direction: str, geom: ConvGeometry) -> tuple[int, int]:
    """(voxels, channels) a forward or input gradient writes: its rows and columns before W taps extend them."""
    if direction == "dgrad":
        return geom.input_voxels, geom.group_in_channels
    return geom.output_voxels, geom.group_out_channels


def w_tap_tiles(direction: str, geom: ConvGeometry, config: KernelConfig) -> tuple[int, int]:
    """(row tiles, column tiles) of a W_TAPS launch (w_tap_columns): each tile writes block_m - w_tap_halo of its
    rows, and block_n // W_TAPS channels."""
    channels = w_tap_outputs(direction, geom)[1]
    rows = gemm_view(direction, geom).rows
    return cdiv(rows, config.block_m - w_tap_halo(geom)), cdiv(
        channels, config.block_n // w_tap_columns(direction, geom)
    )


def w_tap_rows(batch: int, size: tuple, geom: ConvGeometry) -> int:
    """A W_TAPS launch's rows: the voxels of a (D, H, W) volume (the output, the input gradient's input) with each
    row extended by the W taps' reach."""
    d, h, w = size
    return batch * d * h * (w + w_tap_halo(geom))


def pointer_form(direction: str, geom: ConvGeometry) -> str | None:
    """The small-channel form a pointer launch of `direction` runs, or None (one tap a step): "tap_pairs" (the
    reduction or, in the weight gradient, the columns are (tap, channel) pairs: packs_taps), "out_tap_rows" (the
    weight gradient's rows are (tap, output channel) pairs: packs_out_taps) or "w_tap_columns" (the columns are
    (channel, W tap) pairs: w_tap_columns)."""
    if packs_taps(direction, geom):
        return "tap_pairs"
    if direction == "wgrad" and packs_out_taps(geom):
        return "out_tap_rows"
    return "w_tap_columns" if w_tap_columns(direction, geom) else None


@dataclass(frozen=True)
class GemmView:
    """The implicit GEMM a direction computes, one per group: `rows` x `cols`, reduced over `reduction` (fwd:
    Cin, dgrad: Cout, per tap; wgrad: all output voxels), with `grid_taps` programs per tile, one per tap
    (wgrad), or 1, and `groups` such GEMMs side by side. Packed into (tap, channel) pairs, the small-channel
    forms reduce over taps x channels (fwd, dgrad) or make them the columns (wgrad); a weight gradient of few
    output channels makes (tap, output channel) pairs its rows and reduces over input voxels (packs_out_taps), and
    its forward (input gradient) makes (output (input) channel, W tap) pairs its columns over W-extended rows
    (w_tap_columns)."""

    rows: int
    cols: int
    reduction: int
    grid_taps: int = 1
    groups: int = 1


def gemm_view(direction: str, geom: ConvGeometry, box: bool = False) -> GemmView:
    """`direction`'s GEMM on the pointer kernels, or (box) on the box kernels, which pack no output pairs."""
    packed = geom.taps if packs_taps(direction, geom) else 1
    cin, cout, groups = geom.group_in_channels, geom.group_out_channels, geom.groups
    if direction == "fwd":
        if w_taps := (w_tap_columns(direction, geom) if not box else 0):  # rows extended by the W taps' reach
            return GemmView(w_tap_rows(geom.batch, geom.out_size, geom), cout * w_taps, cin, groups=groups)
        return GemmView(geom.output_voxels, cout, cin * packed, groups=groups)
    if direction == "dgrad":
        if w_taps := (w_tap_columns(direction, geom) if not box else 0):
            return GemmView(w_tap_rows(geom.batch, geom.in_size, geom), cin * w_taps, cout, groups=groups)
        return GemmView(geom.input_voxels, cin, cout * packed, groups=groups)
    if direction == "wgrad":
        if packs_out_taps(geom) and not box:
            return GemmView(cout * geom.taps, cin, geom.input_voxels, groups=groups)
        return GemmView(cout, cin * packed, geom.output_voxels, geom.taps // packed, groups)
    raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")


def split_rows(rows: int, split_k: int, block_k: int) -> int:
    """Reduction rows per weight-gradient split: a whole number of BLOCK_K steps, so splits may come out fewer
    than split_k (the launcher's grid and the heuristic's wave count both use this)."""
    return max(1, cdiv(cdiv(rows, split_k), block_k)) * block_k


@functools.lru_cache(maxsize=256)
def live_taps(kernel, stride, front_padding, dilation) -> tuple:
    """The input gradient's live taps: per stride phase and dimension, the taps that land on whole output voxels,
    as an arithmetic progression (first, step, count) (the solutions t in [0, k) of (r + pad - t * dil) % stride
    == 0 are one residue class). ((d, h, w) progressions) per phase, phases ordered (rd, rh, rw), rw fastest."""
    progressions = []
    for k, s, p, d in zip(kernel, stride, front_padding, dilation, strict=True):
        per_residue = []
        for r in range(s):
            live = [t for t in range(k) if (r + p - t * d) % s == 0]
            first = live[0] if live else 0
            step = live[1] - live[0] if len(live) > 1 else 1
            assert live == list(range(first, first + step * len(live), step))
            per_residue.append((first, step, len(live)))
        progressions.append(per_residue)
    return tuple(
        (progressions[0][rd], progressions[1][rh], progressions[2][rw])
        for rd, rh, rw in itertools.product(*(range(s) for s in stride))
    )


def reads_channels_after(direction: str, geom: ConvGeometry, config: KernelConfig) -> bool:
    """Whether a launch with a second channel source (channels_after) reads it in place: the forward's and the input
    gradient's (grad_output's second source) pointer, TMA and Gluon kernels (each channel block within one source:
    channel_blocks), the weight gradient's pointer kernel (each column tile within one) and its TMA and Gluon
    kernels (one launch per source, into its columns), with one group and channels not packed with taps.
    Elsewhere (the depthwise and small-channel kernels, groups) the launcher concatenates the two first
    (tensors.cat_channels), a copy."""
    after = geom.out_after_channels if direction == "dgrad" else geom.after_channels
    return after > 0 and geom.groups == 1 and not config.direct and not packs_taps(direction, geom)


def channel_sources(direction: str, x, channels_after, geom: ConvGeometry, config: KernelConfig) -> tuple:
    """A launch's (x, channels_after, geometry) as its kernels take them, x being the forward's and weight
    gradient's input, the input gradient's grad_output: with a second channel source they read in place, both
    with channel stride 1; else x and channels_after concatenated, one source."""
    if channels_after is None:
        return x, None, geom
    if reads_channels_after(direction, geom, config):
        return unit_channels(x), unit_channels(ndhwc(channels_after)), geom
    one_source = replace(geom, out_after_channels=0) if direction == "dgrad" else replace(geom, after_channels=0)
    return cat_channels(x, channels_after), None, one_source


def channel_blocks(geom: ConvGeometry, block: int, direction: str = "fwd") -> int:
    """Blocks of `block` channels over the reduced channels, each within one source: the input's, then
    channels_after's (a partial block at the end of each); the input gradient's: grad_output's, then its
    channels_after's."""
    first, after = geom.out_channel_sources if direction == "dgrad" else geom.channel_sources
    return cdiv(first, block) + cdiv(after, block)


def reduction_steps(direction: str, geom: ConvGeometry, config: KernelConfig) -> int:
    """BLOCK_K steps of a forward or input-gradient program's reduction (the input gradient's: of the phase with
    the most live taps), which split_k divides between programs: taps x channel blocks, or (tap, channel) pairs
    in BLOCK_K steps where the pointer kernels pack them; a halo tile's (halo_d) (kh, kw) taps x channel blocks."""
    if direction == "fwd":
        taps, channels = geom.taps, geom.group_in_channels
    elif direction == "dgrad":
        phases = live_taps(geom.kernel, geom.stride, geom.front_padding, geom.dilation)
        taps, channels = max(math.prod(count for _, _, count in phase) for phase in phases), geom.group_out_channels
    else:
        raise ValueError(f"the weight gradient splits its voxels, not taps x channels; got {direction!r}")
    if w_tap_columns(direction, geom) and not config.tma_box_w:  # the W taps are columns (unit stride in W)
        taps //= geom.kernel[2]
    if config.halo_d:  # a halo tile's step takes every tap along D (stride 1: each is live)
        taps //= geom.kernel[0]
    if packs_taps(direction, geom) and not config.tma_box_w:
        return cdiv(taps * channels, config.block_k)
    if geom.out_after_channels if direction == "dgrad" else geom.after_channels:  # read in place (else a copy)
        return taps * channel_blocks(geom, config.block_k, direction)
    return taps * cdiv(channels, config.block_k)


def k_splits(direction: str, geom: ConvGeometry, config: KernelConfig) -> tuple[int, int]:
    """(steps per split, splits) of a forward or input-gradient launch: config.split_k divides its reduction
    steps, each split a whole number of them, so there may come out fewer splits than asked for."""
    steps = reduction_steps(direction, geom, config)
    per_split = split_rows(steps, config.split_k, 1)
    return per_split, max(1, cdiv(steps, per_split))


def destination_dtype(direction: str, geom: ConvGeometry, dtype):
    """The dtype a launch of `direction` over operands of `dtype` writes its result in: `dtype`, but float32 at
    least for the input gradient of a layer whose borders read input voxels (geom.reads_border: replicate, reflect,
    circular). That gradient is written over the bordered geometry first, and tensors.fold_padding adds each border
    voxel's onto the voxel it read: rounded to 16 bits before that sum, each term carries its own rounding, and
    where the terms cancel (a 1-voxel input replicated, taps' weights of opposite signs) the sum is mostly rounding
    (test_padding_modes' cancelling borders: bf16 0.03-0.08 from float64, 0.002 written in float32). Written in
    float32, the fold rounds once. The config choice counts the wider epilogue tile (tune.configs.fit_destination)."""
    if direction == "dgrad" and geom.reads_border:
        return at_least_float32(dtype)
    return dtype
