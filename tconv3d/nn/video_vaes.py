"""Adapters for the video VAEs of diffusers (and Kandinsky 6 SR's latent upscalers, FramePack's history patch
embeddings): their causal convolution modules (padding, cached frames and repeated frames taken into one tconv3d
op) and the blocks whose forward would turn channels_last_3d activations NCDHW. tconv3d.nn.convert swaps them in
by class (see convert.py); diffusers is never imported here.

An adapter names the classes it takes over (`classes`, by module and name), the attributes it relies on
(`attributes`: another diffusers version without them is left alone), says when it cannot (`reason`, optional), may
normalise a module's settings once when it takes it over (`prepare`, optional), and gives their forward with
diffusers' signature and results. `wraps_conv` marks the wrappers that pad and call
their `.conv`: that conv is taken over with them.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy

from ..functional import conv_transpose3d
from ..geometry import RMS_NORM_MAX_CHANNELS, SUPPORTED_DTYPES, conv_dtype
from ..kernels.tensors import batched, channels_last, exporting_to_onnx
from ..ops import call_conv3d, call_rms_norm
from . import subpixel
from .hooks import Handed, hand, hooked, instance_forward_reason, received, wrapper
from .modules import (
    Conv3d,
    GroupNorm,
    InstanceNorm3d,
    add_into,
    add_repeated_,
    autograd_traced,
    block_mean,
    empty_for,
    frames,
    frames_in_front,
    fx_leaf,
    given,
    laid_out,
    layout_of,
    nearest_steps,
    normalize,
    repeat_nearest,
    replicate_padded,
    resize_nearest,
    upsample_linear,
)
from .subpixel import subpixel_weight

_CL = torch.channels_last_3d

# F.pad's modes by their names in nn.Conv3d and tconv3d.
_FPAD_MODES = {"constant": "zeros", "zeros": "zeros", "replicate": "replicate", "reflect": "reflect",
               "circular": "circular"}  # fmt: skip


def _from_fpad(pad) -> list[int]:
    """F.pad's (w_left, w_right, h_top, h_bottom, d_front, d_back) -> the op's (d, d, h, h, w, w)."""
    wl, wr, ht, hb, df, db = pad
    return [df, db, ht, hb, wl, wr]


def _compose_padding(outer, outer_modes, conv: nn.Conv3d):
    """One (6-value padding, padding_mode) for a padding `outer` (op order, modes per dim) applied before `conv`'s
    own padding, or None where one op cannot express the two (both pad one dimension in different modes). Asked
    when convert takes a module over (its adapter's `prepare` keeps the answer as `tconv3d_padding`), not per call:
    torch.compile then traces no padding arithmetic."""
    conv_padding, conv_mode = conv.padding, conv.padding_mode
    if isinstance(conv_padding, str):
        return None
    inner = [p for p in conv_padding for _ in range(2)]
    padding, modes = [], []
    for dim in range(3):
        o, i = list(outer[2 * dim : 2 * dim + 2]), inner[2 * dim : 2 * dim + 2]
        o_mode, i_mode = outer_modes[dim], conv_mode
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
    return tuple(padding), ",".join(modes)


def conv_reason(conv: nn.Module) -> str | None:
    """Why tconv3d cannot run a Conv3d's arithmetic (None if it can)."""
    if wrapper(conv):
        return (
            f"its convolution is in a {type(conv).__qualname__} that adds to its call (a LoRA layer, peft's): its "
            "forward runs as its library's, the LoRA layer's convolutions on tconv3d"
        )
    if not isinstance(conv, (nn.Conv3d, nn.ConvTranspose3d)):
        return f"its convolution is a {type(conv).__qualname__}, not an nn.Conv3d"
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
        return conv_reason(module)

    def forward(self, x, cache_x=None, frames_before=None):
        """diffusers' forward; `frames_before` (tconv3d's): frames read in front of x on top of the padding (what
        WanResample concatenates in front of its downsampling time_conv)."""
        if cache_x is not None and frames_before is not None:
            raise ValueError("pass cache_x or frames_before, not both")
        wl, wr, ht, hb, df, db = self._padding
        if cache_x is not None and df > 0:
            frames_before = cache_x.to(device=x.device, dtype=x.dtype)
            df -= frames_before.shape[2]
            if df < 0:
                frames_before, x = _crop_front(frames_before, x, -df)
                df = 0
        return self._convolve(x, (df, db, ht, hb, wl, wr), "zeros", frames_before)


class _PlainConv3d:
    """A Conv3d subclass whose forward only works around cuDNN: diffusers' CogVideoXSafeConv3d (and Kandinsky 6's
    Kandinsky6SRSafeConv3d) splits time into overlapping chunks (torch.cat copies) above 2 GiB (2e9 elements) to keep
    cuDNN in bounds. tconv3d's kernels take any size (int64 offsets), so the whole clip is one op."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_cogvideox.CogVideoXSafeConv3d",
        "diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6SRSafeConv3d",
    )
    attributes = ()

    @staticmethod
    def reason(module) -> str | None:
        return conv_reason(module)

    forward = Conv3d.forward


class _CogVideoXCausalConv3d:
    """diffusers' CogVideoXCausalConv3d (CogVideoX, Mochi): time padded in front by the previous chunk's frames
    (`conv_cache`, read in place) or by repeating the first frame (replicate along D in the op), or everything
    replicate-padded (Mochi). Returns (output, the conv_cache for the next chunk) as diffusers does."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kl_cogvideox.CogVideoXCausalConv3d",)
    attributes = ("conv", "pad_mode", "time_kernel_size", "time_causal_padding")

    @staticmethod
    def reason(module) -> str | None:
        reason = conv_reason(module.conv)
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
        # the last k - 1 frames of what diffusers would have concatenated (k = 1: all of the input, as its [-0:])
        return output, _last_frames(frames_before, inputs, k - 1)


class _PaddedConv:
    """Adapters of modules that pad their input one fixed way (`_padding(module)`: the op's (padding, mode), or
    None where one op cannot) and then run their conv (`_conv(module)`): the padding is composed once, when
    convert takes the module over, and the forward is one op with it inside."""

    @staticmethod
    def _conv(module) -> nn.Conv3d:
        return module.conv

    @classmethod
    def reason(cls, module) -> str | None:
        reason = conv_reason(cls._conv(module))
        if reason is None and cls._padding(module) is None:
            reason = f"its {module.pad_mode!r} padding and its conv's own cannot be one op's"
        return reason

    @classmethod
    def prepare(cls, module) -> None:
        module.tconv3d_padding = cls._padding(module)

    def forward(self, hidden_states):
        padding, mode = self.tconv3d_padding
        conv = self.tconv3d_adapter._conv(self)  # the module itself (inside its call) or its conv
        return (conv._convolve if conv is self else conv.convolve)(hidden_states, padding, mode)


class _ReplicatePaddedConv3d(_PaddedConv):
    """diffusers' HunyuanVideoCausalConv3d (and HunyuanVideo15CausalConv3d and HunyuanImageRefinerCausalConv3d, the
    same class): F.pad(x,
    time_causal_padding, mode=pad_mode) then its conv, as one op with the padding and its mode inside."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_hunyuan_video.HunyuanVideoCausalConv3d",
        "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15.HunyuanVideo15CausalConv3d",
        "diffusers.models.autoencoders.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerCausalConv3d",
    )
    attributes = ("conv", "pad_mode", "time_causal_padding")

    @staticmethod
    def _padding(module):
        mode = _FPAD_MODES.get(module.pad_mode)
        return _compose_padding(_from_fpad(module.time_causal_padding), (mode,) * 3, module.conv) if mode else None

    def forward(self, hidden_states, upsampled_by=None):
        """diffusers' forward; `upsampled_by` (tconv3d's, from HunyuanVideo's upsampler, where
        causal_subpixel_reason allows): the conv of hidden_states upsampled nearest by these factors, the first
        frame in space only, run as `upsampled_causal_conv`."""
        upsampled_by = received(upsampled_by)
        if upsampled_by is None:
            return _PaddedConv.forward(self, hidden_states)
        return upsampled_causal_conv(self, hidden_states, upsampled_by[0])


def _ltx_time_padding(module, causal: bool):
    """LTX-Video's and LTX-2's causal convs' padding: the first frame repeated kd - 1 times in front (causal), or
    the first and last (kd - 1) // 2 times on each side, then the conv's own padding in space, as one op's."""
    k = module.kernel_size[0]
    front, back = (k - 1, 0) if causal else ((k - 1) // 2, (k - 1) // 2)
    return _compose_padding([front, back, 0, 0, 0, 0], ("replicate", "zeros", "zeros"), module.conv)


def _ltx_conv_reason(module) -> str | None:
    reason = conv_reason(module.conv)
    if reason is None and any(_ltx_time_padding(module, causal) is None for causal in (True, False)):
        reason = "its conv pads time as well"
    return reason


def _ltx_prepare(module) -> None:
    module.tconv3d_padding = {causal: _ltx_time_padding(module, causal) for causal in (True, False)}


class _LTXVideoCausalConv3d:
    """diffusers' LTXVideoCausalConv3d (causal or not as built): the repeated frames, the conv's own padding in
    space (its padding_mode) and the conv, one op. `frames_before` (tconv3d's): frames read in front of x, as if
    concatenated before the padding (what the downsamplers concatenate)."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kl_ltx.LTXVideoCausalConv3d",)
    attributes = ("conv", "kernel_size", "is_causal")
    reason = staticmethod(_ltx_conv_reason)
    prepare = staticmethod(_ltx_prepare)

    def forward(self, hidden_states, frames_before=None):
        padding, mode = self.tconv3d_padding[bool(self.is_causal)]
        return self.conv.convolve(hidden_states, padding, mode, frames_before)


class _LTX2VideoCausalConv3d:
    """diffusers' LTX2VideoCausalConv3d: LTX-Video's, causal or not per call."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kl_ltx2.LTX2VideoCausalConv3d",)
    attributes = ("conv", "kernel_size")
    reason = staticmethod(_ltx_conv_reason)
    prepare = staticmethod(_ltx_prepare)

    def forward(self, hidden_states, causal=True, frames_before=None):
        padding, mode = self.tconv3d_padding[bool(causal)]
        return self.conv.convolve(hidden_states, padding, mode, frames_before)


class _CosmosCausalConv3d(_PaddedConv):
    """diffusers' CosmosCausalConv3d: the first frame repeated `temporal_pad` times in front (torch.cat), then space
    padded in its pad_mode (F.pad), then its conv (itself), which pads nothing: one op, both paddings inside."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cosmos.CosmosCausalConv3d",)
    attributes = ("pad_mode", "temporal_pad", "spatial_pad")

    @staticmethod
    def _conv(module) -> nn.Conv3d:
        return module

    @staticmethod
    def _padding(module):
        mode = _FPAD_MODES.get(module.pad_mode)
        if mode is None or module.temporal_pad < 0:
            return None
        wl, wr, ht, hb = module.spatial_pad
        return _compose_padding([module.temporal_pad, 0, ht, hb, wl, wr], ("replicate", mode, mode), module)

    def forward(self, hidden_states, upsampled=None):
        """diffusers' forward. `upsampled` (tconv3d's, from CosmosUpsample3d where cosmos_subpixel_reason allows),
        the factors (2, 1, 1) or (1, 2, 2): the conv of hidden_states repeated by them (in time, the first frame
        once), run as `upsampled_cosmos_conv`. CosmosDownsample3d's convolutions, with a pad or repeated frame of
        its own, are this conv's `convolve` (through this call where it runs hooks)."""
        upsampled = received(upsampled)
        if upsampled is not None:
            return upsampled_cosmos_conv(self, hidden_states, time=upsampled[0] == 2)
        padding, mode = self.tconv3d_padding
        return self._convolve(hidden_states, padding, mode)


class _CosmosDownsample3d:
    """diffusers' CosmosDownsample3d: in space, F.pad of one zero row and column, then a stride-2 conv plus a 2x2
    average pool of the padded tensor; in time, the first frame concatenated in front, then a stride-2 causal conv
    plus a 2-frame average pool of the concatenation. Here both paddings are inside the convs' ops and the pools
    read the input itself, as means over its channels_last_3d view (`block_mean`: CUDA's avg_pool3d copies its input
    NCDHW): in space where H and W are even (the padded row and column fall outside every pooling window;
    diffusers' own sum fails on odd sizes), in time the first frame (its window averages the repeated first frame
    with itself: that frame, exactly) and then pairs of frames, added into the conv's output in place."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cosmos.CosmosDownsample3d",)
    attributes = ("spatial_downsample", "temporal_downsample", "conv1", "conv2", "conv3")

    @staticmethod
    def reason(module) -> str | None:
        for name in ("conv1", "conv2"):
            conv = getattr(module, name)
            if isinstance(conv, nn.Identity):
                continue
            if class_name(type(conv)) not in _CosmosCausalConv3d.classes or any(conv.spatial_pad):
                return f"its {name} is not a CosmosCausalConv3d that pads nothing in space"
        return None

    def forward(self, hidden_states):
        if not self.spatial_downsample and not self.temporal_downsample:
            return hidden_states
        if self.spatial_downsample:
            conv = self.conv1
            if hidden_states.shape[-2] % 2 or hidden_states.shape[-1] % 2 or not _taken_over(conv):
                padded = F.pad(hidden_states, (0, 1, 0, 1, 0, 0), mode="constant", value=0)
                pooled = F.avg_pool3d(padded, kernel_size=(1, 2, 2), stride=(1, 2, 2))
                hidden_states = conv(padded) + pooled
            else:
                padding = (conv.temporal_pad, 0, 0, 1, 0, 1)
                pooled = block_mean(hidden_states, (1, 2, 2))
                hidden_states = conv.convolve(hidden_states, padding, "replicate,zeros,zeros") + pooled
        if self.temporal_downsample:
            conv = self.conv2
            if not _taken_over(conv):
                joined = torch.cat([hidden_states[:, :, :1, ...], hidden_states], dim=2)
                pooled = F.avg_pool3d(joined, kernel_size=(2, 1, 1), stride=(2, 1, 1))
                hidden_states = conv(joined) + pooled
            else:
                out = conv.convolve(hidden_states, (conv.temporal_pad + 1, 0, 0, 0, 0, 0), "replicate,zeros,zeros")
                _add_frame_pool(out, hidden_states)
                hidden_states = out
        return self.conv3(hidden_states)


def _taken_over(conv: nn.Module) -> bool:
    """A Cosmos conv convert took over (a filter may have left it alone)."""
    return getattr(type(conv), "tconv3d_adapter", None) is _CosmosCausalConv3d


def _add_frame_pool(out: torch.Tensor, x: torch.Tensor) -> None:
    """out += F.avg_pool3d(x, (2, 1, 1), stride=(2, 1, 1), padding=(1, 0, 0), count_include_pad=False) over out's
    frames, in place: window k averages the real frames among 2k - 1 and 2k (the first and, for an even count, the
    last frame alone), the pairs as a mean over x's view."""
    count, windows = x.shape[2], out.shape[2]
    out[:, :, :1].add_(frames(x, 0, 1))
    pairs = min(windows - 1, (count - 1) // 2)
    if pairs > 0:
        out[:, :, 1 : 1 + pairs].add_(block_mean(frames(x, 1, 1 + 2 * pairs), (2, 1, 1)))
    if count % 2 == 0 and windows > count // 2:
        out[:, :, count // 2 : count // 2 + 1].add_(frames(x, count - 1))


class _CosmosUpsample3d:
    """diffusers' CosmosUpsample3d: in time, frames repeated 2x (the first once), a 3 x 1 x 1 causal conv, plus the
    repeated frames; in space, pixels repeated 2x, a 1 x 3 x 3 conv zero-padded by 1, plus the repeated pixels;
    then a 1 x 1 x 1 conv. Each upsampled conv runs in the sub-pixel form (`upsampled_cosmos_conv`: a transposed
    conv of its input, 2 taps where 3 in time, 4 where 9 in space) and the repeated input is added into its output
    by broadcasting (`_conv_plus_repeats`): nothing of the upsampled size is written but the conv's output. Where
    `cosmos_subpixel_reason` refuses, the repeats are nearest interpolation by the same whole factors (diffusers'
    repeat_interleave answers NCDHW for a channels_last_3d input: each conv after it would read a layout copy). One
    frame in time is repeated once: no copy."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cosmos.CosmosUpsample3d",)
    attributes = ("spatial_upsample", "temporal_upsample", "conv1", "conv2", "conv3")

    def forward(self, hidden_states):
        if not self.spatial_upsample and not self.temporal_upsample:
            return hidden_states
        if self.temporal_upsample:
            if hidden_states.size(2) < 2:
                hidden_states = self.conv1(hidden_states) + hidden_states
            else:
                subpixel_form = cosmos_subpixel_reason(self.conv1, hidden_states, True) is None
                hidden_states = _conv_plus_repeats(
                    self.conv1, hidden_states, (2, 1, 1), subpixel_form, first_apart=True
                )
        if self.spatial_upsample:
            subpixel_form = cosmos_subpixel_reason(self.conv2, hidden_states, False) is None
            hidden_states = _conv_plus_repeats(self.conv2, hidden_states, (1, 2, 2), subpixel_form)
        return self.conv3(hidden_states)


def _conv_plus_repeats(conv: nn.Module, x: torch.Tensor, factors, subpixel_form: bool, first_apart: bool = False):
    """conv(u) + u, u = x repeated by nearest `factors` (`first_apart` as repeat_nearest's): the step of Cosmos's
    and Kandinsky 6's upsamplers. With `subpixel_form`, the conv is called on x itself with `upsampled=factors`
    (its sub-pixel form) and the repetition added into its output in place, read by broadcasting (`add_repeated_`):
    nothing of u's size is written but the conv's output; the conv's output rounded, then the sum, as stock's
    order. Otherwise u is written and convolved."""
    if subpixel_form:
        out = conv(x, upsampled=hand(conv, factors))
        dtype = torch.promote_types(out.dtype, x.dtype)  # stock's sum's: under autocast a float32 x's, not the conv's
        return add_repeated_(out if out.dtype == dtype else out.to(dtype), x, factors, first_apart=first_apart)
    upsampled = _repeat(x, factors, first_apart=first_apart)
    return conv(upsampled) + upsampled


def upsampled_cosmos_conv(conv: nn.Module, x: torch.Tensor, time: bool) -> torch.Tensor:
    """The conv of Cosmos's upsampler's step (a converted CosmosCausalConv3d) on x repeated by nearest 2x. `time`:
    2x in D, the first frame once (2T - 1 frames), a 3 x 1 x 1 conv with the first frame
    repeated twice in front: one transposed conv of x, its first frame once more in front (`replicate_padded`, a
    copy of x's size where diffusers' repeated frames are twice it), at stride (2, 1, 1) with 4 time taps
    (`subpixel_weight(conv, "repeated", space=False)`, HunyuanVideo's in D): 2 taps an output voxel where 3.
    Else 2x in H and W, a 1 x 3 x 3 conv zero-padded by 1 in space: the transposed conv of x itself at stride
    (1, 2, 2) with 4 x 4 taps (`subpixel.upsampled_conv`, Wan's): 4 taps where 9, nothing written before it."""
    if time:
        padded = replicate_padded(x, (1, 0, 0, 0, 0, 0))
        return conv_transpose3d(padded, subpixel_weight(conv, "repeated", space=False), conv.bias, stride=(2, 1, 1),
                                padding=(3, 0, 0), output_padding=(1, 0, 0))  # fmt: skip
    return subpixel.upsampled_conv(conv, x, (1, 2, 2))


def cosmos_subpixel_reason(conv: nn.Module, x: torch.Tensor, time: bool) -> str | None:
    """Why Cosmos's upsampler upsamples x before its conv `conv` (its time conv where `time`, else its space conv;
    None where it runs `upsampled_cosmos_conv`)."""
    if not _taken_over(conv):
        return "its conv is not taken over"
    if not subpixel.SUBPIXEL:
        return "subpixel.SUBPIXEL is off"
    # (kernel, first frames repeated in front, space padding, its mode where it pads)
    expected = ((3, 1, 1), 2, (0, 0, 0, 0), None) if time else ((1, 3, 3), 0, (1, 1, 1, 1), "constant")
    got = (tuple(conv.kernel_size), conv.temporal_pad, tuple(conv.spatial_pad), None if time else conv.pad_mode)
    if got != expected:
        return f"its (kernel, time padding, space padding, mode) {got} is not {expected}"
    shape = (tuple(conv.padding), tuple(conv.stride), tuple(conv.dilation), conv.groups, conv.padding_mode)
    if shape != ((0, 0, 0), (1, 1, 1), (1, 1, 1), 1, "zeros"):
        return f"its conv (padding, stride, dilation, groups, mode) {shape} is not a plain one"
    if x.dim() != 5 or conv_dtype(x, conv.weight) is None or not x.numel() or (time and x.shape[2] < 2):
        return f"the video is {x.dim()}-D {x.dtype} of {tuple(x.shape)}, its weight {conv.weight.dtype}"
    return None


class _CosmosHaar:
    """What Cosmos's Haar patcher and unpatcher share: their attributes, when tconv3d takes them, and how many
    levels of the transform it runs."""

    attributes = ("patch_size", "patch_method", "wavelets")

    @staticmethod
    def reason(module) -> str | None:
        if module.wavelets.shape != (2,):
            return f"its wavelet has {module.wavelets.numel()} taps (tconv3d takes Haar's 2)"
        if module.patch_size < 1 or module.patch_size & (module.patch_size - 1):
            return f"its patch_size {module.patch_size} is not a power of two"
        return None

    def _tconv3d_levels(self, x: torch.Tensor) -> int:
        """The levels tconv3d runs on x; 0 where diffusers' code runs (the "rearrange" patches, a reshuffle without
        convolutions; patches of 1; a dtype tconv3d's kernels do not run)."""
        if self.patch_method != "haar" or x.dim() != 5 or x.dtype not in SUPPORTED_DTYPES:
            return 0
        return int(math.log2(self.patch_size))


class _CosmosPatchEmbed3d(_CosmosHaar):
    """diffusers' CosmosPatchEmbed3d with Haar patches: the first frame repeated patch_size times in front (a
    torch.cat), then per level of the 3-D wavelet transform an F.pad (reflect, one voxel after each axis), 14
    depthwise 2-tap F.conv3d calls (time, then height, then width), a torch.cat of the 8 subbands and a rescale.
    Here one tconv3d conv a level: 2x2x2 at stride 2 with each channel's 8 subband filters (products of the three
    axes' 2-tap filters, the rescale folded in) in one weight (`_haar_weight`), the reflect padding inside the op,
    the repeated first frames read in front of the clip (frames_before), a channels_last_3d result."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cosmos.CosmosPatchEmbed3d",)

    def forward(self, hidden_states):
        levels = self._tconv3d_levels(hidden_states)
        if not levels:
            return super().forward(hidden_states)
        first = first_frame_repeated(hidden_states, 1)
        before = first.expand(-1, -1, self.patch_size - 1, -1, -1)
        before = before.clone() if batched(first) else before.contiguous(memory_format=layout_of(first))
        for _ in range(levels):
            weight = _haar_weight(self, hidden_states.shape[1], hidden_states.dtype, 8**-0.5)
            hidden_states = call_conv3d(hidden_states, weight, None, (2, 2, 2), (0, 1, 0, 1, 0, 1), (1, 1, 1), 1,
                                        "reflect", before, None)  # fmt: skip
            before = None
        return hidden_states


class _CosmosUnpatcher3d(_CosmosHaar):
    """diffusers' CosmosUnpatcher3d with Haar patches, the inverse: per level a torch.chunk into the 8 subbands,
    14 depthwise 2-tap F.conv_transpose3d calls and 7 sums, then a rescale; then the first patch_size - 1 frames
    dropped. Here one tconv3d conv_transpose3d a level (2x2x2 at stride 2, `_haar_weight` as its weight: the
    filters are their own inverse's), the frames dropped as a view (`frames`)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cosmos.CosmosUnpatcher3d",)

    def forward(self, hidden_states):
        levels = self._tconv3d_levels(hidden_states)
        if not levels or hidden_states.shape[1] % 8**levels:
            return super().forward(hidden_states)
        for _ in range(levels):
            weight = _haar_weight(self, hidden_states.shape[1] // 8, hidden_states.dtype, 8**0.5)
            hidden_states = conv_transpose3d(hidden_states, weight, None, 2)
        return frames(hidden_states, self.patch_size - 1)


def _haar_weight(module, channels: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`_haar_filters` of the module's wavelet, made once per channel count, dtype, device and scale (kept on the
    module, outside its state_dict; each call under torch.compile makes its own in the graph)."""
    if torch.compiler.is_compiling():
        return _haar_filters(module.wavelets, channels, dtype, scale)
    memo = module.__dict__.setdefault("_tconv3d_haar_weights", {})
    key = (channels, dtype, module.wavelets.device, scale)
    if key not in memo:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whichever mode the first call ran in
            memo[key] = _haar_filters(module.wavelets, channels, dtype, scale)
    return memo[key]


def _haar_filters(wavelets: torch.Tensor, channels: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """One level of Cosmos's 3-D Haar transform as a conv3d weight, (8 * channels, channels, 2, 2, 2), times `scale`:
    output channel s * channels + c is channel c under subband s = 4a + 2b + w, a, b and w the filters along T, H
    and W (0: the low pass, the wavelet flipped; 1: the high pass, the wavelet with alternating signs), diffusers'
    order of the subbands. The same tensor is the inverse's conv_transpose3d weight (the subbands in, the channels
    out): the transform is orthogonal."""
    w = wavelets.detach().double()
    f = torch.stack([w.flip(0), w * torch.tensor([1.0, -1.0], dtype=w.dtype, device=w.device)])
    taps = torch.einsum("ax,by,cz->abcxyz", f, f, f).reshape(8, 1, 1, 2, 2, 2)
    eye = torch.eye(channels, dtype=w.dtype, device=w.device).reshape(1, channels, channels, 1, 1, 1)
    weight = (taps * eye * scale).reshape(8 * channels, channels, 2, 2, 2)
    return weight.to(dtype).contiguous(memory_format=_CL)


def _repeat(x: torch.Tensor, factors, first_apart: bool = False) -> torch.Tensor:
    """x.repeat_interleave(f, dim) along D, H and W by whole factors, in x's memory format (`repeat_nearest`: one
    broadcast copy, where CUDA's nearest interpolation would copy a channels_last_3d x NCDHW and back; an unbatched
    4-D x as repeat_interleave takes it). `first_apart`: the first frame's repeats along D dropped but one (a causal
    VAE's time upsampling of a clip's first segment), never written."""
    if x.dim() != 5:
        for dim, factor in enumerate(factors):
            x = x.repeat_interleave(factor, dim=x.dim() - 3 + dim)
        return x[..., factors[0] - 1 :, :, :] if first_apart else x
    return repeat_nearest(x, factors, first_apart=first_apart)


class _EasyAnimateCausalConv3d:
    """diffusers' EasyAnimateCausalConv3d (EasyAnimate's MagVit VAE): time padded in front by repeating the first
    frame, or, on later calls, by the frames it kept from the previous one (`prev_features`, a torch.cat), then its
    conv run once per output frame over a window of kd frames (one conv call per frame, then a torch.cat of the
    outputs). Those windows, `t_stride` apart, are one convolution at that stride in time: one op here, the kept
    frames read in place in front of the input, the repeated frames inside it. It keeps the same frames for the
    next call as diffusers does."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_magvit.EasyAnimateCausalConv3d",)
    attributes = ("temporal_padding", "t_stride", "prev_features")

    @staticmethod
    def reason(module) -> str | None:
        reason = conv_reason(module)
        if reason is None and (module.padding[0] != 0 or module.stride[0] != module.t_stride):
            reason = f"its conv's time padding {module.padding[0]} or stride {module.stride[0]} is not diffusers'"
        if reason is None and module.padding_mode not in _FPAD_MODES:
            reason = f"its padding_mode is {module.padding_mode!r}"
        return reason

    def forward(self, hidden_states, bottom_right: int = 0, upsampled: bool = False):
        """diffusers' forward; `bottom_right` (tconv3d's): zeros padded after H and W first (what
        EasyAnimateDownsampler3D's F.pad does), inside the op. The frames kept for the next call are then kept
        unpadded (diffusers keeps them padded): the op pads them with the clip. `upsampled` (tconv3d's, from
        EasyAnimate's upsampler where easyanimate_subpixel_reason allows): the conv of hidden_states upsampled
        nearest 2x in H and W, run as `upsampled_kept_causal_conv`."""
        bottom_right, upsampled = received(bottom_right), received(upsampled)
        if upsampled:
            return upsampled_kept_causal_conv(self, hidden_states)
        if getattr(self, _KEPT_BEFORE_UPSAMPLING, False):  # kept by the sub-pixel form: the input's frames
            if self.prev_features is not None:
                self.prev_features = repeat_nearest(self.prev_features, (1, 2, 2))
            setattr(self, _KEPT_BEFORE_UPSAMPLING, False)
        kept = self.temporal_padding
        if self.prev_features is None:
            front, pad = None, kept
        else:
            front = self.prev_features if self.t_stride != 2 else frames(self.prev_features, -(kept - 1))
            pad = 0
        self.prev_features = _last_frames(front, hidden_states, kept)
        _, hp, wp = self.padding
        # the downsampler's conv pads nothing itself (_EasyAnimateDownsampler.reason): its borders are the zeros
        mode = "zeros" if bottom_right else _FPAD_MODES[self.padding_mode]
        padding = (pad, 0, hp, hp + bottom_right, wp, wp + bottom_right)
        return self._convolve(hidden_states, padding, f"replicate,{mode},{mode}", front)


class _EasyAnimateUpsampler3D:
    """diffusers' EasyAnimateUpsampler3D: nearest 2x in space, its causal conv, then (after a clip's first call,
    where it compresses time) nearest 2x in time: both as broadcast copies in the activation's layout
    (`repeat_nearest`), where CUDA's 3-D nearest kernel copies a channels_last_3d activation NCDHW and back. Its
    trilinear time upsampling (without spatial_group_norm) is tconv3d's `upsample_linear`."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_magvit.EasyAnimateUpsampler3D",)
    attributes = ("conv", "temporal_upsample", "spatial_group_norm", "prev_features")

    def forward(self, hidden_states):
        if easyanimate_subpixel_reason(self.conv, hidden_states) is None:
            hidden_states = self.conv(hidden_states, upsampled=hand(self.conv, True))
        else:
            hidden_states = self.conv(_repeat(hidden_states, (1, 2, 2)))
        if self.temporal_upsample:
            if self.prev_features is None:
                self.prev_features = hidden_states
            elif self.spatial_group_norm:
                hidden_states = _repeat(hidden_states, (2, 1, 1))
            else:
                hidden_states = upsample_linear(hidden_states, (2, 1, 1))
        return hidden_states


class _EasyAnimateResidualBlock:
    """diffusers' EasyAnimateResidualBlock3D: with `spatial_group_norm` its GroupNorms run frame by frame on a
    (B*T, C, H, W) permute of the video, whose results come back NCDHW to the next causal conv (a layout copy
    each). Here each is one tconv3d group_norm over frames of the channels_last_3d activation (frame_group_norm),
    the SiLU after it fused."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_magvit.EasyAnimateResidualBlock3D",)
    attributes = ("norm1", "norm2", "nonlinearity", "conv1", "conv2", "dropout", "shortcut", "spatial_group_norm",
                  "output_scale_factor")  # fmt: skip

    @staticmethod
    def reason(module) -> str | None:
        for norm in (module.norm1, module.norm2):
            if not isinstance(norm, nn.GroupNorm):
                return f"its norm is a {type(norm).__name__}, not an nn.GroupNorm"
        return None

    def _norm_then_activation(self, norm, x):
        if not self.spatial_group_norm:
            return norm_then_activation(norm, self.nonlinearity, x)
        if hooked(norm):  # called on the frames as a batch, as diffusers does, so that its hooks run
            return self.nonlinearity(_on_frames(norm, x))
        if type(self.nonlinearity) is nn.SiLU:  # (a dtype tconv3d does not run: torch's group_norm, normalize)
            return frame_group_norm(norm, x, "silu")
        return self.nonlinearity(frame_group_norm(norm, x))

    def forward(self, hidden_states):
        shortcut = self.shortcut(hidden_states)
        hidden_states = self.conv1(self._norm_then_activation(self.norm1, hidden_states))
        hidden_states = self.dropout(self._norm_then_activation(self.norm2, hidden_states))
        hidden_states = self.conv2(hidden_states)
        return (hidden_states + shortcut) / self.output_scale_factor


class _EasyAnimateDownsampler:
    """diffusers' EasyAnimateDownsampler3D: F.pad of one zero row and column after H and W, then its causal conv
    (stride 2): the padding inside the conv's op."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_magvit.EasyAnimateDownsampler3D",)
    attributes = ("conv",)

    @staticmethod
    def reason(module) -> str | None:
        conv = module.conv
        if class_name(type(conv)) not in _EasyAnimateCausalConv3d.classes:
            return f"its conv is a {type(conv).__name__}"
        if any(conv.padding[1:]) and conv.padding_mode != "zeros":
            return f"its conv pads space in {conv.padding_mode!r} mode after F.pad's zeros"
        return _EasyAnimateCausalConv3d.reason(conv)

    def forward(self, hidden_states):
        return self.conv(hidden_states, bottom_right=hand(self.conv, 1))


class _MiniMaxH3VideoCausalConv3d:
    """diffusers' MiniMaxH3VideoCausalConv3d (MiniMax-H3's video encoder): F.pad in space in its
    spatial_padding_mode (reflect as released), zero frames in front in time, then the conv (whose own padding its
    forward ignores): one op, each dimension padded in its mode inside it. `bottom_right` (tconv3d's): as many more
    rows and columns after H and W in the same mode, what MiniMaxH3VideoDownsample3d pads in front of a conv that
    pads no space itself."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_minimax_h3.MiniMaxH3VideoCausalConv3d",)
    attributes = ("spatial_padding", "temporal_padding", "spatial_padding_mode")

    @staticmethod
    def reason(module) -> str | None:
        if module.spatial_padding_mode not in _FPAD_MODES:
            return f"its spatial_padding_mode {module.spatial_padding_mode!r} is not one tconv3d pads in"
        return conv_reason(module)

    def forward(self, hidden_states, bottom_right: int = 0):
        bottom_right = received(bottom_right)
        p, t, mode = self.spatial_padding, self.temporal_padding, _FPAD_MODES[self.spatial_padding_mode]
        padding = (t, 0, p, p + bottom_right, p, p + bottom_right)
        return self._convolve(hidden_states, padding, f"zeros,{mode},{mode}")


class _MiniMaxH3VideoDownsample3d:
    """diffusers' MiniMaxH3VideoDownsample3d: at a spatial stride of 2, F.pad of one row and column after H and W in
    its spatial_padding_mode, then its causal conv: the padding inside the conv's op."""

    wraps_conv = True  # its forward calls its conv with tconv3d's bottom_right: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kl_minimax_h3.MiniMaxH3VideoDownsample3d",)
    attributes = ("conv", "spatial_stride", "spatial_padding_mode")

    @staticmethod
    def reason(module) -> str | None:
        conv = module.conv
        if class_name(type(conv)) not in _MiniMaxH3VideoCausalConv3d.classes:
            return f"its conv is a {type(conv).__name__}"
        stride_padded = module.spatial_stride == 2
        if stride_padded and (conv.spatial_padding or conv.spatial_padding_mode != module.spatial_padding_mode):
            return "its conv pads space after F.pad, or in another mode"
        return _MiniMaxH3VideoCausalConv3d.reason(conv)

    def forward(self, hidden_states):
        return self.conv(hidden_states, bottom_right=hand(self.conv, 1 if self.spatial_stride == 2 else 0))


class _MiniMaxH3VideoGroupNorm:
    """diffusers' MiniMaxH3VideoGroupNorm normalises each frame on its own, through an NCDHW copy of the video
    (permute + contiguous) and another back: one tconv3d group_norm over the frames' view of a channels_last_3d
    input instead (frame_group_norm), no copy. The blocks that follow it with a SiLU fuse the SiLU
    (`_frame_norm_silu`)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_minimax_h3.MiniMaxH3VideoGroupNorm",)
    attributes = ("num_groups", "eps")

    @staticmethod
    def reason(module) -> str | None:
        if module.weight is not None and module.weight.dtype not in SUPPORTED_DTYPES:
            return f"its weight is {module.weight.dtype}"
        return None

    def forward(self, hidden_states, activation: str | None = None):
        if hidden_states.dim() != 5 or hidden_states.dtype not in SUPPORTED_DTYPES:
            hidden_states = super().forward(hidden_states)
            return F.silu(hidden_states) if activation == "silu" else hidden_states
        return frame_group_norm(self, hidden_states, activation)


def _frame_norm_silu(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """F.silu(norm(x)), one fused pass where the norm is a converted MiniMaxH3VideoGroupNorm."""
    if getattr(type(norm), "tconv3d_adapter", None) is _MiniMaxH3VideoGroupNorm:
        return norm(x, activation="silu")
    return F.silu(norm(x))


class _MiniMaxH3VideoResnetBlock3d:
    """diffusers' MiniMaxH3VideoResnetBlock3d, each norm's SiLU fused into it."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_minimax_h3.MiniMaxH3VideoResnetBlock3d",)
    attributes = ("norm1", "norm2", "conv1", "conv2", "conv_shortcut")

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.conv1(_frame_norm_silu(self.norm1, hidden_states))
        hidden_states = self.conv2(_frame_norm_silu(self.norm2, hidden_states))
        if self.conv_shortcut is not None:
            residual = self.conv_shortcut(residual)
        return residual + hidden_states


class _MiniMaxH3VideoEncoder3d:
    """diffusers' MiniMaxH3VideoEncoder3d, its last norm's SiLU fused into it."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_minimax_h3.MiniMaxH3VideoEncoder3d",)
    attributes = ("conv_in", "down_blocks", "norm_out", "conv_out")

    def forward(self, hidden_states):
        hidden_states = self.conv_in(hidden_states)
        for down_block in self.down_blocks:
            hidden_states = down_block(hidden_states)
        return self.conv_out(_frame_norm_silu(self.norm_out, hidden_states))


class _KVAESafeConv3d:
    """diffusers' KVAESafeConv3d (Kandinsky 5's video VAE): above 3 GB of input it splits time into overlapping
    chunks (clones and torch.cat copies) to keep cuDNN in bounds. tconv3d's kernels index with int64, so the whole
    clip is one op; `write_to`, where given, receives the result as diffusers' does. `upsampled` as
    tconv3d.nn.Conv3d's (the upsampler's spatial conv)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_kvae_video.KVAESafeConv3d",)
    attributes = ()

    @staticmethod
    def reason(module) -> str | None:
        return conv_reason(module)

    def forward(self, input, write_to=None, upsampled=None):
        output = Conv3d.forward(self, input, upsampled=upsampled)
        if write_to is None:
            return output
        write_to[...] = output
        return write_to


class _KVAECachedCausalConv3d:
    """diffusers' KVAECachedCausalConv3d: F.pad in space (replicate), then in front in time the previous chunk's
    last frames (`cache["padding"]`) or the first frame repeated, over two conv calls into a preallocated output and
    a torch.cat: one op, the cached frames read in place as frames_before, the rest of the padding inside it. The
    cache keeps the frames the next chunk reads, as diffusers does but not padded in space (the op pads them)."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kl_kvae_video.KVAECachedCausalConv3d",)
    attributes = ("conv", "height_pad", "width_pad", "time_pad", "time_kernel_size", "stride")

    @staticmethod
    def reason(module) -> str | None:
        reason = conv_reason(module.conv)
        if reason is None and (any(module.conv.padding) or tuple(module.conv.stride) != tuple(module.stride)):
            reason = "its conv pads, or strides otherwise, on its own"
        return reason

    def forward(self, input, cache):
        front = cache["padding"]
        # diffusers' F.pad pads W by height_pad and H by width_pad (equal for its square kernels)
        space = (self.width_pad, self.width_pad, self.height_pad, self.height_pad)
        time = (self.time_pad, 0) if front is None else (0, 0)
        output = self.conv.convolve(input, (*time, *space), "replicate", front)
        # the frames diffusers keeps for the next chunk: from its pad_offset on
        stride, kernel = self.stride[0], self.time_kernel_size
        ahead = self.time_pad if front is None else front.shape[2]
        offset_in = math.ceil(ahead / stride) * stride - ahead
        kept = offset_in + stride * math.trunc((input.shape[2] - offset_in - kernel) / stride) + stride
        cache["padding"] = channels_last(frames(input, kept), clone=True)
        return output


class _Kandinsky6SRCausalConv3d:
    """diffusers' Kandinsky6SRCausalConv3d (Kandinsky 6's SR VAE): KVAE's cached causal conv with zeros in space,
    the cache carried as diffusers does (across a segment too short to fill it, the frames it had before too): one
    op, the cached (or repeated first) frames in front, where diffusers runs two convs into a preallocated output."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6SRCausalConv3d",)
    attributes = ("conv", "height_pad", "width_pad", "time_pad", "time_kernel_size", "time_stride")

    @staticmethod
    def reason(module) -> str | None:
        reason = conv_reason(module.conv)
        if reason is None and (any(module.conv.padding) or module.conv.stride[0] != module.time_stride):
            reason = "its conv pads, or strides otherwise, on its own"
        return reason

    def forward(self, hidden_states, cache):
        front = cache["padding"]
        space = (self.height_pad, self.height_pad, self.width_pad, self.width_pad)
        if front is None:
            output = self.conv.convolve(hidden_states, (self.time_pad, 0, *space), "replicate,zeros,zeros")
        else:
            output = self.conv.convolve(hidden_states, (0, 0, *space), "zeros", front)
        # the frames diffusers keeps for the next segment: from its pad_offset on, of the padding and the input
        stride, kernel, count = self.time_stride, self.time_kernel_size, hidden_states.shape[2]
        ahead = self.time_pad if front is None else front.shape[2]
        offset_in = math.ceil(ahead / stride) * stride - ahead
        kept = offset_in + stride * math.trunc((count - offset_in - kernel) / stride) + stride
        if kept >= 0:
            cache["padding"] = channels_last(frames(hidden_states, kept), clone=True)
        else:
            cache["padding"] = _last_frames(front, hidden_states, count + min(-kept, ahead))
        # diffusers writes its convs' outputs into a tensor of the input's dtype: under autocast, the conv's bf16
        # in a float32 tensor
        return output if output.dtype == hidden_states.dtype else output.to(hidden_states.dtype)


class _VidTokCausalConv3d:
    """diffusers' VidTokCausalConv3d (VidTok): the first chunk's first frame repeated time_pad times in front, or
    the previous chunk's last frames (`causal_cache`), concatenated; then F.pad in space in its pad_mode; then its
    conv. One op: the cached frames read in place as frames_before, both paddings inside. diffusers keeps a clone
    of the whole concatenated input (less its last `cache_offset` frames) as the cache and reads its last time_pad
    frames; here only those are kept."""

    wraps_conv = True  # its forward calls self.conv.convolve: the conv is taken over with it
    classes = ("diffusers.models.autoencoders.autoencoder_vidtok.VidTokCausalConv3d",)
    attributes = ("conv", "pad_mode", "time_pad", "spatial_padding", "is_first_chunk", "causal_cache", "cache_offset")

    @staticmethod
    def reason(module) -> str | None:
        reason = conv_reason(module.conv)
        if reason is None and (any(module.conv.padding) or module.time_pad < 0):
            reason = "its conv pads on its own, or its stride exceeds its window in time"
        if reason is None and module.pad_mode not in _FPAD_MODES:
            reason = f"its pad_mode {module.pad_mode!r} is not one tconv3d pads with"
        return reason

    def forward(self, x):
        wl, wr, ht, hb = self.spatial_padding[:4]
        mode, pad = _FPAD_MODES[self.pad_mode], self.time_pad
        if self.is_first_chunk:
            front = first_frame_repeated(x, pad) if pad else None
            output = self.conv.convolve(x, (pad, 0, ht, hb, wl, wr), f"replicate,{mode},{mode}")
        else:
            cached = self.causal_cache
            front = frames(cached, max(cached.shape[2] - pad, 0)) if pad and cached.shape[2] else None
            output = self.conv.convolve(x, (0, 0, ht, hb, wl, wr), f"zeros,{mode},{mode}", front)
        # the last time_pad frames of what diffusers keeps: torch.cat([front, x], 2) less its last cache_offset
        ahead = 0 if front is None else front.shape[2]
        end = max(ahead + x.shape[2] - self.cache_offset, 0)
        start = max(end - pad, 0)
        if start >= ahead:
            tail = frames(x, start - ahead, end - ahead)
        else:
            tail = torch.cat([frames(front, start, min(end, ahead)), frames(x, 0, max(end - ahead, 0))], dim=2)
        self.causal_cache = channels_last(tail, clone=True)
        return output


class _AllegroTemporalConvLayer:
    """diffusers' AllegroTemporalConvLayer: four (GroupNorm, SiLU, [Dropout], Conv3d) stages over the frames of a
    (B*T, C, H, W) activation viewed as a video, each but the resampling one after `_pad_temporal_dim` (two
    torch.cats repeating the first and last frame). The norm's statistics count those repeated frames, so the
    padding is made here too (one torch.cat, channels_last_3d), not folded into the op; each stage is then one
    fused norm pass and one op. The upsampling conv's channel pairs are interleaved into frames in one
    channels_last_3d write (diffusers' flatten answers NCDHW), and the identity's repeats are nearest
    interpolation. With channels_last frames (what convert makes of Allegro's: FRAME_BLOCKS) the views between
    the 2-D and 3-D layers are free."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_allegro.AllegroTemporalConvLayer",)
    attributes = ("conv1", "conv2", "conv3", "conv4", "down_sample", "up_sample")

    @staticmethod
    def reason(module) -> str | None:
        for stage in (module.conv1, module.conv2, module.conv3, module.conv4):
            conv = stage[-1] if isinstance(stage, nn.Sequential) else None
            reason = conv_reason(conv) if conv is not None else "a stage without its Conv3d last"
            if reason is None and not isinstance(stage[0], nn.GroupNorm):
                reason = "a stage that does not start with its GroupNorm"
            if reason:
                return reason
        return None

    @staticmethod
    def _stage(stage: nn.Sequential, x: torch.Tensor, repeat_ends: bool) -> torch.Tensor:
        if repeat_ends:  # diffusers' _pad_temporal_dim: the first and last frame once more at each end
            x = torch.cat([frames(x, 0, 1), x, frames(x, -1)], dim=2)
        x = norm_then_activation(stage[0], stage[1], x)
        for layer in stage[2:]:  # the Dropout, the conv
            x = layer(x)
        return x

    def forward(self, hidden_states, batch_size):
        # a view with channels_last_3d's own strides: of one frame, diffusers' view had degenerate ones, and the
        # concatenation of the repeated frames answered NCDHW into each stage's norm (a clip of 3 or 4 frames)
        x = _frames_to_video(hidden_states, batch_size, hidden_states.shape[0] // batch_size)
        if self.down_sample:
            identity = frames(x, step=2)
        elif self.up_sample:
            identity = _repeat(x, (2, 1, 1))
        else:
            identity = x
        resampling = self.down_sample or self.up_sample
        h = self.tconv3d_adapter._stage(self.conv1, x, not resampling)
        if self.up_sample:  # channel halves (s, c) into frames 2t + s
            b, channels, t, height, width = h.shape
            interleaved = empty_for((b, channels // 2, 2 * t, height, width), h)
            interleaved.unflatten(2, (t, 2)).copy_(h.unflatten(1, (2, -1)).permute(0, 2, 3, 1, 4, 5))
            h = interleaved
        for stage in (self.conv2, self.conv3, self.conv4):
            h = self.tconv3d_adapter._stage(stage, h, True)
        return (identity + h).permute(0, 2, 1, 3, 4).flatten(0, 1)


class _KVAECachedSpatialNorm3D:
    """diffusers' KVAECachedSpatialNorm3D: the latent zq interpolated (nearest) to the features' size in one call
    on the channels_last_3d latent, where diffusers interpolates it 32 channels at a time (each chunk a strided
    view, interpolated into NCDHW) and concatenates them; on a clip's first segment its first frame on its own, the
    others together, as diffusers does, without concatenating them (`_nearest_first_apart`; one latent frame:
    resized to one frame). Then the norm, scaled and shifted by its 1x1x1 convs of zq."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_kvae_video.KVAECachedSpatialNorm3D",)
    attributes = ("norm_layer", "add_conv", "conv_y", "conv_b")

    def forward(self, f, zq, cache):
        if cache["norm"].get("mean") is None and cache["norm"].get("var") is None:
            frames, height, width = f.shape[-3:]
            zq = _nearest_first_apart(zq, (frames if zq.shape[2] > 1 else 1, height, width))
        else:
            zq = resize_nearest(zq, tuple(f.shape[-3:]))
        if self.add_conv:
            zq = self.conv(zq, cache["add_conv"])
        return self.norm_layer(f, cache["norm"]) * self.conv_y(zq) + self.conv_b(zq)


class _Kandinsky6SRSpatialNorm3D:
    """diffusers' Kandinsky6SRSpatialNorm3D: the latent zq interpolated (nearest) to the features' size, 32
    channels at a time and concatenated there (on a clip's first segment, its first frame on its own and the others
    together, concatenated in time; one latent frame: resized to one frame): here in one interpolation of the
    channels_last_3d latent (`_nearest_first_apart`), no concatenation. Then the norm, scaled and shifted by its
    1x1x1 convs of zq."""

    classes = ("diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6SRSpatialNorm3D",)
    attributes = ("norm_layer", "conv_y", "conv_b")

    def forward(self, hidden_states, zq, cache):
        frames, height, width = hidden_states.shape[-3:]
        if cache["is_first_segment"]:
            resized = _nearest_first_apart(zq, (frames if zq.shape[2] > 1 else 1, height, width))
        else:
            resized = resize_nearest(zq, (frames, height, width))
        output = self.norm_layer(hidden_states) * self.conv_y(resized) + self.conv_b(resized)
        cache["is_first_segment"] = False
        return output


class _Kandinsky6SRDownsample:
    """diffusers' Kandinsky6SRDownsample: its pixel-unshuffle mean (the video permuted into (B*T, C, H, W) frames,
    unshuffled, pairs of sub-pixels averaged, permuted back) is an average of W pairs with H's parity moved into the
    channels, added into the strided conv's channels_last_3d output through a view of it; its temporal mean (a
    (B*H*W, C, T) copy, pooled, the first frame of a clip's first segment kept) a 2-frame average pool added into
    the temporal convs' output: both on the activation where it lies."""

    classes = ("diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6SRDownsample",)
    attributes = ("compress_time", "spatial_conv", "linear")

    def forward(self, hidden_states, cache):
        c, h, w = hidden_states.shape[1], hidden_states.shape[3], hidden_states.shape[4]
        out = self.spatial_conv(hidden_states)  # (B, 2C, T, H/2, W/2): channel 2c + i, row 2y + i's W pair mean
        pairs = block_mean(hidden_states[..., : h // 2 * 2, : w // 2 * 2], (1, 1, 2))  # (B, C, T, H, W/2)
        pairs = pairs.unflatten(3, (h // 2, 2)).permute(0, 1, 4, 2, 3, 5)  # (B, C, 2, T, H/2, W/2)
        out.unflatten(1, (c, 2)).add_(pairs)
        if not self.compress_time:
            return self.linear(out)
        first_segment = cache["temporal_conv"][0]["padding"] is None
        conv_out = self.temporal_conv[0](out, cache["temporal_conv"][0])
        conv_out = self.temporal_conv[1](conv_out, cache["temporal_conv"][1])
        if first_segment:  # the first frame kept, the others in pairs
            conv_out[:, :, :1].add_(frames(out, 0, 1))
            if out.shape[2] > 1:
                conv_out[:, :, 1:].add_(block_mean(frames(out, 1), (2, 1, 1)))
        else:
            conv_out.add_(block_mean(out, (2, 1, 1)))
        return self.linear(conv_out)


class _Kandinsky6SRUpsample:
    """diffusers' Kandinsky6SRUpsample: frames repeated in time on the channels_last_3d activation (`_repeat`:
    nearest interpolation in its memory format), where diffusers' repeat_interleave answers a fresh NCDHW copy;
    pixels repeated in space, its spatial conv and their sum as one sub-pixel conv plus a broadcast add
    (`_pixels_repeated_plus_conv`)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6SRUpsample",)
    attributes = ("compress_time", "spatial_conv", "linear")

    def forward(self, hidden_states, cache):
        if self.compress_time:
            repeated = _repeat(hidden_states, (2, 1, 1), first_apart=cache["temporal_conv"]["padding"] is None)
            hidden_states = self.temporal_conv(repeated, cache["temporal_conv"]) + repeated
        return self.linear(_pixels_repeated_plus_conv(self.spatial_conv, hidden_states))


def _pixels_repeated_plus_conv(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """u + conv(u), u = x repeated by nearest 2x in H and W (Kandinsky 6's SR VAE's and latent upscalers'
    upsamplers, their conv 1 x 3 x 3 zero-padded in space; KVAE's, reflect-padded), as `_conv_plus_repeats`: the
    conv takes upsampled=(1, 2, 2) where its forward is tconv3d.nn.Conv3d's or passes it on (KVAE's: one sub-pixel
    transposed conv of x, 4 taps an output voxel where 9, where subpixel.upsampled_conv_reason allows; else of u,
    inside it). A conv that takes no `upsampled` (one convert left alone) or an unbatched x gets u."""
    forward = type(conv).forward
    forward = getattr(forward, "__wrapped__", forward)  # (an adapted class's, wrapped for torch.fx by convert)
    takes_upsampled = forward in (Conv3d.forward, _KVAESafeConv3d.forward)
    return _conv_plus_repeats(conv, x, (1, 2, 2), x.dim() == 5 and takes_upsampled)


_K6UP = "diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr."


class _Kandinsky6SRLatentUpscaler:
    """diffusers' Kandinsky6SRLatentUpscaler (Kandinsky 6's latent upscalers, 2x and 4x in space): the latent, which
    its first conv and every modulated norm's 1x1x1 convs read, laid out channels_last_3d once (the input's edge)
    where each of those convs took a layout copy of it."""

    classes = (_K6UP + "Kandinsky6SRLatentUpscaler",)
    attributes = ("scale",)

    def forward(self, latents):
        if latents.dim() == 5:
            latents = channels_last(latents)
        return super().forward(latents)


class _Kandinsky6SRLatentUpscalerConv3d(_PaddedConv):
    """diffusers' Kandinsky6SRLatentUpscalerConv3d: the edge frames repeated along time (F.pad, replicate: a copy
    of the activation), then its conv (itself) with zeros in space: one op, both paddings inside."""

    classes = (_K6UP + "Kandinsky6SRLatentUpscalerConv3d",)
    attributes = ("temporal_pad",)

    @staticmethod
    def _conv(module) -> nn.Conv3d:
        return module

    @staticmethod
    def _padding(module):
        pad = module.temporal_pad
        return _compose_padding([pad, pad, 0, 0, 0, 0], ("replicate", "zeros", "zeros"), module)


class _Kandinsky6SRLatentUpscalerModulatedNorm:
    """diffusers' Kandinsky6SRLatentUpscalerModulatedNorm: the features' RMS norm times conv_y(zq) plus conv_b(zq),
    zq (the latent) resized (nearest) to the features' size first. The upscalers' features are the latent's size
    times 1, 2 or 4 in space, and a 1x1x1 conv commutes with nearest resizing: here conv_y and conv_b run on the
    latent itself and their outputs are broadcast over each latent voxel's copies in one pass (`_modulate`), where
    diffusers resizes the latent to full size, runs both convs there and writes y and b at full size (twice the
    features' channels) before the product and the sum. Other sizes: diffusers' arithmetic on the resized latent."""

    classes = (_K6UP + "Kandinsky6SRLatentUpscalerModulatedNorm",)
    attributes = ("norm", "conv_y", "conv_b")

    def forward(self, hidden_states, zq):
        normalized = self.norm(hidden_states)
        steps = nearest_steps(zq.shape[2:], hidden_states.shape[2:]) if hidden_states.dim() == zq.dim() == 5 else None
        if steps is None or steps[0] != (1, 1, 1):
            if zq.shape[2:] != hidden_states.shape[2:]:
                zq = resize_nearest(zq, tuple(hidden_states.shape[2:]))
            return normalized * self.conv_y(zq) + self.conv_b(zq)
        return _modulate(normalized, self.conv_y(zq), self.conv_b(zq), steps[1])


def _modulate(normalized: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, factors) -> torch.Tensor:
    """normalized * resized(scale) + resized(shift), scale and shift resized (nearest) by whole factors: one addcmul
    over a view of `normalized` split by the factors, scale and shift broadcast over each voxel's copies (in
    `normalized`'s layout); its backward sums their gradients over the copies."""
    b, c, d, h, w = normalized.shape
    fd, fh, fw = factors
    split = normalized.view(b, c, d // fd, fd, h // fh, fh, w // fw, fw)
    spread = (slice(None),) * 3 + (None, slice(None), None, slice(None), None)
    return torch.addcmul(shift[spread], split, scale[spread]).reshape(b, c, d, h, w)


class _Kandinsky6SRLatentUpscalerUpsample:
    """diffusers' Kandinsky6SRLatentUpscalerUpsample: nearest 2x in space, its per-frame conv's residual, then the
    pointwise conv. The first two as one sub-pixel conv of the input plus a broadcast add of it
    (`_pixels_repeated_plus_conv`): the upsampled input is never written (diffusers' F.interpolate, on CUDA, also
    copied a channels_last_3d activation NCDHW and back)."""

    classes = (_K6UP + "Kandinsky6SRLatentUpscalerUpsample",)
    attributes = ("spatial_conv", "linear")

    def forward(self, hidden_states):
        if hidden_states.dim() != 5:
            hidden_states = F.interpolate(hidden_states, scale_factor=(1, 2, 2), mode="nearest")
            return self.linear(hidden_states + self.spatial_conv(hidden_states))
        return self.linear(_pixels_repeated_plus_conv(self.spatial_conv, hidden_states))


class _HunyuanVideoHistoryPatchEmbed:
    """diffusers' HunyuanVideoHistoryPatchEmbed (HunyuanVideo FramePack's patch embeddings of the clean history
    latents): the 2x and 4x latents replicate-padded at their ends to whole patches (F.pad, a copy of each), then
    their patch convs (kernel = stride): one op each with the padding inside. The tokens' flatten as diffusers'
    (contiguous as it is: the convs answer channels_last_3d)."""

    classes = ("diffusers.models.transformers.transformer_hunyuan_video_framepack.HunyuanVideoHistoryPatchEmbed",)
    attributes = ("proj", "proj_2x", "proj_4x")

    def forward(self, latents_clean=None, latents_clean_2x=None, latents_clean_4x=None):
        tokens = []
        for conv, latents, padded in ((self.proj, latents_clean, False), (self.proj_2x, latents_clean_2x, True),
                                      (self.proj_4x, latents_clean_4x, True)):  # fmt: skip
            if latents is not None:
                latents = _patch_embedding(conv, latents, padded).flatten(2).transpose(1, 2)
            tokens.append(latents)
        return tuple(tokens)


def _patch_embedding(conv: nn.Conv3d, latents: torch.Tensor, padded: bool) -> torch.Tensor:
    """conv (kernel = stride) of `latents`, replicate-padded at the ends to whole patches where `padded` (FramePack's
    _pad_for_3d_conv): inside the op where convert took the conv over."""
    ends = [(-size) % k for size, k in zip(latents.shape[2:], conv.kernel_size, strict=True)] if padded else [0] * 3
    if not any(ends):
        return conv(latents)
    composed = _compose_padding([0, ends[0], 0, ends[1], 0, ends[2]], ("replicate",) * 3, conv)
    if isinstance(conv, Conv3d) and latents.dim() == 5 and composed is not None:
        return conv.convolve(latents, *composed)
    return conv(F.pad(latents, (0, ends[2], 0, ends[1], 0, ends[0]), mode="replicate"))


class _KVAECachedPXSDownsample:
    """diffusers' KVAECachedPXSDownsample: its pixel-unshuffle mean (the video copied frame by frame into a (B*T, C,
    H, W) tensor, unshuffled, averaged, permuted back) is a 2x2 average pool in space, and its temporal mean (a
    (B*H*W, C, T) copy, pooled, permuted back) a 2-frame average pool in time (the first frame of a clip's first
    segment kept): both pooled on the channels_last_3d activation where it lies."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_kvae_video.KVAECachedPXSDownsample",)
    attributes = ("factor", "temporal_compress", "spatial_conv", "linear")

    @staticmethod
    def reason(module) -> str | None:
        return None if module.factor == 2 else f"its factor is {module.factor}, not 2"

    def forward(self, x, cache):
        out = self.spatial_conv(x) + block_mean(x, (1, 2, 2))
        if self.temporal_compress:
            if cache[0]["padding"] is None and out.shape[2] > 1:  # the first frame, then the others in pairs
                pooled = torch.cat([frames(out, 0, 1), block_mean(frames(out, 1), (2, 1, 1))], dim=2)
            elif cache[0]["padding"] is None:
                pooled = out
            else:
                pooled = block_mean(out, (2, 1, 1))
            out = self.temporal_conv(out, cache[0]) + pooled
        return self.linear(out)


class _KVAECachedPXSUpsample:
    """diffusers' KVAECachedPXSUpsample: frames repeated in time on the channels_last_3d activation (`_repeat`:
    nearest interpolation in its memory format), where diffusers interpolates a (B, T*C, H, W) copy and permutes it
    back; the pixels' 2x and the 1 x 3 x 3 spatial conv of it (reflect-padded by 1: of a repetition, its edge voxel,
    as replicate) one transposed conv of x replicate-padded by 1 (`upsampled=(1, 2, 2)`, tconv3d.nn.Conv3d's: 4
    taps an output voxel where 9, a copy about x's size where the repetition is 4 times it), the repetition added
    into its output by broadcasting (`_pixels_repeated_plus_conv`); its last conv's result returned, not copied into
    a fresh tensor first."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_kvae_video.KVAECachedPXSUpsample",)
    attributes = ("factor", "temporal_compress", "spatial_conv", "linear")

    @staticmethod
    def reason(module) -> str | None:
        return None if module.factor == 2 else f"its factor is {module.factor}, not 2"

    def forward(self, x, cache):
        if self.temporal_compress:
            factor = 2 if x.shape[2] > 1 else 1
            tail = _repeat(x, (factor, 1, 1), first_apart=cache["padding"] is None)
            x = self.temporal_conv(tail, cache) + tail
        return self.linear(_pixels_repeated_plus_conv(self.spatial_conv, x))


def first_frame_repeated(x: torch.Tensor, count: int) -> torch.Tensor:
    """x's first frame repeated `count` times along D (a view): what a causal conv puts in front of a clip's first
    chunk. A clip of no frames has none to repeat: a ValueError that says so (the expand's own error named sizes
    alone; stock's blocks refuse such a clip too, each in its own words)."""
    if x.shape[2] == 0:
        raise ValueError(
            f"a causal conv repeats its input's first frame in front of it, and input {tuple(x.shape)} has no frames"
        )
    return frames(x, 0, 1).expand(-1, -1, count, -1, -1)


def _last_frames(front, x, count: int) -> torch.Tensor:
    """torch.cat([front, x], dim=2)[:, :, -count:] as a new channels_last_3d tensor, the first frame of x
    repeated where front is None (count == 0: all of it, as Python's [-0:]; x alone is cloned as it is): the
    frames a video VAE's causal conv keeps for its next chunk (CogVideoX's conv_cache, EasyAnimate's
    prev_features)."""
    if count and x.shape[2] >= count:
        return channels_last(frames(x, -count), clone=True)
    if front is None:
        if not count:
            return x.clone()
        front = first_frame_repeated(x, count)
    if count:  # only the front's frames that are kept, written once (not a concatenation cloned again)
        front = frames(front, -(count - x.shape[2]))
    kept = empty_for((*x.shape[:2], front.shape[2] + x.shape[2], *x.shape[3:]), x, front)
    kept[:, :, : front.shape[2]] = front
    kept[:, :, front.shape[2] :] = x
    return kept


def norm_then_activation(norm: nn.Module, activation: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """activation(norm(x)), as one fused pass when the norm is tconv3d's, the activation a SiLU and calling the norm
    runs no hooks (`hooked`: they run, as in diffusers)."""
    if (
        isinstance(norm, (GroupNorm, InstanceNorm3d))
        and norm.activation is None
        and type(activation) is nn.SiLU
        and not hooked(norm)
    ):
        instance = isinstance(norm, InstanceNorm3d)
        if not instance or norm.on_kernels(x):
            groups = x.shape[1] if instance else norm.num_groups
            return normalize(x, groups, norm.weight, norm.bias, norm.eps, "silu", instance=instance)
    return activation(norm(x))


class _HunyuanVideoResnetBlock:
    """diffusers' HunyuanVideoResnetBlockCausal3D without the `.contiguous()` its forward starts with, which
    copies every channels_last_3d activation to NCDHW (and the next norm back); norm + SiLU fused."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video.HunyuanVideoResnetBlockCausal3D",)
    attributes = ("norm1", "norm2", "conv1", "conv2", "nonlinearity", "dropout", "conv_shortcut")

    def forward(self, hidden_states):
        residual = hidden_states
        hidden_states = self.conv1(norm_then_activation(self.norm1, self.nonlinearity, hidden_states))
        hidden_states = norm_then_activation(self.norm2, self.nonlinearity, hidden_states)
        hidden_states = self.conv2(self.dropout(hidden_states))
        if self.conv_shortcut is not None:
            residual = self.conv_shortcut(residual)
        return hidden_states + residual


class _HunyuanVideoUpsample:
    """diffusers' HunyuanVideoUpsampleCausal3D: the first frame upsampled in space, the others in space and time,
    then its conv. diffusers interpolates the two parts and concatenates them (and makes the other frames
    NCDHW-contiguous first, a workaround for pytorch#81665). Here, at factors (2, 2, 2) or (1, 2, 2) with its
    3 x 3 x 3 causal conv, the upsampling and the conv are one transposed conv of the input itself
    (`upsampled_causal_conv`: nothing of the upsampled size written); otherwise, with whole-number factors,
    nearest-neighbour upsampling is a broadcast, both parts written straight into one channels_last_3d input."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuan_video.HunyuanVideoUpsampleCausal3D",)
    attributes = ("conv", "upsample_factor")

    @staticmethod
    def reason(module) -> str | None:
        factors = module.upsample_factor
        if not all(float(f).is_integer() and f >= 1 for f in factors):
            return f"upsample_factor {tuple(factors)} is not whole numbers"
        return None

    def forward(self, hidden_states):
        factors = tuple(int(f) for f in self.upsample_factor)
        if causal_subpixel_reason(self.conv, hidden_states, factors) is None:
            return self.conv(hidden_states, upsampled_by=hand(self.conv, factors))
        return self.conv(repeat_nearest(hidden_states, factors, _CL, first_apart=True))


class _CogVideoXUpsample3D:
    """diffusers' CogVideoXUpsample3D: nearest 2x in space, and in time where it compresses time (an odd count of
    frames: the first frame in space only), then its 2-D conv on the frames. diffusers interpolates a 5-D
    activation (CUDA's 3-D nearest kernel copies a channels_last_3d one NCDHW and back) and concatenates the
    first frame's part, then convolves each frame; here the space upsampling and the frames' 2-D conv are one
    transposed conv of the input (`upsampled_frame_conv`), and its output is repeated in time (`repeat_nearest`,
    the first frame apart) where diffusers repeats its input."""

    classes = ("diffusers.models.upsampling.CogVideoXUpsample3D",)
    attributes = ("conv", "compress_time")

    def forward(self, inputs):
        t = inputs.shape[2]
        if self.compress_time and t > 1 and t % 2 == 1:
            return upsampled_frame_conv(self.conv, inputs, 2, first_apart=True)
        # an even count compressed: all frames in time too; one frame, or time kept: space only
        return upsampled_frame_conv(self.conv, inputs, 2 if self.compress_time and t > 1 else 1)


class _CogVideoXDownsample3D:
    """diffusers' CogVideoXDownsample3D: where it compresses time, the frames' pairs averaged (an odd count: the
    first frame kept) through a (B*H*W, C, T) copy of the activation, avg_pool1d and a torch.cat; here one mean over
    the activation's channels_last_3d view written beside the first frame in one result. Then diffusers' F.pad of
    a row and a column and its stride-2 2-D conv on the frames: one tconv3d conv, the pad inside (`frame_conv`)."""

    classes = ("diffusers.models.downsampling.CogVideoXDownsample3D",)
    attributes = ("conv", "compress_time")

    def forward(self, x):
        if self.compress_time and x.shape[2] > 1:
            b, c, t, h, w = x.shape
            first = t % 2
            pooled = empty_for((b, c, first + t // 2, h, w), x, memory_format=layout_of(x))
            if first:
                pooled[:, :, :1] = frames(x, 0, 1)
            pooled[:, :, first:] = block_mean(frames(x, first), (2, 1, 1))
            x = pooled
        return frame_conv(self.conv, x, (0, 1, 0, 1))


class FrameConv2d(nn.Conv2d):
    """The nn.Conv2d a resampler runs on a video's frames (FRAME_CONV_BLOCKS; convert changes its class in place):
    nn.Conv2d's forward, and forward(video, frames=Handed((kind, arguments))) that conv on each frame of the
    5-D video on tconv3d, `frame_conv`'s ("pad", (pad,)) or `upsampled_frame_conv`'s ("upsampled", (time_factor,
    first_apart)).
    The resampler's adapter calls it so where calling the conv runs hooks (hooks.hooked: diffusers' layerwise
    casting casts its weight in them, offloading moves it in), so that they run; else it reads the weight."""

    def forward(self, input: torch.Tensor, frames=None) -> torch.Tensor:
        if isinstance(input, Proxy):  # recorded whole by torch.fx, as an nn.Conv2d is
            return fx_leaf(self, (input,), given(frames=frames))
        if frames is None:
            return super().forward(input)
        kind, handed = received(frames)
        if kind == "upsampled":
            time_factor, first_apart = handed
            if subpixel_reason(self, input, in_call=True) is None:
                return _upsampled_frame_conv(self, input, time_factor, first_apart)
            input, pad = repeat_nearest(input, (time_factor, 2, 2), first_apart=first_apart), (0, 0, 0, 0)
        else:
            (pad,) = handed
        if frame_conv_reason(self, input, in_call=True) is None:
            return _frame_conv(self, input, pad)
        return _on_frames(functools.partial(nn.Conv2d.forward, self), F.pad(input, pad) if any(pad) else input)


def _called_for_frames(conv: nn.Module) -> bool:
    """Whether `frame_conv` and `upsampled_frame_conv` run `conv` through its call (FrameConv2d's forward)."""
    return type(conv) is FrameConv2d and hooked(conv)


def frame_conv(conv: nn.Conv2d, x: torch.Tensor, pad=(0, 0, 0, 0)) -> torch.Tensor:
    """`conv` on each frame of a 5-D x zero-padded by `pad` first (F.pad's order: W left, W right, H top, H bottom),
    what diffusers' Wan and CogVideoX resamplers compute on the frames as a batch: one tconv3d conv3d over the
    video with a (1, kh, kw) view of conv's weight (channels_last, convert's: a channels_last_3d view, no copy),
    `pad` added to conv's padding inside the op, the result channels_last_3d. Its weight gradient lands in the
    Conv2d's parameter. Where tconv3d cannot run it (`frame_conv_reason`), F.pad and conv on the frames as a
    batch, as diffusers does. A hooked FrameConv2d runs it inside its call."""
    if frame_conv_reason(conv, x) is not None:
        return _on_frames(conv, F.pad(x, pad) if any(pad) else x)
    if _called_for_frames(conv):
        return conv(x, frames=Handed(("pad", (pad,))))
    return _frame_conv(conv, x, pad)


def _frame_conv(conv: nn.Conv2d, x: torch.Tensor, pad) -> torch.Tensor:
    (ph, pw), (wl, wr, ht, hb) = conv.padding, pad
    padding = (0, 0, ph + ht, ph + hb, pw + wl, pw + wr)  # the op's order: D front, D back, H top, ..., W right
    weight = conv.weight.unsqueeze(2)
    return call_conv3d(x, weight, conv.bias, (1, *conv.stride), padding, (1, *conv.dilation), conv.groups, "zeros",
                       None, None)  # fmt: skip


def frame_conv_reason(conv: nn.Module, x: torch.Tensor, in_call: bool = False) -> str | None:
    """Why `frame_conv` cannot run `conv` on x's frames on tconv3d (None if it can). A hooked FrameConv2d's weight
    is what its hooks make it for the call: its dtype is asked there (`in_call`)."""
    if type(conv) not in (nn.Conv2d, FrameConv2d):
        return f"it is a {type(conv).__qualname__}, not an nn.Conv2d"
    called = hooked(conv) and not in_call
    if called and type(conv) is not FrameConv2d:
        return "calling it runs hooks (hooks.hooked), which reading its weight would skip"
    if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
        return f"its padding is {conv.padding!r} ({conv.padding_mode})"
    if not called and conv_dtype(x, conv.weight) is None:  # (under autocast, any it casts)
        return f"its weight is {conv.weight.dtype} and the frames {x.dtype}"
    if x.dim() != 5:
        return f"the video is {x.dim()}-D"
    return None


def upsampled_frame_conv(conv: nn.Conv2d, x: torch.Tensor, time_factor: int = 1, first_apart: bool = False):
    """`conv` on each frame of x repeated by nearest 2x in H and W and `time_factor`x in D (`first_apart` as
    repeat_nearest's): frame_conv(conv, repeat_nearest(x, (time_factor, 2, 2), first_apart=first_apart)). For a
    3x3 conv padded by 1 at unit stride and dilation, one group (the resamplers' convs: `subpixel_reason`), it is
    one transposed conv of x itself at stride (1, 2, 2) with 4 x 4 taps (`subpixel_weight`): per output voxel 4 taps
    where the upsampled input has 9, read from x, and no tensor of the upsampled size written, read, or saved for
    the backward. A frame's conv commutes with repeating frames, so D's repeats are written once, after it, of the
    output. Anything else upsamples first."""
    if subpixel_reason(conv, x) is not None:
        return frame_conv(conv, repeat_nearest(x, (time_factor, 2, 2), first_apart=first_apart))
    if _called_for_frames(conv):
        return conv(x, frames=Handed(("upsampled", (time_factor, first_apart))))
    return _upsampled_frame_conv(conv, x, time_factor, first_apart)


def _upsampled_frame_conv(conv: nn.Conv2d, x: torch.Tensor, time_factor: int, first_apart: bool) -> torch.Tensor:
    y = subpixel.upsampled_conv(conv, x, (1, 2, 2))
    return y if time_factor == 1 else repeat_nearest(y, (time_factor, 1, 1), first_apart=first_apart)


def subpixel_reason(conv: nn.Module, x: torch.Tensor, in_call: bool = False) -> str | None:
    """Why `upsampled_frame_conv` upsamples x before `conv` (None where it runs the transposed conv)."""
    reason = frame_conv_reason(conv, x, in_call) or (None if subpixel.SUBPIXEL else "subpixel.SUBPIXEL is off")
    if reason is None and (tuple(conv.kernel_size), tuple(conv.padding)) != ((3, 3), (1, 1)):
        reason = f"its kernel is {tuple(conv.kernel_size)} padded by {tuple(conv.padding)}, not 3 x 3 padded by 1"
    if reason is None and (tuple(conv.stride), tuple(conv.dilation), conv.groups) != ((1, 1), (1, 1), 1):
        reason = f"its stride {tuple(conv.stride)}, dilation {tuple(conv.dilation)} or groups {conv.groups} is not 1"
    return reason


def upsampled_causal_conv(module: nn.Module, x: torch.Tensor, time_factor: int) -> torch.Tensor:
    """HunyuanVideo's upsampler: its causal conv `module` (a converted HunyuanVideoCausalConv3d: 3 x 3 x 3, the first
    frame repeated twice in front, H and W replicate-padded by 1) on x repeated by nearest 2x in H and W and
    `time_factor`x in D (2: the first frame once, as diffusers' upsampler). It is one transposed conv of x itself
    at stride (time_factor, 2, 2) with 4 taps along each upsampled dimension and 3 along a kept one
    (`subpixel_weight`): in D at factor 2, output frame 2t reads x[t - 1] through w[0] and x[t] through w[1] + w[2],
    frame 2t - 1 reads x[t - 1] through w[0] + w[1] and x[t] through w[2], as in H and W, with the first frame
    repeated in front and 2T - 1 frames out. Its input is x with the replicated borders those taps read
    (`replicate_padded`, a copy about x's size, where diffusers' upsampled input is 4 or 8 times it); per output
    voxel 8 (or 12) taps where the upsampled input has 27."""
    conv = module.conv
    if time_factor == 2:  # the padded input's transposed conv, cropped by 3 all round and 2 at D's back
        padded = replicate_padded(x, (1, 0, 1, 1, 1, 1))
        return conv_transpose3d(padded, subpixel_weight(conv, "repeated"), conv.bias, stride=2, padding=3,
                                output_padding=(1, 0, 0))  # fmt: skip
    padded = replicate_padded(x, (2, 0, 1, 1, 1, 1))
    return conv_transpose3d(padded, subpixel_weight(conv, "kept"), conv.bias, stride=(1, 2, 2), padding=(2, 3, 3))


# Set on an EasyAnimate causal conv whose prev_features are frames of its upsampler's input, as the sub-pixel form
# keeps them (not of the upsampled input, as its conv reads them upsampling first).
_KEPT_BEFORE_UPSAMPLING = "_tconv3d_kept_before_upsampling"


def upsampled_kept_causal_conv(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """EasyAnimate's upsampler: its causal conv `conv` (a converted EasyAnimateCausalConv3d: 3 x 3 x 3, the first
    frame repeated twice in front on a clip's first call and the two frames it kept on a later one, zeros padded by
    1 in H and W) on x repeated by nearest 2x in H and W. A repeat along H and W commutes with the frames put in
    front, so it is one transposed conv of x with those frames in front (`frames_in_front`, a copy of about x's
    size, where the upsampled input is 4 times it) at stride (1, 2, 2), 3 x 4 x 4 taps (`subpixel_weight(conv,
    "kept")`), zeros in H and W as upsampled_frame_conv's: per output voxel 12 taps where the upsampled input has
    27. The frames kept for the next call are x's (a quarter of the upsampled ones diffusers keeps); kept frames of
    the upsampled input (a call that upsampled first) are read at every other row and column, which is them."""
    front = conv.prev_features
    if front is not None and not getattr(conv, _KEPT_BEFORE_UPSAMPLING, False):
        front = front[:, :, :, ::2, ::2]
    conv.prev_features = _last_frames(front, x, 2)
    setattr(conv, _KEPT_BEFORE_UPSAMPLING, True)
    if front is None:
        front = first_frame_repeated(x, 2)
    return conv_transpose3d(frames_in_front(front, x), subpixel_weight(conv, "kept"), conv.bias, stride=(1, 2, 2),
                            padding=(2, 1, 1))  # fmt: skip


def easyanimate_subpixel_reason(conv: nn.Module, x: torch.Tensor) -> str | None:
    """Why EasyAnimate's upsampler upsamples x before its causal conv `conv` (None where it runs
    `upsampled_kept_causal_conv`)."""
    if getattr(type(conv), "tconv3d_adapter", None) is not _EasyAnimateCausalConv3d:
        return "its causal conv is not taken over"
    if not subpixel.SUBPIXEL:
        return "subpixel.SUBPIXEL is off"
    shape = (tuple(conv.kernel_size), tuple(conv.padding), tuple(conv.stride), tuple(conv.dilation), conv.groups,
             conv.padding_mode)  # fmt: skip
    if shape != ((3, 3, 3), (0, 1, 1), (1, 1, 1), (1, 1, 1), 1, "zeros") or conv.temporal_padding != 2:
        return f"its conv (kernel, padding, stride, dilation, groups, mode) {shape} is not a plain 3 x 3 x 3 one"
    if x.dim() != 5 or conv_dtype(x, conv.weight) is None or not x.numel():
        return f"the video is {x.dim()}-D {x.dtype} of {x.numel()} elements, its weight {conv.weight.dtype}"
    return None


def causal_subpixel_reason(module: nn.Module, x: torch.Tensor, factors) -> str | None:
    """Why HunyuanVideo's upsampler upsamples x before its causal conv `module` (None where it runs
    `upsampled_causal_conv`)."""
    if getattr(type(module), "tconv3d_adapter", None) is not _ReplicatePaddedConv3d:
        return "its causal conv is not taken over"
    conv = module.conv
    if not subpixel.SUBPIXEL:
        return "subpixel.SUBPIXEL is off"
    if hooked(conv):  # (its own forward, called, convolves through the conv's call)
        return "calling its conv runs hooks (hooks.hooked), which reading the conv's weight would skip"
    if tuple(factors) not in ((2, 2, 2), (1, 2, 2)):
        return f"its factors {tuple(factors)} are not (2, 2, 2) or (1, 2, 2)"
    if module.pad_mode != "replicate" or tuple(module.time_causal_padding) != (1, 1, 1, 1, 2, 0):
        return f"its padding {tuple(module.time_causal_padding)} ({module.pad_mode}) is not a causal replicate one"
    shape = (tuple(conv.kernel_size), conv.padding, tuple(conv.stride), tuple(conv.dilation), conv.groups)
    if shape != ((3, 3, 3), (0, 0, 0), (1, 1, 1), (1, 1, 1), 1):
        return f"its conv (kernel, padding, stride, dilation, groups) {shape} is not a plain 3 x 3 x 3 one"
    if x.dim() != 5 or conv_dtype(x, conv.weight) is None or not x.numel():
        return f"the video is {x.dim()}-D {x.dtype} of {x.numel()} elements, its weight {conv.weight.dtype}"
    if 1 in x.shape[3:]:
        # Its borders replicated, stock's output is then exactly constant along that dimension; the phases' taps,
        # summed and rounded apart, differ there by an ulp, and the norms after amplify what stock never has
        # (a decode of a 1 x 1 latent: from 1e-7 to 1e0 through HunyuanVideo's test config, tests/fuzz_models.py).
        return f"its frames are {tuple(x.shape[3:])}: one voxel along H or W"
    return None


class _MochiChunkedGroupNorm:
    """diffusers' MochiChunkedGroupNorm3D normalises each frame on its own: frames flattened into the batch, then
    GroupNorm over chunks of frames and a torch.cat of the results. The same statistics come from one tconv3d
    group_norm on a (B*T, C, 1, H, W) view of a channels_last_3d input: no copy, no concatenation."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_mochi.MochiChunkedGroupNorm3D",)
    attributes = ("norm_layer",)

    @staticmethod
    def reason(module) -> str | None:
        norm = module.norm_layer
        if not isinstance(norm, nn.GroupNorm):
            return f"its norm_layer is a {type(norm).__name__}, not an nn.GroupNorm"
        if norm.weight is not None and norm.weight.dtype not in SUPPORTED_DTYPES:
            return f"its weight is {norm.weight.dtype}"
        return None

    def forward(self, x):
        if x.dim() != 5 or x.dtype not in SUPPORTED_DTYPES or hooked(self.norm_layer):
            return super().forward(x)
        return frame_group_norm(self.norm_layer, x)


def frame_group_norm(norm: nn.GroupNorm, x: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """`norm` applied to each frame of a 5-D x on its own (diffusers flattens the frames into the batch): one
    tconv3d group_norm over a (B*T, C, 1, H, W) view, a view of a channels_last_3d x, the result viewed back;
    `activation` ("silu") fused."""
    b, c, t, h, w = x.shape
    frames = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, 1, h, w)
    y = normalize(frames, norm.num_groups, norm.weight, norm.bias, norm.eps, activation)
    return y.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


def _depth_to_space(x: torch.Tensor, stride, drop: int = 0) -> torch.Tensor:
    """LTX-Video's pixel shuffle, (B, C*s0*s1*s2, T, H, W) -> (B, C, T*s0, H*s1, W*s2), written straight into a
    channels_last_3d result: the same one copy as diffusers' permute + flatten, which answers NCDHW. `drop`
    (below s0): the result's first frames left out, as a causal upsampler drops them (a view). Its backward is
    the space-to-depth of the gradient, written channels_last_3d, where autograd's reshape backward answered NCDHW
    and handed the conv before it a gradient to lay out again."""
    if autograd_traced():
        return _shuffled(x, tuple(stride), drop)  # autograd's backward, as _resampled's
    return _DepthToSpace.apply(x, tuple(stride), drop)


class _DepthToSpace(torch.autograd.Function):
    @staticmethod
    def forward(x, stride, drop):
        return _shuffled(x, stride, drop)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.stride, ctx.drop = inputs
        ctx.x = (x.shape, x.dtype, x.device)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.x
        s0, drop = ctx.stride[0], ctx.drop
        grad_x = torch.empty(shape, dtype=dtype, device=device, memory_format=_CL)
        if drop:  # the first input frame's first `drop` sub-frames were dropped: zero; the others from grad's first
            first = grad_x[:, :, :1].unflatten(1, (-1, *ctx.stride))  # (B, C, s0, s1, s2, 1, H, W)
            first[:, :, :drop].zero_()
            h, w = shape[3:]
            kept = grad[:, :, : s0 - drop].unflatten(4, (w, -1)).unflatten(3, (h, -1))  # (B, C, k, H, s1, W, s2)
            first[:, :, drop:].copy_(kept.permute(0, 1, 2, 4, 6, 3, 5).unsqueeze(5))
        view, source = _space_to_depth_into(grad_x[:, :, 1 if drop else 0 :], grad[:, :, s0 - drop if drop else 0 :],
                                            ctx.stride)  # fmt: skip
        view.copy_(source)
        return grad_x, None, None

    @staticmethod
    def jvp(ctx, x_tangent, *_):
        return _shuffled(x_tangent, ctx.stride, ctx.drop)


def _shuffled(x: torch.Tensor, stride, drop: int = 0) -> torch.Tensor:
    """The depth-to-space of x, its first `drop` frames left out, in a dense channels_last_3d tensor (a frame
    slice of one would not be dense at a batch above one: the norms after it would lay it out again)."""
    b, _, t, h, w = x.shape
    s0, s1, s2 = stride
    source = x.reshape(b, -1, s0, s1, s2, t, h, w)
    c = source.shape[1]
    out = empty_for((b, c, t * s0 - drop, h * s1, w * s2), x)
    # channels_last_3d storage is (B, T, s0, H, s1, W, s2, C), less the first frame's first `drop` sub-frames:
    # copy the source in that order.
    frames, order = out.permute(0, 2, 3, 4, 1), (0, 5, 2, 6, 3, 7, 4, 1)
    if drop:
        first = source[:, :, drop:, :, :, :1].permute(order)
        frames[:, : s0 - drop].view(b, 1, s0 - drop, h, s1, w, s2, c).copy_(first)
        frames, source, t = frames[:, s0 - drop :], source[:, :, :, :, :, 1:], t - 1
    frames.view(b, t, s0, h, s1, w, s2, c).copy_(source.permute(order))
    return out


class _LTXVideoUpsampler:
    """diffusers' LTXVideoUpsampler3d and LTX2VideoUpsampler3d (conv, then depth-to-space) with the depth-to-space
    written channels_last_3d (the same copy diffusers makes, in the layout the next layers read)."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_ltx.LTXVideoUpsampler3d",
        "diffusers.models.autoencoders.autoencoder_kl_ltx2.LTX2VideoUpsampler3d",
    )
    attributes = ("conv", "stride", "residual", "upscale_factor")

    def forward(self, hidden_states, *conv_args, **conv_kwargs):  # LTX-2's `causal`, passed to its conv
        drop = self.stride[0] - 1
        if self.residual:
            residual = _depth_to_space(hidden_states, self.stride, drop)
        hidden_states = _depth_to_space(self.conv(hidden_states, *conv_args, **conv_kwargs), self.stride, drop)
        if self.residual:
            # diffusers repeats the residual over channels (a copy) and adds it: here a broadcast add over the
            # channel groups, in the layout of the conv's result
            repeats = hidden_states.shape[1] // residual.shape[1]
            hidden_states = (hidden_states.unflatten(1, (repeats, -1)) + residual.unsqueeze(1)).flatten(1, 2)
        return hidden_states


def _space_to_depth_into(out: torch.Tensor, x: torch.Tensor, stride) -> tuple[torch.Tensor, torch.Tensor]:
    """(out's view, x's view), both (B, T, H, W, C, s0, s1, s2): channels_last_3d `out` (B, C*s0*s1*s2, T, H, W)
    and x (B, C, T*s0, H*s1, W*s2) as LTX-Video's space-to-depth pairs their elements, packed channels ordered
    (C, s0, s1, s2) as diffusers' permute + flatten orders them. Copying (or adding) the second into the first is
    the space-to-depth."""
    b, c, t, h, w = x.shape
    s0, s1, s2 = stride
    source = x.view(b, c, t // s0, s0, h // s1, s1, w // s2, s2).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return out.permute(0, 2, 3, 4, 1).view(source.shape), source


def _space_to_depth(x: torch.Tensor, stride, residual: torch.Tensor | None = None) -> torch.Tensor:
    """LTX-Video's space-to-depth, (B, C, T*s0, H*s1, W*s2) -> (B, C*s0*s1*s2, T, H, W), channels ordered (C, s0,
    s1, s2) as diffusers' permute + flatten orders them, plus `residual` (a tensor of the result's shape) where
    given, in one pass into a channels_last_3d result. Its backward is the depth-to-space of the gradient, written
    channels_last_3d, where autograd's view backward of the rearrangement answered NCDHW."""
    if autograd_traced():
        return _unshuffled(x, tuple(stride), residual)  # autograd's backward, as _resampled's
    return _SpaceToDepth.apply(x, tuple(stride), residual)


class _SpaceToDepth(torch.autograd.Function):
    @staticmethod
    def forward(x, stride, residual):
        return _unshuffled(x, stride, residual)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.stride, _ = inputs
        ctx.x_dtype = x.dtype

    @staticmethod
    def backward(ctx, grad):
        grad_x = _shuffled(grad, ctx.stride) if ctx.needs_input_grad[0] else None
        if grad_x is not None and grad_x.dtype != ctx.x_dtype:  # a residual of a wider dtype promoted the result
            grad_x = grad_x.to(ctx.x_dtype)
        return grad_x, None, grad if ctx.needs_input_grad[2] else None

    @staticmethod
    def jvp(ctx, x_tangent, _, residual_tangent):
        return _unshuffled(x_tangent, ctx.stride, residual_tangent)


def _unshuffled(x: torch.Tensor, stride, residual: torch.Tensor | None) -> torch.Tensor:
    b, c, t, h, w = x.shape
    s0, s1, s2 = stride
    shape = (b, c * s0 * s1 * s2, t // s0, h // s1, w // s2)
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = empty_for(shape, x, residual, dtype=dtype)
    view, source = _space_to_depth_into(out, x, stride)
    if residual is None:
        view.copy_(source)
    else:  # (B, T, H, W, C, s0, s1, s2) views of the residual, read as it is laid out
        residual_view = residual.permute(0, 2, 3, 4, 1).unflatten(-1, source.shape[4:])
        add_into(view, residual_view, source)
    return out


class _LTXVideoDownsampler:
    """diffusers' LTXVideoDownsampler3d (LTX-Video 0.9.5 and later) and LTX2VideoDownsampler3d: the first s0 - 1
    frames repeated in front, then space-to-depth of the conv's output plus the group mean of the input's
    space-to-depth. diffusers concatenates the input for both; here the conv reads the repeated frames in place
    (`frames_before`), and its space-to-depth is added into the channels_last_3d residual in one pass (diffusers'
    result is NCDHW)."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_ltx.LTXVideoDownsampler3d",
        "diffusers.models.autoencoders.autoencoder_kl_ltx2.LTX2VideoDownsampler3d",
    )
    attributes = ("conv", "stride", "group_size")

    @staticmethod
    def reason(module) -> str | None:
        return _ltx_conv_reason(module.conv)

    def forward(self, hidden_states, *conv_args, **conv_kwargs):  # LTX-2's `causal`, passed to its conv
        stride = self.stride
        front = frames(hidden_states, 0, stride[0] - 1) if stride[0] > 1 else None
        padded = torch.cat([front, hidden_states], dim=2) if front is not None else hidden_states
        packed = _space_to_depth(padded, stride)
        # the mean of each group of group_size packed channels: (B, T, H, W, C) contiguous, channels_last_3d as
        # (B, C, T, H, W)
        residual = packed.permute(0, 2, 3, 4, 1).unflatten(-1, (-1, self.group_size)).mean(-1)
        if hasattr(type(self.conv), "tconv3d_adapter"):
            conv_out = self.conv(hidden_states, *conv_args, frames_before=front, **conv_kwargs)
        else:  # a conv convert was told to leave (its filter)
            conv_out = self.conv(padded, *conv_args, **conv_kwargs)
        residual = residual.to(torch.promote_types(residual.dtype, conv_out.dtype)).permute(0, 4, 1, 2, 3)
        return _space_to_depth(conv_out, stride, residual)  # the conv's space-to-depth plus the residual: one pass


class _MochiUpBlock:
    """diffusers' MochiUpBlock3D: its resnets, then a per-voxel projection and an unpatchify (depth-to-space),
    which diffusers makes NCDHW-contiguous; written channels_last_3d here (the same one copy)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_mochi.MochiUpBlock3D",)
    attributes = ("resnets", "proj", "temporal_expansion", "spatial_expansion", "gradient_checkpointing")

    def forward(self, hidden_states, conv_cache=None):
        new_conv_cache = {}
        conv_cache = conv_cache or {}
        for i, resnet in enumerate(self.resnets):
            key = f"resnet_{i}"
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                hidden_states, new_conv_cache[key] = self._gradient_checkpointing_func(
                    resnet, hidden_states, conv_cache.get(key)
                )
            else:
                hidden_states, new_conv_cache[key] = resnet(hidden_states, conv_cache=conv_cache.get(key))
        hidden_states = self.proj(hidden_states.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)
        stride = (self.temporal_expansion, self.spatial_expansion, self.spatial_expansion)
        return _depth_to_space(hidden_states, stride), new_conv_cache


def _packed_frames(x: torch.Tensor, factors) -> torch.Tensor:
    """HunyuanVideo 1.5's depth-to-space as a view: (B, r1*r2*r3*C, F, H, W), channels ordered (r1, r2, r3, C), as
    (B, C, F, r1, H, r2, W, r3): what diffusers' _dcae_upsample_rearrange reshapes (a copy, answering NCDHW) to
    (B, C, F*r1, H*r2, W*r3)."""
    b, packed, f, h, w = x.shape
    r1, r2, r3 = factors
    return x.view(b, r1, r2, r3, packed // (r1 * r2 * r3), f, h, w).permute(0, 4, 5, 1, 6, 2, 7, 3)


def _unpacked_frames(x: torch.Tensor, factors) -> torch.Tensor:
    """Its inverse, space-to-depth, as a view: (B, C, F*r1, H*r2, W*r3) as (B, r1, r2, r3, C, F, H, W), what
    diffusers' _dcae_downsample_rearrange reshapes (a copy, answering NCDHW) to (B, r1*r2*r3*C, F, H, W)."""
    b, c, f, h, w = x.shape
    r1, r2, r3 = factors
    return x.view(b, c, f // r1, r1, h // r2, r2, w // r3, r3).permute(0, 3, 5, 7, 1, 2, 4, 6)


def _frame_parts(frames_in: int, first: int, r1: int, up: bool):
    """The output's frames and the (input frames, output frames, factors) of HunyuanVideo 1.5's resampling: the
    first `first` frames in space only (the first frame with time resampling; all of them in HunyuanImage 2.1's
    refiner), the others in space and time by r1 (up: depth-to-space, else space-to-depth)."""
    rest = frames_in - first
    frames_out = first + (rest * r1 if up else rest // r1)
    parts = [(slice(0, first), slice(0, first), (1, 2, 2))] if first else []
    if rest:
        parts.append((slice(first, frames_in), slice(first, frames_out), (r1, 2, 2)))
    return frames_out, parts


def _space_only_frames(module, temporal: bool, frames: int) -> int:
    """How many of the input's frames a HunyuanVideo 1.5 resampler (`temporal`: with time) resamples in space
    only, as its first frame: the first, or all of them in the refiner's (time_resampled False)."""
    if not temporal:
        return 0
    return min(frames, 1) if module.time_resampled else frames


def _rms_norm_takes(x: torch.Tensor, *params) -> bool:
    """Whether tconv3d's rms_norm takes x (N, C, D, H, W) with these parameters."""
    return (
        x.dim() == 5 and 0 < x.shape[1] <= RMS_NORM_MAX_CHANNELS and x.dtype in SUPPORTED_DTYPES
        and all(p is None or (p.dtype in SUPPORTED_DTYPES and p.shape == (x.shape[1],)) for p in params)
    )  # fmt: skip


class _ChannelRMSNorm:
    """diffusers' RMS_norm of Wan, Qwen-Image, HunyuanVideo 1.5 and HunyuanImage 2.1's refiner on 5-D activations:
    F.normalize over the channels (in fp32 for 16-bit inputs, cast back), times sqrt(C) and gamma, plus bias. One
    tconv3d rms_norm pass (clamped, fp32 inside, rounded once) instead of an fp32 copy and five more passes; the
    result in the dtype diffusers' returns (a 16-bit input with fp32 parameters gives fp32 there: then one cast). 4-D
    inputs (the attention blocks' per-frame norm) run diffusers' forward."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_wan.WanRMS_norm",
        "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageRMS_norm",
        "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15.HunyuanVideo15RMS_norm",
        "diffusers.models.autoencoders.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerRMS_norm",
    )
    attributes = ("channel_first", "scale", "gamma", "bias")
    eps = 1e-12  # F.normalize's default, which diffusers uses

    @staticmethod
    def reason(module) -> str | None:
        if not module.channel_first:
            return "it normalises the last dimension (channel_first=False)"
        if module.gamma.dtype not in SUPPORTED_DTYPES:
            return f"its gamma is {module.gamma.dtype}"
        return None

    @staticmethod
    def prepare(module) -> None:
        module.activation = None  # "silu" once fuse_norm_silu_blocks gives it the block's SiLU

    def forward(self, x):
        channels = x.shape[1] if x.dim() == 5 else 0
        if not _rms_norm_takes(x, self.gamma.reshape(-1)):
            y = super().forward(x)
            return F.silu(y) if self.activation == "silu" else y
        bias = getattr(self, "bias", None)
        bias = bias.reshape(-1) if isinstance(bias, torch.Tensor) else None
        # F.normalize(x, eps=e) * scale = x / max(rms(x), e / sqrt(C)) * scale / sqrt(C); diffusers' scale is sqrt(C)
        weight = self.gamma.reshape(-1)
        if self.scale != channels**0.5:
            weight = weight * (self.scale / channels**0.5)
        eps = _ChannelRMSNorm.eps / channels**0.5
        y = call_rms_norm(x, weight, bias, eps, self.activation or "none", True)
        dtype = torch.promote_types(x.dtype, self.gamma.dtype)
        if bias is not None:
            dtype = torch.promote_types(dtype, bias.dtype)
        return y if y.dtype == dtype else y.to(dtype)


class _Kandinsky6RMSNorm(_ChannelRMSNorm):
    """diffusers' Kandinsky6VAERMSNorm (and the latent upscalers' Kandinsky6SRLatentUpscalerRMSNorm, the same
    class): the same arithmetic (normalized in fp32, cast back, times sqrt(C) and gamma), without the flags or a
    bias."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kandinsky6_sr.Kandinsky6VAERMSNorm",
        _K6UP + "Kandinsky6SRLatentUpscalerRMSNorm",
    )
    attributes = ("scale", "gamma")

    @staticmethod
    def reason(module) -> str | None:
        return None if module.gamma.dtype in SUPPORTED_DTYPES else f"its gamma is {module.gamma.dtype}"


class _PerChannelRMSNorm:
    """diffusers' PerChannelRMSNorm of LTX-2: x / sqrt(mean(x^2) + eps) over the channels, in x's dtype, no
    parameters. One tconv3d rms_norm pass (fp32 inside, rounded once) instead of four in x's dtype."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_ltx2.PerChannelRMSNorm",)
    attributes = ("channel_dim", "eps")

    @staticmethod
    def reason(module) -> str | None:
        if module.channel_dim != 1:
            return f"it normalises dimension {module.channel_dim}, not the channels"
        return None

    @staticmethod
    def prepare(module) -> None:
        module.activation = None  # "silu" once fuse_norm_silu_blocks gives it the SiLU that follows it

    def forward(self, x, channel_dim=None):  # diffusers' forward ignores channel_dim too
        if not _rms_norm_takes(x):
            y = super().forward(x, channel_dim)
            return F.silu(y) if self.activation == "silu" else y
        return call_rms_norm(x, None, None, float(self.eps), self.activation or "none")


class _LastDimRMSNorm:
    """diffusers' RMSNorm on a video's channels moved last, as LTX-Video's blocks call it
    (`norm(x.movedim(1, -1)).movedim(-1, 1)`): x * rsqrt(mean(x^2) + eps) over the last dimension in fp32, times
    the weight, plus the bias. For 5-D inputs one tconv3d rms_norm pass over x.movedim(-1, 1) (channels_last_3d
    when x is what such a block passes: a view, no copy), the result in the dtype diffusers returns; other inputs
    (the transformers' 3-D and 4-D ones) run diffusers' forward."""

    classes = ("diffusers.models.normalization.RMSNorm",)
    attributes = ("eps", "weight", "bias")

    @staticmethod
    def prepare(module) -> None:
        module.activation = None  # "silu" once fuse_norm_silu_blocks gives it the SiLU that follows it

    def forward(self, hidden_states):
        x = hidden_states.movedim(-1, 1) if hidden_states.dim() == 5 else hidden_states
        if not _rms_norm_takes(x, self.weight, self.bias):
            y = super().forward(hidden_states)
            return F.silu(y) if self.activation == "silu" else y
        y = call_rms_norm(x, self.weight, self.bias, float(self.eps), self.activation or "none").movedim(1, -1)
        if self.weight is None:
            dtype = hidden_states.dtype
        elif self.weight.dtype in (torch.float16, torch.bfloat16):  # diffusers casts to it before the affine
            dtype = self.weight.dtype if self.bias is None else torch.promote_types(self.weight.dtype, self.bias.dtype)
        else:
            dtype = torch.promote_types(torch.promote_types(hidden_states.dtype, torch.float32), self.weight.dtype)
            dtype = dtype if self.bias is None else torch.promote_types(dtype, self.bias.dtype)
        return y if y.dtype == dtype else y.to(dtype)


class _HunyuanVideo15Upsample:
    """diffusers' HunyuanVideo15Upsample: its conv, then depth-to-space of the conv's output and of the input
    (repeated over channels) for the shortcut, the first frame in space only, and their sum. diffusers makes each
    of these an NCDHW copy and concatenates the frames; here the conv's part is written straight into one
    channels_last_3d result and the shortcut added into it, both from views: two passes over the result. The
    backward (`_DcaeResample`) pairs the same views the other way, so the conv's and the input's gradients come
    out channels_last_3d too, where autograd's slice and reshape backwards would answer NCDHW."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15.HunyuanVideo15Upsample",)
    attributes = ("conv", "add_temporal_upsample", "repeats")
    time_resampled = True  # with add_temporal_upsample, the frames after the first are upsampled in time

    @staticmethod
    def prepare(module) -> None:
        # diffusers computes the flag with numpy (a numpy bool), on which torch.compile breaks the graph at every
        # branch: the same value as a Python bool.
        module.add_temporal_upsample = bool(module.add_temporal_upsample)

    def forward(self, x):
        h = self.conv(x)
        temporal = self.add_temporal_upsample
        first = _space_only_frames(self, temporal, h.shape[2])
        if not temporal and x.shape[1] % 4:  # diffusers repeats over channels before it rearranges: no view pairs
            return _upsample_repeating_first(h, x, self.repeats)
        return _resampled(_dcae_upsample, h, x, (temporal, first, self.repeats))


class _HunyuanVideo15Downsample:
    """diffusers' HunyuanVideo15Downsample: its conv, then space-to-depth of the conv's output (the first frame in
    space only, its channels twice) and of the input (averaged over groups of channels) for the shortcut, and their
    sum, written into one channels_last_3d result from views instead of diffusers' NCDHW copies and
    concatenations; its backward as the upsample's."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15.HunyuanVideo15Downsample",)
    attributes = ("conv", "add_temporal_downsample", "group_size")
    time_resampled = True  # with add_temporal_downsample, the frames after the first are downsampled in time

    @staticmethod
    def prepare(module) -> None:
        module.add_temporal_downsample = bool(module.add_temporal_downsample)  # see _HunyuanVideo15Upsample's

    def forward(self, x):
        h = self.conv(x)
        temporal = self.add_temporal_downsample
        first = _space_only_frames(self, temporal, h.shape[2])
        return _resampled(_dcae_downsample, h, x, (temporal, first, self.group_size))


def _resampled(pairing, h: torch.Tensor, x: torch.Tensor, plan) -> torch.Tensor:
    """A HunyuanVideo 1.5 resampler's channels_last_3d result from its conv's output h and its input x, as
    `pairing` (_dcae_upsample or _dcae_downsample) pairs their elements under `plan` (temporal, the frames in
    space only at the front, the shortcut's repeats or group size)."""
    if autograd_traced():
        return pairing(None, h, x, plan)  # Inductor's backward; torch.func's transforms: autograd through views
    return _DcaeResample.apply(pairing, h, x, plan)


class _DcaeResample(torch.autograd.Function):
    """A resampler's rearrangement, linear in (h, x): the backward and the jvp run its pairing the other way and
    forward, on the gradients and the tangents."""

    @staticmethod
    def forward(pairing, h, x, plan):
        return pairing(None, h, x, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.pairing, h, x, ctx.plan = inputs
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (h, x)]

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_x = (torch.empty(shape, dtype=dtype, device=device, memory_format=_CL)
                          for shape, dtype, device in ctx.inputs)  # fmt: skip
        ctx.pairing(grad, grad_h, grad_x, ctx.plan)  # writes every element of both
        return None, grad_h, grad_x, None

    @staticmethod
    def jvp(ctx, _, h_tangent, x_tangent, __):
        tangents = [
            torch.zeros(shape, dtype=dtype, device=device) if tangent is None else tangent
            for tangent, (shape, dtype, device) in zip((h_tangent, x_tangent), ctx.inputs, strict=True)
        ]
        return ctx.pairing(None, *tangents, ctx.plan)


def _dcae_parts(out, h: torch.Tensor, x: torch.Tensor, plan, up: bool):
    """(`out`, or a new channels_last_3d tensor of the rearrangement's result of h (and the input x), and its frame
    parts: (source frames, target frames, factors) of _frame_parts)."""
    temporal, first_frames, _ = plan
    b, c, t, height, width = h.shape
    r1 = 2 if temporal else 1
    frames, parts = _frame_parts(t, first_frames, r1, up)
    if out is None:
        size = (c // (4 * r1), frames, 2 * height, 2 * width) if up else (4 * r1 * c, frames, height // 2, width // 2)
        out = empty_for((b, *size), h, x)
    return out, parts


def _dcae_upsample(out, h: torch.Tensor, x: torch.Tensor, plan):
    """HunyuanVideo 1.5's upsample rearrangement. With `out` None: its result from the conv's output h and the
    input x, written into a new channels_last_3d tensor. Given `out` (the result's gradient): its backward, written
    into h and x (the gradients' buffers, every element)."""
    temporal, _, repeats_after = plan
    backward = out is not None
    b, _, _, height, width = h.shape
    out, parts = _dcae_parts(out, h, x, plan, up=True)
    c = out.shape[1]
    for source, target, factors in parts:
        first = temporal and factors[0] == 1  # a frame in space only: half the channels, half the repeats
        repeats = repeats_after // 2 if first else repeats_after
        # (B, C / repeats, repeats, F, r1, H, 2, W, 2): repeat_interleave after the rearrange (diffusers' order with
        # time; without, the same values when the input's channels split into the 4 spatial positions) feeds
        # each shortcut channel into `repeats` in a row
        shape = (b, c // repeats, repeats, (target.stop - target.start) // factors[0], factors[0], height, 2, width, 2)
        conv_part = _packed_frames(h[:, :, source], factors)  # (B, C or 2C, F, r1, H, 2, W, 2)
        shortcut = _packed_frames(x[:, :, source], factors).unsqueeze(2)
        if backward:
            grad = out[:, :, target].view(shape)
            conv_part[:, :c].view(shape).copy_(grad)
            conv_part[:, c:].zero_()  # the first frame's second half of the conv's channels goes unused
            shortcut.copy_(grad.sum(2, keepdim=True))
        else:  # each write through a fresh view of out: autograd refuses one taken before out's first write
            out[:, :, target].view(shape).copy_(conv_part[:, :c].view(shape))
            out[:, :, target].view(shape).add_(shortcut)
    return out


def _dcae_downsample(out, h: torch.Tensor, x: torch.Tensor, plan):
    """HunyuanVideo 1.5's downsample rearrangement, both ways as _dcae_upsample's."""
    temporal, _, group_after = plan
    backward = out is not None
    b, _, _, height, width = h.shape
    out, parts = _dcae_parts(out, h, x, plan, up=False)
    for source, target, factors in parts:
        first = temporal and factors[0] == 1  # a frame in space only: its channels twice, half the group
        frames_part = (target.stop - target.start, height // 2, width // 2)
        conv_part = _unpacked_frames(h[:, :, source], factors).unsqueeze(1)  # (B, 1, r1, r2, r3, C, F, H, W)
        copies = (b, 2 if first else 1, *conv_part.shape[2:6], *frames_part)
        group = group_after // 2 if first else group_after
        inputs = _unpacked_frames(x[:, :, source], factors)  # (B, r1, r2, r3, Cin, F, H, W)
        inputs = inputs.unflatten(4, (inputs.shape[4] // group, group))
        means = (b, *inputs.shape[1:5], 1, *frames_part)
        if backward:
            conv_part.copy_(out[:, :, target].view(copies).sum(1, keepdim=True))
            inputs.copy_((out[:, :, target].view(means) / group).expand(inputs.shape))
        else:  # fresh views of out, as the upsample's
            out[:, :, target].view(copies).copy_(conv_part.expand(copies))
            out[:, :, target].view(means).add_(inputs.mean(dim=5, keepdim=True))
    return out


def _upsample_repeating_first(h: torch.Tensor, x: torch.Tensor, repeats: int) -> torch.Tensor:
    """HunyuanVideo 1.5's upsample without time, where the input's channels do not split into the 4 spatial
    positions: diffusers repeats them before the rearrangement, and so does this (autograd's backward)."""
    b, packed, t, height, width = h.shape
    out = empty_for((b, packed // 4, t, 2 * height, 2 * width), h, x)
    out.view(b, packed // 4, t, 1, height, 2, width, 2).copy_(_packed_frames(h, (1, 2, 2)))
    return out.add_(_packed_frames(x.repeat_interleave(repeats, dim=1), (1, 2, 2)).reshape(out.shape))


class _HunyuanImageRefinerUpsample(_HunyuanVideo15Upsample):
    """diffusers' HunyuanImageRefinerUpsampleDCAE (HunyuanImage 2.1's refiner): HunyuanVideo 1.5's upsample, but
    with add_temporal_upsample every frame goes its first frame's way (space only, half the channels)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerUpsampleDCAE",)
    time_resampled = False


class _HunyuanImageRefinerDownsample(_HunyuanVideo15Downsample):
    """diffusers' HunyuanImageRefinerDownsampleDCAE: HunyuanVideo 1.5's downsample, but with
    add_temporal_downsample every frame goes its first frame's way (space only, the conv's channels twice)."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_hunyuanimage_refiner.HunyuanImageRefinerDownsampleDCAE",)
    time_resampled = False


def _nearest_first_apart(zq: torch.Tensor, size) -> torch.Tensor:
    """zq resized (nearest) to size (D, H, W) as diffusers resizes a clip's first latent frames: the first frame on
    its own, the others together (two interpolations and a torch.cat at full resolution). The same result, bit for
    bit, from picking the latent's frames first (frame 0 from frame 0, the rest by nearest over frames 1..:
    interpolate's own index rule, read off an arange so it is the same arithmetic; a gather at latent resolution),
    then one interpolation."""
    frames = size[0]
    if frames > 1 and zq.shape[2] > 1:
        rest = torch.arange(1, zq.shape[2], dtype=torch.float32, device=zq.device).view(1, 1, -1, 1, 1)
        rest = resize_nearest(rest, (frames - 1, 1, 1)).flatten().long()
        index = torch.cat([rest.new_zeros(1), rest])
        zq = channels_last(zq.index_select(2, index))
    return resize_nearest(zq, size)


class _CogVideoXSpatialNorm:
    """diffusers' CogVideoXSpatialNorm3D resizes the latent to the features' size (first frame on its own, the
    rest together, then a torch.cat at full resolution) for its conv_y and conv_b: `_nearest_first_apart`, one
    full-resolution write instead of two."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_cogvideox.CogVideoXSpatialNorm3D",)
    attributes = ("norm_layer", "conv_y", "conv_b")

    def forward(self, f, zq, conv_cache=None):
        conv_cache = conv_cache or {}
        # diffusers resizes an odd count of frames with the first apart
        size = tuple(f.shape[-3:])
        zq = _nearest_first_apart(zq, size) if f.shape[2] % 2 == 1 else resize_nearest(zq, size)
        new_conv_cache = {}
        conv_y, new_conv_cache["conv_y"] = self.conv_y(zq, conv_cache=conv_cache.get("conv_y"))
        conv_b, new_conv_cache["conv_b"] = self.conv_b(zq, conv_cache=conv_cache.get("conv_b"))
        return self.norm_layer(f) * conv_y + conv_b, new_conv_cache


class _WanResample:
    """diffusers' WanResample (and QwenImageResample) with two copies taken out of the layout's way: the
    downsampling time_conv reads the previous chunk's last frame in place (frames_before) instead of after a
    torch.cat, and the upsampling interleave of the time_conv's two halves is written channels_last_3d (the same
    one copy as diffusers' torch.stack, which answers NCDHW)."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_wan.WanResample",
        "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageResample",
    )
    attributes = ("mode", "resample")

    def forward(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 (diffusers' signature)
        if self.mode == "upsample3d" and feat_cache is not None:
            idx = feat_idx[0]
            if feat_cache[idx] is None:
                feat_cache[idx] = "Rep"
                feat_idx[0] += 1
            else:
                cache_x = frames(x, -2).clone()
                if cache_x.shape[2] < 2 and feat_cache[idx] != "Rep":
                    cache_x = torch.cat([frames(feat_cache[idx], -1).to(cache_x.device), cache_x], dim=2)
                if cache_x.shape[2] < 2 and feat_cache[idx] == "Rep":
                    cache_x = torch.cat([torch.zeros_like(cache_x), cache_x], dim=2)
                x = self.time_conv(x) if feat_cache[idx] == "Rep" else self.time_conv(x, feat_cache[idx])
                feat_cache[idx] = cache_x
                feat_idx[0] += 1
                x = _interleave_frames(x)
        x = _wan_resample_frames(self.resample, x)
        if self.mode == "downsample3d" and feat_cache is not None:
            idx = feat_idx[0]
            if feat_cache[idx] is None:
                feat_cache[idx] = x.clone()
                feat_idx[0] += 1
            else:
                cache_x = frames(x, -1).clone()
                if isinstance(self.time_conv, Conv3d):  # not when convert's filter left it out
                    x = self.time_conv(x, frames_before=frames(feat_cache[idx], -1))
                else:
                    x = self.time_conv(torch.cat([frames(feat_cache[idx], -1), x], 2))
                feat_cache[idx] = cache_x
                feat_idx[0] += 1
        return x


def _wan_resample_frames(resample: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """WanResample's `resample` on each frame of x: nearest 2x (diffusers' WanUpsample, in float32 and cast back:
    the same values) or a zero pad of a row and a column, then a 2-D conv. The pad: one `frame_conv`, the pad inside
    the conv. The upsampling: `upsampled_frame_conv`, one transposed conv of x (nothing of the upsampled size
    written). Anything else as diffusers runs it."""
    if isinstance(resample, nn.Sequential) and len(resample) == 2 and frame_conv_reason(resample[1], x) is None:
        first, conv = resample
        if type(first) is nn.ZeroPad2d:
            return frame_conv(conv, x, first.padding)
        if _nearest_2x(first):
            return upsampled_frame_conv(conv, x)
    return _on_frames(resample, x)


def _nearest_2x(module: nn.Module) -> bool:
    """An nn.Upsample (or a subclass that only casts around it, as WanUpsample) doubling H and W by nearest."""
    if not isinstance(module, nn.Upsample) or module.size is not None:
        return False
    if module.mode not in ("nearest", "nearest-exact"):
        return False
    factors = module.scale_factor if isinstance(module.scale_factor, tuple) else (module.scale_factor,) * 2
    return tuple(float(f) for f in factors) == (2.0, 2.0)


def _on_frames(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A 2-D `module` on each frame of a 5-D x, as diffusers runs it: the frames as a batch, (B*T, C, H, W)."""
    b, c, t, h, w = x.shape
    return _frames_to_video(module(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)), b, t)


def _frames_to_video(frames: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """(B*T, C, H, W) frames -> (B, C, T, H, W). NHWC frames give a channels_last_3d view with the strides an
    NDHWC tensor of that shape has: a batch of one frame can come back from conv2d with degenerate strides for
    its size-1 dims, which later concatenations (diffusers' frame caches) read as NCDHW and copy to it. The view
    alone under torch.onnx.export (exporting_to_onnx)."""
    _, c, h, w = frames.shape
    if laid_out(frames, torch.channels_last) and not exporting_to_onnx():
        return frames.as_strided((b, c, t, h, w), (t * h * w * c, 1, h * w * c, w * c, c))
    return frames.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)


def _interleave_frames(x: torch.Tensor) -> torch.Tensor:
    """(B, 2C, T, H, W) -> (B, C, 2T, H, W), frame 2t + s from channels [sC, (s+1)C) of frame t (WanResample's
    temporal upsampling), written into a channels_last_3d result. Its backward is the inverse rearrangement of the
    gradient, written channels_last_3d, where autograd's reshape backward of diffusers' stack answered NCDHW and
    handed the time_conv a gradient to lay out again."""
    if autograd_traced():
        return _interleaved(x)  # autograd's backward, as _depth_to_space's
    return _InterleaveFrames.apply(x)


class _InterleaveFrames(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return _interleaved(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        b, c, t2, h, w = grad.shape
        grad_x = torch.empty((b, 2 * c, t2 // 2, h, w), dtype=grad.dtype, device=grad.device, memory_format=_CL)
        frames_view, packed_view = _frame_pairs(grad, grad_x)
        packed_view.copy_(frames_view)
        return grad_x

    @staticmethod
    def jvp(ctx, x_tangent):
        return _interleaved(x_tangent)


def _interleaved(x: torch.Tensor) -> torch.Tensor:
    b, c2, t, h, w = x.shape
    out = empty_for((b, c2 // 2, 2 * t, h, w), x)
    frames_view, packed_view = _frame_pairs(out, x)
    frames_view.copy_(packed_view)
    return out


def _frame_pairs(frames: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames' view, packed's view), both (B, 2, C, T, H, W), that the interleave pairs: frame 2t + s of frames
    (B, C, 2T, H, W) and channels [sC, (s+1)C) of packed (B, 2C, T, H, W)'s frame t. Views in any layout: copying
    the second into the first interleaves, the first into the second is its backward."""
    return frames.unflatten(2, (-1, 2)).permute(0, 3, 1, 2, 4, 5), packed.unflatten(1, (2, -1))


class _WanResidualDownBlock:
    """diffusers' WanResidualDownBlock (Wan 2.2's encoder): a clone of the input kept for the shortcut while the
    resnets and the downsampler run, then the shortcut (AvgDown3D) of the clone added. The resnets leave their input
    as it is, so the shortcut is taken first, from the input itself: no clone, and the input can go once the first
    resnet has read it."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_wan.WanResidualDownBlock",)
    attributes = ("avg_shortcut", "resnets", "downsampler")

    def forward(self, x, feat_cache=None, feat_idx=[0]):  # noqa: B006 (diffusers' signature)
        shortcut = self.avg_shortcut(x)
        for resnet in self.resnets:
            x = resnet(x, feat_cache=feat_cache, feat_idx=feat_idx)
        if self.downsampler is not None:
            x = self.downsampler(x, feat_cache=feat_cache, feat_idx=feat_idx)
        return x + shortcut


class _WanResidualUpBlock:
    """diffusers' WanResidualUpBlock (Wan 2.2's decoder): as the down block, a clone of the input for the shortcut
    (DupUp3D). The shortcut is the upsampled size, so it is made last, from the input itself (the resnets leave it
    as it is): no clone."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_wan.WanResidualUpBlock",)
    attributes = ("avg_shortcut", "resnets", "upsampler")

    def forward(self, x, feat_cache=None, feat_idx=[0], first_chunk=False):  # noqa: B006 (diffusers' signature)
        inputs = x
        cached = {} if feat_cache is None else {"feat_cache": feat_cache, "feat_idx": feat_idx}
        for resnet in self.resnets:
            x = resnet(x, **cached)
        if self.upsampler is not None:
            x = self.upsampler(x, **cached)
        if self.avg_shortcut is not None:
            x = x + self.avg_shortcut(inputs, first_chunk=first_chunk)
        return x


class _WanAvgDown3D:
    """diffusers' AvgDown3D (Wan 2.2's encoder shortcut): zero frames in front up to a whole factor in time, a
    space-to-depth by (ft, fs, fs) made NCDHW-contiguous, the mean of each group of group_size packed channels;
    NCDHW out, added to the channels_last_3d main path. Here the space-to-depth is written channels_last_3d
    (`_space_to_depth`) and the group mean taken over it: a channels_last_3d result."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_wan.AvgDown3D",)
    attributes = ("factor_t", "factor_s", "group_size")

    def forward(self, x):
        if x.dim() != 5:
            return super().forward(x)
        pad_t = (self.factor_t - x.shape[2] % self.factor_t) % self.factor_t
        if pad_t:  # a first chunk's frame or so, as diffusers pads it
            x = F.pad(x, (0, 0, 0, 0, pad_t, 0))
        packed = _space_to_depth(x, (self.factor_t, self.factor_s, self.factor_s))
        return packed.permute(0, 2, 3, 4, 1).unflatten(-1, (-1, self.group_size)).mean(-1).permute(0, 4, 1, 2, 3)


class _WanDupUp3D:
    """diffusers' DupUp3D (Wan 2.2's decoder shortcut): each channel repeated (repeat_interleave, a copy of the
    repeats' size), then a depth-to-space by (ft, fs, fs) made NCDHW-contiguous (a second copy, of the upsampled
    size), the first chunk's first ft - 1 frames dropped. Each output voxel is one input channel's value, so here
    it is written once as a broadcast into a channels_last_3d result (`_duplicated`); the frames dropped as a view."""

    classes = ("diffusers.models.autoencoders.autoencoder_kl_wan.DupUp3D",)
    attributes = ("factor_t", "factor_s", "repeats", "out_channels")

    def forward(self, x, first_chunk=False):
        factors = (self.factor_t, self.factor_s, self.factor_s)
        if x.dim() != 5 or _source_shape(factors, self.repeats) is None:
            return super().forward(x, first_chunk=first_chunk)
        out = _duplicated(x, self.out_channels, factors, self.repeats)
        return frames(out, self.factor_t - 1) if first_chunk else out


def _source_shape(factors, repeats: int) -> tuple[int, ...] | None:
    """DupUp3D's input channel of output channel o at sub-voxel (i0, i1, i2) is (o * F + i) // repeats, i the
    sub-voxel's packed index and F the factors' product. Where `repeats` is the product of the trailing factors,
    that is o * (F // repeats) plus the leading factors' index; where it is a multiple k of F, o // k. The sizes to
    view the input's channels as, (repeat groups, f0, f1, f2) with 1 where a value is broadcast; None otherwise."""
    f0, f1, f2 = factors
    product = f0 * f1 * f2
    if repeats % product == 0:
        return (repeats // product, 1, 1, 1)  # the repeat groups split off the output channels
    for leading, shape in (((f0, f1, f2), (f0, f1, f2)), ((f0, f1), (f0, f1, 1)), ((f0,), (f0, 1, 1))):
        if repeats * math.prod(leading) == product:
            return (1, *shape)
    return None


def _duplicated(x: torch.Tensor, out_channels: int, factors, repeats: int) -> torch.Tensor:
    """DupUp3D: x.repeat_interleave(repeats, dim=1) depth-to-space by `factors` (packed channels ordered (C, f0,
    f1, f2)), written once into a channels_last_3d result, x's values broadcast as `_source_shape` maps them. Its
    backward sums the gradient over what was broadcast into a channels_last_3d gradient, where autograd's expand
    backward answered NCDHW."""
    if autograd_traced():
        return _duplicate(x, out_channels, tuple(factors), repeats)  # autograd's backward, as _depth_to_space's
    return _Duplicated.apply(x, out_channels, tuple(factors), repeats)


class _Duplicated(torch.autograd.Function):
    @staticmethod
    def forward(x, out_channels, factors, repeats):
        return _duplicate(x, out_channels, factors, repeats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.out_channels, ctx.factors, ctx.repeats = inputs
        ctx.x = (x.shape, x.dtype, x.device)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.x
        grad_x = torch.empty(shape, dtype=dtype, device=device, memory_format=_CL)
        target, source = _duplicate_views(grad, grad_x, ctx.factors, ctx.repeats)
        broadcast = [d for d, (n, m) in enumerate(zip(source.shape, target.shape, strict=True)) if n != m]
        torch.sum(target, broadcast, keepdim=True, out=source)
        return grad_x, None, None, None

    @staticmethod
    def jvp(ctx, x_tangent, *_):
        return _duplicate(x_tangent, ctx.out_channels, ctx.factors, ctx.repeats)


def _duplicate(x: torch.Tensor, out_channels: int, factors, repeats: int) -> torch.Tensor:
    b, _, t, h, w = x.shape
    f0, f1, f2 = factors
    out = empty_for((b, out_channels, t * f0, h * f1, w * f2), x)
    target, source = _duplicate_views(out, x, factors, repeats)
    target.copy_(source.expand(target.shape))
    return out


def _duplicate_views(out: torch.Tensor, x: torch.Tensor, factors, repeats: int):
    """(out's view, x's view) that DupUp3D pairs, (B, C / groups, groups, f0, f1, f2, T, H, W), x's with size 1
    where its values are broadcast: out's voxel (n, c, t f0 + i0, h f1 + i1, w f2 + i2) is the element (n, c //
    groups, c % groups, i0, i1, i2, t, h, w). Views in any layout."""
    b, _, t, h, w = x.shape
    groups, *shape = _source_shape(factors, repeats)
    target = out.unflatten(4, (w, -1)).unflatten(3, (h, -1)).unflatten(2, (t, -1)).permute(0, 1, 3, 5, 7, 2, 4, 6)
    return target.unflatten(1, (-1, groups)), x.view(b, -1, 1, *shape, t, h, w)


class _WanAttentionBlock:
    """diffusers' WanAttentionBlock (and QwenImageAttentionBlock): single-head attention over each frame's pixels.
    Its 1x1 Conv2d projections are matmuls over the (pixels, channels) rows a channels_last_3d activation already
    holds, so the block reads and answers channels_last_3d with no permute copies (diffusers' qkv
    `.contiguous()` and its NCHW reshapes). Where a projection's call runs hooks (`hooked`: layerwise casting,
    offloading) or a LoRA layer stands in for it (`wrapper`: peft's, added after convert), both are called, on
    channels_last views: NHWC in and out whatever their weights' layout (PyTorch's conv2d answers channels_last where
    its input is), so a contiguous weight (after `shardable`, which offloading to disk needs) leaves the next norm
    no layout copy, as diffusers' forward, run with such weights, did."""

    classes = (
        "diffusers.models.autoencoders.autoencoder_kl_wan.WanAttentionBlock",
        "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageAttentionBlock",
    )
    attributes = ("norm", "to_qkv", "proj")

    @staticmethod
    def reason(module) -> str | None:
        for name in ("to_qkv", "proj"):
            conv = getattr(module, name)
            if not isinstance(conv, nn.Conv2d) or conv.kernel_size != (1, 1) or conv.groups != 1:
                return f"its {name} is not a 1x1 nn.Conv2d"
        return None

    def forward(self, x):
        identity = x
        b, c, t, h, w = x.size()
        x = self.norm(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))  # views when x is channels_last_3d
        to_qkv, proj = self.to_qkv, self.proj
        if hooked(to_qkv) or hooked(proj) or wrapper(to_qkv) or wrapper(proj):  # their calls: hooks, LoRA layers
            qkv = to_qkv(x).permute(0, 2, 3, 1).reshape(b * t, 1, h * w, 3 * c)
            x = F.scaled_dot_product_attention(*qkv.chunk(3, dim=-1))
            x = proj(x.view(b * t, h, w, c).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        else:
            rows = x.permute(0, 2, 3, 1).reshape(b * t, 1, h * w, c)
            qkv = F.linear(rows, to_qkv.weight.flatten(1), to_qkv.bias)
            x = F.scaled_dot_product_attention(*qkv.chunk(3, dim=-1))
            x = F.linear(x, proj.weight.flatten(1), proj.bias)
        return x.reshape(b, t, h, w, c).permute(0, 4, 1, 2, 3) + identity


ADAPTERS = (
    _WanCausalConv3d, _PlainConv3d, _CogVideoXCausalConv3d, _ReplicatePaddedConv3d, _LTXVideoCausalConv3d,
    _HunyuanVideoResnetBlock, _HunyuanVideoUpsample, _MochiChunkedGroupNorm, _LTXVideoUpsampler, _WanResample,
    _WanAttentionBlock, _CogVideoXSpatialNorm, _MochiUpBlock, _HunyuanVideo15Upsample, _HunyuanVideo15Downsample,
    _HunyuanImageRefinerUpsample, _HunyuanImageRefinerDownsample, _ChannelRMSNorm, _LTX2VideoCausalConv3d,
    _LTXVideoDownsampler, _PerChannelRMSNorm, _LastDimRMSNorm,
    _CosmosCausalConv3d, _CosmosDownsample3d, _CosmosUpsample3d, _CosmosPatchEmbed3d, _CosmosUnpatcher3d,
    _EasyAnimateCausalConv3d, _EasyAnimateResidualBlock, _WanResidualDownBlock, _WanResidualUpBlock, _WanAvgDown3D,
    _WanDupUp3D,
    _EasyAnimateDownsampler, _MiniMaxH3VideoCausalConv3d, _MiniMaxH3VideoDownsample3d, _MiniMaxH3VideoGroupNorm,
    _MiniMaxH3VideoResnetBlock3d, _MiniMaxH3VideoEncoder3d, _KVAESafeConv3d, _KVAECachedCausalConv3d,
    _KVAECachedPXSDownsample, _KVAECachedPXSUpsample, _KVAECachedSpatialNorm3D, _Kandinsky6SRCausalConv3d,
    _Kandinsky6RMSNorm, _Kandinsky6SRSpatialNorm3D, _Kandinsky6SRDownsample, _Kandinsky6SRUpsample,
    _VidTokCausalConv3d, _AllegroTemporalConvLayer, _Kandinsky6SRLatentUpscaler, _Kandinsky6SRLatentUpscalerConv3d,
    _Kandinsky6SRLatentUpscalerModulatedNorm, _Kandinsky6SRLatentUpscalerUpsample, _HunyuanVideoHistoryPatchEmbed,
    _CogVideoXUpsample3D, _CogVideoXDownsample3D, _EasyAnimateUpsampler3D,
)  # fmt: skip


# Blocks that run 2-D convolutions frame by frame on a (B*T, C, H, W) view of the video. A channels_last_3d
# activation gives them a channels_last (NHWC) view for free, and with channels_last weights PyTorch's conv2d
# answers in NHWC, which views back as channels_last_3d; with NCHW weights it may answer NCHW (CPU), and the
# next 3-D layer pays a layout copy. convert makes their nn.Conv2d weights channels_last (in place).
FRAME_BLOCKS = (
    "diffusers.models.autoencoders.autoencoder_kl_wan.WanResample",
    "diffusers.models.autoencoders.autoencoder_kl_wan.WanAttentionBlock",
    "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageResample",
    "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageAttentionBlock",
    "diffusers.models.downsampling.CogVideoXDownsample3D",
    "diffusers.models.upsampling.CogVideoXUpsample3D",
    "diffusers.models.autoencoders.autoencoder_kl_allegro.AllegroEncoder3D",
    "diffusers.models.autoencoders.autoencoder_kl_allegro.AllegroDecoder3D",
)


# The resamplers whose 2-D conv on the frames runs as one tconv3d conv over the video (frame_conv), where tconv3d
# can run it: audit counts that conv as theirs.
FRAME_CONV_BLOCKS = (
    "diffusers.models.autoencoders.autoencoder_kl_wan.WanResample",
    "diffusers.models.autoencoders.autoencoder_kl_qwenimage.QwenImageResample",
    "diffusers.models.downsampling.CogVideoXDownsample3D",
    "diffusers.models.upsampling.CogVideoXUpsample3D",
)


# Modules whose activation (a SiLU) follows their norms and nothing else: once the norms run on tconv3d's rms_norm,
# the SiLU is fused into each norm's pass and the module's activation becomes nn.Identity (its forward stays
# diffusers'; tests/test_integrations.py holds the converted VAEs to the stock ones). By class: (the norms, the
# activation). Not where a scale_shift_table (timestep conditioning) comes between norm and activation.
_WAN = "diffusers.models.autoencoders.autoencoder_kl_wan."
_QWEN = "diffusers.models.autoencoders.autoencoder_kl_qwenimage."
_HV15 = "diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15."
_HIR = "diffusers.models.autoencoders.autoencoder_kl_hunyuanimage_refiner."
_LTX = "diffusers.models.autoencoders.autoencoder_kl_ltx."
_LTX2 = "diffusers.models.autoencoders.autoencoder_kl_ltx2."
_BLOCK, _OUT, _OUT_ACT = (
    (("norm1", "norm2"), "nonlinearity"),
    (("norm_out",), "nonlinearity"),
    (("norm_out",), "conv_act"),
)
NORM_SILU_BLOCKS = {
    _WAN + "WanResidualBlock": _BLOCK, _WAN + "WanEncoder3d": _OUT, _WAN + "WanDecoder3d": _OUT,
    _QWEN + "QwenImageResidualBlock": _BLOCK, _QWEN + "QwenImageEncoder3d": _OUT, _QWEN + "QwenImageDecoder3d": _OUT,
    _HV15 + "HunyuanVideo15ResnetBlock": _BLOCK, _HV15 + "HunyuanVideo15Encoder3D": _OUT_ACT,
    _HV15 + "HunyuanVideo15Decoder3D": _OUT_ACT,
    _HIR + "HunyuanImageRefinerResnetBlock": _BLOCK, _HIR + "HunyuanImageRefinerEncoder3D": _OUT_ACT,
    _HIR + "HunyuanImageRefinerDecoder3D": _OUT_ACT,
    _LTX + "LTXVideoResnetBlock3d": _BLOCK, _LTX + "LTXVideoEncoder3d": _OUT_ACT, _LTX + "LTXVideoDecoder3d": _OUT_ACT,
    _LTX2 + "LTX2VideoResnetBlock3d": _BLOCK, _LTX2 + "LTX2VideoEncoder3d": _OUT_ACT,
    _LTX2 + "LTX2VideoDecoder3d": _OUT_ACT,
}  # fmt: skip
_FUSING_NORMS = (_ChannelRMSNorm, _PerChannelRMSNorm, _LastDimRMSNorm)


def fuse_norm_silu_blocks(model: nn.Module) -> None:
    """The SiLU of each NORM_SILU_BLOCKS module into its converted RMS norms (see NORM_SILU_BLOCKS)."""
    for block in model.modules():
        norm_names, activation_name = NORM_SILU_BLOCKS.get(class_name(type(block)), ((), None))
        if type(getattr(block, activation_name or "", None)) is not nn.SiLU:
            continue
        if getattr(block, "scale_shift_table", None) is not None:
            continue
        norms = [getattr(block, name, None) for name in norm_names]
        if all(getattr(type(n), "tconv3d_adapter", None) in _FUSING_NORMS and n.activation is None for n in norms):
            for norm in norms:
                norm.activation = "silu"
            setattr(block, activation_name, nn.Identity())


def adapter_reason(adapter: type, module: nn.Module) -> str | None:
    """Why `adapter` cannot take over `module` (None if it can), a layout of another library version included."""
    reason = instance_forward_reason(module)
    if (
        reason is None
        and getattr(adapter, "wraps_conv", False)
        and isinstance(getattr(module, "conv", None), nn.Module)
    ):
        reason = instance_forward_reason(module.conv)
        reason = reason and f"its conv: {reason}"
    if reason is not None:
        return reason
    missing = [name for name in adapter.attributes if not hasattr(module, name)]
    if missing:
        return f"it has no {', '.join(missing)}: not the {type(module).__name__} this tconv3d knows (other version?)"
    reason = getattr(adapter, "reason", None)  # an adapter that takes every module of its classes has none
    return reason(module) if reason is not None else None


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
