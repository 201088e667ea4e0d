"""tconv3d's modules (public as tconv3d.nn): drop-in Conv3d, ConvTranspose3d, GroupNorm, InstanceNorm3d and
BatchNorm3d on tconv3d's NDHWC kernels, CausalConv3d, AvgPool3d (torch's, answering channels_last_3d) and Upsample
(nearest by whole factors as one copy in the input's layout, trilinear by 2 on tconv3d's kernels); the resampling
helpers the model adapters share."""

from __future__ import annotations

import contextlib
import functools
import math
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx import Proxy
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from ..functional import conv_transpose3d, unbatched
from ..geometry import NORM_ACTIVATIONS, PLAIN_TENSORS, SUPPORTED_DTYPES, resolve_padding, triple
from ..kernels.aten import activated
from ..kernels.tensors import batched, fold_padding, format_strides, func_transformed
from ..ops import call_conv3d, call_group_norm, call_upsample_linear
from ..settings import TRITON_MISSING, runs_triton
from .hooks import Handed, hooked, received
from .subpixel import upsampled_conv, upsampled_conv_reason

if TRITON_MISSING is None:  # the kernel that moves BatchNorm's running statistics, where the kernels run
    from ..kernels.group_norm import RUNNING_DTYPES, update_running_statistics

_CL = torch.channels_last_3d
WEIGHT_FORMATS = {"channels_last_3d": _CL, "contiguous": torch.contiguous_format}


def fx_leaf(module: nn.Module, args: tuple, kwargs: dict, forward=None) -> Proxy:
    """`module`'s call recorded whole, as one call_module node, where torch.fx's symbolic tracing reaches its
    forward (an argument a Proxy): fx records torch.nn's own modules so (its leaves), and tracing into tconv3d's
    forwards would meet their tests of shapes, dtypes and layouts, which a Proxy refuses. A converted model then
    traces wherever stock's does, to stock's graph (an adapted block of another library's: one node where stock's
    has its layers), and its modules run tconv3d when the graph runs. `forward`, a function of (module, *args):
    recorded as a call_function node in the module's place, where a subclass's forward reached this one by super()
    (convert's subclasses="rebase"; the subclass's own steps are traced before it)."""
    tracer = next(a for a in (*args, *kwargs.values()) if isinstance(a, Proxy)).tracer
    if module is tracer.root:  # (a graph has no node for the module it is traced from)
        raise TypeError(
            f"torch.fx.symbolic_trace records a converted {type(module).__name__} as one call of it, which needs a "
            "module that holds it: trace the model, or nn.Sequential(layer)"
        )
    if forward is not None:
        return tracer.create_proxy("call_function", forward, (module, *args), kwargs)
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)


def given(**kwargs) -> dict:
    """The keyword arguments of a forward whose defaults are None that its caller passed (fx_leaf's)."""
    return {key: value for key, value in kwargs.items() if value is not None}


class _KeptWeightFormat:
    """A conv module whose weight storage stays in `weight_format`, converted in place on the same Parameter.

    A weight computed from other Parameters (torch.nn.utils.parametrize's weight_norm or spectral_norm, the older
    hook-based weight_norm and spectral_norm: each takes the weight out of the module's Parameters) is read as it
    comes, once a forward as nn.Conv3d's forward reads it (spectral_norm steps its power iteration once a read in
    training). Laying its sources out otherwise would not spare the op its copy of it: weight_norm's fused kernel
    writes its weight contiguous whatever the direction's layout (and copies a channels_last_3d one first), and
    spectral_norm reshapes its weight to a matrix each read, a copy of a channels_last_3d one. So the op converts it,
    one weight-sized copy a call, as cuDNN does for a stock layer's."""

    # A name of WEIGHT_FORMATS, not the torch.memory_format itself: torch.save cannot pickle those.
    weight_format = "channels_last_3d"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._keep_stored_weight_format()

    def _keep_weight_format(self) -> torch.Tensor:
        """The weight: a stored one first converted in place if its storage is not in weight_format, a derived one
        computed."""
        weight = self._keep_stored_weight_format()
        return self.weight if weight is None else weight

    def _keep_stored_weight_format(self) -> torch.Tensor | None:
        """The weight Parameter, converted in place if its storage is not in weight_format; None where the weight
        is computed from others (not computed here). A repeated call compares one tuple: the layout last kept."""
        weight, name = self._parameters.get("weight"), self.weight_format
        if weight is None:
            return None
        if torch.compiler.is_compiling():  # no memo: a traced write to the module is a side effect
            keep_memory_format(weight, WEIGHT_FORMATS[name])
        elif self.__dict__.get("_kept_layout") != (weight.shape, weight.stride(), name):
            keep_memory_format(weight, WEIGHT_FORMATS[name])
            self.__dict__["_kept_layout"] = (weight.shape, weight.stride(), name)
        return weight

    # Outside any graph: hooks call .to() inside a compiled model (diffusers' layerwise casting, twice a layer call),
    # Module._apply breaks the graph there (it builds Parameters), and dynamo resumed this frame after it,
    # recompiling it per weight shape and dtype up to its recompile limit.
    @torch.compiler.disable
    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half() ... may hand back a new weight storage in another layout.
        module = super()._apply(fn, recurse)
        self._keep_stored_weight_format()
        return module


class Conv3d(_KeptWeightFormat, nn.Conv3d):
    """`torch.nn.Conv3d` running `torch.ops.tconv3d.conv3d`: same constructor, parameters, state_dict and repr.

    The weight is kept channels_last_3d, (Cout, kd, kh, kw, Cin) in memory, so no call copies it: it is converted
    in place on the same Parameter at construction, after `.to()`/`.cuda()`/`.half()` and the like, and on the
    first forward after anything else replaced its storage. `weight_format` says which layout is kept:
    `tconv3d.nn.shardable(model)` sets it to "contiguous", the layout FSDP's fully_shard accepts, and
    each call then converts the gathered weight. Every padding_mode runs inside the kernels: 'zeros' masks the
    border, 'replicate', 'reflect' and 'circular' remap its loads, and no padded input is made.
    """

    def _op_padding(self) -> tuple[int, ...]:
        """The 6-value padding the op takes, resolved again only when an attribute it depends on was replaced."""
        memo = self.__dict__.get("_op_padding_memo")
        if (
            memo is not None
            and memo[0] is self.padding
            and memo[1] is self.kernel_size
            and memo[2] is self.stride
            and memo[3] is self.dilation
        ):
            return memo[4]
        attributes = (self.padding, self.kernel_size, self.stride, self.dilation)
        padding = resolve_padding(*attributes)
        if not torch.compiler.is_compiling():  # no memo: a traced write to the module is a side effect
            self.__dict__["_op_padding_memo"] = (*attributes, padding)
        return padding

    def forward(
        self, input: torch.Tensor, channels_after: torch.Tensor | None = None, upsampled=None, *, convolving=None
    ) -> torch.Tensor:
        """nn.Conv3d's forward; `channels_after` (optional) follows the input's channels, read in place as if
        torch.cat([input, channels_after], dim=1) were the input (what the adapters of UNet decoder blocks pass).
        `upsampled` (what the adapters of MONAI's UpSample and Kandinsky 6's latent upsamplers pass), the factors
        (2, 2, 2) or (1, 2, 2): the convolution of input repeated by nearest upsampling by them, one transposed conv
        of input where subpixel.upsampled_conv_reason allows (the sub-pixel form, `upsampled_conv`; of input
        replicate-padded by 1, a copy about its size, for a conv padded in mode reflect or replicate), else of the
        repetition. `convolving`: the arguments of a `convolve` made through this call (hooks run for it)."""
        if isinstance(input, Proxy):
            reached = None if type(self).forward is Conv3d.forward else conv3d_forward  # by super()
            handed = given(channels_after=channels_after, upsampled=upsampled, convolving=convolving)
            return fx_leaf(self, (input,), handed, reached)
        if convolving is not None:
            return self._convolve(input, *received(convolving))
        upsampled = received(upsampled)
        if upsampled is not None:
            if channels_after is not None or input.dim() != 5:
                raise ValueError(f"Conv3d: upsampled takes a 5-D input and no channels_after, not {input.dim()}-D")
            if upsampled_conv_reason(self, input, upsampled) is None:
                if self.padding_mode != "zeros":  # a reflect or replicate border of the repetition: x's edge voxel
                    time = 1 if upsampled[0] == 2 else 0
                    input = replicate_padded(input, (time, time, 1, 1, 1, 1))
                return upsampled_conv(self, input, upsampled)
            input = repeat_nearest(input, upsampled)
        return self._convolve(input, self._op_padding(), self.padding_mode, channels_after=channels_after)

    def convolve(self, input, padding, padding_mode="zeros", frames_before=None, channels_after=None) -> torch.Tensor:
        """This layer's convolution with another padding (6 values), padding_mode and, optionally, frames read in
        front of the input along D or channels after its channels: what the adapters of video-VAE conv modules
        and UNet blocks call (tconv3d.convert) in place of the layer's call. Where that call runs hooks (`hooked`:
        diffusers' layerwise casting casts the weight in them, offloading moves it in) and its forward takes
        `convolving` (this class's, an adapted class's: convert.adapted_class), the convolution is made through
        the call, so that they run."""
        if hooked(self) and getattr(type(self).forward, "takes_convolving", False):
            return self(input, convolving=Handed((padding, padding_mode, frames_before, channels_after)))
        return self._convolve(input, padding, padding_mode, frames_before, channels_after)

    forward.takes_convolving = True

    def _convolve(self, input, padding, padding_mode="zeros", frames_before=None, channels_after=None):
        """`convolve` inside this layer's call (its forward's, an adapter's of its class): no hooks to run."""
        weight = self._keep_weight_format()
        if input.dim() == 4:  # nn.Conv3d's unbatched (C, D, H, W) form
            second = (unbatched(frames_before, "frames_before"), unbatched(channels_after, "channels_after"))
            return self._convolve(input[None], padding, padding_mode, *second)[0]
        return call_conv3d(
            input, weight, self.bias, self.stride, padding, self.dilation, self.groups, padding_mode, frames_before,
            channels_after,
        )  # fmt: skip


def conv3d_forward(module: Conv3d, *args, **kwargs) -> torch.Tensor:
    """tconv3d.nn.Conv3d's forward of `module`, a subclass's: what fx records where the subclass's forward calls
    super().forward (fx_leaf)."""
    return Conv3d.forward(module, *args, **kwargs)


class CausalConv3d(Conv3d):
    """The causal Conv3d of video VAEs in one fused call: time padded on the front only, (kd - 1) * dilation_d
    frames, so frame t sees frames t - kd + 1 .. t; space padded symmetrically, (k - 1) * dilation / 2 on each
    side (odd kernels). `padding_mode` ("replicate" by default, as most VAEs pad; "zeros" too) says what the
    border reads, inside the kernel: no padded copy of the input is made.

    Parameters and state_dict are those of an `nn.Conv3d` of the same shape, so a checkpoint of a VAE's own
    causal conv module (which holds such a Conv3d, typically as `.conv`) loads into it after the prefix is
    renamed.
    """

    def __init__(
        self, in_channels, out_channels, kernel_size, stride=1, dilation=1, bias=True, padding_mode="replicate",
        device=None, dtype=None,
    ):  # fmt: skip
        kernel, dilation3 = triple(kernel_size, "kernel_size"), triple(dilation, "dilation")
        for k, name in zip(kernel[1:], "hw", strict=True):
            if k % 2 == 0:
                raise ValueError(f"CausalConv3d pads space symmetrically: kernel_size in {name} must be odd, got {k}")
        super().__init__(
            in_channels, out_channels, kernel, stride, padding=0, dilation=dilation3, bias=bias,
            padding_mode=padding_mode, device=device, dtype=dtype,
        )  # fmt: skip
        self.causal_padding = (
            (kernel[0] - 1) * dilation3[0], 0,
            (kernel[1] - 1) * dilation3[1] // 2, (kernel[1] - 1) * dilation3[1] // 2,
            (kernel[2] - 1) * dilation3[2] // 2, (kernel[2] - 1) * dilation3[2] // 2,
        )  # fmt: skip

    def _op_padding(self) -> tuple[int, ...]:
        return self.causal_padding

    def extra_repr(self) -> str:
        return super().extra_repr() + f", causal_padding={self.causal_padding}"


class ConvTranspose3d(_KeptWeightFormat, nn.ConvTranspose3d):
    """`torch.nn.ConvTranspose3d` on tconv3d's kernels (`tconv3d.conv_transpose3d`): same constructor, parameters,
    state_dict and forward(input, output_size=None). Its weight, (Cin, Cout, kd, kh, kw), is kept
    channels_last_3d as Conv3d's is (or in `weight_format`, as there); the output is channels_last_3d.
    forward(input, channels_after=skip) is forward(torch.cat([input, skip], dim=1)) with no concatenation made
    (`tconv3d.conv_transpose3d`'s channels_after)."""

    def forward(self, input: torch.Tensor, output_size=None, channels_after=None) -> torch.Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), given(output_size=output_size, channels_after=channels_after))
        weight = self._keep_weight_format()
        output_padding = self._output_padding(
            input, received(output_size), self.stride, self.padding, self.kernel_size, 3, self.dilation
        )
        return conv_transpose3d(
            input, weight, self.bias, self.stride, self.padding, output_padding, self.groups, self.dilation,
            channels_after=channels_after,
        )  # fmt: skip


def weight_sources(conv: nn.Module) -> list[torch.Tensor]:
    """The Parameters of a conv module of the weight's shape, (out, in / groups, *kernel) or, transposed, (in,
    out / groups, *kernel): its weight, or those a derived weight is computed from (parametrize's originals, the
    older weight_norm's direction or spectral_norm's weight_orig), found without computing it (which would step
    spectral_norm's power iteration)."""
    channels = (conv.in_channels, conv.out_channels // conv.groups) if conv.transposed else (
        conv.out_channels, conv.in_channels // conv.groups)  # fmt: skip
    shape = torch.Size((*channels, *conv.kernel_size))
    return [t for t in conv.parameters() if t.shape == shape]


def keep_memory_format(weight: torch.Tensor, memory_format=_CL) -> None:
    """Make a Parameter's storage `memory_format` (channels_last_3d; channels_last for a 2-D conv's) in place,
    with exactly the strides torch.empty gives that format, size-1 dims included: those of the gradients the ops
    return, so that a gradient never needs restriding to its parameter's strides."""
    strides = format_strides(tuple(weight.shape), memory_format)
    if weight.stride() != strides:
        # A tensor of the weight's kind, whichever mode the call runs in: a plain weight's storage written in
        # inference mode (a first forward or `convert` inside torch.inference_mode()) would be an inference tensor,
        # which no later training step could save for backward or update in place, where stock's Parameter stays
        # plain; an inference tensor's (a model built in inference mode) stays one. (Dynamo cannot trace the
        # question; a traced write is a plain tensor.)
        leave = not torch.compiler.is_compiling() and torch.is_inference_mode_enabled() and not weight.is_inference()
        with torch.inference_mode(False) if leave else contextlib.nullcontext(), torch.no_grad():
            kept = torch.empty_strided(weight.shape, strides, dtype=weight.dtype, device=weight.device)
            weight.data = kept.copy_(weight.data)


# The activation modules a norm takes into its pass, by their `activation` names (tconv3d.nn.convert fuses them
# after a norm in an nn.Sequential; MONAI's DynUNet blocks, which call them in code, through norm_then)
FUSED_ACTIVATIONS = {nn.SiLU: "silu", nn.ReLU: "relu", nn.LeakyReLU: "leaky_relu", nn.PReLU: "prelu"}


def activation_of(module: nn.Module) -> Activation | None:
    """The Activation a norm applies in its pass for activation `module`, None for one it does not fuse."""
    name = FUSED_ACTIVATIONS.get(type(module))
    if name is None:
        return None
    return Activation(name, module.negative_slope if name == "leaky_relu" else 0.01,
                      module.weight if name == "prelu" else None)  # fmt: skip


class _FusedActivation:
    """A norm module's fused activation: `activation`, None or a name of geometry.NORM_ACTIVATIONS but "none"
    (the constructors take any but "prelu"), a leaky ReLU's `negative_slope`, and for "prelu" the nn.PReLU that
    convert fused (`fused_prelu`, left in its slot as a FusedPReLU, so its weight stays its parameter under its
    state_dict key and in the optimizer). Class attributes: the defaults of modules convert made, which runs no
    __init__."""

    activation = None
    negative_slope = 0.01
    fused_prelu = None

    def _set_activation(self, activation, negative_slope) -> None:
        names = (None, *NORM_ACTIVATIONS[1:-1])
        if activation not in names:
            raise ValueError(f"activation must be one of {', '.join(map(repr, names))}, got {activation!r} (a PReLU "
                             "is fused by tconv3d.nn.convert)")  # fmt: skip
        self.activation, self.negative_slope = activation, negative_slope

    def fuse_prelu(self, prelu: nn.PReLU) -> None:
        """Apply `prelu` (an nn.PReLU of one weight or one a channel) in this norm's pass, and make it a FusedPReLU
        (the identity): its weight is read from it at each call, not copied."""
        prelu.__class__ = FusedPReLU
        self.__dict__["fused_prelu"] = prelu  # a reference, not a submodule: no second state_dict key
        self.activation = "prelu"

    def fused_activation(self) -> Activation:
        """This norm's fused activation, as its forward applies it (normalized's argument). A fused PReLU whose call
        runs hooks (accelerate's offloading moves its weight in for the call) applies itself in that call."""
        if self.activation != "prelu":
            return Activation(self.activation, self.negative_slope)
        if hooked(self.fused_prelu):
            return Activation()
        return Activation("prelu", self.negative_slope, self.fused_prelu.weight)

    def extra_repr(self) -> str:
        text = super().extra_repr()
        if self.activation == "leaky_relu":
            return text + f", activation='leaky_relu', negative_slope={self.negative_slope}"
        return text + (f", activation={self.activation!r}" if self.activation else "")


class Activation(NamedTuple):
    """An activation a norm applies in its pass: `name` (None, or one of geometry.NORM_ACTIVATIONS but "none"), a
    leaky ReLU's `negative_slope`, a PReLU's `weight` (one, or one a channel)."""

    name: str | None = None
    negative_slope: float = 0.01
    weight: torch.Tensor | None = None

    def op_arguments(self) -> tuple:
        """(activation, negative_slope, activation_weight) as torch.ops.tconv3d.group_norm takes them: the slope
        where the activation reads it, else a constant of this code. Under torch.compile(dynamic=True) Dynamo makes
        a float it reads from an object (a module's attribute, this tuple's field) a symbolic input, and one read
        again in a second checkpoint region fails the trace (a converted MONAI CheckpointUNet did:
        "lift_tracked_freevar_to_input should not be called on root SubgraphTracer"; docs/upstream.md)."""
        return self.name or "none", self.negative_slope if self.name == "leaky_relu" else 0.01, self.weight

    def slope(self):
        """What aten.activated takes as the slope: the PReLU's weight, else the number."""
        return self.weight if self.name == "prelu" else self.negative_slope

    def applied(self, output: torch.Tensor) -> torch.Tensor:
        """The activation of a norm's output torch's ops computed."""
        return activated(output, self.name, self.slope())


class FusedPReLU(nn.PReLU):
    """An nn.PReLU that tconv3d.nn.convert fused into the norm before it (_FusedActivation.fuse_prelu): the
    identity, its weight read by that norm's kernels; the PReLU itself where its call runs hooks (`hooked`), which
    the norm leaves it to."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) if hooked(self) else input

    def extra_repr(self) -> str:
        return super().extra_repr() + ", fused into the norm before it"


class GroupNorm(_FusedActivation, nn.GroupNorm):
    """`torch.nn.GroupNorm` on tconv3d's NDHWC kernels for 5-D inputs (channels_last_3d out, fp32 statistics,
    no NCDHW intermediate) and 4-D channels_last ones (channels_last out: a video's frames in the batch), with an
    optional fused activation: `activation="silu"` is GroupNorm then SiLU in one pass, the video VAE and UNet
    block's norm -> SiLU -> conv (`"relu"` the same with ReLU, `"leaky_relu"` with LeakyReLU(negative_slope); a
    PReLU after it convert fuses: _FusedActivation). Other inputs run torch's group_norm. Same constructor,
    parameters and state_dict as nn.GroupNorm."""

    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, activation=None,
                 negative_slope=0.01):  # fmt: skip
        super().__init__(num_groups, num_channels, eps, affine, device, dtype)
        self._set_activation(activation, negative_slope)

    def forward(self, input: torch.Tensor, channels_after: torch.Tensor | None = None) -> torch.Tensor:
        """`channels_after` (N, C2, D, H, W), e.g. a UNet decoder's skip connection, follows the input's channels
        as if torch.cat([input, channels_after], dim=1) were normalized (num_channels counts both), read in
        place; it gets a gradient like the input."""
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), given(channels_after=channels_after))
        return self.normalized(input, self.fused_activation(), channels_after)

    def normalized(self, input, activation: Activation, channels_after=None) -> torch.Tensor:
        """The forward with `activation` in the norm's pass (an adapter's: a block that calls its activation in
        code), whatever this norm's own."""
        return normalize(input, self.num_groups, self.weight, self.bias, self.eps, activation, channels_after)


@functools.cache
def _group_norm_refuses_no_voxel() -> bool:
    """Whether the installed torch's group_norm refuses an input with no voxel (2.14 on; 2.13 answered it empty, as
    tconv3d's kernels do, and its instance and batch norms still do): nn.GroupNorm then refuses it as stock's."""
    try:
        F.group_norm(torch.empty(1, 1, 0, device="meta"), 1)
    except RuntimeError:
        return True
    return False


class InstanceNorm3d(_FusedActivation, nn.InstanceNorm3d):
    """`torch.nn.InstanceNorm3d` on tconv3d's GroupNorm kernels (one group per channel) for 5-D inputs, with an
    optional fused `activation` ("silu", "relu" or "leaky_relu" of negative_slope, as GroupNorm's; a PReLU convert
    fuses, as MONAI's UNet follows its norms). With track_running_stats, an unbatched input or a dtype the kernels
    do not take (float64), torch's instance_norm runs (tconv3d does not keep running statistics)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=False, track_running_stats=False, device=None,
                 dtype=None, activation=None, negative_slope=0.01):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._set_activation(activation, negative_slope)

    def on_kernels(self, input: torch.Tensor) -> bool:
        """Whether tconv3d's kernels normalize `input`: 5-D, a dtype they take, no running statistics."""
        return not self.track_running_stats and input.dim() == 5 and input.dtype in SUPPORTED_DTYPES

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), {})
        return self.normalized(input, self.fused_activation())

    def normalized(self, input: torch.Tensor, activation: Activation) -> torch.Tensor:
        """The forward with `activation` in the norm's pass, whatever this norm's own (GroupNorm.normalized)."""
        if not self.on_kernels(input):
            output = super().forward(input)
            # Dynamo traces _ContiguousGradient; torch.func's transforms (compiled or not) do not
            plain = not func_transformed()
            if output.requires_grad and (input.dim() == 4 or input.shape[0] == 1) and plain:
                output = _ContiguousGradient.apply(output)
            return activation.applied(output)
        if math.prod(input.shape[2:]) == 1:  # torch's instance_norm refuses it whatever the batch
            raise ValueError(
                f"InstanceNorm3d expects more than 1 spatial element, as torch's does: input {tuple(input.shape)}"
            )
        return normalize(input, input.shape[1], self.weight, self.bias, self.eps, activation, instance=True)


class BatchNorm3d(_FusedActivation, nn.BatchNorm3d):
    """`torch.nn.BatchNorm3d` whose batch statistics (training, or no running statistics) come from tconv3d's
    GroupNorm kernels: a channels_last_3d (N, C, D, H, W) tensor is, in memory, the (1, C, N * D, H, W) one whose
    instance norm is this batch norm, so the kernels normalize that view with one group a channel (fp32 statistics
    combined by Chan's formula, the backward's sums about the mean: no cancellation; channels_last_3d out).
    torch's CPU batch_norm sums a channels_last_3d channel's statistics 10-100x less accurately than an NCDHW one's
    (docs/upstream.md), which every converted model's activations are. The running statistics are updated as
    torch updates them (momentum, or a cumulative average with momentum=None; the unbiased variance): eagerly on
    the kernels' devices by one launch that also counts the batch, with no host read of the count; traced (or
    where torch's ops normalize) in torch ops on C values. Normalizing by the running statistics (eval), an input
    that is not 5-D or of a dtype the kernels take, and vmap run torch's batch_norm. An optional fused
    `activation` ("silu", "relu" or "leaky_relu" of negative_slope, as GroupNorm's: a DenseNet's norm -> ReLU in
    one pass; a PReLU convert fuses). Same constructor, parameters, buffers and state_dict as nn.BatchNorm3d."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True, device=None,
                 dtype=None, activation=None, negative_slope=0.01):  # fmt: skip
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._set_activation(activation, negative_slope)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), {})
        return self.normalized(input, self.fused_activation())

    def normalized(self, input: torch.Tensor, activation: Activation) -> torch.Tensor:
        """The forward with `activation` in the norm's pass, whatever this norm's own (GroupNorm.normalized)."""
        # Each of the module's buffers and parameters read once: a read is nn.Module.__getattr__'s (~0.5 us)
        running_mean, running_var, training = self.running_mean, self.running_var, self.training
        batch_statistics = training or (running_mean is None and running_var is None)
        if not batch_statistics or input.dim() != 5 or input.dtype not in SUPPORTED_DTYPES or batched(input):
            return activation.applied(super().forward(input))
        # nn.BatchNorm3d's bookkeeping: by how much the running statistics move
        tracked = training and self.track_running_stats
        update = tracked and running_mean is not None
        count = self.num_batches_tracked if tracked else None
        momentum, eps = self.momentum, self.eps
        shape = input.shape
        c = shape[1]
        values = shape[0] * math.prod(shape[2:])
        empty = values * c == 0  # (normalized as it is: no view to fold)
        # Where the kernels run eagerly on plain tensors, one launch moves both statistics and counts the batch,
        # after the norm (update_running_statistics); traced, under a dispatch mode (fake tensors: what Dynamo and
        # AOTAutograd trace; a mode that watches the ops) or in torch's ops, torch's ops do, the count first
        in_kernel = update and not empty and runs_triton(input) and not autograd_traced()
        in_kernel = in_kernel and type(input) in PLAIN_TENSORS and not is_in_torch_dispatch_mode()
        in_kernel = in_kernel and running_mean.dtype in RUNNING_DTYPES
        factor = 0.0 if momentum is None else momentum
        if count is not None and not in_kernel:
            count.add_(1)
            factor = 1.0 / float(count) if momentum is None else momentum
        _check_batch_norm(input, values, eps, running_mean if update else None)
        folded = batch_folded(input) if not empty else input
        name, *slopes = activation.op_arguments()
        output, mean, rstd = call_group_norm(folded, self.weight, self.bias, c, eps, name, None, *slopes)
        if in_kernel:  # (the statistics (1, C) as they are: a view of one is an autograd node, ~1.5 us)
            moved = momentum if momentum is not None or count is not None else 0.0
            update_running_statistics(mean, rstd, running_mean, running_var, count, moved, eps, values)
        elif update and not empty:
            # The variance back from rstd (fp32 already holds it within 2e-7 of variance + eps), both statistics
            # moved in one foreach launch
            with torch.no_grad():
                variance = (rstd.view(c).pow(-2) - eps).clamp_min_(0).mul_(values / (values - 1))
                statistics = [t.to(running_mean.dtype) for t in (mean.view(c), variance)]
                torch._foreach_lerp_([running_mean, running_var], statistics, factor)
        return batch_unfolded(output, shape) if not empty else output


def _check_batch_norm(input, values: int, eps: float, running_mean) -> None:
    """torch's refusals of a batch norm by the batch's statistics, in its words (F.batch_norm's, and its kernels'
    of running statistics of another size)."""
    if values == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {input.size()}")
    if eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    if running_mean is not None and running_mean.numel() != input.shape[1]:
        raise RuntimeError(f"running_mean should contain {input.shape[1]} elements not {running_mean.numel()}")


def batch_folded(input: torch.Tensor) -> torch.Tensor:
    """A 5-D tensor (N, C, D, H, W), made channels_last_3d if it is not, as the (1, C, N * D, H, W) channels_last_3d
    view of its memory: the batch folded into its frames."""
    n, c, d, h, w = input.shape
    if n == 1:  # the view itself (see batch_unfolded)
        return input.contiguous(memory_format=_CL)
    # (C, N, D, H, W), whose N and D merge: two views, two autograd nodes
    return input.contiguous(memory_format=_CL).transpose(0, 1).view(1, c, n * d, h, w)


def batch_unfolded(folded: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """batch_folded's inverse: a channels_last_3d (1, C, N * D, H, W) tensor as the (N, C, D, H, W) view; with a
    batch of one, the tensor itself. (Its view as (C, 1, D, H, W) transposed would be the same memory, but with one
    channel its channel stride differs between eager torch, D*H*W, and the fakes, 1: torch.cat lays out a
    concatenation by it, and a compiled graph views what the fakes said.)"""
    n, c, d, h, w = shape
    if n == 1:
        return folded
    return folded.view(c, n, d, h, w).transpose(0, 1)


class _ContiguousGradient(torch.autograd.Function):
    """A copy, its gradient handed on contiguous: torch's instance_norm (2.13, CPU) answers a wrong input gradient
    for a batch of one (or an unbatched input) given a gradient laid out otherwise, channels_last_3d as a converted
    model's are (docs/upstream.md). A copy, not a view: a view made in a Function refuses the in-place activation
    that may follow a norm (nn.LeakyReLU(inplace=True))."""

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


class AvgPool3d(nn.AvgPool3d):
    """`torch.nn.AvgPool3d` that answers a channels_last_3d input channels_last_3d. torch's kernels answer NCDHW
    whatever the input's layout (CPU's; CUDA's copies its input NCDHW first and indexes a (N*C, D, H, W) view, and
    its backward answers an NCDHW gradient), and what follows then passes NCDHW on: after a DenseNet transition,
    every dense layer's concatenation, and each convolution of it a layout copy. Windows that tile the input
    (stride = kernel, no padding, no ceil_mode or divisor: DenseNet's 2x2x2 transitions) are a mean over a view of
    a channels_last_3d input (`block_mean`: no copy, its gradient channels_last_3d); other pools are torch's, the
    output copied channels_last_3d once where torch answers otherwise (an eighth of the input at kernel 2). Same
    constructor, no parameters, torch's values (up to the order of a window's sum)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), {})
        if input.dim() == 5 and input.is_floating_point() and layout_of(input) == _CL:  # (integers: torch's)
            kernel = _tiling_kernel(self)
            if kernel is not None and all(k <= n for k, n in zip(kernel, input.shape[2:], strict=True)):
                return block_mean(input, kernel)  # (a window past the input: torch's refusal)
        output = super().forward(input)
        if input.dim() == 5 and _laid_out_only(input, _CL) and not output.is_contiguous(memory_format=_CL):
            return output.contiguous(memory_format=_CL)
        return output


def _tiling_kernel(pool: nn.AvgPool3d) -> tuple[int, int, int] | None:
    """A pool's kernel where its windows tile the input (a remainder dropped), else None."""
    try:  # a kernel or stride of 0 or a float: torch's pool, and its refusal
        kernel = triple(pool.kernel_size, "kernel_size")
        stride = triple(pool.stride if pool.stride is not None else pool.kernel_size, "stride")
    except (TypeError, ValueError):
        return None
    padding = pool.padding if isinstance(pool.padding, (tuple, list)) else (pool.padding,) * 3
    if kernel != stride or any(padding) or pool.ceil_mode or pool.divisor_override is not None:
        return None
    return kernel


def frames(x: torch.Tensor, start: int | None = None, stop: int | None = None, step: int | None = None):
    """x[:, :, start:stop:step] of a 5-D x (a view), whose backward answers in x's layout: autograd's slice
    backward writes the gradient into zeros laid out NCDHW, and every layer before a channels_last_3d activation's
    frame slice (a causal conv's kept frames, a first frame resampled apart) then got a gradient to lay out again.
    Without autograd (inference, torch.compile, torch.func): the plain slice."""
    key = slice(start, stop, step)
    if not (x.requires_grad and torch.is_grad_enabled()) or autograd_traced():
        return x[:, :, key]
    return _Frames.apply(x, key)


def autograd_traced() -> bool:
    """Whether torch.compile traces this call or a torch.func transform runs it. There the Functions that lay out
    their gradients channels_last_3d (`frames`, the video VAEs' rearrangements) step aside for plain ops: Dynamo
    traces no Function with a jvp and the compiled backward is Inductor's, and torch.func batches plain ops."""
    return torch.compiler.is_compiling() or func_transformed()


def empty_for(shape, *sources: torch.Tensor | None, dtype=None, memory_format=_CL) -> torch.Tensor:
    """A new tensor of `shape` in `memory_format` (of sources[0]'s dtype, or `dtype`, and device) for the
    sources' elements (None: no source) to be written into. Under torch.func.vmap, where a source is batched, one
    batched at every level the sources are (zeros of theirs added: vmap refuses a batched write into a tensor it
    does not batch), its elements zero."""
    first = sources[0]
    out = torch.empty(shape, dtype=dtype or first.dtype, device=first.device, memory_format=memory_format)
    if not batched(*sources):
        return out
    return out.zero_() + sum(t.new_zeros((), dtype=out.dtype) for t in sources if t is not None)


def add_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """a + b written into `out`, a view of a result being filled: in one pass (out=) where nothing records the
    addition, else a copy and an in-place add, which autograd records (out= records no gradient) and Dynamo traces
    (it breaks its graph at an out= slice)."""
    if autograd_traced() or (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        out.copy_(a).add_(b)
    else:
        torch.add(a, b, out=out)


class _Frames(torch.autograd.Function):
    @staticmethod
    def forward(x, key):
        return x[:, :, key]

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.key = inputs
        ctx.x = (x.shape, x.dtype, x.device, layout_of(x))

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device, memory_format = ctx.x
        grad_x = torch.empty(shape, dtype=dtype, device=device, memory_format=memory_format).zero_()
        grad_x[:, :, ctx.key] = grad
        return grad_x, None

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return x_tangent[:, :, ctx.key]


def block_mean(x: torch.Tensor, factors) -> torch.Tensor:
    """F.avg_pool3d(x, factors) (stride the kernel, no padding, a remainder dropped) as the mean over the blocks of
    x's (N, D, H, W, C) view: channels_last_3d out, no copy of x, and any dtype on any device (CPU's avg_pool3d has
    no bfloat16, where diffusers' pixel-unshuffle means do)."""
    return _blocks(x, factors).mean((2, 4, 6)).permute(0, 4, 1, 2, 3)


def block_sum(x: torch.Tensor, factors) -> torch.Tensor:
    """The sums over the blocks of `factors` voxels of x's (N, D, H, W, C) view (a remainder dropped):
    channels_last_3d out, whatever x's layout."""
    return _blocks(x, factors).sum((2, 4, 6)).permute(0, 4, 1, 2, 3)


def _blocks(x: torch.Tensor, factors) -> torch.Tensor:
    """x's (N, D, H, W, C) view split into (N, D / fd, fd, H / fh, fh, W / fw, fw, C) blocks."""
    fd, fh, fw = factors
    _, _, d, h, w = x.shape
    blocks = x[:, :, : d // fd * fd, : h // fh * fh, : w // fw * fw].permute(0, 2, 3, 4, 1)
    return blocks.unflatten(1, (d // fd, fd)).unflatten(3, (h // fh, fh)).unflatten(5, (w // fw, fw))


class Upsample(nn.Upsample):
    """`torch.nn.Upsample` whose nearest interpolation of a 5-D input by whole power-of-two factors (MONAI's
    AutoencoderKL and DiffusionModelUNet decoders: 2x) is one broadcast copy answered in the input's layout
    (`repeat_nearest`). CUDA's 3-D nearest kernel indexes NCDHW: on a channels_last_3d activation torch copies the
    input NCDHW, interpolates into an NCDHW buffer and copies that back channels_last_3d, and its backward hands
    the layer before an NCDHW gradient. Other modes, factors and inputs: torch's. Same constructor, same values."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if isinstance(input, Proxy):
            return fx_leaf(self, (input,), {})
        # Torch's own: what it refuses (align_corners with a nearest mode; a size with a scale_factor or with
        # recompute_scale_factor) and what its kernels take or refuse by dtype (integers)
        refused = self.align_corners is not None and self.mode != "trilinear"
        refused |= self.size is not None and (self.scale_factor is not None or bool(self.recompute_scale_factor))
        if refused or not input.is_floating_point():
            return super().forward(input)
        if input.dim() == 5 and self.mode in ("nearest", "nearest-exact"):
            if self.size is not None:
                return resize_nearest(input, self.size, self.mode)
            factors = _whole_scale_factors(self.scale_factor)
            size = factors and [n * f for n, f in zip(input.shape[2:], factors, strict=True)]
            steps = size and nearest_steps(input.shape[2:], size, self.mode)
            if steps:
                return repeat_nearest(input, steps[1])
        if input.dim() == 5 and self.mode == "trilinear" and not self.align_corners:
            if self.size is not None:
                size = tuple(self.size) if isinstance(self.size, (tuple, list)) else (self.size,) * 3
                pairs = zip(input.shape[2:], size, strict=True) if len(size) == 3 else ()
                factors = tuple(m // n if n and m in (n, 2 * n) else 0 for n, m in pairs)
            else:
                factors = _whole_scale_factors(self.scale_factor)
            if factors and all(f in (1, 2) for f in factors):
                return upsample_linear(input, factors)
        return super().forward(input)


def upsample_linear(x: torch.Tensor, factors) -> torch.Tensor:
    """F.interpolate(x, scale_factor=factors, mode="trilinear") (align_corners=False) of a 5-D x, by 1 or 2 along
    each of D, H and W (MAISI's and SegResNet's decoders, EasyAnimate's time upsampling): tconv3d's upsample_linear
    op, one gather pass in channels_last_3d with a channels_last_3d gradient, where CUDA's kernel indexes NCDHW (on
    a channels_last_3d activation each thread walks one voxel's channels) and answers its backward NCDHW. Other
    factors, dtypes and layouts (an NCDHW x: torch's kernel reads it coalesced): torch's."""
    factors = tuple(int(f) for f in factors)
    ours = len(factors) == 3 and set(factors) <= {1, 2} and x.dim() == 5 and x.dtype in SUPPORTED_DTYPES
    if not ours or layout_of(x) != _CL:  # an NCDHW x: torch's kernel indexes its own layout, coalesced
        return F.interpolate(x, scale_factor=tuple(float(f) for f in factors), mode="trilinear")
    return call_upsample_linear(x, list(factors))


# Below 2^24 every index of torch's nearest rule, floor(i * scale) in float32, is exact for power-of-two scales.
_EXACT = 1 << 24


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _whole_scale_factors(scale_factor) -> tuple[int, int, int] | None:
    """An nn.Upsample's scale_factor as three whole factors of at least 1, or None (`nearest_steps` then says
    whether torch's nearest rule repeats each voxel that often, exactly)."""
    if scale_factor is None:
        return None
    scales = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * 3
    if len(scales) != 3 or any(float(s) != int(s) or s < 1 for s in scales):
        return None
    return tuple(int(s) for s in scales)


def resize_nearest(x: torch.Tensor, size, mode: str = "nearest") -> torch.Tensor:
    """F.interpolate(x, size=size, mode=mode) for mode "nearest" (or "nearest-exact", growing only). Where each
    dimension of a 5-D x grows or shrinks by a whole power of two (a latent resized to a decoder's features, a
    segmentation map to an activation's), one copy of a strided view of x repeated by `repeat_nearest` into x's
    layout (`nearest_steps`). Other sizes: torch's."""
    size = tuple(size) if isinstance(size, (tuple, list, torch.Size)) else (size,) * 3
    steps = nearest_steps(x.shape[2:], size, mode) if x.dim() == 5 and len(size) == 3 else None
    if steps is None:
        return F.interpolate(x, size=size, mode=mode)
    (sd, sh, sw), factors = steps
    picked = x[:, :, ::sd, ::sh, ::sw] if (sd, sh, sw) != (1, 1, 1) else x
    return repeat_nearest(picked, factors, layout_of(x))


def nearest_steps(source_size, size, mode: str = "nearest"):
    """(steps, factors): nearest resizing from `source_size` to `size` reads every step-th voxel along each
    dimension and repeats each `factor` times, all whole powers of two (one of them 1 a dimension); None where
    it does not. For these torch's index rule, floor(i * scale) in float32 with scale = in / out, is exact (below
    2^24 voxels). "nearest-exact" (floor((i + 0.5) * scale)) agrees where it grows only."""
    steps, factors = [], []
    for n, m in zip(source_size, size, strict=True):
        small, large = min(n, m), max(n, m)
        if small < 1 or large % small or not _power_of_two(large // small) or large >= _EXACT:
            return None
        if n > m and mode != "nearest":  # nearest-exact reads the middle of each f voxels when shrinking
            return None
        steps.append(n // m if n > m else 1)
        factors.append(m // n if m > n else 1)
    return tuple(steps), tuple(factors)


def layout_of(x: torch.Tensor) -> torch.memory_format:
    """The layout torch's kernels answer a 5-D x in (`suggest_memory_format`): channels_last_3d where x's strides
    rank C, W, H, D, N from the innermost out (a channel slice of a channels_last_3d tensor too), else NCDHW.
    While dynamo traces: `_traced_layout`, or NCDHW under a traced torch.func transform (vmap queries no other)."""
    if torch.compiler.is_compiling():
        return torch.contiguous_format if batched(x) else _traced_layout(x)
    sizes, strides, floor = x.shape, x.stride(), 0
    if strides[1] == 0:
        return torch.contiguous_format
    for dim in (1, 4, 3, 2, 0):
        if sizes[dim] == 0 or strides[dim] < floor or (dim == 0 and floor == strides[1]):
            return torch.contiguous_format
        floor = strides[dim] * max(sizes[dim], 1)
    return _CL


def _traced_layout(x: torch.Tensor) -> torch.memory_format:
    """layout_of(x) while dynamo traces, with no stride read. Strides read there are SymInts in the graph, and
    dynamo may later pass one for a size equal to it: a size-1 dimension's stride, which AOTAutograd's re-trace
    may give another value (Inductor compiling KVAE's decode after Wan 2.2's in one process: a view of twice the
    elements, `repeat_nearest`). Instead torch's own rule (`empty_like` lays a channel slice out channels_last_3d
    and keeps a dense tensor's strides), asked through is_contiguous, which dynamo answers while tracing and
    guards. Where x is contiguous both ways (one channel, or one voxel a sample: the same memory either way)
    channels_last_3d."""
    like = torch.empty_like(x)
    return _CL if like.is_contiguous(memory_format=_CL) else torch.contiguous_format


def repeat_nearest(
    x: torch.Tensor, factors, memory_format: torch.memory_format | None = None, first_apart: bool = False
) -> torch.Tensor:
    """F.interpolate(x, scale_factor=factors, mode="nearest") of a 5-D x for whole factors (output voxel i reads
    input voxel i // f), as one broadcast copy into a tensor of x's layout (or `memory_format`): channels_last_3d
    stays so. `first_apart`: x's first frame repeated in H and W only, as a causal VAE upsamples it (1 + (D - 1) *
    fd frames out). Its backward sums each voxel's copies into a channels_last_3d gradient, where the expand's
    backward (a reduction) would answer NCDHW and hand every layer before it a gradient of another layout."""
    factors = tuple(factors)
    if func_transformed():  # torch.func's vmap, jvp, grad (compiled too): out of place
        return _interpolated(x, factors, first_apart)
    if torch.compiler.is_compiling():  # Dynamo traces no Function with a jvp; the compiled backward is Inductor's
        return _repeated(x, factors, memory_format or layout_of(x), first_apart)
    return _RepeatNearest.apply(x, factors, memory_format or layout_of(x), first_apart)


def _interpolated(x: torch.Tensor, factors, first_apart: bool) -> torch.Tensor:
    """repeat_nearest's values by torch's interpolation, out of place (what torch.func transforms batch)."""
    scale = tuple(float(f) for f in factors)
    if not first_apart or x.shape[2] < 2:
        return F.interpolate(x, scale_factor=scale if not first_apart else (1.0, *scale[1:]), mode="nearest")
    first = F.interpolate(x[:, :, :1], scale_factor=(1.0, *scale[1:]), mode="nearest")
    return torch.cat([first, F.interpolate(x[:, :, 1:], scale_factor=scale, mode="nearest")], dim=2)


class _RepeatNearest(torch.autograd.Function):
    @staticmethod
    def forward(x, factors, memory_format, first_apart):
        return _repeated(x, factors, memory_format, first_apart)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.factors, ctx.memory_format, ctx.first_apart = inputs

    @staticmethod
    def backward(ctx, grad):
        return _repeats_summed(grad, ctx.factors, ctx.first_apart), None, None, None

    @staticmethod
    def jvp(ctx, x_tangent, *_):
        return _repeated(x_tangent, ctx.factors, ctx.memory_format, ctx.first_apart)


def _repeats_summed(grad: torch.Tensor, factors, first_apart: bool) -> torch.Tensor:
    """The gradient of repeat_nearest's input from its output's: each voxel's repeats summed, channels_last_3d."""
    fd, fh, fw = factors
    if not first_apart:
        return block_sum(grad, factors)
    b, c, d, h, w = grad.shape
    frames = 1 + (d - 1) // fd
    summed = torch.empty((b, c, frames, h // fh, w // fw), dtype=grad.dtype, device=grad.device, memory_format=_CL)
    summed[:, :, :1] = block_sum(grad[:, :, :1], (1, fh, fw))
    if frames > 1:
        summed[:, :, 1:] = block_sum(grad[:, :, 1:], factors)
    return summed


def _repeated_shape(x: torch.Tensor, factors, first_apart: bool) -> tuple:
    """The shape of x repeated by nearest `factors` (`first_apart`: the first frame once)."""
    b, c, d, h, w = x.shape
    fd, fh, fw = factors
    return b, c, 1 + (d - 1) * fd if first_apart and d else d * fd, h * fh, w * fw


def _repeated(x: torch.Tensor, factors, memory_format, first_apart: bool) -> torch.Tensor:
    shape = _repeated_shape(x, factors, first_apart)
    out = torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=memory_format)
    _into_repeats(out, x, factors, first_apart, "copy_")
    return out


def _into_repeats(out: torch.Tensor, x: torch.Tensor, factors, first_apart: bool, how: str) -> None:
    """out.copy_ (or .add_, `how`) of x repeated by nearest upsampling (repeat_nearest's, `first_apart` as it),
    in place, by broadcasting views: no tensor of out's size made."""
    if first_apart and x.shape[2]:
        _into_upsampled(out[:, :, :1], x[:, :, :1], (1, *factors[1:]), how)
        if x.shape[2] > 1:
            _into_upsampled(out[:, :, 1:], x[:, :, 1:], factors, how)
    else:
        _into_upsampled(out, x, factors, how)


def _into_upsampled(out: torch.Tensor, x: torch.Tensor, factors, how: str) -> None:
    """out.copy_ (or .add_) of F.interpolate(x, scale_factor=factors, mode="nearest") for whole-number factors, as
    one broadcast into `out` (a view of a larger tensor too)."""
    b, c, d, h, w = x.shape
    fd, fh, fw = factors
    source = x[:, :, :, None, :, None, :, None].expand(b, c, d, fd, h, fh, w, fw)
    getattr(out.view(b, c, d, fd, h, fh, w, fw), how)(source)


def add_repeated_(out: torch.Tensor, x: torch.Tensor, factors, first_apart: bool = False) -> torch.Tensor:
    """out += repeat_nearest(x, factors, first_apart=first_apart), in place and returned: the repeats read by
    broadcasting, nothing of out's size written but out (a residual added to an upsampled conv's output whose input
    was never upsampled). Its backward passes out's gradient through and hands x the sums of each voxel's repeats,
    channels_last_3d, where autograd's broadcast reduction would answer NCDHW. Under torch.compile the broadcast
    add is traced as it is; under torch.func, out of place."""
    factors = tuple(factors)
    if tuple(out.shape) != _repeated_shape(x, factors, first_apart):
        raise ValueError(f"add_repeated_: out is {tuple(out.shape)}, x {tuple(x.shape)} repeated by {factors}")
    if func_transformed():
        return out + _interpolated(x, factors, first_apart)
    if torch.compiler.is_compiling():
        _into_repeats(out, x, factors, first_apart, "add_")
        return out
    return _AddRepeated.apply(out, x, factors, first_apart)


class _AddRepeated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, x, factors, first_apart):
        _into_repeats(out, x, factors, first_apart, "add_")
        ctx.mark_dirty(out)
        ctx.factors, ctx.first_apart = factors, first_apart
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, _repeats_summed(grad, ctx.factors, ctx.first_apart), None, None

    @staticmethod
    def jvp(ctx, out_tangent, x_tangent, *_):
        if out_tangent is None:
            return _repeated(x_tangent, ctx.factors, layout_of(x_tangent), ctx.first_apart)
        if x_tangent is not None:
            _into_repeats(out_tangent, x_tangent, ctx.factors, ctx.first_apart, "add_")
        return out_tangent


# Called as observe(kind, copy, sources) for each copy of activations tconv3d's modules write themselves through
# views and copy_ (a replicated border no kernel reads in place yet), which a dispatcher mode sees as no pad: the
# audit (tconv3d.nn.audit) counts them as their layer's own copies.
COPY_OBSERVERS: list = []


def replicate_padded(x: torch.Tensor, padding) -> torch.Tensor:
    """F.pad(x, mode="replicate") of a 5-D x, `padding` in the op's order (D front, D back, H top, H bottom, W left,
    W right), written into a tensor of x's layout (channels_last_3d stays so) by broadcast copies of its edges. Its
    backward folds each border's gradient onto the voxel it repeated in a fixed order, summed in float32
    (kernels.tensors.fold_padding: deterministic, where CUDA's replication-pad backward adds with atomics) and
    channels_last_3d. Under torch.compile and torch.func, F.pad."""
    padding = tuple(int(p) for p in padding)
    if autograd_traced():
        df, db, ht, hb, wl, wr = padding
        return F.pad(x, (wl, wr, ht, hb, df, db), mode="replicate")
    return _own_copy(_ReplicatePad.apply(x, padding), x)


def _own_copy(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """`out`, a copy of x a layer writes itself, reported to COPY_OBSERVERS."""
    for observe in COPY_OBSERVERS:
        observe("own", out, [x])
    return out


def frames_in_front(front: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch.cat([front, x], dim=2) written into a tensor of x's layout by two copies into views (channels_last_3d
    stays so): a copy a layer makes itself, reported to COPY_OBSERVERS as replicate_padded's is (a dispatcher mode
    sees no concatenation). Autograd's backward: each source's gradient a view of the result's."""
    out = empty_for((*x.shape[:2], front.shape[2] + x.shape[2], *x.shape[3:]), x, front, memory_format=layout_of(x))
    out[:, :, : front.shape[2]] = front
    out[:, :, front.shape[2] :] = x
    return _own_copy(out, x)


class _ReplicatePad(torch.autograd.Function):
    @staticmethod
    def forward(x, padding):
        return _replicated(x, padding)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.padding = inputs
        ctx.in_size = tuple(x.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        border = SimpleNamespace(in_size=ctx.in_size, padding=ctx.padding, dim_modes=("replicate",) * 3)
        # the fold overwrites the planes it folds onto: a copy of autograd's gradient, which others may hold
        return fold_padding(grad.clone(memory_format=torch.channels_last_3d), border), None

    @staticmethod
    def jvp(ctx, x_tangent, _):
        return _replicated(x_tangent, ctx.padding)


def _replicated(x: torch.Tensor, padding) -> torch.Tensor:
    df, db, ht, hb, wl, wr = padding
    b, c, d, h, w = x.shape
    out = torch.empty((b, c, df + d + db, ht + h + hb, wl + w + wr), dtype=x.dtype, device=x.device,
                      memory_format=layout_of(x))  # fmt: skip
    # D's borders within x's rows and columns, then H's within its columns over every frame, then W's over all
    core = out[:, :, :, ht : ht + h, wl : wl + w]
    core[:, :, df : df + d].copy_(x)
    columns = out[:, :, :, :, wl : wl + w]
    for view, axis, front, size, back in ((core, 2, df, d, db), (columns, 3, ht, h, hb), (out, 4, wl, w, wr)):
        for start, length, edge in ((0, front, front), (front + size, back, front + size - 1)):
            if length:
                border = view.narrow(axis, start, length)
                border.copy_(view.narrow(axis, edge, 1).expand_as(border))
    return out


def laid_out(x: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """x.is_contiguous(memory_format=memory_format); False under torch.func.vmap, which queries no layout but
    NCDHW (a batched tensor is taken as laid out otherwise)."""
    return not batched(x) and x.is_contiguous(memory_format=memory_format)


def _laid_out_only(input: torch.Tensor, memory_format: torch.memory_format) -> bool:
    """An input laid out in `memory_format` (channels_last for 4-D, channels_last_3d for 5-D) and not also
    contiguous (where both hold, NCHW or NCDHW is as good)."""
    return laid_out(input, memory_format) and not input.is_contiguous()


def normalize(input, groups, weight, bias, eps, activation, channels_after=None, *, instance=False):
    """GroupNorm (then `activation`: an Activation, or its name) of `input`, or of torch.cat([input, channels_after],
    dim=1) read in place where both are 5-D tensors of one supported dtype (concatenated first otherwise).
    An input of no voxel is refused where the installed torch's group_norm refuses it (2.14 on), as every caller's
    stock would (nn.GroupNorm, the blocks and adapters that call group_norm themselves), unless `instance` (an
    instance norm's call, groups = channels: torch's instance_norm answers it empty)."""
    # numel first: cheap; an instance norm's call skips even that
    no_voxel = not instance and input.numel() == 0 and input.dim() > 2 and math.prod(input.shape[2:]) == 0
    if no_voxel and _group_norm_refuses_no_voxel():
        raise RuntimeError(
            f"GroupNorm: Expected HxW to be greater than 0, got 0 (input {tuple(input.shape)}), as this torch's "
            "group_norm refuses an input of no voxel"
        )
    if not isinstance(activation, Activation):
        activation = Activation(activation)
    name, *slopes = activation.op_arguments()
    if channels_after is not None:
        if input.dim() == channels_after.dim() == 5 and input.dtype == channels_after.dtype in SUPPORTED_DTYPES:
            return call_group_norm(input, weight, bias, groups, eps, name, channels_after, *slopes)[0]
        input = torch.cat([input, channels_after], dim=1)
    if input.dim() == 4 and input.dtype in SUPPORTED_DTYPES and _laid_out_only(input, torch.channels_last):
        # (N, C, H, W) channels_last, such as a video's frames flattened into the batch (B*T, C, H, W) from a
        # channels_last_3d activation: the same kernel over its (N, C, 1, H, W) channels_last_3d view, and the
        # result viewed back channels_last, where torch's group_norm would answer NCHW.
        return normalize(input.unsqueeze(2), groups, weight, bias, eps, activation, instance=instance).squeeze(2)
    if input.dim() != 5 or input.dtype not in SUPPORTED_DTYPES:
        # vmap's group_norm queries the layout of what it batches: contiguous, as a stock model's activations are
        output = F.group_norm(input.contiguous() if batched(input) else input, groups, weight, bias, eps)
        return activation.applied(output)
    return call_group_norm(input, weight, bias, groups, eps, name, None, *slopes)[0]
