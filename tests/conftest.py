"""Test set-up: on a machine without CUDA, run the Triton kernels through Triton's interpreter.

TRITON_INTERPRET must be set before tconv3d (and so its @triton.jit kernels) is imported. On a GPU the tests
run the compiled kernels on CUDA tensors.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest

import tconv3d  # noqa: F401  (registers torch.ops.tconv3d)
from tconv3d.kernels.config import KernelConfig
from tconv3d.tune import choice, configs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _seed_and_precision():
    """A fixed seed per test, and exact fp32 matmuls in both tconv3d and the reference, unless a test opts in."""
    torch.manual_seed(0)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def device():
    return DEVICE


SMALL_TILES = KernelConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2, group_m=2, split_k=3)


@pytest.fixture
def small_tiles(monkeypatch):
    """Force 16x16x16 tiles so that problems span many tiles along every axis (and wgrad several splits)."""
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", lambda *args: SMALL_TILES)


@pytest.fixture
def gpu_heuristic_tiles(monkeypatch):
    """Run with the tiles the heuristic picks for an H100 (132 SMs), so the interpreter checks the masks and
    split-K ranges of the configs GPUs will actually launch."""
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(
        choice,
        "_select",
        lambda direction, geom, dtype, device, run: configs.heuristic_config(direction, geom, dtype, 132),
    )
