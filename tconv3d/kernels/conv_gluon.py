"""The Gluon implicit GEMMs for Hopper (sm_90): the forward and stride-1 input gradient (one kernel, an INPUT_GRAD
flag) and the weight gradient, and their launchers. A stride in H or W reads the TMA variant's phase views
(conv_tma.tap_box): the forward issues each step's source load from every view, all but its tap's predicated off
(the software-pipelined loop pays a CTA barrier between two such copies into one stage, the warp-specialized
producer none), the weight gradient compiles its loop once per view.

The loop Hopper GEMMs reach their peak with, written out because Triton's own lowering of the 5-D TMA box goes
through registers (conv_tma.py): TMA moves both operands into swizzled shared memory through a STAGES-deep ring
guarded by one mbarrier per stage, the 5-D box is reshaped to the 2-D GEMM operand in shared memory (a view, no
copy), wgmma reads both operands from there asynchronously with one group in flight, and the epilogue adds the
bias and writes the patch back with a TMA store. Per K step the main loop should compile to: an mbarrier wait
(SYNCS.PHASECHK), the HGMMAs of one BLOCK_K slice with both operands in shared memory, one WARPGROUP.DEPBAR.LE
gsb0, 0x1, and the next stage's two UTMALDG; no LDS/LDSM/STS. `python -m tconv3d.inspect` checks that. The
three also come persistent and warp-specialized (WARP_SPECIALIZE, config gluon = 2): a one-warp producer
issues the loads, the kernel's warps only wait, wgmma and store, one program per SM (two where a one-warpgroup
tile fits twice: persistent_programs_per_sm).

Gluon is experimental and its API moves between Triton releases: the variant is offered only where this module
imports and its Triton is one the kernel was compiled against (GLUON_TRITON), and only for sm_90 (wgmma)."""

import contextlib
import functools
import math

import torch
import triton
from packaging.version import Version

from ..geometry import ConvGeometry
from .config import (
    GROUPED_TAP_COLUMNS,
    HALO_BOX_FRAMES,
    HALO_FRAMES,
    HALO_KD,
    KernelConfig,
    grouped_taps_fit,
    half_tail,
    wgrad_half_tails,
)
from .conv_tma import (
    dst_box,
    dst_row_strides,
    first_channels,
    next_patch,
    next_step,
    patch_descriptors,
    patch_origin,
    patch_phase,
    phase_descriptors,
    phase_view,
    prefix_descriptor,
    source_frames,
    step_box,
    step_of,
    tap_box,
    tap_shift,
)
from .launch import launch
from .tensors import cdiv
from .utils import ndhwc_descriptor, padded_coord

# Triton releases whose Gluon this kernel is written for and compile-checked against (tests/test_hopper_main_loops.py,
# .ci/run): 3.6 (torch 2.11's, the GPU machines'), 3.7 (torch 2.12's and 2.13's CUDA builds), 3.8 (torch 2.14's) and
# 3.9 (torch 2.15's, and the newest: CPU CI's).
GLUON_TRITON = ("3.6", "3.7", "3.8", "3.9")

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
except ImportError as error:  # a Triton without Gluon, or with another layout of it
    _NO_GLUON = f"this Triton ({triton.__version__}) has no usable Gluon: {error}"
else:
    _NO_GLUON = None


def unwritten_for(version: str) -> str | None:
    """Why the kernels are not offered under Triton `version`, or None where they are written for it."""
    release = f"{Version(version).major}.{Version(version).minor}"
    if release in GLUON_TRITON:
        return None
    return f"the Gluon kernels are written for Triton {', '.join(GLUON_TRITON)}, not {version}"


UNAVAILABLE = _NO_GLUON or unwritten_for(triton.__version__)

# Registers a thread of the warp-specialized kernel's one-warp TMA producer keeps (it holds a few scalars), and the
# most any thread may take so that the kernel's warps plus the producer's warpgroup fit an SM's 64K registers.
PRODUCER_REGS = 40
# The weight gradient's producer with four taps a tile (tap_group 4) issues four boxes a step, each from one of up to
# four phase views: at 40 registers ptxas spills it.
GROUPED_PRODUCER_REGS = 56
# What an sm_90 SM holds, shared between the persistent kernel's programs on it: 228 KB of shared memory (1 KB of it
# reserved per program) and 64K registers.
SM_SHARED_BYTES = 233472
SM_REGISTERS = 65536


def specialized_max_registers(num_warps: int, programs_per_sm: int = 1) -> int:
    """maxnreg of a warp-specialized launch with `programs_per_sm` programs an SM: registers are handed out per
    warpgroup, so the producer's one warp costs a whole warpgroup of 4 warps. Triton's setmaxnreg then moves what
    the producer leaves (PRODUCER_REGS a thread) to the kernel's warps: 232 a thread for one warpgroup at 128."""
    return min(256, SM_REGISTERS // (programs_per_sm * 32 * (num_warps + 4))) // 8 * 8


def persistent_shared_bytes(
    config: KernelConfig, element_size: int, weight_grad: bool, dst_size: int | None = None
) -> int:
    """At most the shared memory of the persistent warp-specialized kernel over operands of `element_size` bytes:
    the ring and its barriers and, beside the ring, the forward's and input gradient's epilogue tile (fp32 where
    split-K writes partial sums; else `dst_size`-byte elements where given: config.destination_dtype's), which it
    keeps while the next tile's loads land (the weight gradient stores from registers)."""
    if config.halo_d:  # a stage: the box of HALO_BOX_FRAMES input frames and the weight boxes of the HALO_KD taps
        stage = HALO_BOX_FRAMES * config.block_m + HALO_KD * config.block_n
    else:
        stage = config.block_m + config.block_n
    ring = config.num_stages * stage * config.block_k * element_size + 1024
    if weight_grad:
        return ring
    if config.split_k > 1:
        dst_size = 4
    return ring + config.block_m * config.block_n * (dst_size or element_size)


def persistent_programs_per_sm(config: KernelConfig, shared_bytes: int) -> int:
    """Programs of the persistent warp-specialized kernel an SM runs at once. Two where the kernel's warps are one
    warpgroup whose accumulators (at most 128 x 128 fp32, 128 a thread) fit the 232 registers a thread two programs
    leave it, and the shared memory fits twice: one program's epilogue and its ring's first fills then overlap the
    other's wgmma, as the two consumer warpgroups of CUTLASS's ping-pong schedule do in one CTA (a single program
    would leave the tensor cores idle there, where the one-tile-per-program kernel gets the same overlap from the
    hardware scheduling two of its CTAs on an SM). Otherwise one, as the cooperative schedule: two warpgroups on one
    tile. At most 128 columns a wgmma (voxels with swap_ab): ptxas holds each instruction to the kernel's maxnreg (128
    at two programs), not to the consumer's limit that setmaxnreg raises, and one m64n256 wgmma alone keeps 128
    accumulators a thread (64 x 256 on one warpgroup does not compile there: C7602, "register target of 154")."""
    frames = max(config.halo_d, 1)  # a halo tile's accumulators, one a frame
    one_warpgroup = (
        config.num_warps == 4 and frames * config.block_m * config.block_n <= 128 * 128 and config.mma_tile[1] <= 128
    )
    fits_twice = one_warpgroup and 2 * (shared_bytes + 1024) <= SM_SHARED_BYTES
    return min(2 if fits_twice else 1, _most_programs_per_sm)


_most_programs_per_sm = 2


def programs_an_sm(config: KernelConfig, element_size: int, weight_grad: bool, dst_size: int | None = None) -> int:
    """The programs of persistent `config` an SM holds at once, its shared memory from the config
    (persistent_shared_bytes, persistent_programs_per_sm)."""
    return persistent_programs_per_sm(config, persistent_shared_bytes(config, element_size, weight_grad, dst_size))


def resident_programs(config: KernelConfig, element_size: int, weight_grad: bool, dst_size: int | None = None) -> int:
    """programs_an_sm where that many fit the SM's shared memory together, else 0 (a ring too deep for them): what
    a deeper ring may be compared by."""
    shared = persistent_shared_bytes(config, element_size, weight_grad, dst_size)
    count = persistent_programs_per_sm(config, shared)
    return count if count * (shared + 1024) <= SM_SHARED_BYTES else 0


@contextlib.contextmanager
def programs_per_sm_at_most(programs: int):
    """Inside, persistent launches run at most `programs` programs an SM: bench.variants times the two-program
    form against one program an SM on the same tiles."""
    global _most_programs_per_sm
    saved, _most_programs_per_sm = _most_programs_per_sm, programs
    try:
        yield
    finally:
        _most_programs_per_sm = saved


if UNAVAILABLE is None:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

    _PRODUCER_REGS = gl.constexpr(PRODUCER_REGS)
    _GROUPED_PRODUCER_REGS = gl.constexpr(GROUPED_PRODUCER_REGS)
    _HALO_FRAMES = gl.constexpr(HALO_FRAMES)  # a halo tile's output frames (config.halo_d)
    # The TMA copies' names: async_copy_global_to_shared / async_copy_shared_to_global in 3.6, async_load /
    # async_store from 3.7 on.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.constexpr_function
    def _accumulator_layout(rows, cols, num_warps, instr_k):
        """The wgmma accumulator layout of a [rows, cols] tile on `num_warps` warps (instr_k: 256 // the operands'
        bits): every warp along M where the rows give each 16 (the tiles gluon_takes), else one warpgroup's 64 rows
        and the other warpgroups splitting the columns (a half tile's: half_tail)."""
        warps_m = num_warps if 16 * num_warps <= rows else 4
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[warps_m, num_warps // warps_m],
            instr_shape=[16, cols // (num_warps // warps_m), instr_k],
        )  # fmt: skip

    @gluon.constexpr_function
    def _tile_layout(layout, rows, cols):
        """`layout` (a full tile's accumulator layout) for a [rows, cols] accumulator on the same warps: itself where
        the shape is the full tile's, a half tile's otherwise (_accumulator_layout)."""
        num_warps = layout.warps_per_cta[0] * layout.warps_per_cta[1]
        return _accumulator_layout(rows, cols, num_warps, layout.instr_shape[2])

    @gluon.jit
    def _stage_barriers(STAGES: gl.constexpr):
        """One mbarrier per stage of the ring: "this stage's boxes landed" (or, for a warp-specialized producer,
        "this stage was read")."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        return ready

    @gluon.jit
    def _mma_one_in_flight(a, b, acc):
        """acc += a @ b by wgmma from shared memory, this group left in flight once the one before has finished:
        when this returns, the stage the previous step read may be refilled."""
        acc = warpgroup_mma(a, b, acc, is_async=True)
        acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
        return acc

    @gluon.jit
    def _stage_operands(a_ring, b_ring, index, W_KN: gl.constexpr, WEIGHT_GRAD: gl.constexpr,
                        SWAP_AB: gl.constexpr = False, HALF: gl.constexpr = False,
                        HALF_M: gl.constexpr = False):  # fmt: skip
        """Stage `index` as the wgmma's operands, views of the boxes in shared memory. Forward and input gradient: A
        [BLOCK_M, BLOCK_K] from the 5-D source box, B [BLOCK_K, BLOCK_N] from the weight box: as it landed where the box
        is [BLOCK_K, 1, BLOCK_N] (W_KN: the input gradient's, N-major), else used transposed (the forward's and the
        input gradient's over a transposed weight: K-major, as wgmma takes fp32). Weight gradient: A [BLOCK_M, BLOCK_K]
        the grad_out box read M-major (a transposed view), B [BLOCK_K, BLOCK_N] the input box as it landed, BLOCK_K =
        the box's voxels. SWAP_AB: the tile transposed, dst^T = B^T A^T. Forward and input gradient: A [BLOCK_N,
        BLOCK_K] the weight box (K-major, the input gradient's 16-bit one M-major), B [BLOCK_K, BLOCK_M] the source box
        read K-major. Weight gradient: A [BLOCK_N, BLOCK_K] the input boxes read M-major, B [BLOCK_K, BLOCK_M] the
        grad_out box as it landed (N-major). Both views of the same boxes, nothing moves. HALF: the first half of
        the columns only, a half tile's (half_tail): of the weight box (forward and input gradient) or of the input
        box (the weight gradient, one tap a tile, unswapped); HALF_M (the weight gradient's): of grad_out's rows."""
        if WEIGHT_GRAD:
            BLOCK_K: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
            a = a_ring.index(index).reshape([BLOCK_K, a_ring.type.shape[5]])
            if HALF_M:  # whole swizzle rows (half_tail), at offset 0
                a = a.slice(0, a_ring.type.shape[5] // 2, dim=1)
            a = a.permute((1, 0))
            b = b_ring.index(index).reshape([BLOCK_K, b_ring.type.shape[5]])
            if HALF:
                b = b.slice(0, b_ring.type.shape[5] // 2, dim=1)
        else:
            BLOCK_M: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
            BLOCK_K: gl.constexpr = a_ring.type.shape[5]
            a = a_ring.index(index).reshape([BLOCK_M, BLOCK_K])
            if W_KN:
                b = b_ring.index(index).reshape([BLOCK_K, b_ring.type.shape[3]])
                if HALF:  # whole swizzle rows (half_tail), at offset 0
                    b = b.slice(0, b_ring.type.shape[3] // 2, dim=1)
            else:
                b = b_ring.index(index).reshape([b_ring.type.shape[1], BLOCK_K])
                if HALF:
                    b = b.slice(0, b_ring.type.shape[1] // 2, dim=0)
                b = b.permute((1, 0))
        if SWAP_AB:
            a, b = b.permute((1, 0)), a.permute((1, 0))
        return a, b

    @gluon.jit
    def _consume_steps(a_ring, b_ring, ready, empty, it, steps, acc,
                       W_KN: gl.constexpr, WEIGHT_GRAD: gl.constexpr, SWAP_AB: gl.constexpr,
                       HALF: gl.constexpr = False, HALF_M: gl.constexpr = False):  # fmt: skip
        """A warp-specialized consumer's K loop over one tile: `steps` stages from ring position `it` on, each
        waited for, wgmma'd from shared memory with one group in flight and handed back to the producer (on
        `empty`) once the group after it has been issued. Returns the finished accumulator and the ring position."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        for step in range(steps):
            index = it % STAGES
            mbarrier.wait(ready.index(index), (it // STAGES) & 1)
            a, b = _stage_operands(a_ring, b_ring, index, W_KN, WEIGHT_GRAD, SWAP_AB, HALF, HALF_M)
            acc = _mma_one_in_flight(a, b, acc)
            # The previous step's group has finished: its stage may be refilled.
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=step > 0)
            it += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=steps > 0)  # the tile's last
        return acc, it

    @gluon.jit
    def _drain(acc, ready, STAGES: gl.constexpr):
        """The last wgmma's result, and the ring's barriers put away."""
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
        return acc

    @gluon.jit
    def _copy_source_box(views, coords, bar, buf, phase, pred, PHASES: gl.constexpr, frames,
                         PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr):  # fmt: skip
        """The source box at `coords` of phase view `phase` of the PHASES `views` into `buf` (views[0] where there
        is one): one copy issued per view, all but the phase's predicated off. Its frame coords[1] is one of the
        frames = (D_IN, P_FRAMES) along D, frames_before's first (views[4], HAS_PREFIX, one phase), bordered in
        PAD_MODE_D (conv_tma.source_frame)."""
        frame = padded_coord(coords[1], frames[0], PAD_MODE_D)
        n, row, col, c0 = coords[0], coords[2], coords[3], coords[4]
        if HAS_PREFIX:  # one phase (configs.tma_eligible)
            _tma_load(views[4], [n, frame, row, col, c0], bar, buf, pred & (frame < frames[1]))
            _tma_load(views[0], [n, frame - frames[1], row, col, c0], bar, buf, pred & (frame >= frames[1]))
        elif PHASES == 1:
            _tma_load(views[0], [n, frame, row, col, c0], bar, buf, pred)
        else:
            for p in gl.static_range(PHASES):
                _tma_load(phase_view(views, p), [n, frame, row, col, c0], bar, buf, pred & (phase == p))

    @gluon.jit
    def _load_live_taps(live_ptr, phase):
        """conv_tma.load_live_taps: phase `phase`'s (first, step, count) x (d, h, w) live taps."""
        row = live_ptr + phase * 9
        return (gl.load(row), gl.load(row + 1), gl.load(row + 2), gl.load(row + 3), gl.load(row + 4),
                gl.load(row + 5), gl.load(row + 6), gl.load(row + 7), gl.load(row + 8))  # fmt: skip

    @gluon.jit
    def _tile_work(
        n, d, split, BATCH, live_ptr, k_blocks, SPLIT_STEPS, live_d,
        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, INPUT_GRAD: gl.constexpr,
        LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """What a tile whose patch is at batch entry `n` (patch_origin's) and output frame d reduces: (batch entry,
        phase, the phase's live taps (a strided input gradient's; else 0), first K step, steps: those of split
        `split`). LIVE_D (live_d_eligible; live_d = (source frames, front padding, dilation) along D): only the
        steps of the taps along D that read inside the source (_live_kd), the others' boxes all zeros; a split
        outside them has none, and stores zeros."""
        n, phase = patch_phase(n, BATCH, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD)
        live = 0
        if INPUT_GRAD and STRIDE_D * STRIDE_H * STRIDE_W > 1:
            live = _load_live_taps(live_ptr, phase)
            total = live[2] * live[5] * live[8] * k_blocks
        else:
            total = KD * KH * KW * k_blocks
        first = split * SPLIT_STEPS
        if LIVE_D:
            kd_lo, kd_hi = _live_kd(d, live_d, KD, INPUT_GRAD)
            first = gl.maximum(first, kd_lo * KH * KW * k_blocks)
            end = gl.minimum(split * SPLIT_STEPS + SPLIT_STEPS, kd_hi * KH * KW * k_blocks)
            return n, phase, live, first, gl.maximum(end - first, 0)
        return n, phase, live, first, gl.minimum(first + SPLIT_STEPS, total) - first

    @gluon.jit
    def _live_kd(d, live_d, KD: gl.constexpr, INPUT_GRAD: gl.constexpr):
        """The taps along D that output frame d reads inside the source, a run [kd_lo, kd_hi) (empty where kd_hi <=
        kd_lo), at stride 1 along D: the forward's tap kd reads frame d - pad + kd * dil, the input gradient's
        (the taps flipped) grad_out's frame d + pad - kd * dil. live_d: (source frames, front padding, dilation).
        Every numerator is non-negative, so the divisions floor."""
        frames, pad, dil = live_d
        if INPUT_GRAD:
            kd_lo = gl.maximum(d + pad - frames + dil, 0) // dil  # d + pad - kd * dil <= frames - 1
            kd_hi = gl.minimum((d + pad + dil) // dil, KD)  # d + pad - kd * dil >= 0
        else:
            kd_lo = gl.maximum(pad - d + dil - 1, 0) // dil  # d - pad + kd * dil >= 0
            kd_hi = gl.minimum(gl.maximum(frames - 1 - d + pad + dil, 0) // dil, KD)  # ... <= frames - 1
        return kd_lo, gl.maximum(kd_hi, kd_lo)

    @gluon.jit
    def _issue_loads(
        src_views, w_desc, a_buf, b_ring, b_index, bar, k_tap, k_block, n, d, h0, w0, n0, phase, live,
        PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
        KH: gl.constexpr, KW: gl.constexpr, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        BLOCK_K: gl.constexpr, INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr, pred,
        frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr, HAS_AFTER: gl.constexpr,
        KD_BOXES: gl.constexpr = 1,
    ):  # fmt: skip
        """The K step (k_tap, k_block)'s (conv_tma.step_of's) boxes into one stage: the source box its tap reads
        (conv_tma.step_box; zeros where it leaves the volume, from the TMA unit) and the weight box of its (tap, channel
        block), into b_ring.index(b_index): [c0, tap, n0] of the weight as stored where W_KN (the input gradient's),
        else [n0, tap, c0] (the forward's; the input gradient's over the weight transposed to [Cin, taps, Cout]).
        HAS_AFTER (the forward at one phase; the input gradient at any): the channel blocks past the first source's
        frames[2] channels (x's; grad_out's) are channels_after's (src_views[4]), both copies issued, one predicated
        off, as conv_tma.channel_block counts them. KD_BOXES > 1 (a halo tile's, halo_eligible): k_tap is a (kh, kw)
        tap at kd 0, whose box spans the frames of every kd (the input gradient's from the frame kd = KD - 1 reads for
        the tile's first frame), and the weight boxes of its KD_BOXES taps along D land in
        b_ring.index(b_index + kd)."""
        tap, c0, src_d, view, row, col = step_box(
            k_tap, k_block, d, h0, w0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW,
            STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, BLOCK_K,
        )  # fmt: skip
        if INPUT_GRAD and KD_BOXES > 1:  # the taps flipped: kd 0 reads the box's last frames, its first kd's last
            src_d -= KD_BOXES - 1
        mbarrier.expect(bar, src_views[0].block_type.nbytes + KD_BOXES * w_desc.block_type.nbytes, pred=pred)
        c_w = c0
        if HAS_AFTER:  # the forward (one phase, one source along D: configs.tma_eligible) or the input gradient
            a_end = gl.cdiv(frames[2], BLOCK_K) * BLOCK_K  # the first source's channel blocks end
            second = (c0 >= a_end).to(gl.int32)
            c0 -= second * a_end  # in the block's source
            c_w = c0 + second * frames[2]  # in the weight
            frame = src_d if INPUT_GRAD else padded_coord(src_d, frames[0], PAD_MODE_D)
            _tma_load(src_views[4], [n, frame, row, col, c0], bar, a_buf, pred & (second == 1))
            _tma_load(src_views[0], [n, frame, row, col, c0], bar, a_buf, pred & (second == 0))
        elif INPUT_GRAD:  # one source view: grad_out
            _tma_load(src_views[0], [n, src_d, row, col, c0], bar, a_buf, pred)
        else:
            _copy_source_box(src_views, [n, src_d, row, col, c0], bar, a_buf, view, pred, STRIDE_H * STRIDE_W,
                             frames, PAD_MODE_D, HAS_PREFIX)  # fmt: skip
        for kd in gl.static_range(KD_BOXES):
            if W_KN:
                _tma_load(w_desc, [c_w, tap + kd * KH * KW, n0], bar, b_ring.index(b_index + kd), pred)
            else:
                _tma_load(w_desc, [n0, tap + kd * KH * KW, c_w], bar, b_ring.index(b_index + kd), pred)

    @gluon.jit
    def _pipelined_steps(
        src_views, w_desc, a_ring, b_ring, ready, first, steps, k_blocks, n, d, h0, w0, n0, phase, live,
        PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
        KH: gl.constexpr, KW: gl.constexpr, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        BLOCK_K: gl.constexpr, INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr, mma_layout: gl.constexpr,
        frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr, HAS_AFTER: gl.constexpr, SWAP_AB: gl.constexpr,
        HALF: gl.constexpr,
    ):  # fmt: skip
        """The K loop software-pipelined in the kernel's own warps: STAGES - 1 steps' boxes in flight, each step
        a wait, its wgmma (one group in flight), and the loads of the step STAGES - 1 ahead into the stage the
        finished group read. Returns the accumulator ([BLOCK_N, BLOCK_M] with SWAP_AB; BLOCK_N // 2 columns with
        HALF, the weight boxes' first half: half_tail), the ring's barriers put away."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BLOCK_M: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
        BLOCK_N: gl.constexpr = (b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]) // (2 if HALF else 1)
        # Each step's (tap, channel block) is divided out of its number here (step_of), not carried from the
        # step before as the warp-specialized producer and the weight gradient's loop do (next_step, next_patch):
        # carried, triton 3.6 lays this loop out so that ptxas serializes the forward's wgmmas (C7515: the
        # accumulator's zeros on a path into the drain; tests/test_hopper_main_loops.py would fail).
        for s in gl.static_range(STAGES - 1):  # the prologue: the first STAGES - 1 steps in flight
            k_tap, k_block = step_of(first + s, k_blocks)
            _issue_loads(
                src_views, w_desc, a_ring.index(s), b_ring, s, ready.index(s), k_tap, k_block,
                n, d, h0, w0, n0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW,
                STRIDE_D, STRIDE_H, STRIDE_W, BLOCK_K, INPUT_GRAD, W_KN, s < steps, frames, PAD_MODE_D, HAS_PREFIX,
                HAS_AFTER,
            )  # fmt: skip
        acc = gl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for step in range(steps):
            index = step % STAGES
            mbarrier.wait(ready.index(index), (step // STAGES) & 1)
            a, b = _stage_operands(a_ring, b_ring, index, W_KN, False, SWAP_AB, HALF)
            acc = _mma_one_in_flight(a, b, acc)  # the previous step's stage, STAGES - 1 steps ahead, is free
            ahead = step + STAGES - 1
            refill = ahead % STAGES
            k_tap, k_block = step_of(first + ahead, k_blocks)
            _issue_loads(
                src_views, w_desc, a_ring.index(refill), b_ring, refill, ready.index(refill), k_tap, k_block,
                n, d, h0, w0, n0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW,
                STRIDE_D, STRIDE_H, STRIDE_W, BLOCK_K, INPUT_GRAD, W_KN, ahead < steps, frames, PAD_MODE_D,
                HAS_PREFIX, HAS_AFTER,
            )  # fmt: skip
        return _drain(acc, ready, STAGES)

    @gluon.jit
    def _tile_origin(tile, C_COLS, ENTRIES, D_DST, H_DST, W_DST, BOX_H: gl.constexpr, BOX_W: gl.constexpr,
                     BLOCK_N: gl.constexpr, FRAMES: gl.constexpr = 1):  # fmt: skip
        """A persistent program's tile `tile` -> (batch entry, d, h0, w0, first column, split) over ENTRIES batch
        entries (a strided input gradient's count each phase's): the column blocks of one patch are neighbours
        (they read the same input boxes, from L2), then the patches, then the splits. A tile of FRAMES output frames
        (a halo tile's) starts at a multiple of FRAMES along D."""
        num_cols = gl.cdiv(C_COLS, BLOCK_N)
        d_tiles = gl.cdiv(D_DST, FRAMES)
        patches = ENTRIES * d_tiles * gl.cdiv(H_DST, BOX_H) * gl.cdiv(W_DST, BOX_W)
        rest = tile // num_cols
        n, d, h0, w0 = patch_origin(rest % patches, d_tiles, H_DST, W_DST, BOX_H, BOX_W)
        return n, d * FRAMES, h0, w0, (tile % num_cols) * BLOCK_N, rest // patches

    @gluon.jit
    def _persistent_tile(
        tile, C_COLS, ENTRIES, BATCH, D_DST, H_DST, W_DST, live_ptr, k_blocks, SPLIT_STEPS, live_d,
        BOX_H: gl.constexpr, BOX_W: gl.constexpr, BLOCK_N: gl.constexpr, KD: gl.constexpr, KH: gl.constexpr,
        KW: gl.constexpr, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        INPUT_GRAD: gl.constexpr, HALO: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """A persistent program's tile `tile`, as its producer and its consumers both walk it: (batch entry, d, h0,
        w0, first column, split, phase, live taps, first step, steps) (_tile_origin, _tile_work); a HALO tile two
        output frames, its steps the (kh, kw) taps', each step all KD taps along D."""
        n, d, h0, w0, n0, split = _tile_origin(
            tile, C_COLS, ENTRIES, D_DST, H_DST, W_DST, BOX_H, BOX_W, BLOCK_N, _HALO_FRAMES if HALO else 1
        )
        n, phase, live, first, steps = _tile_work(
            n, d, split, BATCH, live_ptr, k_blocks, SPLIT_STEPS, live_d, 1 if HALO else KD, KH, KW, STRIDE_D,
            STRIDE_H, STRIDE_W, INPUT_GRAD, LIVE_D and not HALO,
        )  # fmt: skip
        return n, d, h0, w0, n0, split, phase, live, first, steps

    @gluon.jit
    def _store_rows(acc, dst_ptr, entry, d, h0, w0, n0, H_DST, W_DST, C_COLS, dst_strides,
                    BOX_W: gl.constexpr, mma_layout: gl.constexpr, SWAP_AB: gl.constexpr):  # fmt: skip
        """A patch stored from registers, rows and columns past the volume's edges and the channels dropped: the
        forward's output where its rows are not whole 16-byte units (DST_PTR). dst_strides: (N, D, H, W). acc is
        [voxels, columns], or [columns, voxels] with SWAP_AB."""
        VOXEL_AXIS: gl.constexpr = 1 if SWAP_AB else 0
        BLOCK_M: gl.constexpr = acc.type.shape[VOXEL_AXIS]
        BLOCK_N: gl.constexpr = acc.type.shape[1 - VOXEL_AXIS]
        offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1 - VOXEL_AXIS, mma_layout))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(VOXEL_AXIS, mma_layout))
        h, w = h0 + offs_m // BOX_W, w0 + offs_m % BOX_W
        rows = (entry.to(gl.int64) * dst_strides[0] + d.to(gl.int64) * dst_strides[1]
                + h.to(gl.int64) * dst_strides[2] + w.to(gl.int64) * dst_strides[3])  # fmt: skip
        mask = (gl.expand_dims((h < H_DST) & (w < W_DST), 1 - VOXEL_AXIS)
                & gl.expand_dims(offs_n < C_COLS, VOXEL_AXIS))  # fmt: skip
        ptrs = dst_ptr + gl.expand_dims(rows, 1 - VOXEL_AXIS) + gl.expand_dims(offs_n, VOXEL_AXIS)
        gl.store(ptrs, acc.to(dst_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _store_tile(acc, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase, BATCH, C_COLS,
                    H_DST, W_DST, dst_strides,
                    STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
                    INPUT_GRAD: gl.constexpr, HAS_BIAS: gl.constexpr, DST_PTR: gl.constexpr, BOX_W: gl.constexpr,
                    mma_layout: gl.constexpr, SWAP_AB: gl.constexpr):  # fmt: skip
        """The epilogue of one tile: the bias (split 0's partial carries it), then a TMA store of the patch (to the
        phase's view of grad_in, conv_tma.dst_box, for a strided input gradient), which drops what lies past the
        volume's edges. The store is left in flight: wait before reusing c_smem. DST_PTR: dst_views[0] is the
        forward's output tensor, stored from registers (_store_rows); c_smem is not used. SWAP_AB: acc is the tile
        transposed, [columns, voxels], written into c_smem through a transposed view. A half tile's acc (half_tail)
        fills the first half of c_smem's columns; the store's other half lies past the tensor's last channel and is
        dropped with what lies past the volume's edges."""
        VOXEL_AXIS: gl.constexpr = 1 if SWAP_AB else 0
        BLOCK_M: gl.constexpr = acc.type.shape[VOXEL_AXIS]
        BLOCK_N: gl.constexpr = acc.type.shape[1 - VOXEL_AXIS]
        if HAS_BIAS:
            offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(VOXEL_AXIS, mma_layout))
            bias_cols = gl.where(split == 0, C_COLS, 0)
            bias = gl.load(bias_ptr + offs_n, mask=offs_n < bias_cols, other=0.0)
            acc = acc + gl.expand_dims(bias.to(gl.float32), VOXEL_AXIS)
        if DST_PTR:
            _store_rows(acc, dst_views[0], split * BATCH + n, d, h0, w0, n0, H_DST, W_DST, C_COLS, dst_strides,
                        BOX_W, mma_layout, SWAP_AB)  # fmt: skip
        else:
            BOX_N: gl.constexpr = c_smem.type.shape[4]
            tile = c_smem.reshape([BLOCK_M, BOX_N])
            if BLOCK_N < BOX_N:  # a half tile: whole swizzle rows at offset 0 (half_tail)
                tile = tile.slice(0, BLOCK_N, dim=1)
            if SWAP_AB:
                tile = tile.permute((1, 0))
            tile.store(acc.to(dst_views[0].dtype))
        if not DST_PTR:
            fence_async_shared()
            frame, view = dst_box(d, phase, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD)
            coords = [split * BATCH + n, frame, h0, w0, n0]
            if INPUT_GRAD and STRIDE_H * STRIDE_W > 1:
                for p in gl.static_range(STRIDE_H * STRIDE_W):
                    if view == p:
                        _tma_store(phase_view(dst_views, p), coords, c_smem)
            else:
                _tma_store(dst_views[0], coords, c_smem)

    @gluon.jit
    def _consume_tile(
        a_ring, b_ring, ready, empty, it, steps, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase,
        BATCH, C_COLS, H_DST, W_DST, dst_strides,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr, HAS_BIAS: gl.constexpr, DST_PTR: gl.constexpr,
        mma_layout: gl.constexpr, SWAP_AB: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """One tile of _mma_tiles from ring position `it`: its `steps` stages wgmma'd into an accumulator (BLOCK_N // 2
        columns with HALF: half_tail, in _tile_layout's layout), then its epilogue. Returns the ring position after
        it."""
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_M: gl.constexpr = a_ring.type.shape[3] * BOX_W
        BLOCK_N: gl.constexpr = (b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]) // (2 if HALF else 1)
        SHAPE: gl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
        layout: gl.constexpr = _tile_layout(mma_layout, SHAPE[0], SHAPE[1]) if HALF else mma_layout
        acc = gl.zeros(SHAPE, dtype=gl.float32, layout=layout)
        acc, it = _consume_steps(a_ring, b_ring, ready, empty, it, steps, acc, W_KN, False, SWAP_AB, HALF)
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        _store_tile(
            acc, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase, BATCH, C_COLS, H_DST, W_DST,
            dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HAS_BIAS, DST_PTR, BOX_W, layout, SWAP_AB,
        )  # fmt: skip
        return it

    @gluon.jit
    def _halo_step(a_ring, b_ring, index, acc0, acc1, INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr,
                   SWAP_AB: gl.constexpr):  # fmt: skip
        """One K step of a halo tile (_consume_halo_tile) from stage `index`: frame d's and frame d + 1's wgmma for
        each of the KD weight boxes, each reading its frame of the box (a BLOCK_M-row slice of its 2-D view), 2 x KD
        groups left in flight once the step before's have finished (the stage it read may then be refilled)."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BOX_D: gl.constexpr = a_ring.type.shape[2]
        BLOCK_M: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
        BLOCK_K: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]
        KD: gl.constexpr = b_ring.type.shape[0] // STAGES
        frames = a_ring.index(index).reshape([BOX_D * BLOCK_M, BLOCK_K])
        for kd in gl.static_range(KD):
            if W_KN:
                b = b_ring.index(index * KD + kd).reshape([BLOCK_K, BLOCK_N])
            else:
                b = b_ring.index(index * KD + kd).reshape([BLOCK_N, BLOCK_K]).permute((1, 0))
            # frame d reads box frame kd (the input gradient's KD - 1 - kd), frame d + 1 the next (the frame's row
            # inline: assigned to a name, it would be a tensor, and a slice takes a constant)
            a0 = frames.slice((KD - 1 - kd if INPUT_GRAD else kd) * BLOCK_M, BLOCK_M, dim=0)
            a1 = frames.slice((KD - kd if INPUT_GRAD else kd + 1) * BLOCK_M, BLOCK_M, dim=0)
            if SWAP_AB:  # dst^T = W^T x^T
                acc0 = warpgroup_mma(b.permute((1, 0)), a0.permute((1, 0)), acc0, is_async=True)
                acc1 = warpgroup_mma(b.permute((1, 0)), a1.permute((1, 0)), acc1, is_async=True)
            else:
                acc0 = warpgroup_mma(a0, b, acc0, is_async=True)
                acc1 = warpgroup_mma(a1, b, acc1, is_async=True)
        acc0, acc1, _ = warpgroup_mma_wait(num_outstanding=2 * KD, deps=(acc0, acc1, frames))
        return acc0, acc1

    @gluon.jit
    def _consume_halo_tile(
        a_ring, b_ring, ready, empty, it, steps, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split,
        BATCH, C_COLS, H_DST, W_DST, dst_strides, INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr,
        HAS_BIAS: gl.constexpr, mma_layout: gl.constexpr, SWAP_AB: gl.constexpr,
    ):  # fmt: skip
        """_consume_tile for a halo tile (halo_eligible: stride 1, KD taps along D, FRAMES = 2 output frames d and
        d + 1 of one patch). Each stage holds the box of the FRAMES + KD - 1 source frames the patch reads at one
        (kh, kw) tap and channel block, and the KD weight boxes of that (kh, kw) along D; output frame f and tap kd
        read the box's frame f + kd (the input gradient's, its taps flipped: f + KD - 1 - kd), a BLOCK_M-row slice of
        its 2-D view (a multiple of its own length: no descriptor offset). So 2 x KD wgmmas a step into two
        accumulators, the step before's all finished (its stage handed back) when this step's are issued; then each
        frame's epilogue, the second frame's dropped by the TMA store where it lies past D. The weight boxes as
        _stage_operands reads them (W_KN: the input gradient's 16-bit one, N-major); SWAP_AB, each frame's tile
        transposed as there (the weight box wgmma's A, the frame's slice its B: m64n128 at 128 voxels)."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BOX_D: gl.constexpr = a_ring.type.shape[2]
        BLOCK_M: gl.constexpr = a_ring.type.shape[3] * a_ring.type.shape[4]
        BLOCK_N: gl.constexpr = b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]
        KD: gl.constexpr = b_ring.type.shape[0] // STAGES
        gl.static_assert(BOX_D - KD + 1 == _HALO_FRAMES, "a halo tile's box: its frames' sources")
        SHAPE: gl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
        acc0 = gl.zeros(SHAPE, dtype=gl.float32, layout=mma_layout)
        acc1 = gl.zeros(SHAPE, dtype=gl.float32, layout=mma_layout)
        for step in range(steps):
            index = it % STAGES
            mbarrier.wait(ready.index(index), (it // STAGES) & 1)
            acc0, acc1 = _halo_step(a_ring, b_ring, index, acc0, acc1, INPUT_GRAD, W_KN, SWAP_AB)
            # The step before's groups have finished: its stage may be refilled.
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=step > 0)
            it += 1
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1, pred=steps > 0)  # the tile's last
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
        _store_tile(
            acc0, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, 0, BATCH, C_COLS, H_DST, W_DST, dst_strides,
            1, 1, 1, INPUT_GRAD, HAS_BIAS, False, BOX_W, mma_layout, SWAP_AB,
        )  # fmt: skip
        tma.store_wait(pendings=0)  # the first frame's store has read c_smem
        _store_tile(
            acc1, c_smem, dst_views, bias_ptr, n, d + 1, h0, w0, n0, split, 0, BATCH, C_COLS, H_DST, W_DST,
            dst_strides, 1, 1, 1, INPUT_GRAD, HAS_BIAS, False, BOX_W, mma_layout, SWAP_AB,
        )  # fmt: skip
        return it

    @gluon.jit
    def _pipelined_tile(
        src_views, w_desc, dst_views, bias_ptr, a_ring, b_ring, ready, frames, tile, sizes,
        KH: gl.constexpr, KW: gl.constexpr, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr,
        HAS_AFTER: gl.constexpr, HAS_BIAS: gl.constexpr, DST_PTR: gl.constexpr, SWAP_AB: gl.constexpr,
        mma_layout: gl.constexpr, HALF: gl.constexpr,
    ):  # fmt: skip
        """The one-tile-per-program kernel's tile: its K loop (_pipelined_steps) into an accumulator (half the columns
        with HALF: half_tail, in _tile_layout's layout), then the epilogue (_store_tile) and its store waited for, its
        buffer allocated after the loop, where it may reuse the ring's shared memory. tile: (n, d, h0, w0, n0, split,
        phase, live taps, first step, steps); sizes: (k_blocks, BATCH, C_COLS, H_DST, W_DST, dst_strides, front
        padding, dilation)."""
        BOX_H: gl.constexpr = a_ring.type.shape[3]
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_K: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]
        COLS: gl.constexpr = BLOCK_N // 2 if HALF else BLOCK_N  # the accumulator's
        SHAPE: gl.constexpr = (COLS, BOX_H * BOX_W) if SWAP_AB else (BOX_H * BOX_W, COLS)
        layout: gl.constexpr = _tile_layout(mma_layout, SHAPE[0], SHAPE[1]) if HALF else mma_layout
        n, d, h0, w0, n0, split, phase, live, first, steps = tile
        k_blocks, BATCH, C_COLS, H_DST, W_DST, dst_strides = sizes[0], sizes[1], sizes[2], sizes[3], sizes[4], sizes[5]
        acc = _pipelined_steps(
            src_views, w_desc, a_ring, b_ring, ready, first, steps, k_blocks, n, d, h0, w0, n0, phase, live,
            sizes[6], sizes[7], sizes[8], sizes[9], sizes[10], sizes[11], KH, KW, STRIDE_D, STRIDE_H, STRIDE_W,
            BLOCK_K, INPUT_GRAD, W_KN, layout, frames, PAD_MODE_D, HAS_PREFIX, HAS_AFTER, SWAP_AB, HALF,
        )  # fmt: skip
        if DST_PTR:
            c_smem = a_ring
        else:
            c_smem = gl.allocate_shared_memory(dst_views[0].dtype, [1, 1, BOX_H, BOX_W, BLOCK_N], dst_views[0].layout)
        _store_tile(
            acc, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split, phase, BATCH, C_COLS, H_DST, W_DST,
            dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HAS_BIAS, DST_PTR, BOX_W, layout, SWAP_AB,
        )  # fmt: skip
        tma.store_wait(pendings=0)

    @gluon.jit
    def _mma_tiles(
        a_ring, b_ring, ready, empty, c_smem, dst_views, bias_ptr, live_ptr, tiles, k_blocks,
        C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, dst_strides, live_d,
        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        INPUT_GRAD: gl.constexpr, W_KN: gl.constexpr, HAS_BIAS: gl.constexpr, DST_PTR: gl.constexpr,
        mma_layout: gl.constexpr, SWAP_AB: gl.constexpr, HALF_TAIL: gl.constexpr, HALO: gl.constexpr,
        LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialized kernel's default partition, persistent: for each of its tiles, wait for each
        step's stage, wgmma it from shared memory with one group in flight and hand the stage the previous group
        read back to the producer; then the tile's epilogue, its TMA store overlapping the next tile's loads.
        HALF_TAIL: the last column block's tiles, whose columns past the first half lie past C_COLS, compute that
        half only (half_tail). HALO: each tile two output frames, each step all KD taps along D
        (_consume_halo_tile)."""
        BOX_H: gl.constexpr = a_ring.type.shape[3]
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_N: gl.constexpr = b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]
        entries = BATCH * (STRIDE_D * STRIDE_H * STRIDE_W if INPUT_GRAD else 1)
        it = 0  # steps consumed over all this program's tiles: the ring's position and phase
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            n, d, h0, w0, n0, split, phase, _, _, steps = _persistent_tile(
                tile, C_COLS, entries, BATCH, D_DST, H_DST, W_DST, live_ptr, k_blocks, SPLIT_STEPS, live_d, BOX_H,
                BOX_W, BLOCK_N, KD, KH, KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HALO, LIVE_D,
            )  # fmt: skip
            if HALO:
                it = _consume_halo_tile(
                    a_ring, b_ring, ready, empty, it, steps, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split,
                    BATCH, C_COLS, H_DST, W_DST, dst_strides, INPUT_GRAD, W_KN, HAS_BIAS, mma_layout, SWAP_AB,
                )  # fmt: skip
            # (the test inline: assigned to a name, a constexpr False becomes a tensor, and the half branch compiles)
            elif (n0 + BLOCK_N // 2 >= C_COLS) if HALF_TAIL else False:
                it = _consume_tile(
                    a_ring, b_ring, ready, empty, it, steps, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split,
                    phase, BATCH, C_COLS, H_DST, W_DST, dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, W_KN,
                    HAS_BIAS, DST_PTR, mma_layout, SWAP_AB, True,
                )  # fmt: skip
            else:
                it = _consume_tile(
                    a_ring, b_ring, ready, empty, it, steps, c_smem, dst_views, bias_ptr, n, d, h0, w0, n0, split,
                    phase, BATCH, C_COLS, H_DST, W_DST, dst_strides, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, W_KN,
                    HAS_BIAS, DST_PTR, mma_layout, SWAP_AB, False,
                )  # fmt: skip
        tma.store_wait(pendings=0)

    @gluon.jit
    def _load_tiles(
        src_views, w_desc, a_ring, b_ring, ready, empty, live_ptr, tiles, k_blocks,
        C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, live_d,
        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, INPUT_GRAD: gl.constexpr,
        W_KN: gl.constexpr, frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr, HAS_AFTER: gl.constexpr,
        HALO: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialized kernel's producer, one warp, persistent over the same tiles as _mma_tiles: as soon
        as a stage is free (its `empty` barrier; all are free at first), load the next step's boxes into it,
        running up to STAGES steps ahead of the wgmma and on into the next tile during the epilogue. HALO: each
        step a (kh, kw) tap's box of the tile's input frames and its KD weight boxes along D."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BOX_H: gl.constexpr = a_ring.type.shape[3]
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_K: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[3] if W_KN else b_ring.type.shape[1]
        KD_BOXES: gl.constexpr = b_ring.type.shape[0] // STAGES  # weight boxes a stage (KD for a halo tile)
        entries = BATCH * (STRIDE_D * STRIDE_H * STRIDE_W if INPUT_GRAD else 1)
        it = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            n, d, h0, w0, n0, _, phase, live, first, steps = _persistent_tile(
                tile, C_COLS, entries, BATCH, D_DST, H_DST, W_DST, live_ptr, k_blocks, SPLIT_STEPS, live_d, BOX_H,
                BOX_W, BLOCK_N, KD, KH, KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, HALO, LIVE_D,
            )  # fmt: skip
            k_tap, k_block = step_of(first, k_blocks)  # the tile's first step, then carried (next_step)
            for _ in range(steps):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # a new barrier passes phase 1
                _issue_loads(
                    src_views, w_desc, a_ring.index(stage), b_ring, stage * KD_BOXES, ready.index(stage), k_tap,
                    k_block, n, d, h0, w0, n0, phase, live, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW,
                    STRIDE_D, STRIDE_H, STRIDE_W, BLOCK_K, INPUT_GRAD, W_KN, True, frames, PAD_MODE_D, HAS_PREFIX,
                    HAS_AFTER, KD_BOXES,
                )  # fmt: skip
                k_tap, k_block = next_step(k_tap, k_block, k_blocks)
                it += 1

    @gluon.jit
    def _conv3d_gluon_kernel(
        # TMA descriptors: src as [N, D, H, W, C_RED] (boxes [1, 1, BOX_H, BOX_W, BLOCK_K]), the weight as
        # [Cout, taps, Cin] (boxes [BLOCK_N, 1, BLOCK_K] forward, [BLOCK_K, 1, BLOCK_N] input gradient; with
        # W_TRANSPOSED, the input gradient's weight transposed to [Cin, taps, Cout], boxes [BLOCK_N, 1, BLOCK_K]:
        # K-major, as wgmma reads fp32 operands), dst as
        # [splits x N, D, H, W, C_COLS] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N]). At a stride in H or W the strided
        # operand (src forward, dst input gradient) comes as its phase views, in tap_box's order: src_desc or
        # dst_desc the first, view1..3 the others (None past the last). live_ptr: the input gradient's live-tap
        # table at a stride (config.live_taps), else None.
        # DST_PTR (a forward whose output rows are not whole 16-byte units, e.g. 3 channels): dst_desc is the
        # output tensor itself, its (N, D, H, W) strides stride_d*, stored from registers (_store_rows).
        # The forward's input along D: D_IN frames, the first P_FRAMES of them frames_before's (prefix_desc, with
        # HAS_PREFIX; stride 1 in H and W), bordered in PAD_MODE_D (conv_tma.source_frame). Along C (HAS_AFTER,
        # stride 1 in H and W): x's C_A channels, then channels_after's C_RED - C_A (prefix_desc).
        src_desc, w_desc, dst_desc, view1, view2, view3, prefix_desc, bias_ptr, live_ptr,
        C_RED, C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, SPLITS, stride_dn, stride_dd, stride_dh, stride_dw,
        D_IN, P_FRAMES, C_A, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, D_SRC,
        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        INPUT_GRAD: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr,
        DST_PTR: gl.constexpr, W_TRANSPOSED: gl.constexpr, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr,
        HAS_AFTER: gl.constexpr, SWAP_AB: gl.constexpr, HALF_TAIL: gl.constexpr, LIVE_D: gl.constexpr,
        num_warps: gl.constexpr,
    ):  # fmt: skip
        """dst[v, col] = sum over (tap, red) of src[v + shift(tap), red] * w[tap][red, col] for a BOX_H x BOX_W
        patch of dst voxels at one (n, d) and BLOCK_N columns: the GEMM view M = N*D*H*W voxels (patches of
        BLOCK_M = BOX_H * BOX_W), N = columns (Cout forward, Cin input gradient), K = taps x reduced channels.
        Each step's source box comes from conv_tma.step_box, as in the TMA kernel: the forward reads v * stride +
        tap * dil - pad (from the tap's phase view at a stride in H or W), the weight box used transposed; the
        input gradient convolves grad_out with the taps flipped, the weight box as it is, and at a stride a
        program's patch lies in one phase of grad_in (D_DST x H_DST x W_DST its largest), reduced over that
        phase's live taps and stored through its phase view. Split-K (grid axis 2; SPLITS of them): program s
        reduces steps [s * SPLIT_STEPS, (s + 1) * SPLIT_STEPS) into split s of an fp32 dst (batch entries s *
        BATCH on), the bias in split 0's. WARP_SPECIALIZE: persistent and warp-specialized, each program walking
        tiles (patch, column block, split) num_programs apart; one extra warp issues every TMA load (_load_tiles)
        while the kernel's warps only wait, wgmma and store (_mma_tiles), the stages handed back and forth by two
        mbarrier rings. The producer runs on into the next tile while the consumers store the last one. SWAP_AB:
        the wgmma computes each tile transposed (_stage_operands), BLOCK_N columns on the warps' 16-row atoms and
        the BLOCK_M voxels as its N; the loads, the ring and the tiles' order are the same. HALF_TAIL (half_tail):
        the last column block's tiles, where C_COLS leaves at most half of them, compute that half only, from the
        first half of each weight box (the boxes load as before), half the MMA work: a 192-channel layer's tiles of
        128 columns are 128 + 64, not 128 + 128. LIVE_D (live_d_eligible): a tile reduces only the taps along D
        that read inside the source's D_SRC frames (_live_kd): at a D border, the others read zeros."""
        BOX_D: gl.constexpr = src_desc.block_type.shape[1]  # 1, or a halo tile's input frames (halo_eligible)
        BOX_H: gl.constexpr = src_desc.block_type.shape[2]
        BOX_W: gl.constexpr = src_desc.block_type.shape[3]
        BLOCK_K: gl.constexpr = src_desc.block_type.shape[4]
        HALO: gl.constexpr = BOX_D > 1
        FRAMES: gl.constexpr = _HALO_FRAMES if HALO else 1  # output frames a tile
        KD_BOXES: gl.constexpr = KD if HALO else 1  # weight boxes a stage
        W_KN: gl.constexpr = INPUT_GRAD and not W_TRANSPOSED  # the weight box is [BLOCK_K, 1, BLOCK_N]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[2] if W_KN else w_desc.block_type.shape[0]
        dtype: gl.constexpr = src_desc.dtype
        # the forward's phase views, then frames_before or channels_after
        src_views = (src_desc, view1, view2, view3, prefix_desc)
        frames = (D_IN, P_FRAMES, C_A)
        dst_views = (dst_desc, view1, view2, view3)  # the input gradient's
        dst_strides = (stride_dn, stride_dd, stride_dh, stride_dw)
        live_d = (D_SRC, PAD_D, DIL_D)

        # The stage ring: STAGES source boxes, STAGES weight boxes, one barrier each ("this stage's boxes landed").
        a_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, BOX_D, BOX_H, BOX_W, BLOCK_K], src_desc.layout)
        W_ROWS: gl.constexpr = w_desc.block_type.shape[0]
        W_COLS: gl.constexpr = w_desc.block_type.shape[2]
        b_ring = gl.allocate_shared_memory(dtype, [STAGES * KD_BOXES, W_ROWS, 1, W_COLS], w_desc.layout)
        ready = _stage_barriers(STAGES)
        TILE: gl.constexpr = (BLOCK_N, BOX_H * BOX_W) if SWAP_AB else (BOX_H * BOX_W, BLOCK_N)  # the accumulator's
        mma_layout: gl.constexpr = _accumulator_layout(TILE[0], TILE[1], num_warps, 256 // dtype.primitive_bitwidth)
        # with HAS_AFTER: x's channel blocks, then channels_after's
        k_blocks = gl.cdiv(C_A, BLOCK_K) + gl.cdiv(C_RED - C_A, BLOCK_K) if HAS_AFTER else gl.cdiv(C_RED, BLOCK_K)

        if HALO:
            gl.static_assert(WARP_SPECIALIZE and not (HALF_TAIL or DST_PTR or HAS_PREFIX),
                             "a halo tile: warp-specialized, whole, stored by TMA")  # fmt: skip
            gl.static_assert(BOX_D == _HALO_FRAMES + KD - 1 and STRIDE_D * STRIDE_H * STRIDE_W == 1,
                             "a halo tile: its frames' sources in one box, stride 1")  # fmt: skip
        if WARP_SPECIALIZE:  # persistent: program_id(0) walks tiles num_programs(0) apart
            entries = BATCH * (STRIDE_D * STRIDE_H * STRIDE_W if INPUT_GRAD else 1)
            patches = entries * gl.cdiv(D_DST, FRAMES) * gl.cdiv(H_DST, BOX_H) * gl.cdiv(W_DST, BOX_W)
            tiles = patches * gl.cdiv(C_COLS, BLOCK_N) * SPLITS
            empty = _stage_barriers(STAGES)  # "this stage was read": the producer may refill it
            # The epilogue's buffer lives beside the ring: the next tile's loads land while the last one stores.
            # Stored from registers (DST_PTR), a tile needs none: the ring stands in, unused.
            if DST_PTR:
                c_smem = a_ring
            else:
                c_smem = gl.allocate_shared_memory(dst_desc.dtype, [1, 1, BOX_H, BOX_W, BLOCK_N], dst_desc.layout)
            gl.warp_specialize(
                [
                    (_mma_tiles, (a_ring, b_ring, ready, empty, c_smem, dst_views, bias_ptr, live_ptr, tiles,
                                  k_blocks, C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, dst_strides, live_d, KD,
                                  KH, KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, W_KN, HAS_BIAS, DST_PTR,
                                  mma_layout, SWAP_AB, HALF_TAIL, HALO, LIVE_D)),
                    (_load_tiles, (src_views, w_desc, a_ring, b_ring, ready, empty, live_ptr, tiles, k_blocks,
                                   C_COLS, BATCH, D_DST, H_DST, W_DST, SPLIT_STEPS, PAD_D, PAD_H, PAD_W,
                                   DIL_D, DIL_H, DIL_W, live_d, KD, KH, KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD,
                                   W_KN, frames, PAD_MODE_D, HAS_PREFIX, HAS_AFTER, HALO, LIVE_D)),
                ],
                [1],
                [_PRODUCER_REGS],
            )  # fmt: skip
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(empty.index(s))
                mbarrier.invalidate(ready.index(s))
        else:  # one tile per program: (patch, column block, split) = program_id(0, 1, 2)
            n, d, h0, w0 = patch_origin(gl.program_id(0), D_DST, H_DST, W_DST, BOX_H, BOX_W)
            n0 = gl.program_id(1) * BLOCK_N
            split = gl.program_id(2)
            n, phase, live, first, steps = _tile_work(
                n, d, split, BATCH, live_ptr, k_blocks, SPLIT_STEPS, live_d, KD, KH, KW, STRIDE_D, STRIDE_H, STRIDE_W,
                INPUT_GRAD, LIVE_D,
            )  # fmt: skip
            tile = (n, d, h0, w0, n0, split, phase, live, first, steps)
            sizes = (k_blocks, BATCH, C_COLS, H_DST, W_DST, dst_strides, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W)
            # the last column block's first half only (half_tail; the test inline as in _mma_tiles)
            if (n0 + BLOCK_N // 2 >= C_COLS) if HALF_TAIL else False:
                _pipelined_tile(src_views, w_desc, dst_views, bias_ptr, a_ring, b_ring, ready, frames, tile, sizes, KH,
                                KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, W_KN, PAD_MODE_D, HAS_PREFIX, HAS_AFTER,
                                HAS_BIAS, DST_PTR, SWAP_AB, mma_layout, True)  # fmt: skip
            else:
                _pipelined_tile(src_views, w_desc, dst_views, bias_ptr, a_ring, b_ring, ready, frames, tile, sizes, KH,
                                KW, STRIDE_D, STRIDE_H, STRIDE_W, INPUT_GRAD, W_KN, PAD_MODE_D, HAS_PREFIX, HAS_AFTER,
                                HAS_BIAS, DST_PTR, SWAP_AB, mma_layout, False)  # fmt: skip

    @gluon.jit
    def _issue_wgrad_loads(
        go_desc, x_views, a_buf, b_buf, bar, origin, co0, ci0, shifts,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr, PHASES: gl.constexpr,
        pred, frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr,
    ):  # fmt: skip
        """The boxes of the patch at `origin` (n, od, h0, w0: patch_origin's) into one stage: grad_out's patch (zeros
        past the output's edges, adding nothing) and, for each of the tile's taps (`shifts`: one (d, h, w) shift a tap),
        the input's box the tap reads for it (tap_box; zeros in the padding) from its phase view, one of the PHASES
        `x_views`, or from frames_before (x_views[4]; _copy_source_box), side by side along the stage's columns: one
        wgmma then spans the taps' columns. Every box is loaded (the barrier counts bytes known at compile time), a last
        group's taps past the kernel's too: their columns are never stored."""
        GROUP: gl.constexpr = len(shifts)
        BLOCK_CI: gl.constexpr = x_views[0].block_type.shape[4]
        n, od, h0, w0 = origin
        mbarrier.expect(bar, go_desc.block_type.nbytes + GROUP * x_views[0].block_type.nbytes, pred=pred)
        _tma_load(go_desc, [n, od, h0, w0, co0], bar, a_buf, pred)
        for j in gl.static_range(GROUP):
            shift_d, shift_h, shift_w = shifts[j]
            src_d, phase, row, col = tap_box(od, h0, w0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W)
            buf = b_buf if GROUP == 1 else b_buf.slice(j * BLOCK_CI, BLOCK_CI, dim=4)
            _copy_source_box(x_views, [n, src_d, row, col, ci0], bar, buf, phase, pred, PHASES, frames, PAD_MODE_D,
                             HAS_PREFIX)  # fmt: skip

    @gluon.jit
    def _group_shifts(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH: gl.constexpr, KW: gl.constexpr,
                      GROUP: gl.constexpr):  # fmt: skip
        """The (d, h, w) shifts of taps tap .. tap + GROUP - 1 (conv_tma.tap_shift), one tuple each (GROUP 1, 2 or
        4; those past the kernel's last tap are loaded and never stored)."""
        first = tap_shift(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
        if GROUP == 1:  # one return, each branch static: triton 3.6 holds every return to one type
            shifts = (first,)
        else:
            second = tap_shift(tap + 1, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
            if GROUP == 2:
                shifts = (first, second)
            else:
                third = tap_shift(tap + 2, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
                shifts = (first, second, third, tap_shift(tap + 3, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW))
        return shifts

    @gluon.jit
    def _wgrad_tile(tile, C_IN, C_OUT, BLOCK_M: gl.constexpr, BLOCK_CI: gl.constexpr, TAPS: gl.constexpr,
                    GROUP: gl.constexpr = 1):  # fmt: skip
        """Weight-gradient tile `tile` -> (first tap, first Cout row, first Cin column, split), each tile GROUP taps
        x BLOCK_CI input channels wide: tap groups innermost (neighbouring tiles read the same grad_out boxes and
        overlapping input boxes, from L2), then the Cout x Cin tiles, then the splits of the output patches."""
        groups: gl.constexpr = (TAPS + GROUP - 1) // GROUP
        num_n = gl.cdiv(C_IN, BLOCK_CI)
        tiles_mn = gl.cdiv(C_OUT, BLOCK_M) * num_n
        rest = tile // groups
        mn = rest % tiles_mn
        return (tile % groups) * GROUP, (mn // num_n) * BLOCK_M, (mn % num_n) * BLOCK_CI, rest // tiles_mn

    @gluon.jit
    def _wgrad_patches(
        tap, split, SPLIT_PATCHES, PATCHES, live_d, PER_FRAME, KH: gl.constexpr, KW: gl.constexpr,
        TAPS: gl.constexpr, GROUP: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """(first patch, patches, live frames) of a weight-gradient tile: its split's patches from `first` on (in
        patch_origin's order: batch entry, output frame, then the frame's PER_FRAME patches), and live frames =
        (d_lo, d_hi), the output frames of each batch entry a walk of them visits (_live_origin, _next_live_patch).
        LIVE_D (live_d_eligible's weight gradient): only the frames where some tap along D of the tile's taps (tap ..
        tap + GROUP - 1) reads inside the source, live_d = (source frames, output frames, front padding, dilation)
        at stride 1 along D: output frame od, tap kd read source frame od - pad + kd * dil; the patches are the
        split's in those frames of every batch entry it spans (_live_patches). Where the taps' runs of frames leave a
        gap (a dilation past the source's frames), the range spans it. Else every frame."""
        frames, out_frames, pad, dil = live_d
        first = split * SPLIT_PATCHES
        end = gl.minimum(first + SPLIT_PATCHES, PATCHES)
        if LIVE_D:
            kd_first = tap // (KH * KW)
            kd_last = gl.minimum(tap + GROUP - 1, TAPS - 1) // (KH * KW)
            d_lo = gl.maximum(pad - kd_last * dil, 0)  # od - pad + kd_last * dil >= 0
            d_hi = gl.maximum(gl.minimum(frames + pad - kd_first * dil, out_frames), d_lo)  # ... kd_first ... < frames
            steps = _live_patches(end, d_lo, d_hi, out_frames, PER_FRAME)
            steps -= _live_patches(first, d_lo, d_hi, out_frames, PER_FRAME)
            return first, steps, (d_lo, d_hi)
        return first, gl.maximum(end - first, 0), (0, out_frames)

    @gluon.jit
    def _live_patches(p, d_lo, d_hi, out_frames, PER_FRAME):
        """How many of the patches before patch p lie in output frames [d_lo, d_hi) of their batch entry."""
        entry = out_frames * PER_FRAME
        live = (d_hi - d_lo) * PER_FRAME
        n = p // entry
        return n * live + gl.minimum(gl.maximum(p - n * entry - d_lo * PER_FRAME, 0), live)

    @gluon.jit
    def _live_origin(first, live, D_OUT, H_OUT, W_OUT, BOX_H: gl.constexpr, BOX_W: gl.constexpr,
                     LIVE_D: gl.constexpr):  # fmt: skip
        """The origin (patch_origin's) of the first patch at or after patch `first` in the live frames `live` =
        (d_lo, d_hi) of its batch entry (LIVE_D), else of patch `first`."""
        n, d, h0, w0 = patch_origin(first, D_OUT, H_OUT, W_OUT, BOX_H, BOX_W)
        if LIVE_D:
            d_lo, d_hi = live
            after = (d >= d_hi).to(gl.int32)  # past the entry's live frames: the next entry's first
            moved = gl.maximum((d < d_lo).to(gl.int32), after)
            n += after
            d += moved * (d_lo - d)
            h0 *= 1 - moved
            w0 *= 1 - moved
        return n, d, h0, w0

    @gluon.jit
    def _next_live_patch(origin, live, H_OUT, W_OUT, BOX_H: gl.constexpr, BOX_W: gl.constexpr,
                         LIVE_D: gl.constexpr):  # fmt: skip
        """The patch after `origin` in the live frames `live` = (d_lo, d_hi) (LIVE_D): the next one, or past frame
        d_hi - 1 of a batch entry the first patch of frame d_lo of the next (next_patch's walk over d_hi frames,
        d_lo on); else next_patch's."""
        d_lo, d_hi = live
        n, d, h0, w0 = next_patch(*origin, d_hi, H_OUT, W_OUT, BOX_H, BOX_W)
        if LIVE_D:
            d = gl.maximum(d, d_lo)
        return n, d, h0, w0

    @gluon.jit
    def _downcast(acc, dtype: gl.constexpr):
        """acc (fp32) as `dtype`, two elements an instruction (cvt.rn.bf16x2.f32, cvt.rn.f16x2.f32). A store that
        cannot be vectorised (a channel count not a multiple of 8) lets LLVM split `acc.to(dtype)` into one cvt an
        element, and ptxas 13 (triton 3.9) then serializes the main loop's wgmmas (C7514) in the weight gradient at
        a stride; an asm statement keeps the pairs. Round to nearest even, as `.to` does."""
        if dtype == gl.bfloat16:
            return gl.inline_asm_elementwise(
                "cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [acc], dtype=gl.bfloat16, is_pure=True, pack=2
            )
        elif dtype == gl.float16:
            return gl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [acc], dtype=gl.float16, is_pure=True, pack=2
            )
        else:
            return acc.to(dtype)

    @gluon.jit
    def _store_wgrad_tile(acc, out_ptr, split, tap, co0, ci0, C_OUT, C_IN, stride_os, stride_oo, stride_ot, stride_oi,
                          mma_layout: gl.constexpr, TAPS: gl.constexpr, GROUP: gl.constexpr,
                          SWAP_AB: gl.constexpr = False):  # fmt: skip
        """One tile of out[split, Cout, tap, Cin], from registers (the rows and columns past the channels and the
        taps dropped): its columns GROUP taps from `tap` on, BLOCK_N / GROUP input channels each. SWAP_AB: acc is the
        tile transposed, [BLOCK_N, BLOCK_M]."""
        CO_AXIS: gl.constexpr = 1 if SWAP_AB else 0  # acc's axis along Cout; its other runs along the columns
        BLOCK_M: gl.constexpr = acc.type.shape[CO_AXIS]
        BLOCK_N: gl.constexpr = acc.type.shape[1 - CO_AXIS]
        BLOCK_CI: gl.constexpr = BLOCK_N // GROUP
        offs_m = co0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1 - CO_AXIS, mma_layout))
        columns = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(CO_AXIS, mma_layout))
        if GROUP == 1:
            offs_n = ci0 + columns
            column_offsets = tap * stride_ot + offs_n * stride_oi
            column_mask = offs_n < C_IN
        else:
            offs_n = ci0 + columns % BLOCK_CI
            taps = tap + columns // BLOCK_CI
            column_offsets = taps * stride_ot + offs_n * stride_oi
            column_mask = (offs_n < C_IN) & (taps < TAPS)
        out_ptrs = (out_ptr + split * stride_os + gl.expand_dims(offs_m, 1 - CO_AXIS) * stride_oo
                    + gl.expand_dims(column_offsets, CO_AXIS))  # fmt: skip
        mask = gl.expand_dims(offs_m < C_OUT, 1 - CO_AXIS) & gl.expand_dims(column_mask, CO_AXIS)
        gl.store(out_ptrs, _downcast(acc, out_ptr.dtype.element_ty), mask=mask)

    @gluon.jit
    def _wgrad_steps(
        go_desc, x_views, a_ring, b_ring, ready, first, steps, live, D_OUT, H_OUT, W_OUT, co0, ci0,
        shift_d, shift_h, shift_w, STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        mma_layout: gl.constexpr, frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """The weight gradient's K loop over output patches (_wgrad_patches' `steps` from `first`, in the live
        frames `live` with LIVE_D), software-pipelined as the forward's, reading the input from one view, x_views[0]
        (or frames_before, x_views[4]). Returns the accumulator, the ring's barriers put away."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BOX_H: gl.constexpr = a_ring.type.shape[3]
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_M: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[5]
        origin = _live_origin(first, live, D_OUT, H_OUT, W_OUT, BOX_H, BOX_W, LIVE_D)  # the next patch to load
        for s in gl.static_range(STAGES - 1):
            _issue_wgrad_loads(
                go_desc, x_views, a_ring.index(s), b_ring.index(s), ready.index(s), origin, co0, ci0,
                ((shift_d, shift_h, shift_w),), STRIDE_D, STRIDE_H, STRIDE_W, 1, s < steps, frames, PAD_MODE_D,
                HAS_PREFIX,
            )  # fmt: skip
            origin = _next_live_patch(origin, live, H_OUT, W_OUT, BOX_H, BOX_W, LIVE_D)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
        for step in range(steps):
            index = step % STAGES
            mbarrier.wait(ready.index(index), (step // STAGES) & 1)
            a, b = _stage_operands(a_ring, b_ring, index, False, True)
            acc = _mma_one_in_flight(a, b, acc)
            ahead = step + STAGES - 1
            refill = ahead % STAGES
            _issue_wgrad_loads(
                go_desc, x_views, a_ring.index(refill), b_ring.index(refill), ready.index(refill), origin, co0, ci0,
                ((shift_d, shift_h, shift_w),), STRIDE_D, STRIDE_H, STRIDE_W, 1, ahead < steps, frames, PAD_MODE_D,
                HAS_PREFIX,
            )  # fmt: skip
            origin = _next_live_patch(origin, live, H_OUT, W_OUT, BOX_H, BOX_W, LIVE_D)
        return _drain(acc, ready, STAGES)

    @gluon.jit
    def _consume_wgrad_tile(
        a_ring, b_ring, ready, empty, it, steps, work, TAPS: gl.constexpr, GROUP: gl.constexpr,
        mma_layout: gl.constexpr, SWAP_AB: gl.constexpr, HALF_M: gl.constexpr, HALF_N: gl.constexpr,
    ):  # fmt: skip
        """One tile of _wgrad_mma_tiles from ring position `it`: its `steps` patches wgmma'd into an accumulator (half
        its rows with HALF_M, half its columns with HALF_N: half_tail, in _tile_layout's layout), then stored (work:
        the store's (out_ptr, split, tap, co0, ci0, C_OUT, C_IN, out's four strides)). Returns the ring position after
        it."""
        BLOCK_M: gl.constexpr = a_ring.type.shape[5] // (2 if HALF_M else 1)
        BLOCK_N: gl.constexpr = b_ring.type.shape[5] // (2 if HALF_N else 1)
        SHAPE: gl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)
        layout: gl.constexpr = _tile_layout(mma_layout, SHAPE[0], SHAPE[1]) if HALF_M or HALF_N else mma_layout
        acc = gl.zeros(SHAPE, dtype=gl.float32, layout=layout)
        acc, it = _consume_steps(a_ring, b_ring, ready, empty, it, steps, acc, False, True, SWAP_AB, HALF_N, HALF_M)
        out_ptr, split, tap, co0, ci0, C_OUT, C_IN, stride_os, stride_oo, stride_ot, stride_oi = work
        _store_wgrad_tile(
            acc, out_ptr, split, tap, co0, ci0, C_OUT, C_IN, stride_os, stride_oo, stride_ot, stride_oi,
            layout, TAPS, GROUP, SWAP_AB,
        )  # fmt: skip
        return it

    @gluon.jit
    def _wgrad_mma_tiles(
        a_ring, b_ring, ready, empty, out_ptr, tiles, PATCHES, SPLIT_PATCHES, C_IN, C_OUT,
        stride_os, stride_oo, stride_ot, stride_oi, live_d, PER_FRAME, KH: gl.constexpr, KW: gl.constexpr,
        TAPS: gl.constexpr, GROUP: gl.constexpr, mma_layout: gl.constexpr,
        SWAP_AB: gl.constexpr, HALF_M_TAIL: gl.constexpr, HALF_N_TAIL: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialized weight gradient's default partition, persistent: each tile's patches consumed
        from the ring as the producer fills it, then the tile stored from registers while the producer loads the
        next tile's first patches. HALF_M_TAIL, HALF_N_TAIL (one tap a tile, unswapped): the last Cout (Cin) block's
        tiles, at most half of whose rows (columns) are channels, compute that half only (half_tail)."""
        BLOCK_M: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[5]
        it = 0  # patches consumed over all this program's tiles: the ring's position and phase
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            tap, co0, ci0, split = _wgrad_tile(tile, C_IN, C_OUT, BLOCK_M, BLOCK_N // GROUP, TAPS, GROUP)
            _, steps, _ = _wgrad_patches(
                tap, split, SPLIT_PATCHES, PATCHES, live_d, PER_FRAME, KH, KW, TAPS, GROUP, LIVE_D
            )  # fmt: skip
            work = (out_ptr, split, tap, co0, ci0, C_OUT, C_IN, stride_os, stride_oo, stride_ot, stride_oi)
            # (the tests inline: assigned to a name, a constexpr False becomes a tensor and its branch compiles)
            if (co0 + BLOCK_M // 2 >= C_OUT) if HALF_M_TAIL else False:
                if (ci0 + BLOCK_N // 2 >= C_IN) if HALF_N_TAIL else False:
                    it = _consume_wgrad_tile(a_ring, b_ring, ready, empty, it, steps, work, TAPS, GROUP,
                                             mma_layout, SWAP_AB, True, True)  # fmt: skip
                else:
                    it = _consume_wgrad_tile(a_ring, b_ring, ready, empty, it, steps, work, TAPS, GROUP,
                                             mma_layout, SWAP_AB, True, False)  # fmt: skip
            elif (ci0 + BLOCK_N // 2 >= C_IN) if HALF_N_TAIL else False:
                it = _consume_wgrad_tile(a_ring, b_ring, ready, empty, it, steps, work, TAPS, GROUP,
                                         mma_layout, SWAP_AB, False, True)  # fmt: skip
            else:
                it = _consume_wgrad_tile(a_ring, b_ring, ready, empty, it, steps, work, TAPS, GROUP,
                                         mma_layout, SWAP_AB, False, False)  # fmt: skip

    @gluon.jit
    def _wgrad_load_tiles(
        go_desc, x_views, a_ring, b_ring, ready, empty, tiles, PATCHES, SPLIT_PATCHES, C_IN, C_OUT,
        D_OUT, H_OUT, W_OUT, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, live_d, PER_FRAME,
        KH: gl.constexpr, KW: gl.constexpr, TAPS: gl.constexpr, GROUP: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        frames, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr, LIVE_D: gl.constexpr,
    ):  # fmt: skip
        """The warp-specialized weight gradient's producer, one warp, over the same tiles as _wgrad_mma_tiles: each
        free stage gets the next patch's grad_out box and its input boxes, one a tap of the tile's group (each from
        its tap's phase view: the copies from the others are predicated off, which costs a one-warp partition
        nothing)."""
        STAGES: gl.constexpr = a_ring.type.shape[0]
        BOX_H: gl.constexpr = a_ring.type.shape[3]
        BOX_W: gl.constexpr = a_ring.type.shape[4]
        BLOCK_M: gl.constexpr = a_ring.type.shape[5]
        BLOCK_N: gl.constexpr = b_ring.type.shape[5]
        it = 0
        for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
            tap, co0, ci0, split = _wgrad_tile(tile, C_IN, C_OUT, BLOCK_M, BLOCK_N // GROUP, TAPS, GROUP)
            shifts = _group_shifts(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW, GROUP)
            first, steps, live = _wgrad_patches(
                tap, split, SPLIT_PATCHES, PATCHES, live_d, PER_FRAME, KH, KW, TAPS, GROUP, LIVE_D
            )  # fmt: skip
            origin = _live_origin(first, live, D_OUT, H_OUT, W_OUT, BOX_H, BOX_W, LIVE_D)  # then carried
            for _ in range(steps):
                stage = it % STAGES
                mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # a new barrier passes phase 1
                _issue_wgrad_loads(
                    go_desc, x_views, a_ring.index(stage), b_ring.index(stage), ready.index(stage), origin, co0, ci0,
                    shifts, STRIDE_D, STRIDE_H, STRIDE_W, STRIDE_H * STRIDE_W, True, frames, PAD_MODE_D, HAS_PREFIX,
                )  # fmt: skip
                origin = _next_live_patch(origin, live, H_OUT, W_OUT, BOX_H, BOX_W, LIVE_D)
                it += 1

    @gluon.jit
    def _conv3d_wgrad_gluon_kernel(
        # TMA descriptors: grad_out as [N, Do, Ho, Wo, Cout] (boxes [1, 1, BOX_H, BOX_W, BLOCK_M]), x as
        # [N, D, H, W, Cin] (boxes [1, 1, BOX_H, BOX_W, BLOCK_N]; at a stride in H or W, x_desc and x_phase1..3
        # are its phase views, in tap_box's order, None past the last); out is [split, Cout, tap, Cin]. Along D the
        # input is D_IN frames, the first P_FRAMES of them frames_before's (prefix_desc, with HAS_PREFIX: stride 1
        # in H and W), bordered in PAD_MODE_D (conv_tma.source_frame).
        go_desc, x_desc, x_phase1, x_phase2, x_phase3, prefix_desc, out_ptr,
        C_IN, C_OUT, D_OUT, H_OUT, W_OUT, PATCHES, SPLIT_PATCHES,
        stride_os, stride_oo, stride_ot, stride_oi,
        D_IN, P_FRAMES, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W,
        KD: gl.constexpr, KH: gl.constexpr, KW: gl.constexpr,
        STRIDE_D: gl.constexpr, STRIDE_H: gl.constexpr, STRIDE_W: gl.constexpr,
        STAGES: gl.constexpr, WARP_SPECIALIZE: gl.constexpr, PAD_MODE_D: gl.constexpr, HAS_PREFIX: gl.constexpr,
        TAP_GROUP: gl.constexpr, SWAP_AB: gl.constexpr, HALF_M_TAIL: gl.constexpr, HALF_N_TAIL: gl.constexpr,
        LIVE_D: gl.constexpr, num_warps: gl.constexpr,
    ):  # fmt: skip
        """gw[co, tap, ci] = sum over output voxels v of go[v, co] * x[v * stride + tap * dil - pad, ci]: the
        GEMM view M = Cout, N = Cin, K = output voxels, one tap per tile, K split over the output patches
        (BLOCK_K = BOX_H * BOX_W voxels at one (n, od)) between the splits. The grad_out box is A read M-major (a
        transposed view), the input box B as it lands; the ring and the wait are the forward's. One tile per
        program (program_id(0) the tap and Cout x Cin tile, program_id(1) the split), or with WARP_SPECIALIZE
        persistent and warp-specialized as the forward: a one-warp producer (_wgrad_load_tiles) and the kernel's
        warps (_wgrad_mma_tiles) walking the tiles num_programs apart. At a stride in H or W a tile's tap reads
        one phase view throughout: the software-pipelined loop is compiled once per view and the program runs its
        own (copies from several views into one stage would put a CTA barrier between every two). TAP_GROUP (2 or
        4, warp-specialized only): a tile is that many taps' Cin blocks side by side, one grad_out box and TAP_GROUP
        input boxes a stage, so that one wgmma spans them (m64n256 from 2 x 128 input channels) and reads the
        grad_out box once for all of them. SWAP_AB (warp-specialized only): the tile transposed, gw^T = x^T go, the
        taps' input channels along the wgmma's M and Cout along its N: a layer of few output channels (32: half of
        the 64 rows a wgmma takes unswapped) fills its rows with 2-4 taps of 32-64 input channels (a tap's box a
        slice of the buffer as wide as its swizzle rows, so 32 16-bit channels do). HALF_M_TAIL, HALF_N_TAIL
        (warp-specialized, one tap a tile, unswapped; half_tail): the last Cout or Cin block's tiles, at most half
        full, compute their first half only (192 channels: 128 + 64 rows and columns, not 128 + 128). LIVE_D
        (live_d_eligible): a tile reduces only the output frames its taps along D read inside the source at
        (_wgrad_patches): the others' input boxes are all padding."""
        BOX_H: gl.constexpr = go_desc.block_type.shape[2]
        BOX_W: gl.constexpr = go_desc.block_type.shape[3]
        BLOCK_M: gl.constexpr = go_desc.block_type.shape[4]
        BLOCK_N: gl.constexpr = TAP_GROUP * x_desc.block_type.shape[4]  # the tile's columns: TAP_GROUP Cin blocks
        dtype: gl.constexpr = go_desc.dtype
        TAPS: gl.constexpr = KD * KH * KW
        PHASES: gl.constexpr = STRIDE_H * STRIDE_W
        x_views = (x_desc, x_phase1, x_phase2, x_phase3, prefix_desc)
        frames = (D_IN, P_FRAMES)
        live_d = (D_IN, D_OUT, PAD_D, DIL_D)
        per_frame = gl.cdiv(H_OUT, BOX_H) * gl.cdiv(W_OUT, BOX_W)  # patches an output frame (of one batch entry)

        a_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BOX_H, BOX_W, BLOCK_M], go_desc.layout)
        if TAP_GROUP == 1:
            b_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BOX_H, BOX_W, BLOCK_N], x_desc.layout)
        else:  # the taps' boxes land in column slices of one buffer, swizzled as each box is (whole swizzle rows)
            b_layout: gl.constexpr = gl.NVMMASharedLayout(
                swizzle_byte_width=x_desc.layout.swizzle_byte_width, element_bitwidth=dtype.primitive_bitwidth, rank=5
            )
            b_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BOX_H, BOX_W, BLOCK_N], b_layout)
        ready = _stage_barriers(STAGES)
        TILE: gl.constexpr = (BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N)  # the accumulator's
        mma_layout: gl.constexpr = _accumulator_layout(TILE[0], TILE[1], num_warps, 256 // dtype.primitive_bitwidth)
        if WARP_SPECIALIZE:
            groups: gl.constexpr = (TAPS + TAP_GROUP - 1) // TAP_GROUP
            ci_blocks = gl.cdiv(C_IN, x_desc.block_type.shape[4])
            tiles = groups * gl.cdiv(C_OUT, BLOCK_M) * ci_blocks * gl.cdiv(PATCHES, SPLIT_PATCHES)
            empty = _stage_barriers(STAGES)
            gl.warp_specialize(
                [
                    (_wgrad_mma_tiles, (a_ring, b_ring, ready, empty, out_ptr, tiles, PATCHES, SPLIT_PATCHES,
                                        C_IN, C_OUT, stride_os, stride_oo, stride_ot, stride_oi, live_d, per_frame,
                                        KH, KW, TAPS, TAP_GROUP, mma_layout, SWAP_AB, HALF_M_TAIL, HALF_N_TAIL,
                                        LIVE_D)),
                    (_wgrad_load_tiles, (go_desc, x_views, a_ring, b_ring, ready, empty, tiles, PATCHES,
                                         SPLIT_PATCHES, C_IN, C_OUT, D_OUT, H_OUT, W_OUT, PAD_D, PAD_H, PAD_W,
                                         DIL_D, DIL_H, DIL_W, live_d, per_frame, KH, KW, TAPS, TAP_GROUP, STRIDE_D,
                                         STRIDE_H, STRIDE_W, frames, PAD_MODE_D, HAS_PREFIX, LIVE_D)),
                ],
                [1],
                [_GROUPED_PRODUCER_REGS if TAP_GROUP == 4 else _PRODUCER_REGS],
            )  # fmt: skip
            for s in gl.static_range(STAGES):
                mbarrier.invalidate(empty.index(s))
                mbarrier.invalidate(ready.index(s))
        else:  # one tap a tile (TAP_GROUP 1: the launcher refuses more here)
            tile = gl.program_id(0) + gl.program_id(1) * gl.num_programs(0)
            tap, co0, ci0, split = _wgrad_tile(tile, C_IN, C_OUT, BLOCK_M, BLOCK_N, TAPS)
            shift_d, shift_h, shift_w = tap_shift(tap, PAD_D, PAD_H, PAD_W, DIL_D, DIL_H, DIL_W, KH, KW)
            first, steps, live = _wgrad_patches(
                tap, split, SPLIT_PATCHES, PATCHES, live_d, per_frame, KH, KW, TAPS, 1, LIVE_D
            )  # fmt: skip
            if PHASES == 1:
                acc = _wgrad_steps(
                    go_desc, x_views, a_ring, b_ring, ready, first, steps, live, D_OUT, H_OUT, W_OUT, co0, ci0,
                    shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W, mma_layout, frames, PAD_MODE_D, HAS_PREFIX,
                    LIVE_D,
                )  # fmt: skip
            else:
                phase = tap_box(0, 0, 0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H, STRIDE_W)[1]
                acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma_layout)
                for p in gl.static_range(PHASES):
                    if phase == p:
                        acc = _wgrad_steps(
                            go_desc, (phase_view(x_views, p), None, None, None, None), a_ring, b_ring, ready, first,
                            steps, live, D_OUT, H_OUT, W_OUT, co0, ci0, shift_d, shift_h, shift_w, STRIDE_D, STRIDE_H,
                            STRIDE_W, mma_layout, frames, PAD_MODE_D, False, LIVE_D,
                        )  # fmt: skip
            _store_wgrad_tile(
                acc, out_ptr, split, tap, co0, ci0, C_OUT, C_IN, stride_os, stride_oo, stride_ot, stride_oi,
                mma_layout, TAPS, 1,
            )  # fmt: skip


def _gluon_descriptor(t: torch.Tensor, shape: list, strides: list, block: list):
    """A Gluon TMA descriptor: the box lands in shared memory with the widest swizzle its rows allow, the layout
    wgmma reads operands in (a 2-D view of a 5-D box keeps it: the swizzle acts on the channel rows)."""
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return GluonDescriptor(t, shape, strides, block, layout)


# SMs of the GPU a persistent grid is sized for where the launch has no CUDA device (compiling on meta tensors):
# an H100 SXM's.
DEFAULT_MULTIPROCESSORS = 132


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return DEFAULT_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _persistent_launch(
    grid: tuple, config: KernelConfig, device, element_size: int, weight_grad: bool, dst_size: int | None = None
) -> tuple[tuple, dict]:
    """(grid, launch options) of a launch with `grid`'s tiles. Warp-specialized (gluon = 2): persistent, the
    programs an SM holds at once (persistent_programs_per_sm) on every SM, and a maxnreg that lets that many fit:
    without one the compiler assumes 256 a thread, more than an SM holds for 8 warps plus the producer's
    warpgroup. Else the grid as it is, no options."""
    if config.gluon != 2:
        return grid, {}
    programs = programs_an_sm(config, element_size, weight_grad, dst_size)
    persistent = (min(math.prod(grid), programs * _multiprocessors(device)),)
    return persistent, {"maxnreg": specialized_max_registers(config.num_warps, programs)}


def live_d_eligible(geom: ConvGeometry, config: KernelConfig, input_grad: bool) -> bool:
    """Whether a launch skips the (frame, tap along D) pairs that read only zeros (LIVE_D): padding along D read as
    zeros (no frames_before, whose frames are the front padding's), stride 1 along D (and in every dimension for
    the input gradient, whose strided launches walk phases of live taps instead), no halo tile (its steps hold
    every tap along D). A forward or input-gradient tile at a D border then skips up to a third of its steps at 3
    taps, a weight-gradient tile of the first or last tap along D a frame of patches of each batch entry: a video
    VAE's latent of 5-7 frames has 9.5-13% of its (frame, tap) pairs in the padding."""
    strides_one = geom.stride[0] == 1 and (not input_grad or geom.stride == (1, 1, 1))
    padded = geom.padding[0] > 0 or geom.padding[1] > 0
    return (
        padded and strides_one and geom.dim_modes[0] == "zeros" and not geom.prefix_frames and not config.halo_d
    )  # fmt: skip


def conv3d_gluon(
    src, weight, bias, dst, geom: ConvGeometry, config: KernelConfig, input_grad: bool, split_steps: int,
    frames_before=None, channels_after=None,
) -> None:  # fmt: skip
    """Run the Gluon kernel: the forward (src = x, dst = y) or the input gradient (src = grad_out, dst = grad_in), at
    strides of at most MAX_PHASES phase views, or with dst holding several splits (split_k.ndhwc_partials) their fp32
    partial sums of `split_steps` K steps each. src is 16-bit, or fp32 (read as TF32; wgmma's fp32 operands must be
    K-major, so the input gradient reads a copy of the weight transposed to [Cin, taps, Cout]); both tensors have
    unit-stride channels and TMA-aligned strides; dst is written whole. frames_before (along D) or channels_after
    (along C) is the forward's second source, at stride 1 in H and W; channels_after the input gradient's too (after
    grad_out's channels), at any stride. The tuning layer (tconv3d/tune/) offers this
    variant only where UNAVAILABLE is None."""
    transposed = input_grad and src.dtype == torch.float32  # wgmma's fp32 (TF32) operands are K-major only
    descriptors, live, grid, (reduced, columns), volume, stride = patch_descriptors(
        src, weight, dst, geom, config, input_grad, _gluon_descriptor, weight_transposed=transposed,
        frames_before=frames_before, channels_after=channels_after,
    )  # fmt: skip
    splits = grid[2]
    grid, options = _persistent_launch(grid, config, dst.device, src.element_size(), False, dst.element_size())
    dst_ptr = descriptors[2] is dst
    launch(
        _conv3d_gluon_kernel, grid,
        *descriptors, bias if bias is not None else dst, live,
        reduced, columns, src.shape[0], *volume, split_steps, splits, *dst_row_strides(dst, dst_ptr),
        *source_frames(geom, input_grad), first_channels(geom, input_grad), *geom.front_padding, *geom.dilation,
        geom.out_size[0] if input_grad else geom.in_size[0], *geom.kernel, *stride,
        INPUT_GRAD=input_grad, HAS_BIAS=bias is not None, STAGES=config.num_stages,
        WARP_SPECIALIZE=config.gluon == 2, DST_PTR=dst_ptr, W_TRANSPOSED=transposed,
        PAD_MODE_D=0 if input_grad else geom.pad_mode_indices[0], HAS_PREFIX=frames_before is not None,
        HAS_AFTER=channels_after is not None, SWAP_AB=bool(config.swap_ab),
        HALF_TAIL=half_tail(config, columns, src.element_size()), LIVE_D=live_d_eligible(geom, config, input_grad),
        num_warps=config.num_warps, **options,
    )  # fmt: skip


def conv3d_wgrad_gluon(
    grad_out, x, out, geom: ConvGeometry, config: KernelConfig, patches: int, patches_per_split: int,
    frames_before=None,
) -> None:  # fmt: skip
    """The Gluon weight gradient into `out` ([splits, Cout, taps, Cin]), over the TMA weight gradient's patches
    and splits (conv_tma.wgrad_tma_patches), persistent and warp-specialized where config.gluon is 2: both
    tensors 16-bit, unit-stride channels, TMA-aligned strides."""
    if config.swap_ab and config.gluon != 2:
        raise ValueError(f"the Gluon weight gradient swaps its operands (swap_ab) warp-specialized only: {config}")
    if not grouped_taps_fit(config):
        raise ValueError(
            f"grouped taps (tap_group) need the warp-specialized kernel and {GROUPED_TAP_COLUMNS}+ input channels "
            f"a tap (a tap's slice of the swizzled buffer holds whole swizzle rows): {config}"
        )
    group = max(config.tap_group, 1)
    box_h, box_w = config.tma_box(config.block_k)
    ci_block = config.block_n // group  # each tap's input channels in a tile
    go_desc = ndhwc_descriptor(grad_out, (1, 1, box_h, box_w, config.block_m), _gluon_descriptor)
    x_views = phase_descriptors(x, geom.stride, (1, 1, box_h, box_w, ci_block), _gluon_descriptor)
    prefix = prefix_descriptor(frames_before, (1, 1, box_h, box_w, ci_block), _gluon_descriptor)
    c_out, c_in = geom.out_channels, geom.in_channels
    halves = wgrad_half_tails(config, c_out, c_in, grad_out.element_size())
    grid = (cdiv(c_out, config.block_m) * cdiv(c_in, ci_block) * cdiv(geom.taps, group), out.shape[0])
    grid, options = _persistent_launch(grid, config, out.device, grad_out.element_size(), True)
    launch(
        _conv3d_wgrad_gluon_kernel, grid,
        go_desc, *x_views, prefix, out,
        c_in, c_out, *geom.out_size, patches, patches_per_split,
        *out.stride(),
        *source_frames(geom), *geom.front_padding, *geom.dilation,
        *geom.kernel, *geom.stride,
        STAGES=config.num_stages, WARP_SPECIALIZE=config.gluon == 2, PAD_MODE_D=geom.pad_mode_indices[0],
        HAS_PREFIX=prefix is not None, TAP_GROUP=group, SWAP_AB=bool(config.swap_ab),
        HALF_M_TAIL=halves[0], HALF_N_TAIL=halves[1], LIVE_D=live_d_eligible(geom, config, False),
        num_warps=config.num_warps, **options,
    )  # fmt: skip
