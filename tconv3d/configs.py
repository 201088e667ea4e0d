"""Tilings for the three kernels: the config type and the one function launchers ask for a config.

Every launch gets its BLOCK sizes, num_warps, num_stages, program-order group and split-K factor from
`pick_config`; no launcher holds a tile literal. For now the choice is a heuristic; tuned tables replace it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from .geometry import ConvGeometry

DIRECTIONS = ("fwd", "dgrad", "wgrad")

# tl.dot needs every tile dimension to be at least 16.
MIN_TILE = 16
# Elements per program of the elementwise pass that adds weight-gradient split-K partials.
SPLIT_SUM_BLOCK = 1024


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    split_k: int = 1


@dataclass(frozen=True)
class GemmView:
    """The implicit GEMM a direction computes: rows x cols, reduced over `taps` x `reduce_channels`
    (or, for wgrad, over `rows` output voxels)."""

    rows: int
    cols: int
    reduce_channels: int


def gemm_view(direction: str, geom: ConvGeometry) -> GemmView:
    if direction == "fwd":
        return GemmView(geom.output_voxels, geom.out_channels, geom.in_channels)
    if direction == "dgrad":
        return GemmView(geom.input_voxels, geom.in_channels, geom.out_channels)
    if direction == "wgrad":
        # rows: Cout, cols: Cin (per tap), reduction over every output voxel.
        return GemmView(geom.out_channels, geom.in_channels, geom.output_voxels)
    raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, triton.next_power_of_2(max(int(n), 1))))


@functools.lru_cache(maxsize=64)
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def heuristic_config(direction: str, geom: ConvGeometry, dtype: torch.dtype, sm_count: int) -> KernelConfig:
    """A sound default: 128-wide output tiles where the problem fills them, 64-deep reductions (32 for fp32 to
    keep the pipeline's shared memory in bounds), 8 warps for 128x128 tiles."""
    view = gemm_view(direction, geom)
    k_cap = 32 if dtype == torch.float32 else 64
    stages = 2 if dtype == torch.float32 else 3
    if direction == "wgrad":
        block_m = _pow2_clamp(view.rows, MIN_TILE, 128)
        block_n = _pow2_clamp(view.cols, MIN_TILE, 128)
        block_k = k_cap
        tiles = triton.cdiv(view.rows, block_m) * triton.cdiv(view.cols, block_n) * geom.taps
        k_iters = triton.cdiv(view.reduce_channels, block_k)
        # Enough programs to fill the device twice over, but every split keeps at least 8 reduction steps.
        split_k = max(1, min(triton.cdiv(2 * sm_count, tiles), k_iters // 8))
    else:
        block_m = 128 if view.rows >= 128 * sm_count else 64
        block_n = _pow2_clamp(view.cols, MIN_TILE, 128)
        block_k = _pow2_clamp(view.reduce_channels, MIN_TILE, k_cap)
        split_k = 1
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    return KernelConfig(block_m, block_n, block_k, num_warps, stages, group_m=8, split_k=split_k)


def interpreter_config(direction: str, geom: ConvGeometry) -> KernelConfig:
    """The Triton interpreter runs programs one by one, paying per operation rather than per element: few,
    large tiles are fastest there. Two wgrad splits keep the split-K reduction exercised."""
    view = gemm_view(direction, geom)
    if direction == "wgrad":
        block_m = _pow2_clamp(view.rows, MIN_TILE, 64)
        block_n = _pow2_clamp(view.cols, MIN_TILE, 64)
        block_k = _pow2_clamp(triton.cdiv(view.reduce_channels, 2), MIN_TILE, 1024)
        return KernelConfig(block_m, block_n, block_k, num_warps=4, num_stages=1, split_k=2)
    block_m = _pow2_clamp(view.rows, MIN_TILE, 512)
    block_n = _pow2_clamp(view.cols, MIN_TILE, 64)
    block_k = _pow2_clamp(view.reduce_channels, MIN_TILE, 64)
    return KernelConfig(block_m, block_n, block_k, num_warps=4, num_stages=1)


@functools.lru_cache(maxsize=4096)
def _cached_config(direction, geom, dtype, device) -> KernelConfig:
    if device.type != "cuda":
        return interpreter_config(direction, geom)
    return heuristic_config(direction, geom, dtype, multiprocessor_count(device))


def pick_config(direction: str, geom: ConvGeometry, dtype: torch.dtype, device: torch.device) -> KernelConfig:
    """The tiling for one launch. Memoised: a lookup costs a dict probe, not a search."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    return _cached_config(direction, geom, dtype, device)
