"""tconv3d.nn.convert: tconv3d's modules swapped into a model in place, the causal convolutions of diffusers'
video VAEs included, with their padding and cached frames taken into the op.

A layer is converted by changing its class, never by replacing the module: parameters, hooks, the optimizer's
references and the state_dict keys stay. Known classes of other libraries get an adapter class built on the
fly, `(Adapter, TheirClass[, tconv3d.nn.Conv3d])`: it stays an instance of their class (so their own
`isinstance` checks, e.g. Wan's count of its causal convs for the frame cache, still hold) and its forward keeps
their signature and meaning while running one tconv3d op. Known classes are matched by their module and name,
so diffusers is never imported here.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable

import torch
from torch import nn

from .geometry import SUPPORTED_DTYPES
from .modules import Conv3d, ConvTranspose3d, GroupNorm, InstanceNorm3d, keep_channels_last

logger = logging.getLogger("tconv3d")

SUBCLASS_POLICIES = ("skip", "rebase")

# F.pad's modes by their names in nn.Conv3d and tconv3d.
_FPAD_MODES = {"constant": "zeros", "zeros": "zeros", "replicate": "replicate", "reflect": "reflect",
               "circular": "circular"}  # fmt: skip


def _from_fpad(pad) -> list[int]:
    """F.pad's (w_left, w_right, h_top, h_bottom, d_front, d_back) -> the op's (d, d, h, h, w, w)."""
    wl, wr, ht, hb, df, db = pad
    return [df, db, ht, hb, wl, wr]


def _compose_padding(outer, outer_modes, conv: nn.Conv3d):
    """One (6-value padding, padding_mode) for a padding `outer` (op order, modes per dim) applied before `conv`'s
    own padding, or None where one op cannot express the two (both pad one dimension in different modes)."""
    inner = [p for p in conv.padding for _ in range(2)] if not isinstance(conv.padding, str) else None
    if inner is None:
        return None
    padding, modes = [], []
    for dim in range(3):
        o, i = outer[2 * dim : 2 * dim + 2], inner[2 * dim : 2 * dim + 2]
        o_mode, i_mode = outer_modes[dim], conv.padding_mode
        if not any(i):
            padding += o
            modes.append(o_mode)
        elif not any(o):
            padding += i
            modes.append(i_mode)
        elif o_mode == i_mode == "zeros":
            padding += [o[0] + i[0], o[1] + i[1]]
            modes.append("zeros")
        else:
            return None
    return padding, ",".join(modes)


def _conv_reason(conv: nn.Module) -> str | None:
    """Why tconv3d cannot run a Conv3d's arithmetic (None if it can)."""
    if not isinstance(conv, (nn.Conv3d, nn.ConvTranspose3d)):
        return f"its convolution is a {type(conv).__qualname__}, not an nn.Conv3d"
    if conv.groups != 1:
        return f"groups={conv.groups} (tconv3d runs groups=1 only)"
    if conv.weight.dtype not in SUPPORTED_DTYPES:
        return f"its weight is {conv.weight.dtype} (tconv3d runs float16, bfloat16 and float32)"
    return None


def _crop_front(frames_before, x, frames: int):
    """Drop the first `frames` frames of torch.cat([frames_before, x], 2), as views (F.pad with a negative
    front does this)."""
    kept = frames_before.shape[2] - frames
    if kept > 0:
        return frames_before.narrow(2, frames, kept), x
    return None, x.narrow(2, -kept, x.shape[2] + kept)


# ---------------------------------------------------------------------------------------------------------------
# adapters: each names the classes it takes over, says when it cannot, and gives their forward on one op


class _WanCausalConv3d:
    """diffusers' WanCausalConv3d (and QwenImageCausalConv3d, the same class): zeros padding of 2x the time pad
    in front, `cache_x` (the previous chunk's last frames) read in place in front of the clip instead of
    concatenated, the rest of the time padding and all the spatial padding inside the op."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_wan.WanCausalConv3d",
        "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageCausalConv3d",
    )

    attributes = ("_padding",)

    @staticmethod
    def reason(module) -> str | None:
        return _conv_reason(module)

    def forward(self, x, cache_x=None):
        wl, wr, ht, hb, df, db = self._padding
        frames_before = None
        if cache_x is not None and df > 0:
            frames_before = cache_x.to(device=x.device, dtype=x.dtype)
            df -= frames_before.shape[2]
            if df < 0:
                frames_before, x = _crop_front(frames_before, x, -df)
                df = 0
        return self.convolve(x, (df, db, ht, hb, wl, wr), "zeros", frames_before)


class _PlainConv3d:
    """A Conv3d subclass whose forward only works around cuDNN: diffusers' CogVideoXSafeConv3d splits time into
    overlapping chunks (torch.cat copies) above 2 GiB to keep cuDNN in bounds. tconv3d's kernels take any size
    (int64 offsets), so the whole clip is one op."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cogvideox.CogVideoXSafeConv3d",)
    attributes = ()

    @staticmethod
    def reason(module) -> str | None:
        return _conv_reason(module)

    forward = Conv3d.forward


class _CogVideoXCausalConv3d:
    """diffusers' CogVideoXCausalConv3d (CogVideoX, Mochi): time padded in front by the previous chunk's frames
    (`conv_cache`, read in place) or by repeating the first frame (replicate along D in the op), or everything
    replicate-padded (Mochi). Returns (output, the conv_cache for the next chunk) as diffusers does."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cogvideox.CogVideoXCausalConv3d",)
    attributes = ("conv", "pad_mode", "time_kernel_size", "time_causal_padding")

    @staticmethod
    def reason(module) -> str | None:
        reason = _conv_reason(module.conv)
        if reason is None and module.pad_mode != "replicate" and any(module.conv.padding[:1]):
            reason = "its conv pads time as well"
        if reason is None and module.pad_mode == "replicate" and any(module.conv.padding):
            reason = "its conv pads after the replicate padding"
        return reason

    def forward(self, inputs, conv_cache=None):
        conv, k = self.conv, self.time_kernel_size
        if self.pad_mode == "replicate":
            return conv.convolve(inputs, _from_fpad(self.time_causal_padding), "replicate"), None
        _, hp, wp = conv.padding
        if k > 1 and conv_cache is not None:
            padding, mode, frames_before = (0, 0, hp, hp, wp, wp), "zeros", conv_cache
        elif k > 1:
            padding, mode, frames_before = (k - 1, 0, hp, hp, wp, wp), "replicate,zeros,zeros", None
        else:
            padding, mode, frames_before = (0, 0, hp, hp, wp, wp), "zeros", None
        output = conv.convolve(inputs, padding, mode, frames_before)
        return output, self._next_cache(inputs, frames_before, k)

    @staticmethod
    def _next_cache(inputs, frames_before, k):
        """The last k - 1 frames of what diffusers would have concatenated, as a new channels_last_3d tensor."""
        if k == 1:
            return inputs.clone()  # diffusers' inputs[:, :, -0:] is all of it
        need = k - 1
        if inputs.shape[2] >= need:
            return inputs[:, :, -need:].clone(memory_format=torch.channels_last_3d)
        front = frames_before if frames_before is not None else inputs[:, :, :1].expand(-1, -1, need, -1, -1)
        return torch.cat([front, inputs], dim=2)[:, :, -need:].clone(memory_format=torch.channels_last_3d)


class _ReplicatePaddedConv3d:
    """diffusers' HunyuanVideoCausalConv3d: F.pad(x, time_causal_padding, mode=pad_mode) then its conv, as one op
    with the padding and its mode inside."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video.HunyuanVideoCausalConv3d",)
    attributes = ("conv", "pad_mode", "time_causal_padding")

    @staticmethod
    def _padding(module):
        mode = _FPAD_MODES.get(module.pad_mode)
        return _compose_padding(_from_fpad(module.time_causal_padding), (mode,) * 3, module.conv) if mode else None

    @classmethod
    def reason(cls, module) -> str | None:
        reason = _conv_reason(module.conv)
        if reason is None and cls._padding(module) is None:
            reason = f"its {module.pad_mode!r} padding and its conv's own padding cannot be one op's"
        return reason

    def forward(self, hidden_states):
        padding, mode = _ReplicatePaddedConv3d._padding(self)
        return self.conv.convolve(hidden_states, padding, mode)


class _LTXVideoCausalConv3d:
    """diffusers' LTXVideoCausalConv3d: the first frame repeated kd - 1 times in front (causal) or the first and
    last (kd - 1) // 2 times on each side (not causal), then its conv: one op, replicate along D, the conv's own
    padding in space."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_ltx.LTXVideoCausalConv3d",)
    attributes = ("conv", "kernel_size", "is_causal")

    @staticmethod
    def _padding(module):
        k = module.kernel_size[0]
        front, back = (k - 1, 0) if module.is_causal else ((k - 1) // 2, (k - 1) // 2)
        return _compose_padding([front, back, 0, 0, 0, 0], ("replicate", "zeros", "zeros"), module.conv)

    @classmethod
    def reason(cls, module) -> str | None:
        reason = _conv_reason(module.conv)
        if reason is None and cls._padding(module) is None:
            reason = "its conv pads time as well"
        return reason

    def forward(self, hidden_states):
        padding, mode = _LTXVideoCausalConv3d._padding(self)
        return self.conv.convolve(hidden_states, padding, mode)


class _Rebased:
    """An nn.Conv3d subclass of unknown behaviour, opted in with subclasses="rebase": its own forward runs as it
    is, and its super().forward lands in tconv3d.nn.Conv3d."""

    attributes = ()


_ADAPTERS = (_WanCausalConv3d, _PlainConv3d, _CogVideoXCausalConv3d, _ReplicatePaddedConv3d, _LTXVideoCausalConv3d)
KNOWN_CLASSES = {name: adapter for adapter in _ADAPTERS for name in adapter.classes}


def adapter_reason(adapter: type, module: nn.Module) -> str | None:
    """Why `adapter` cannot take over `module` (None if it can), a layout of another library version included."""
    missing = [name for name in adapter.attributes if not hasattr(module, name)]
    if missing:
        return f"it has no {', '.join(missing)}: not the {type(module).__name__} this tconv3d knows (other version?)"
    return adapter.reason(module)


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def adapted_class(adapter: type, original: type) -> type:
    """The class a converted module of class `original` gets: the adapter's forward over `original`, and
    tconv3d.nn.Conv3d (weight kept channels_last_3d, super().forward on tconv3d) for convolutions."""
    bases = (adapter, original, Conv3d) if issubclass(original, nn.Conv3d) else (adapter, original)
    return type(original.__name__, bases, {"__module__": original.__module__, "tconv3d_adapter": adapter})


# The torch modules tconv3d has a drop-in for: exact classes (subclasses bring their own forward).
DROP_INS = {nn.Conv3d: Conv3d, nn.ConvTranspose3d: ConvTranspose3d, nn.GroupNorm: GroupNorm,
            nn.InstanceNorm3d: InstanceNorm3d}  # fmt: skip


def is_converted(module: nn.Module) -> bool:
    return isinstance(module, tuple(DROP_INS.values())) or hasattr(type(module), "tconv3d_adapter")


def unsupported_reason(module: nn.Module, subclasses: str) -> str | None:
    """Why convert leaves an nn.Conv3d (or another module with a drop-in) as it is; None if it takes it over."""
    if isinstance(module, nn.Conv3d) and type(module) is not nn.Conv3d and subclasses == "skip":
        return (
            f"it is a {type(module).__qualname__}, a subclass of nn.Conv3d whose forward may differ (convert(model, "
            "subclasses='rebase') keeps its forward and runs its super().forward on tconv3d)"
        )
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        return _conv_reason(module)
    if getattr(module, "weight", None) is not None and module.weight.dtype not in SUPPORTED_DTYPES:
        return f"its weight is {module.weight.dtype} (tconv3d runs float16, bfloat16 and float32)"
    return None


def convert(
    model: nn.Module, filter: Callable[[str, nn.Module], bool] | None = None, subclasses: str = "skip"
) -> nn.Module:
    """Swap tconv3d in for every eligible layer of `model`, in place, and return `model`.

    - `nn.Conv3d`, `nn.ConvTranspose3d`, `nn.GroupNorm` and `nn.InstanceNorm3d` become tconv3d's drop-ins
      (NDHWC kernels, channels_last_3d outputs), and a GroupNorm or InstanceNorm3d followed by `nn.SiLU` in an
      `nn.Sequential` becomes one fused norm + SiLU (the SiLU slot an `nn.Identity`).
    - The causal convolutions of diffusers' video VAEs (Wan, QwenImage, CogVideoX, Mochi, HunyuanVideo,
      LTX-Video) are taken over with their padding, repeated frames and cached frames inside one op: no F.pad or
      torch.cat copy of an activation remains around them. Their forward signatures and results are diffusers'.
    - Other subclasses of nn.Conv3d are left alone unless `subclasses="rebase"`: then their own forward still
      runs, and its super().forward runs tconv3d.

    Each layer keeps its identity and Parameters (its class is changed and a conv weight made channels_last_3d in
    place), so an optimizer built before the call keeps working and state_dicts load both ways.
    `filter(qualified_name, module)` returning False leaves a module alone (a VAE's conv wrapper, once taken
    over, takes its inner conv with it). What tconv3d cannot run (groups > 1 convolutions, float64 weights,
    paddings one op cannot express) stays as it is, each reported by a warning on the "tconv3d" logger with its
    name and the reason. Nothing outside `model` is patched.
    """
    if subclasses not in SUBCLASS_POLICIES:
        raise ValueError(f"subclasses must be one of {SUBCLASS_POLICIES}, got {subclasses!r}")
    converted = 0
    for name, module in model.named_modules():
        if is_converted(module) or (filter is not None and not filter(name, module)):
            continue
        label = name or type(module).__name__
        adapter = KNOWN_CLASSES.get(class_name(type(module)))
        if adapter is not None:
            reason = adapter_reason(adapter, module)
            if reason is None:
                _swap(module, adapted_class(adapter, type(module)))
                inner = getattr(module, "conv", None)
                if not isinstance(module, nn.Conv3d) and not is_converted(inner):
                    # A wrapper calls its conv's tconv3d op directly: the conv goes with it.
                    inner_adapter = KNOWN_CLASSES.get(class_name(type(inner)), _Rebased)
                    _swap(inner, Conv3d if type(inner) is nn.Conv3d else adapted_class(inner_adapter, type(inner)))
                converted += 1
            else:
                logger.warning("tconv3d.nn.convert left %s (%s) as it is: %s", label, type(module).__name__, reason)
            continue
        if type(module) not in DROP_INS and not isinstance(module, nn.Conv3d):
            continue
        reason = unsupported_reason(module, subclasses)
        if reason is not None:
            logger.warning("tconv3d.nn.convert left %s as it is: %s", label, reason)
            continue
        _swap(module, DROP_INS.get(type(module)) or adapted_class(_Rebased, type(module)))
        converted += 1
    _fuse_norm_silu(model)
    logger.info("tconv3d.nn.convert took over %d module(s)", converted)
    return model


def _swap(module: nn.Module, cls: type) -> None:
    module.__class__ = cls
    if isinstance(module, (GroupNorm, InstanceNorm3d)):
        module.activation = None
    if isinstance(module, (Conv3d, ConvTranspose3d)):
        keep_channels_last(module.weight)


def _fuse_norm_silu(model: nn.Module) -> None:
    """GroupNorm / InstanceNorm3d then nn.SiLU, next to each other in an nn.Sequential -> one fused pass."""
    for parent in model.modules():
        if not isinstance(parent, nn.Sequential):
            continue
        items = list(parent._modules.items())
        for (_, norm), (silu_name, silu) in itertools.pairwise(items):
            if isinstance(norm, (GroupNorm, InstanceNorm3d)) and norm.activation is None and type(silu) is nn.SiLU:
                norm.activation = "silu"
                parent._modules[silu_name] = nn.Identity()
