"""The choice of kernel variant and tiling for every launch: `pick_config`, `launch`, which asks it and runs a
launcher, and `explain`, which says what would run.

Order of choice for a CUDA launch: the exact key in this GPU's tuning table, else (with TCONV3D_AUTOTUNE=1) a tuning
run on first use, else the table's nearest key if it is near, else the heuristic, which on sm_90+ takes the TMA
variant for an eligible problem (configs.tma_eligible); the Gluon kernel runs where a table or TCONV3D_KERNELS=gluon
asks for it on sm_90. TCONV3D_KERNELS then forces a variant where eligible, and a launch whose tensors TMA cannot
describe (unaligned, odd strides) runs the pointer variant on its tiles as far as that takes them
(config.pointer_tiles). Choices are memoised per problem, so after the first call a lookup is one dict probe. No
launcher holds a tile literal and none chooses its own: this module sits above the kernels (configs and tables below
them, the tuner beside it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .. import settings
from ..geometry import ConvGeometry, check_conv3d
from ..kernels import conv_gluon, grouped
from ..kernels.config import (
    DIRECTIONS,
    KernelConfig,
    gathered_tiles,
    off_gluon,
    pointer_form,
    pointer_tiles,
    reads_channels_after,
)
from ..kernels.utils import RiskyTensorMap, address_aligned, exact_products, tma_aligned
from . import configs, tables, tuner
from .configs import (
    NEAR_FILL_RATIO,
    default_config,
    fit_destination,
    gluon_eligible,
    gluon_takes,
    halo_eligible,
    heuristic_config,
    mma_fill,
    nearest_key,
    tma_eligible,
    tuning_key,
    with_gluon,
    with_tma,
)


def choose(
    direction: str,
    geom: ConvGeometry,
    dtype: torch.dtype,
    device_name: str,
    sm_count: int,
    capability: int = 90,
    timed_only: bool = False,
) -> tuple[KernelConfig, str]:
    """The config a GPU model would use for a problem from its tables alone, and where it came from: "table",
    "nearest" or "heuristic". An entry (its key's, or the nearest key's) from a tuning that never searched the
    box kernel the heuristic would run (TMA or Gluon) gives way to the heuristic: the box kernels were timed
    faster than the pointer kernels where the heuristic chooses them (configs.heuristic_config), and the H100
    table of 2026-11-22 was tuned before they existed. python -m tconv3d.inspect asks this for GPUs that are not
    there. `timed_only`: with the heuristic's timed rules alone (configs.heuristic_config), the choice before its
    untimed ones (bench.variants' timed_only row). The config's ring fits the launch's epilogue tile
    (configs.fit_destination)."""
    config, source = _chosen(direction, geom, dtype, device_name, sm_count, capability, timed_only)
    return fit_destination(direction, geom, dtype, config), source


def _chosen(direction, geom, dtype, device_name, sm_count, capability, timed_only) -> tuple[KernelConfig, str]:
    key = tuning_key(direction, geom, dtype)
    table = tables.named_table(device_name)
    found = key if key in table else nearest_key(key, table)
    heuristic = heuristic_config(direction, geom, dtype, sm_count, capability, timed_only)
    if found is None:
        return heuristic, "heuristic"
    searched = tables.searched_variants(device_name).get(found)
    if searched is not None and heuristic.variant in ("tma", "gluon") and heuristic.variant not in searched:
        return heuristic, "heuristic"
    if found != key and _wastes_more(direction, geom, dtype, table[found], heuristic):
        return heuristic, "heuristic"
    return table[found], "table" if found == key else "nearest"


def _wastes_more(direction, geom, dtype, lent: KernelConfig, heuristic: KernelConfig) -> bool:
    """Whether a nearest key's entry `lent` fills the problem's MMA work less than NEAR_FILL_RATIO of what the
    heuristic's config does (configs.mma_fill): tiles sized for another layer's channels."""
    size = dtype.itemsize
    ours, theirs = mma_fill(direction, geom, lent, size), mma_fill(direction, geom, heuristic, size)
    return ours is not None and theirs is not None and ours < NEAR_FILL_RATIO * theirs


def force_variant(
    direction, geom, dtype, config: KernelConfig, kernels: str = "auto", gluon_runs: bool = False
) -> KernelConfig:
    """A variant setting (TCONV3D_KERNELS) applied to `config`: pointer never runs TMA; tma runs the TMA kernel
    wherever the problem is eligible; gluon runs the Gluon kernel where it can (`gluon_runs`: an sm_90 device
    and a Triton that has it; configs.gluon_eligible for the problem), else TMA where eligible. Whatever the
    setting, a config is never left asking for a variant the problem or the device cannot run, nor a ring its
    epilogue tile leaves no room for (configs.fit_destination)."""
    return fit_destination(direction, geom, dtype, _forced(direction, geom, dtype, config, kernels, gluon_runs))


def _forced(direction, geom, dtype, config: KernelConfig, kernels: str, gluon_runs: bool) -> KernelConfig:
    if kernels == "pointer" or not tma_eligible(direction, geom, dtype):
        if not config.tma_box_w:
            return config
        # the box tiles on the pointer kernel, within what its gathers hold where channels are not 16-divisible
        return gathered_tiles(direction, geom, dataclasses.replace(off_gluon(config), tma_box_w=0), dtype.itemsize)
    gluon_ok = gluon_runs and gluon_eligible(direction, geom, dtype)
    if kernels == "gluon" and gluon_ok and not (config.gluon and gluon_takes(config)):
        return with_gluon(config if gluon_takes(config) else heuristic_gluon_tiles(off_gluon(config)), geom, direction)
    if config.gluon and (kernels == "tma" or not gluon_ok):
        config = off_gluon(config)
    if kernels in ("tma", "gluon") and not config.tma_box_w:
        return with_tma(config, geom, direction)
    if config.halo_d and not halo_eligible(direction, geom, config, dtype.itemsize):  # a nearest key's, lent
        return dataclasses.replace(config, halo_d=0)
    return config


def heuristic_gluon_tiles(config: KernelConfig) -> KernelConfig:
    """Tiles the Gluon kernel takes from ones it does not: rows enough for every warp's wgmma atoms, at most 256
    columns, a ring of three."""
    warps = min(config.num_warps, 8)
    rows = max(config.block_m, 16 * warps)
    return dataclasses.replace(
        config, block_m=rows, block_n=min(config.block_n, 256), num_warps=warps, num_stages=max(config.num_stages, 3)
    )


def _gluon_runs(device: torch.device) -> bool:
    """Whether `device` runs the Gluon kernel: a CUDA sm_90 device, compiled kernels (not the interpreter), a
    Triton the kernel is written for."""
    return (
        device.type == "cuda"
        and not settings.INTERPRET
        and conv_gluon.UNAVAILABLE is None
        and configs.compute_capability(device) == configs.GLUON_CAPABILITY
    )


_memo: dict = {}


def _memo_key(direction: str, geom: ConvGeometry, dtype: torch.dtype, device: torch.device) -> tuple:
    """A problem's key in the memo. fp32 problems carry whether TF32 is allowed (settings.tf32_allowed, read at
    every launch as cuDNN reads it): the Gluon kernel takes fp32 only as TF32 (configs.gluon_eligible), so the
    choice may differ with it."""
    if dtype == torch.float32:
        return direction, geom, dtype, device, settings.tf32_allowed()
    return direction, geom, dtype, device


def _select_with_source(direction, geom, dtype, device, run) -> tuple[KernelConfig, str]:
    if device.type != "cuda":
        config, source = default_config(direction, geom, dtype, device), "interpreter"
    else:
        key = tuning_key(direction, geom, dtype)
        if run is not None and settings.AUTOTUNE and key not in tables.device_table(device):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"tconv3d: no tuned config for {key}, and TCONV3D_AUTOTUNE=1 would time candidates for it now, "
                    "inside a CUDA-graph capture, where nothing can be timed. Run one eager step before capturing "
                    "(torch.compile's mode='reduce-overhead' included), or tune ahead with python -m tconv3d.tune."
                )
            config, source = tuner.tune_on_first_use(key, direction, geom, dtype, device, run), "first-use tuning"
        else:
            name = torch.cuda.get_device_name(device)
            sm_count, capability = configs.multiprocessor_count(device), configs.compute_capability(device)
            config, source = choose(direction, geom, dtype, name, sm_count, capability)
    return force_variant(direction, geom, dtype, config, settings.KERNELS, _gluon_runs(device)), source


def _select(direction, geom, dtype, device, run) -> KernelConfig:
    return _select_with_source(direction, geom, dtype, device, run)[0]


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
    memo_key = _memo_key(direction, geom, dtype, device)
    config = _memo.get(memo_key)
    if config is None:
        config = _memo[memo_key] = _select(direction, geom, dtype, device, run)
    return config


def _tma_describable(
    direction: str, first: torch.Tensor, second: torch.Tensor, *rest: torch.Tensor | None, channels_after=None
) -> bool:
    """Whether TMA descriptors can cover a launch's operands (input and weight; grad_output and weight;
    grad_output and input; and the forward's and weight gradient's frames_before, the last of `rest`, and
    channels_after). An activation whose channels are not unit-stride is copied to channels_last_3d by the launcher
    first, and then is aligned; a weight is described from its shape once channels_last_3d, so only its base
    address matters."""

    def activation_ok(t: torch.Tensor | None) -> bool:
        return t is None or t.stride(1) != 1 or tma_aligned(t)

    # the input gradient's channels_after follows grad_output's channels; its rest is empty
    prefix_ok = (direction == "dgrad" or not rest or activation_ok(rest[-1])) and activation_ok(channels_after)
    if direction == "wgrad":
        return activation_ok(first) and activation_ok(second) and prefix_ok
    return activation_ok(first) and (second.stride(1) != 1 or address_aligned(second)) and prefix_ok


def launch_config(
    direction: str, geom: ConvGeometry, *tensors: torch.Tensor | None, run=None, channels_after=None
) -> KernelConfig:
    """The config `launch` runs for these tensors: pick_config's, on the pointer kernel where TMA cannot describe
    the tensors."""
    first = tensors[0]
    config = pick_config(direction, geom, first.dtype, first.device, run=run)
    if config.tma_box_w and not _tma_describable(direction, *tensors, channels_after=channels_after):
        config = pointer_tiles(config, direction, geom, first.element_size())
    return config


def launch(
    direction: str, launcher, geom: ConvGeometry, *tensors: torch.Tensor | None, channels_after=None, bias=None
) -> torch.Tensor:
    """launcher(*tensors, geom, config) (and channels_after= and bias=, where given: the input gradient's) with the
    config chosen for `direction` on the first tensor's device. Under TCONV3D_TMA_MAPS=strict, a TMA or Gluon
    config with a tensor map CCCL would refuse runs (and from then on is) the pointer kernels on its tiles
    (config.pointer_tiles); a tensor map the driver refuses is an error that says so. A grouped problem of few
    channels a group runs as block-diagonal groups of more (kernels/grouped.py): its launches, configs and tuning
    keys are the coarse problem's."""
    coarse = grouped.coarsened(geom)
    if coarse is geom:
        return _launch(direction, launcher, geom, *tensors, channels_after=channels_after, bias=bias)
    return grouped.on_coarse(
        geom, coarse,
        lambda *t, **diagonal: _launch(
            direction, launcher, coarse, *t, channels_after=channels_after, bias=bias, **diagonal
        ),
        *tensors,
    )  # fmt: skip


def _launch(
    direction: str, launcher, geom: ConvGeometry, *tensors, channels_after=None, bias=None, diagonal: int = 1
) -> torch.Tensor:
    """`launch` of a problem as its kernels run it (no groups left to coarsen; `diagonal` > 1: the weight is that of
    groups `diagonal` times as many, grouped.on_coarse)."""
    extra = {}
    if channels_after is not None:
        extra["channels_after"] = channels_after
    if diagonal > 1:
        extra["diagonal"] = diagonal
    if bias is not None:
        extra["bias"] = bias
    run = lambda config: launcher(*tensors, geom, config, **extra)  # noqa: E731  (first-use tuning launches it too)
    config = launch_config(direction, geom, *tensors, run=run, channels_after=channels_after)
    try:
        return run(config)
    except RiskyTensorMap:  # raised while the launcher built its descriptors: nothing has run
        pointer = pointer_tiles(config, direction, geom, tensors[0].element_size())
        _memo[_memo_key(direction, geom, tensors[0].dtype, tensors[0].device)] = pointer
        return run(pointer)
    except RuntimeError as error:
        if config.tma_box_w and "tensor map descriptor" in str(error):
            raise RuntimeError(
                f"tconv3d: the driver refused a TMA tensor map of the {config.variant} {direction} launch ({config}); "
                "utils.tensor_map_problems names what cuda.h and CCCL ask of one, tests/gpu/tma_probe.py tries "
                "the maps in doubt on this GPU, TCONV3D_TMA_MAPS=strict runs launches with such maps on the "
                "pointer kernels, TCONV3D_KERNELS=pointer all of them"
            ) from error
        raise


def inductor_refusal(direction: str, geom: ConvGeometry, *tensors: torch.Tensor | None) -> str | None:
    """Why a launch cannot be handed to Inductor as Triton kernels in its graph (ops.py, TCONV3D_INDUCTOR_KERNELS),
    or None. Such a launch stays one opaque op call in the compiled graph, as every launch does without the
    setting. Chooses as `launch` would, without tuning."""
    if settings.INTERPRET:
        return "the interpreter runs the kernels itself; Inductor cannot"
    if geom.prefix_frames or geom.after_channels or geom.out_after_channels:
        return (
            "frames_before or channels_after: the kernels reach the second source by its distance in memory from "
            "the input"
        )
    first = tensors[0]
    if (
        first.device.type == "cuda"
        and settings.AUTOTUNE
        and _memo_key(direction, geom, first.dtype, first.device) not in _memo
        and tuning_key(direction, geom, first.dtype) not in tables.device_table(first.device)
    ):
        return "TCONV3D_AUTOTUNE=1 and no tuned config yet: the op tunes it on its first call"
    config = launch_config(direction, grouped.coarsened(geom), *tensors)
    if config.gluon:
        return "the Gluon kernels: Inductor recompiles a kernel from its source with triton.jit"
    if config.tma_box_w:
        return "TMA descriptors: torch.library.wrap_triton keeps them as constants, blind to the kernel's writes"
    return None


def decision_state() -> tuple:
    """What the choices of this module depend on besides each launch's own arguments: the settings that steer
    them and the tuning tables they read (each file's path, size and modification time: first-use tuning writes
    to one). A compiled graph whose launches were handed to Inductor (ops.py, TCONV3D_INDUCTOR_KERNELS) holds
    choices made under one such state, and its cache keys include it (ops.keep_choices_in_cache_keys)."""
    files = []
    for directory in tables.table_dirs():
        for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
            stat = path.stat()
            files.append((str(path), stat.st_size, stat.st_mtime_ns))
    steering = (
        settings.KERNELS,
        settings.AUTOTUNE,
        settings.TMA_MAPS,
        settings.INTERPRET,
        settings.CPU_BACKEND,
        settings.CUDA_BACKEND,
    )
    return (*steering, settings.tf32_allowed(), tuple(files))


def explain(
    input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, padding_mode="zeros", channels_after=None,
    frames_before=None,
) -> dict:  # fmt: skip
    """tconv3d.explain's plan where the ops run the kernels (settings.runs_triton holds for `input`):
    functional.explain says what each entry means."""
    geom = check_conv3d(
        input, weight, bias, stride, padding, dilation, groups, padding_mode, frames_before, channels_after
    )
    coarse = grouped.coarsened(geom)  # what the kernels run (kernels/grouped.py)
    plan = {}
    for direction in DIRECTIONS:
        key = _memo_key(direction, coarse, input.dtype, input.device)
        tunes = input.device.type == "cuda" and settings.AUTOTUNE
        if tunes and tuning_key(direction, coarse, input.dtype) not in tables.device_table(input.device):
            plan[direction] = {"variant": "pending", "config": None, "source": "first-use tuning"}
            continue
        config, source = _select_with_source(direction, coarse, input.dtype, input.device, None)
        config = _memo.get(key, config)
        operands = (input, input) if direction == "wgrad" else (input, weight)  # grad_output shares input's layout
        if direction != "dgrad":  # the input gradient computes the concatenation's, one source
            operands += (frames_before,)
        second = channels_after if direction != "dgrad" else None
        if config.tma_box_w and not _tma_describable(direction, *operands, channels_after=second):
            config = dataclasses.replace(config, tma_box_w=0, gluon=0)
        plan[direction] = {"variant": config.variant, "config": config, "source": source}
        if config.variant == "pointer" and (form := pointer_form(direction, coarse)):
            plan[direction]["form"] = form
        if coarse is not geom:
            plan[direction]["block_diagonal"] = geom.groups // coarse.groups
            # else the call builds the block-diagonal weight, or copies the gradient's diagonal blocks
            plan[direction]["weight_in_place"] = grouped.in_place(direction, coarse, config)
        if second is not None:
            plan[direction]["reads_in_place"] = reads_channels_after(direction, geom, config)
        if settings.KERNELS == "gluon" and not config.gluon:
            plan[direction]["gluon_unavailable"] = gluon_unavailable(direction, coarse, input.dtype, input.device)
        if settings.INDUCTOR_KERNELS:
            refusal = inductor_refusal(direction, geom, *operands)
            plan[direction]["inductor"] = (
                "its kernels in Inductor's graph" if refusal is None else f"op call: {refusal}"
            )
    return plan


def gluon_unavailable(direction: str, geom: ConvGeometry, dtype: torch.dtype, device: torch.device) -> str:
    """Why the Gluon kernel does not run this launch."""
    if conv_gluon.UNAVAILABLE is not None:
        return conv_gluon.UNAVAILABLE
    if device.type != "cuda" or settings.INTERPRET:
        return "the Gluon kernel runs only compiled, on a CUDA device (Triton's interpreter cannot run Gluon)"
    if configs.compute_capability(device) != configs.GLUON_CAPABILITY:
        return f"the Gluon kernel is wgmma code for sm_90; this device is sm_{configs.compute_capability(device)}"
    if exact_products(dtype):
        return "its wgmma reads fp32 only as TF32, and cuDNN's convolutions may not use TF32 now (allow_tf32 off)"
    if not gluon_eligible(direction, geom, dtype):
        return (
            "it runs the TMA variant's problems (configs.tma_eligible) in fp16/bf16, and in fp32 (as TF32) their "
            "forward and input gradient; not this launch"
        )
    return "the problem's TMA operands are not 16-byte aligned"
