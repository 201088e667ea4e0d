"""The choice of tiling for every launch: `pick_config`, and `launch`, which asks it and runs a launcher.

Order of choice for a CUDA launch: the exact key in this GPU's tuning table, else (with TCONV3D_AUTOTUNE=1) a
tuning run on first use, else the table's nearest key if it is near, else the heuristic. Choices are memoised
per problem, so after the first call a lookup is one dict probe. No launcher holds a tile literal and none
chooses its own: this module sits above the kernels (configs and tables below them, the tuner beside it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import configs, settings, tables, tune
from .configs import DIRECTIONS, KernelConfig, default_config, heuristic_config, nearest_key, tuning_key
from .geometry import ConvGeometry


def choose(
    direction: str, geom: ConvGeometry, dtype: torch.dtype, device_name: str, sm_count: int
) -> tuple[KernelConfig, str]:
    """The config a GPU model would use for a problem from its tables alone, and where it came from: "table",
    "nearest" or "heuristic". python -m tconv3d.inspect asks this for GPUs that are not there."""
    key = tuning_key(direction, geom, dtype)
    table = tables.named_table(device_name)
    if key in table:
        return table[key], "table"
    near = nearest_key(key, table)
    if near is not None:
        return table[near], "nearest"
    return heuristic_config(direction, geom, dtype, sm_count), "heuristic"


_memo: dict = {}


def _select(direction, geom, dtype, device, run) -> KernelConfig:
    if device.type != "cuda":
        return default_config(direction, geom, dtype, device)
    key = tuning_key(direction, geom, dtype)
    if run is not None and settings.AUTOTUNE and key not in tables.device_table(device):
        return tune.tune_on_first_use(key, direction, geom, dtype, device, run)
    name = torch.cuda.get_device_name(device)
    return choose(direction, geom, dtype, name, configs.multiprocessor_count(device))[0]


def pick_config(
    direction: str,
    geom: ConvGeometry,
    dtype: torch.dtype,
    device: torch.device,
    run: Callable[[KernelConfig], object] | None = None,
) -> KernelConfig:
    """The tiling for one launch. `run(config)` launches the caller's kernel with a config: it lets
    TCONV3D_AUTOTUNE=1 tune a key no table holds on its first use. Memoised per problem."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")
    memo_key = (direction, geom, dtype, device)
    config = _memo.get(memo_key)
    if config is None:
        config = _memo[memo_key] = _select(direction, geom, dtype, device, run)
    return config


def launch(direction: str, launcher, geom: ConvGeometry, *tensors: torch.Tensor | None) -> torch.Tensor:
    """launcher(*tensors, geom, config) with the config chosen for `direction` on the first tensor's device."""
    first = tensors[0]
    run = lambda config: launcher(*tensors, geom, config)  # noqa: E731  (first-use tuning launches it too)
    return run(pick_config(direction, geom, first.dtype, first.device, run=run))
