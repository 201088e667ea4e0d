"""Argument checking and normalisation for Conv3d: the one place that turns user arguments into a ConvGeometry."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Their short names (tuning keys, shape sets, the command lines)
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DTYPES_BY_NAME = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# What the padded border reads, as in F.pad's modes; the kernels take the index (PAD_MODE_D/H/W) of the name.
# A padding_mode is one name for all three dimensions or three, "d,h,w" (e.g. "replicate,zeros,zeros": repeat
# the edge frames in time, zeros in space, as the LTX-Video and CogVideoX VAEs pad).
PADDING_MODES = ("zeros", "replicate", "reflect", "circular")


class _cached_property:
    """functools.cached_property without its lock (Python 3.12's): the value computed on first use, kept in the
    instance's __dict__. Python 3.11's takes an RLock, which dynamo does not trace (a geometry built in a compiled
    graph, tconv3d's ops in torch ops under a torch.func transform)."""

    def __init__(self, function):
        self.function = function
        self.__doc__ = function.__doc__

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.function(instance)
        return value


@dataclass(frozen=True)
class ConvGeometry:
    """A checked Conv3d problem. Spatial triples are (d, h, w); padding is the 6-value form
    (d_front, d_back, h_top, h_bottom, w_left, w_right). Sizes may be SymInts under torch.compile."""

    batch: int
    in_channels: int
    out_channels: int
    in_size: tuple[int, int, int]
    kernel: tuple[int, int, int]
    out_size: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int, int, int, int]
    dilation: tuple[int, int, int]
    padding_mode: str = "zeros"
    # Frames read from a second tensor in front of the input along D (a video VAE's cached frames): in_size[0]
    # counts them, and the padding and its modes apply to the concatenation, as if torch.cat had made it.
    prefix_frames: int = 0
    # Channels read from a second tensor after the input's along C (a UNet decoder's skip connection, read in
    # place of torch.cat([input, channels_after], dim=1)): in_channels counts them too.
    after_channels: int = 0
    # Output channels whose values a second tensor holds after grad_output's own along C, for the input gradient
    # (a transposed convolution of torch.cat([x, skip], dim=1), MONAI UNet's decoder, read in place): out_channels
    # counts them too.
    out_after_channels: int = 0
    # Grouped convolution: channels split into `groups` equal runs, each convolved with its own slice of the
    # weight's output channels (in_channels and out_channels count all of them; depthwise: groups == in_channels).
    groups: int = 1

    # The derived values below are cached on first use (in the instance's __dict__, which a frozen dataclass
    # still has): the launchers read them on every call (issue 19).

    @_cached_property
    def group_in_channels(self) -> int:
        return self.in_channels // self.groups

    @_cached_property
    def channel_sources(self) -> tuple[int, int]:
        """(the input's channels, channels_after's) of the reduced channels: (in_channels, 0) with one source."""
        return self.in_channels - self.after_channels, self.after_channels

    @_cached_property
    def out_channel_sources(self) -> tuple[int, int]:
        """(grad_output's channels, its channels_after's) of the input gradient's reduced channels."""
        return self.out_channels - self.out_after_channels, self.out_after_channels

    @_cached_property
    def group_out_channels(self) -> int:
        return self.out_channels // self.groups

    @_cached_property
    def is_depthwise(self) -> bool:
        """One input channel per group (a channel multiplier of out_channels / in_channels): the direct kernels'
        case, which no GEMM tile would fill."""
        return self.groups > 1 and self.group_in_channels == 1

    @_cached_property
    def front_padding(self) -> tuple[int, int, int]:
        return self.padding[0], self.padding[2], self.padding[4]

    @_cached_property
    def dim_modes(self) -> tuple[str, str, str]:
        return split_padding_mode(self.padding_mode)

    @_cached_property
    def pad_mode_indices(self) -> tuple[int, int, int]:
        return tuple(PADDING_MODES.index(mode) for mode in self.dim_modes)

    @_cached_property
    def reads_border(self) -> bool:
        """Whether some padded border reads input voxels (a mode other than zeros) rather than zeros."""
        return self.padding_mode != "zeros"

    def border_geometry(self) -> ConvGeometry:
        """The geometry whose input gradient the input gradient under modes other than zeros is folded from: the
        dimensions whose border reads input voxels are padded out (their border becomes input of its own, added
        back by kernels.tensors.fold_padding), zeros borders stay padding, and one source."""
        padding, size = list(self.padding), list(self.in_size)
        for dim, mode in enumerate(self.dim_modes):
            if mode != "zeros":
                size[dim] += padding[2 * dim] + padding[2 * dim + 1]
                padding[2 * dim] = padding[2 * dim + 1] = 0
        return dataclasses.replace(
            self, in_size=tuple(size), padding=tuple(padding), padding_mode="zeros", prefix_frames=0, after_channels=0
        )

    @_cached_property
    def is_symmetric(self) -> bool:
        p = self.padding
        return p[0] == p[1] and p[2] == p[3] and p[4] == p[5]

    @_cached_property
    def taps(self) -> int:
        return self.kernel[0] * self.kernel[1] * self.kernel[2]

    @_cached_property
    def output_voxels(self) -> int:
        return self.batch * self.out_size[0] * self.out_size[1] * self.out_size[2]

    @_cached_property
    def input_voxels(self) -> int:
        return self.batch * self.in_size[0] * self.in_size[1] * self.in_size[2]

    def output_shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.out_channels, *self.out_size)

    def input_shape(self) -> tuple[int, int, int, int, int]:
        return (self.batch, self.in_channels, *self.in_size)

    def weight_shape(self) -> tuple[int, int, int, int, int]:
        return (self.out_channels, self.group_in_channels, *self.kernel)

    def flops(self) -> int:
        """Multiply-adds times two of one direction (forward, input-grad or weight-grad cost the same)."""
        return 2 * self.output_voxels * self.out_channels * self.group_in_channels * self.taps


def _is_int(v) -> bool:
    if type(v) is int:  # the common case, without the slow abstract-class check below
        return True
    return not isinstance(v, bool) and isinstance(v, (numbers.Integral, torch.SymInt))


def _int_tuple(value, name: str, lengths: tuple[int, ...]) -> tuple[int, ...]:
    if _is_int(value):
        return (value if isinstance(value, torch.SymInt) else int(value),)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(f"{name} must be an int or a sequence of ints, got {type(value).__name__}")
    if len(value) not in lengths:
        *head, last = (str(n) for n in lengths)
        allowed = f"{', '.join(head)} or {last}" if head else last
        raise ValueError(f"{name} must have {allowed} values, got {len(value)}: {tuple(value)}")
    for v in value:
        if not _is_int(v):
            raise TypeError(f"{name} must contain ints, got {v!r} in {tuple(value)}")
    return tuple(v if isinstance(v, torch.SymInt) else int(v) for v in value)


def triple(value, name: str) -> tuple[int, int, int]:
    """stride or dilation: an int or 1 or 3 ints, each at least 1."""
    values = _int_tuple(value, name, (1, 3))
    if len(values) == 1:
        values = values * 3
    if any(v < 1 for v in values):
        raise ValueError(f"{name} must be >= 1 in every dimension, got {values}")
    return values


def resolve_padding(padding, kernel, stride, dilation) -> tuple[int, int, int, int, int, int]:
    """padding as an int, 1, 3 or 6 ints, 'valid' or 'same' -> (d_front, d_back, h_top, h_bottom, w_left, w_right)."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0,) * 6
        if padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"padding='same' is not supported for strided convolutions, got stride {stride}")
            pads = []
            for k, d in zip(kernel, dilation, strict=True):
                total = d * (k - 1)
                # torch puts the odd element of an even kernel's padding at the back, so do we.
                pads += [total // 2, total - total // 2]
            return tuple(pads)
        raise ValueError(f"padding must be 'same', 'valid', an int or 1, 3 or 6 ints, got {padding!r}")
    values = _int_tuple(padding, "padding", (1, 3, 6))
    if any(v < 0 for v in values):
        raise ValueError(f"padding must be non-negative, got {values}")
    if len(values) == 1:
        return values * 6
    if len(values) == 3:
        return (values[0], values[0], values[1], values[1], values[2], values[2])
    return values


def check_tensors(**tensors) -> None:
    """Each named argument is a tensor (or None) of a supported dtype, all of one dtype and on one device."""
    first_name = first = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; tconv3d supports float16, bfloat16 and float32")
        if first is None:
            first_name, first = name, t
        elif t.dtype != first.dtype:
            raise TypeError(f"{name} dtype {t.dtype} does not match {first_name} dtype {first.dtype}")
        elif t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; put them on one device")


def split_padding_mode(padding_mode: str) -> tuple[str, str, str]:
    """A canonical padding_mode -> its (d, h, w) modes. Not cached: torch.func's transforms under torch.compile
    trace it (the ops' torch ops), and torch 2.15's Dynamo warns at every functools.lru_cache it traces into."""
    modes = tuple(padding_mode.split(","))
    return modes * 3 if len(modes) == 1 else modes


def check_padding_mode(padding_mode) -> str:
    """padding_mode as a name, "d,h,w" names or a sequence of 3 names -> the canonical string the op takes: one
    name when all three agree, else "d,h,w"."""
    if isinstance(padding_mode, str):
        return _canonical_padding_mode(padding_mode)
    if isinstance(padding_mode, Sequence) and len(padding_mode) == 3 and all(isinstance(m, str) for m in padding_mode):
        return _canonical_padding_mode(",".join(padding_mode))
    raise TypeError(f"padding_mode must be a str or 3 strs (d, h, w), got {padding_mode!r}")


def _canonical_padding_mode(padding_mode: str) -> str:
    if padding_mode in PADDING_MODES:  # the common case
        return padding_mode
    modes = padding_mode.split(",")
    if len(modes) not in (1, 3) or any(mode not in PADDING_MODES for mode in modes):
        raise ValueError(
            f"padding_mode must be one of {PADDING_MODES} or three of them for (d, h, w), got {padding_mode!r}"
        )
    return modes[0] if len(set(modes)) == 1 else ",".join(modes)


def _check_pads_fit_mode(in_size, padding, padding_mode: str) -> None:
    """The limits F.pad puts on each mode: a reflected border mirrors inside the dimension (pad < size), a
    circular one wraps around it once (pad <= size), a replicated one needs a voxel to repeat."""
    for dim, (size, mode) in enumerate(zip(in_size, split_padding_mode(padding_mode), strict=True)):
        front, back = padding[2 * dim], padding[2 * dim + 1]
        if not front and not back:
            continue
        name = "DHW"[dim]
        if mode == "reflect" and max(front, back) >= size:
            raise ValueError(
                f"reflect padding must be smaller than the input in dimension {name}: padding {(front, back)}, "
                f"size {size}"
            )
        if mode == "circular" and max(front, back) > size:
            raise ValueError(
                f"circular padding must not exceed the input in dimension {name}: padding {(front, back)}, size {size}"
            )
        if mode == "replicate" and size == 0:
            raise ValueError(f"replicate padding of an empty dimension {name} has nothing to repeat")


def _empty_dimension(name: str, shape, size) -> str:
    """The refusal of a batch of inputs with an empty D, H or W (`size`, frames_before's included)."""
    empty = "".join(n for n, s in zip("DHW", size, strict=True) if s == 0)
    return (
        f"{name} {tuple(shape)} has an empty {empty}: as torch's convolutions, tconv3d takes an empty batch but not "
        "an empty D, H or W"
    )


def check_groups(groups, in_channels, out_channels) -> int:
    """groups as nn.Conv3d takes it: a positive int dividing both channel counts."""
    if not _is_int(groups):
        raise TypeError(f"groups must be an int, got {groups!r}")
    if groups < 1:
        raise ValueError(f"groups must be a positive integer, got {groups}")
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide both the {in_channels} input channels and the {out_channels} output channels"
        )
    return int(groups)


def conv_geometry(
    input_shape, weight_shape, stride, padding, dilation, padding_mode="zeros", prefix_frames=0, groups=1,
    after_channels=0,
) -> ConvGeometry:  # fmt: skip
    """Check the shapes and convolution arguments of one conv3d and return its geometry. `prefix_frames` frames
    of a second source precede the input along D, `after_channels` channels of one follow its channels (their
    shapes are checked by the caller)."""
    if len(input_shape) != 5:
        raise ValueError(
            f"input must be 5-D (N, C, D, H, W) (or, outside the op, unbatched 4-D), got {len(input_shape)}-D with "
            f"shape {tuple(input_shape)}"
        )
    if len(weight_shape) != 5:
        raise ValueError(
            f"weight must be 5-D (Cout, Cin, kd, kh, kw), got {len(weight_shape)}-D with shape {tuple(weight_shape)}"
        )
    batch, in_channels, frames, *in_plane = input_shape
    in_size = [frames + prefix_frames, *in_plane]
    if batch and 0 in in_size:  # torch's convolutions refuse it too, whatever the padding would add
        raise ValueError(_empty_dimension("input", input_shape, in_size))
    in_channels += after_channels
    out_channels, weight_in_channels, *kernel = weight_shape
    if in_channels == 0 or out_channels == 0 or any(k == 0 for k in kernel) or weight_in_channels == 0:
        raise ValueError(f"weight must have no zero-sized dimension, got shape {tuple(weight_shape)}")
    groups = check_groups(groups, in_channels, out_channels)
    if weight_in_channels * groups != in_channels:
        has = f"input has {in_channels}"
        if after_channels:
            has = f"input and channels_after have {in_channels - after_channels} + {after_channels}"
        raise ValueError(
            f"channel mismatch: {has} channels but weight {tuple(weight_shape)} with "
            f"groups={groups} expects {weight_in_channels * groups}"
        )
    stride = triple(stride, "stride")
    dilation = triple(dilation, "dilation")
    padding = resolve_padding(padding, kernel, stride, dilation)
    padding_mode = check_padding_mode(padding_mode)
    if padding_mode != "zeros":
        _check_pads_fit_mode(in_size, padding, padding_mode)
    out_size = []
    for dim, (size, k, s, d) in enumerate(zip(in_size, kernel, stride, dilation, strict=True)):
        padded = size + padding[2 * dim] + padding[2 * dim + 1]
        span = d * (k - 1) + 1
        if padded < span:
            raise ValueError(
                f"input is smaller than the dilated kernel in dimension {'DHW'[dim]}: padded size {padded} "
                f"< dilated kernel size {span} (input {tuple(in_size)}, kernel {tuple(kernel)}, "
                f"dilation {dilation}, padding {padding})"
            )
        out_size.append((padded - span) // s + 1)
    return ConvGeometry(
        batch=batch,
        in_channels=in_channels,
        out_channels=out_channels,
        in_size=tuple(in_size),
        kernel=tuple(kernel),
        out_size=tuple(out_size),
        stride=stride,
        padding=padding,
        dilation=dilation,
        padding_mode=padding_mode,
        prefix_frames=prefix_frames,
        after_channels=after_channels,
        groups=groups,
    )


def _second_source_extent(input, second, name: str, dim: int) -> int:
    """`second`'s extent along `dim` (2: frames before the input along D; 1: channels after its channels along C);
    every other dim must match the input's."""
    if second.dim() != 5 or input.dim() != 5:
        raise ValueError(f"{name} must be 5-D (N, C, D, H, W) like the input, got shape {tuple(second.shape)}")
    others = [i for i in range(5) if i != dim]
    if [second.shape[i] for i in others] != [input.shape[i] for i in others]:
        raise ValueError(
            f"{name} has shape {tuple(second.shape)}; it must match the input {tuple(input.shape)} in every "
            f"dimension but {'NCDHW'[dim]}"
        )
    return second.shape[dim]


def prefix_frame_count(input, frames_before) -> int:
    """How many frames `frames_before` puts in front of `input` along D; its other dims must match input's."""
    return 0 if frames_before is None else _second_source_extent(input, frames_before, "frames_before", 2)


def after_channel_count(input, channels_after, frames_before=None) -> int:
    """How many channels `channels_after` puts after `input`'s along C; its other dims must match input's."""
    if channels_after is None:
        return 0
    channels = _second_source_extent(input, channels_after, "channels_after", 1)
    if frames_before is not None:
        raise ValueError(
            "frames_before and channels_after together are not supported: concatenate one of them (torch.cat) "
            "before the call"
        )
    if channels == 0:
        raise ValueError(f"channels_after has no channels (shape {tuple(channels_after.shape)}); pass None")
    return channels


def check_conv3d(
    input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros", frames_before=None,
    channels_after=None,
) -> ConvGeometry:  # fmt: skip
    """Validate a conv3d call and return its geometry. Raises TypeError, ValueError or NotImplementedError
    naming the problem, so no bad argument ever reaches a kernel. Memoised (see `_memo_key`)."""
    tensors = (input, weight, bias, frames_before, channels_after)
    key = _memo_key(tensors, (stride, padding, dilation), groups, padding_mode)
    geom = _checked.get(key)
    if geom is None:
        check_tensors(input=input, weight=weight, bias=bias, frames_before=frames_before, channels_after=channels_after)
        prefix = prefix_frame_count(input, frames_before)
        after = after_channel_count(input, channels_after, frames_before)
        geom = conv_geometry(input.shape, weight.shape, stride, padding, dilation, padding_mode, prefix, groups, after)
        if bias is not None and tuple(bias.shape) != (geom.out_channels,):
            raise ValueError(f"bias must have shape ({geom.out_channels},) to match weight, got {tuple(bias.shape)}")
        _remember(key, geom)
    return geom


def check_input_grad(
    grad_output, weight, input_size, stride, padding, dilation, padding_mode="zeros", groups=1, channels_after=None,
    bias=None,
):  # fmt: skip
    """Validate a conv3d_input_grad call (its arguments) and return the geometry of the forward convolution.
    channels_after follows grad_output's channels (geom.out_after_channels); bias, one per input channel, is added
    to the result (a transposed convolution's)."""
    geom = _check_gradient(
        grad_output, weight, "weight", input_size, weight.shape, stride, padding, dilation, padding_mode, None, groups,
        grad_after=channels_after,
    )  # fmt: skip
    if bias is not None:
        check_tensors(grad_output=grad_output, bias=bias)
        if tuple(bias.shape) != (geom.in_channels,):
            shape = tuple(bias.shape)
            raise ValueError(f"bias must have shape ({geom.in_channels},), one per input channel, got {shape}")
    return geom


def check_weight_grad(
    grad_output, input, weight_size, stride, padding, dilation, padding_mode="zeros", frames_before=None, groups=1,
    channels_after=None,
):  # fmt: skip
    """Validate a conv3d_weight_grad call (its arguments) and return the geometry of the forward convolution."""
    return _check_gradient(
        grad_output, input, "input", input.shape, weight_size, stride, padding, dilation, padding_mode, frames_before,
        groups, channels_after,
    )  # fmt: skip


def _check_gradient(
    grad_output, other, other_name, input_size, weight_size, stride, padding, dilation, padding_mode, frames_before,
    groups, channels_after=None, grad_after=None,
) -> ConvGeometry:  # fmt: skip
    """A gradient op's check: `other` is the weight for the input gradient, the input for the weight gradient,
    named `other_name`; the sizes of the two are given; channels_after follows the input's channels, grad_after
    grad_output's. Memoised (see `_memo_key`)."""
    key = _memo_key(
        (grad_output, other, frames_before, channels_after, grad_after),
        (input_size, weight_size, stride, padding, dilation), groups, padding_mode,
    )  # fmt: skip
    geom = _checked.get(key)
    if geom is None:
        after = channels_after if grad_after is None else grad_after  # the input's, or grad_output's
        check_tensors(grad_output=grad_output, **{other_name: other}, frames_before=frames_before, channels_after=after)
        prefix = prefix_frame_count(other, frames_before)
        after = after_channel_count(other, channels_after, frames_before)
        geom = conv_geometry(input_size, weight_size, stride, padding, dilation, padding_mode, prefix, groups, after)
        expected = geom.output_shape()
        if grad_after is not None:
            out_after = after_channel_count(grad_output, grad_after)
            geom = dataclasses.replace(geom, out_after_channels=out_after)
            expected = (expected[0], expected[1] - out_after, *expected[2:])
        if tuple(grad_output.shape) != expected:
            has = f"grad_output has shape {tuple(grad_output.shape)}"
            if grad_after is not None:
                has += f" (and channels_after {out_after} channels after its {grad_output.shape[1]})"
            raise ValueError(f"{has}, but the convolution's output is {geom.output_shape()}")
        _remember(key, geom)
    return geom


# Checked problems by their exact arguments, so that a layer's repeated call costs one key and one dict probe
# (issue 19); only a problem that passed every check is remembered.
_checked: dict[tuple, ConvGeometry] = {}
_MAX_CHECKED = 4096  # past that, problems are checked afresh (a process with more is unusual)
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not subclasses, which have dispatch of their own


def _memo_key(tensors, int_sequences, groups, padding_mode) -> tuple | None:
    """A check's exact arguments as a key: each tensor's (shape, dtype, device), the int sequences and the
    scalars. None (checked afresh) where a remembered result could differ from a fresh check: a tensor subclass
    (a FakeTensor's sizes may be symbolic), anything but plain ints where ints belong (1.0 and True equal 1 as
    keys; SymInts), an int where a sequence may be."""
    if type(groups) is not int or type(padding_mode) is not str:
        return None
    key = [groups, padding_mode]
    for values in int_sequences:
        values = int_sequence_key(values)
        if values is None:
            return None
        key.append(values)
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) in PLAIN_TENSORS:
            key += (t.shape, t.dtype, t.device)
        else:
            return None
    return tuple(key)


def int_sequence_key(values) -> tuple | None:
    """A list, tuple or torch.Size of plain ints as a tuple (a memo key's part; the gradient checks take a tensor's
    shape as a size), or None: anything else (a bool or SymInt where an int belongs; an int where a sequence may
    be) is checked afresh, as 1.0 and True equal 1 as keys."""
    if type(values) not in (list, tuple, torch.Size):
        return None
    for v in values:
        if type(v) is not int:
            return None
    return tuple(values)


def _remember(key, geom: ConvGeometry) -> None:
    if key is not None and len(_checked) < _MAX_CHECKED:
        _checked[key] = geom


def conv_arguments(
    input, weight, bias, stride, padding, dilation, groups, padding_mode="zeros", frames_before=None,
    channels_after=None,
):  # fmt: skip
    """The functional form's arguments as the op's schema takes them: (stride, 6-value padding, dilation), each a
    list of ints, and the canonical padding_mode. Checks what the schema could only reject with a dispatcher error
    (argument types) and resolves 'same' / 'valid'; everything else is checked once, by the op."""
    check_tensors(input=input, weight=weight, bias=bias, frames_before=frames_before, channels_after=channels_after)
    key = _arguments_key(stride, padding, dilation, groups, padding_mode)
    known = _resolved.get(key) if key is not None else None
    if known is not None:
        stride, padding, dilation, padding_mode = known
        return [*stride], [*padding], [*dilation], padding_mode
    if not _is_int(groups):
        raise TypeError(f"groups must be an int, got {groups!r}")
    padding_mode = check_padding_mode(padding_mode)
    stride, dilation = triple(stride, "stride"), triple(dilation, "dilation")
    if isinstance(padding, str):  # needs the kernel size, so the shapes are checked here already
        after = after_channel_count(input, channels_after, frames_before)
        padding = conv_geometry(
            input.shape, weight.shape, stride, padding, dilation, groups=groups, after_channels=after
        ).padding
    else:
        padding = resolve_padding(padding, None, stride, dilation)
        if key is not None and len(_resolved) < _MAX_CHECKED:
            _resolved[key] = tuple(stride), tuple(padding), tuple(dilation), padding_mode
    return list(stride), list(padding), list(dilation), padding_mode


# conv_arguments' results by their arguments where they need no shapes (padding not 'same' or 'valid'), so that a
# layer's repeated call does not resolve them again (issue 29).
_resolved: dict[tuple, tuple] = {}


def _arguments_key(*arguments) -> tuple | None:
    """conv_arguments' int, str and int-sequence arguments as a key, each sequence as a tuple (int_sequence_key);
    None where any is something else (a bool or a SymInt where an int belongs, a padding string: resolved afresh)."""
    key = []
    for index, value in enumerate(arguments):
        kind = type(value)
        if kind is int or (kind is str and index == len(arguments) - 1):  # only padding_mode may be a string
            key.append(value)
        else:
            value = int_sequence_key(value)
            if value is None:
                return None
            key.append(value)  # a tuple, told from an int: (3,) from 3
    return tuple(key)


def check_group_norm(input, weight, bias, groups, activation, channels_after=None, activation_weight=None) -> None:
    """Validate a group_norm call (5-D input, and channels_after whose channels follow the input's; weight and
    bias per channel of both, of any supported dtype, as under autocast a bf16 activation meets fp32
    parameters), of more than one value a group; a PReLU's weight (activation "prelu" only) of one value or one a
    channel."""
    channels = _check_norm(input, weight, bias, groups, activation, channels_after)
    if (activation == "prelu") != (activation_weight is not None):
        raise ValueError(f"activation_weight (a PReLU's weight) goes with activation 'prelu' only, got {activation!r} "
                         f"and {'a tensor' if activation_weight is not None else 'None'}")  # fmt: skip
    if activation_weight is not None:
        check_tensors(activation_weight=activation_weight)
        if activation_weight.device != input.device:
            raise ValueError(f"activation_weight is on {activation_weight.device} but input is on {input.device}")
        if activation_weight.dim() != 1 or activation_weight.numel() not in (1, channels):
            raise ValueError(
                f"activation_weight must have shape (1,) or ({channels},), got {tuple(activation_weight.shape)}"
            )
    if input.shape[0] * (channels // groups) * math.prod(input.shape[2:]) == 1:  # torch's F.group_norm refuses it
        raise ValueError(
            f"GroupNorm expects more than 1 value per group, as torch's group_norm does: input {tuple(input.shape)}, "
            f"{channels} channels in {groups} groups"
        )


# The norms' fused activations, their ops' `activation` argument; the index is the kernels' ACTIVATION code
# (kernels/utils.activated). "leaky_relu" (its slope the op's negative_slope) and "prelu" (its weight the op's
# activation_weight; to the kernels a leaky ReLU whose slopes they load) are group_norm's only.
NORM_ACTIVATIONS = ("none", "silu", "relu", "leaky_relu", "prelu")
RMS_NORM_ACTIVATIONS = NORM_ACTIVATIONS[:3]


def _check_norm(input, weight, bias, groups, activation, channels_after=None) -> int:
    """check_group_norm's checks but the values a group (rms_norm's too, with one group): the channels."""
    check_tensors(input=input, channels_after=channels_after)
    if weight is not None or bias is not None:
        check_tensors(weight=weight, bias=bias)
        param = weight if weight is not None else bias
        if param.device != input.device:
            raise ValueError(f"weight and bias are on {param.device} but input is on {input.device}")
    if input.dim() != 5:
        raise ValueError(f"input must be 5-D (N, C, D, H, W), got shape {tuple(input.shape)}")
    channels = input.shape[1] + after_channel_count(input, channels_after)
    if not _is_int(groups) or groups < 1 or channels % groups:
        raise ValueError(f"groups must be a positive divisor of the {channels} channels, got {groups!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (channels,):
            raise ValueError(f"{name} must have shape ({channels},), got {tuple(t.shape)}")
    if activation not in NORM_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, NORM_ACTIVATIONS))}, got {activation!r}")
    return channels


# Channels the rms_norm kernels hold in registers at once: a voxel's whole channel vector.
RMS_NORM_MAX_CHANNELS = 4096


def check_rms_norm(input, weight, bias, eps, activation) -> None:
    """Validate an rms_norm call: 5-D input of at most RMS_NORM_MAX_CHANNELS channels, weight and bias per channel
    (any supported dtype), a positive eps."""
    if activation not in RMS_NORM_ACTIVATIONS:
        raise ValueError(
            f"rms_norm's activation must be one of {', '.join(map(repr, RMS_NORM_ACTIVATIONS))}, got {activation!r}"
        )
    _check_norm(input, weight, bias, 1, activation)  # a voxel's channels: one value is an RMS norm's (its sign)
    if input.shape[1] > RMS_NORM_MAX_CHANNELS:
        raise ValueError(f"rms_norm takes at most {RMS_NORM_MAX_CHANNELS} channels, got {input.shape[1]}")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")


def check_upsample_linear(input, factors, input_size=None) -> None:
    """Validate an upsample_linear call (its gradient's, given the input's size: `input` is then the output's
    gradient): a 5-D tensor, factors (fd, fh, fw) each 1 or 2."""
    check_tensors(input=input)
    if input.dim() != 5:
        raise ValueError(f"input must be 5-D (N, C, D, H, W), got shape {tuple(input.shape)}")
    if len(factors) != 3 or not all(_is_int(f) and f in (1, 2) for f in factors):
        raise ValueError(f"factors must be 3 ints, each 1 or 2, got {list(factors)!r}")
    size = input.shape if input_size is None else input_size
    if len(size) == 5 and 0 in size[2:]:  # F.interpolate refuses it, whatever the batch
        raise ValueError(f"upsample_linear of an empty D, H or W, as F.interpolate refuses it: size {list(size)}")
    if input_size is not None:
        expected = [*input_size[:2], *(n * f for n, f in zip(input_size[2:], factors, strict=True))]
        if len(input_size) != 5 or list(input.shape) != expected:
            raise ValueError(
                f"grad_output of shape {tuple(input.shape)} is not the output of an input of size "
                f"{list(input_size)} upsampled by {list(factors)}"
            )


def _autocasting(device_type: str) -> bool:
    """Whether an autocast region is on for `device_type`; False for a device autocast has no notion of (meta,
    where torch.is_autocast_enabled raises: a model's shapes traced on the meta device). torch 2.11's dynamo does not
    trace torch.amp.is_autocast_available (a graph break, an error under fullgraph=True), and a compiled graph's
    tensors are on a device autocast knows, so it is asked outside compilation only."""
    if not torch._C._is_any_autocast_enabled():
        return False
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(device_type):
        return False
    return torch.is_autocast_enabled(device_type)


def conv_dtype(input: torch.Tensor, weight: torch.Tensor) -> torch.dtype | None:
    """The dtype a convolution of `input` by `weight` runs in on tconv3d: inside an autocast region on input's
    device, the region's (the ops cast both, as aten's convolutions do: a bf16 activation meets float32 parameters
    there); else theirs where they agree. None where they do not, or a dtype is not one tconv3d runs."""
    if _autocasting(input.device.type):
        dtype = torch.get_autocast_dtype(input.device.type)
        runs = {input.dtype, weight.dtype, dtype} <= set(SUPPORTED_DTYPES)
    else:
        dtype = input.dtype
        runs = input.dtype == weight.dtype and dtype in SUPPORTED_DTYPES
    return dtype if runs else None


def conv_transpose_arguments(
    input, weight, bias, stride, padding, output_padding, groups, dilation, channels_after=None
):  # fmt: skip
    """conv_transpose3d's arguments as the input-gradient op takes them: (output shape, stride, 6-value padding,
    dilation), each a list of ints, groups, and the surplus: per dimension, how many more outputs the convolution
    it transposes has than `input` has voxels (output_padding // stride, nonzero only where output_padding reaches
    a stride, which a dilation larger than the stride allows). Checks what F.conv_transpose3d checks, of `input`
    followed along C by channels_after where given."""
    if isinstance(input, torch.Tensor) and _autocasting(input.device.type):
        # The op casts its floating inputs to the region's dtype, as aten's conv_transpose3d does: a bf16
        # activation meets fp32 parameters here.
        check_tensors(input=input)
        check_tensors(weight=weight, bias=bias)
        if weight.device != input.device:
            raise ValueError(f"weight is on {weight.device} but input is on {input.device}; put them on one device")
    else:
        check_tensors(input=input, weight=weight, bias=bias)
    check_tensors(input=input, channels_after=channels_after)
    if input.dim() != 5 or weight.dim() != 5:
        raise ValueError(
            f"input and weight must be 5-D, got input {tuple(input.shape)} and weight {tuple(weight.shape)}"
        )
    in_channels = input.shape[1] + after_channel_count(input, channels_after)
    if weight.shape[0] != in_channels:
        has = f"input has {input.shape[1]}"
        if channels_after is not None:
            has = f"input and channels_after have {input.shape[1]} + {channels_after.shape[1]}"
        raise ValueError(
            f"channel mismatch: {has} channels but the transposed weight "
            f"{tuple(weight.shape)} (Cin, Cout / groups, kd, kh, kw) expects {weight.shape[0]}"
        )
    out_channels = weight.shape[1] * (groups if _is_int(groups) else 1)
    groups = check_groups(groups, in_channels, out_channels)
    if bias is not None and tuple(bias.shape) != (out_channels,):
        raise ValueError(f"bias must have shape ({out_channels},), got {tuple(bias.shape)}")
    stride, dilation = triple(stride, "stride"), triple(dilation, "dilation")
    pads = _int_tuple(padding, "padding", (1, 3))
    pads = pads * 3 if len(pads) == 1 else pads
    extra = _int_tuple(output_padding, "output_padding", (1, 3))
    extra = extra * 3 if len(extra) == 1 else extra
    if any(p < 0 for p in pads) or any(e < 0 for e in extra):
        raise ValueError(f"padding and output_padding must be non-negative, got {pads} and {extra}")
    if any(e >= max(s, d) for e, s, d in zip(extra, stride, dilation, strict=True)):
        raise ValueError(
            f"output_padding {extra} must be smaller than stride {stride} or dilation {dilation} in each dimension"
        )
    if input.shape[0] and 0 in input.shape[2:]:
        raise ValueError(_empty_dimension("input", input.shape, input.shape[2:]))
    out_size = [
        (size - 1) * s - 2 * p + d * (k - 1) + e + 1
        for size, s, p, d, k, e in zip(input.shape[2:], stride, pads, dilation, weight.shape[2:], extra, strict=True)
    ]
    if any(size <= 0 for size in out_size):
        raise ValueError(f"the output size {tuple(out_size)} is not positive (input {tuple(input.shape)})")
    padding6 = [pads[0], pads[0], pads[1], pads[1], pads[2], pads[2]]
    surplus = [e // s for e, s in zip(extra, stride, strict=True)]
    return [input.shape[0], out_channels, *out_size], list(stride), padding6, list(dilation), groups, surplus
