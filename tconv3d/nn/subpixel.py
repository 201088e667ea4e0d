"""The sub-pixel form of nearest upsampling followed by a convolution: nearest 2x along a dimension, then a 3-tap
conv padded by 1, is one transposed conv of the input itself at stride 2 with 4 taps, each a sum of the conv's
(`subpixel_weight`). The video VAEs' upsamplers (video_vaes.py) and MONAI's (monai_nets.py) run in it; SUBPIXEL
switches all of them back to upsampling first (bench.vae_decode's `converted_upsample_first`)."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..functional import conv_transpose3d
from ..geometry import conv_dtype

_CL = torch.channels_last_3d

# Nearest 2x along H (or W), then a 3-tap conv padded by 1, is a transposed conv of the input itself at stride 2 with
# 4 taps, padded by 1, each tap a sum of the conv's: output 2i reads x[i - 1] through w[0] and x[i] through
# w[1] + w[2]; output 2i + 1 reads x[i] through w[0] + w[1] and x[i + 1] through w[2]. Row k: which of the conv's
# taps the transposed conv's tap k sums (output o = 2j + k - 1 reads x[j]).
_SUBPIXEL_TAPS = ((0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 0, 0))
SUBPIXEL = True  # False: every sub-pixel form upsamples first, as before (bench.vae_decode's converted_upsample_first)


def subpixel_weight(conv: nn.Conv2d | nn.Conv3d, time: str | None = None, space: bool = True) -> torch.Tensor:
    """The channels_last_3d weight of the transposed conv that `upsampled_frame_conv` runs for a Conv2d `conv` (or
    a Conv3d of one frame: Cosmos's spatial upsampler's), (C_in, C_out, 1, 4, 4): _SUBPIXEL_TAPS along H and W,
    summed in fp32, rounded once to the weight's dtype; or that `upsampled_causal_conv` runs for a 3 x 3 x 3 Conv3d,
    (C_in, C_out, 4, 4, 4) with `time` "repeated" (_SUBPIXEL_TAPS along D too) or (C_in, C_out, 3, 4, 4) with
    `time` "kept" (D's taps reversed, as a transposed conv at stride 1 reads them); `space` False: H and W's taps
    the conv's own (Cosmos's time upsampler's 3 x 1 x 1 conv, "repeated": (C_in, C_out, 4, 1, 1)). Differentiable:
    the weight gradient lands in conv.weight. Kept for the module (_KEPT) while the weight has no gradient to take
    (inference) and unchanged (its storage and version): a decode computes it once. An inference tensor's weight
    (a model built inside torch.inference_mode()) has no version to tell an in-place change by (a state dict
    loaded into it): each call computes it."""
    weight = conv.weight
    cacheable = not (  # (compiling first: Dynamo cannot trace is_inference)
        torch.compiler.is_compiling() or (torch.is_grad_enabled() and weight.requires_grad) or weight.is_inference()
    )
    storage = StorageWeakRef(weight.untyped_storage()) if cacheable else None
    key = _weight_key(weight, storage, time, space) if cacheable else None
    kept = _KEPT.get(conv) if cacheable else None
    if (
        kept is not None
        and kept[0] == key
        and not kept[2].expired()
        and (torch.is_inference_mode_enabled() or not kept[1].is_inference())
    ):
        return kept[1]
    taps = _subpixel_taps(weight.device)
    w = weight.float() if weight.dim() == 5 else weight.float().unsqueeze(2)  # a Conv2d: one frame
    if time is None:
        summed = torch.einsum("ka,lb,oitab->iotkl", taps, taps, w)
    else:
        frame_taps = taps if time == "repeated" else _subpixel_taps(weight.device, _REVERSED_TAPS)
        if space:
            summed = torch.einsum("jt,ka,lb,oitab->iojkl", frame_taps, taps, taps, w)
        else:
            summed = torch.einsum("jt,oitab->iojab", frame_taps, w)
    subpixel = summed.to(weight.dtype).contiguous(memory_format=_CL)
    if cacheable:
        _KEPT[conv] = (key, subpixel, storage)
    return subpixel


# conv -> (_weight_key, its sub-pixel weight, the weak reference to its weight's storage): outside the module's
# state, which copy.deepcopy and torch.save copy (two copies of a weak reference would free it twice).
_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_key(weight: torch.Tensor, storage: StorageWeakRef, time, space) -> tuple:
    """What a kept sub-pixel weight was computed from: the weight's storage by identity (a weak reference to it,
    kept with the result, keeps another storage from taking its identity, and tells when it was freed), where its
    data lies and its version. An address and a version alone repeat: a weight whose storage was replaced by a
    fresh one (`.data` assigned, as diffusers' layerwise casting and offloading hooks do each call) can get the
    freed one's address and the same version."""
    return (storage.cdata, weight.data_ptr(), weight._version, weight.dtype, weight.device, time, space)


_TAP_TENSORS = {}  # (rows of taps, device): their float32 tensor there


def _subpixel_taps(device: torch.device, rows=None) -> torch.Tensor:
    """`rows` (_SUBPIXEL_TAPS by default) as a float32 tensor on `device`, made there once (a training step's call
    would otherwise copy it from the host each time: a copy a CUDA graph's capture refuses); traced as a constant
    under torch.compile. Made outside inference mode whatever the caller's: a first call in a decode under
    torch.inference_mode() would otherwise keep an inference tensor, which a later training step's einsum cannot
    save for its backward (model fuzz run 66, Cosmos)."""
    rows = _SUBPIXEL_TAPS if rows is None else rows
    if torch.compiler.is_compiling():
        return torch.tensor(rows, dtype=torch.float32, device=device)
    key = (rows, device)
    if key not in _TAP_TENSORS:
        with torch.inference_mode(False):
            _TAP_TENSORS[key] = torch.tensor(rows, dtype=torch.float32, device=device)
    return _TAP_TENSORS[key]


# A causal conv's 3 time taps as a transposed conv at stride 1 reads them: tap k is the conv's tap 2 - k.
_REVERSED_TAPS = ((0, 0, 1), (0, 1, 0), (1, 0, 0))


def upsampled_conv(conv: nn.Conv3d, x: torch.Tensor, factors) -> torch.Tensor:
    """conv(x repeated by nearest `factors`), (2, 2, 2) or (1, 2, 2), for a conv that `upsampled_conv_reason`
    allows (3 taps padded by 1 along each upsampled dimension, 1 unpadded along a kept one, unit stride and
    dilation, one group): one transposed conv of x itself at stride `factors`, padded by 1 along each upsampled
    dimension, 4 taps there (`subpixel_weight`, 2 live an output voxel): 8 taps an output voxel where the upsampled
    input has 27 at (2, 2, 2) (MONAI's UpSample), 4 where 9 at (1, 2, 2) (Kandinsky 6's latent upscalers, Cosmos's
    space step); nothing of the upsampled size written, read or saved for the backward. A conv padded in mode
    reflect or replicate (BORDERED_MODES) takes x already replicate-padded by 1 along each upsampled dimension
    (Conv3d.forward pads it: both modes repeat a repetition's edge voxel, which is x's); the transposed conv crops
    3 there."""
    crop = 1 if conv.padding_mode == "zeros" else 3
    if tuple(factors) == (2, 2, 2):
        return conv_transpose3d(x, subpixel_weight(conv, "repeated"), conv.bias, stride=2, padding=crop)
    return conv_transpose3d(x, subpixel_weight(conv), conv.bias, stride=(1, 2, 2), padding=(0, crop, crop))


# A repetition by 2 padded by 1 in these modes repeats its edge voxel (u[-1] = u[1] = u[0] reflected): x's edge.
BORDERED_MODES = ("reflect", "replicate")


def upsampled_conv_reason(conv: nn.Conv3d, x: torch.Tensor, factors) -> str | None:
    """Why `conv` of x repeated by nearest `factors` runs on the repetition (None where it runs
    `upsampled_conv`)."""
    if not SUBPIXEL:
        return "subpixel.SUBPIXEL is off"
    factors = tuple(factors)
    if factors not in ((2, 2, 2), (1, 2, 2)):
        return f"its factors {factors} are not (2, 2, 2) or (1, 2, 2)"
    expected = ((2 * factors[0] - 1, 3, 3), (factors[0] - 1, 1, 1), (1, 1, 1), (1, 1, 1), 1)
    shape = (tuple(conv.kernel_size), conv.padding, tuple(conv.stride), tuple(conv.dilation), conv.groups)
    if shape != expected:
        return f"its (kernel, padding, stride, dilation, groups) {shape} is not {expected}"
    if conv.padding_mode not in ("zeros", *BORDERED_MODES):
        return f"its padding mode {conv.padding_mode} is not zeros, reflect or replicate"
    if x.dim() != 5 or conv_dtype(x, conv.weight) is None or not x.numel():
        return f"the input is {x.dim()}-D {x.dtype} of {x.numel()} elements, its weight {conv.weight.dtype}"
    if conv.padding_mode != "zeros" and any(size == 1 for size, f in zip(x.shape[2:], factors, strict=True) if f == 2):
        # Its borders repeated, stock's output is then exactly constant along that dimension; the phases' taps,
        # summed and rounded apart, would differ there by an ulp (video_vaes.causal_subpixel_reason's case).
        return f"its input is {tuple(x.shape[2:])}, {conv.padding_mode}-padded: one voxel along an upsampled dimension"
    return None
