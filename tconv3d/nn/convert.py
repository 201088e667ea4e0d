"""tconv3d.nn.convert: tconv3d's modules swapped into a model in place, the causal convolutions of diffusers'
video VAEs included, with their padding and cached frames taken into the op.

A layer is converted by changing its class, never by replacing the module: parameters, hooks, the optimizer's
references and the state_dict keys stay. Known classes of other libraries get an adapter class built on the
fly, `(Adapter, TheirClass[, tconv3d.nn.Conv3d])`: it stays an instance of their class (so their own
`isinstance` checks, e.g. Wan's count of its causal convs for the frame cache, still hold) and its forward keeps
their signature and meaning while running tconv3d ops. The adapters (video_vaes.py for diffusers, monai_nets.py
for MONAI) are matched by module and class name, so neither library is ever imported.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.fx import Proxy, _symbolic_trace
from torch.nn.utils import parametrize

from ..geometry import SUPPORTED_DTYPES
from ..ops import in_strides_of
from . import monai_nets, torchvision_nets, video_vaes
from .hooks import instance_forward_reason, received, wrapper_error
from .modules import (
    AvgPool3d,
    BatchNorm3d,
    Conv3d,
    ConvTranspose3d,
    GroupNorm,
    InstanceNorm3d,
    Upsample,
    activation_of,
    fx_leaf,
    given,
    keep_memory_format,
    weight_sources,
)
from .video_vaes import (
    FRAME_BLOCKS,
    FRAME_CONV_BLOCKS,
    FrameConv2d,
    adapter_reason,
    class_name,
    conv_reason,
    fuse_norm_silu_blocks,
)

logger = logging.getLogger("tconv3d")

# Whether torch.fx.symbolic_trace runs (is_fx_tracing, in torches that lack the other, now logs that it answers
# torch.export's tracing too)
_fx_tracing = getattr(_symbolic_trace, "is_fx_symbolic_tracing", _symbolic_trace.is_fx_tracing)

SUBCLASS_POLICIES = ("skip", "rebase")


class _Rebased:
    """An nn.Conv3d subclass of unknown behaviour, opted in with subclasses="rebase" (its own forward runs as it
    is, and its super().forward lands in tconv3d.nn.Conv3d), or one with no forward of its own (`own_forward`:
    tconv3d.nn.Conv3d's runs)."""

    attributes = ()


@functools.cache
def adapted_class(adapter: type, original: type) -> type:
    """The class a converted module of class `original` gets: the adapter's forward over `original`, and
    tconv3d.nn.Conv3d (weight kept channels_last_3d, super().forward on tconv3d) for convolutions."""
    bases = (adapter, original, Conv3d) if issubclass(original, nn.Conv3d) else (adapter, original)
    attributes = {"__module__": original.__module__, "tconv3d_adapter": adapter, "__reduce_ex__": _reduce_adapted}
    forward = getattr(adapter, "forward", None)
    if forward not in (None, Conv3d.forward):  # (Conv3d's records itself)
        attributes["forward"] = _recorded_whole(forward)
    return type(original.__name__, bases, attributes)


def _recorded_whole(forward: Callable) -> Callable:
    """An adapter's forward, which torch.fx's symbolic tracing records whole (modules.fx_leaf): adapters test
    shapes and call the ops and their layers' methods directly, which a Proxy refuses. The module traced itself
    (a whole network's adapter: MONAI's UNet) is traced into, its layers recorded. One check a call in eager
    (~0.17 us; a block's or causal conv's call: several us). `convolving`: a parent's Conv3d.convolve of an adapted
    conv made through its call, where hooks run (Conv3d.convolve)."""

    @functools.wraps(forward)
    def whole(self, *args, convolving=None, **kwargs):
        if _fx_tracing():
            proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, Proxy)), None)
            if proxy is not None and proxy.tracer.root is not self:
                return fx_leaf(self, args, {**kwargs, **given(convolving=convolving)})
        if convolving is not None:  # a parent's Conv3d.convolve of this conv, made through its call (hooks run)
            return self._convolve(*args, *received(convolving))
        try:
            return forward(self, *args, **kwargs)
        except AttributeError as error:  # (free where nothing is raised)
            wrapped = wrapper_error(self)
            if wrapped is None:
                raise
            raise wrapped from error

    whole.takes_convolving = True
    return whole


def _reduce_adapted(module: nn.Module, protocol: int):
    # An adapted class is made at run time under their class's name, so pickle (torch.save of a whole model)
    # cannot find it by name: it is pickled as the (adapter, their class) pair it is made of, both importable.
    cls = type(module)
    return _new_adapted, (cls.tconv3d_adapter, cls.__bases__[1]), module.__getstate__()


def _new_adapted(adapter: type, original: type) -> nn.Module:
    cls = adapted_class(adapter, original)
    return cls.__new__(cls)


# The classes of other libraries convert knows, by module and name: diffusers' video VAEs, MONAI's networks,
# torchvision's MViT.
KNOWN_CLASSES = {name: adapter for adapter in video_vaes.ADAPTERS + monai_nets.ADAPTERS + torchvision_nets.ADAPTERS
                 for name in adapter.classes}  # fmt: skip

# The torch modules tconv3d has a drop-in for: exact classes (subclasses bring their own forward).
DROP_INS = {nn.Conv3d: Conv3d, nn.ConvTranspose3d: ConvTranspose3d, nn.GroupNorm: GroupNorm,
            nn.InstanceNorm3d: InstanceNorm3d, nn.BatchNorm3d: BatchNorm3d, nn.AvgPool3d: AvgPool3d,
            nn.Upsample: Upsample}  # fmt: skip


def is_converted(module: nn.Module) -> bool:
    return isinstance(module, tuple(DROP_INS.values())) or hasattr(type(module), "tconv3d_adapter")


def parametrized_base(module: nn.Module) -> type | None:
    """nn.Conv3d or nn.ConvTranspose3d where torch.nn.utils.parametrize made `module`, one of them, parametrized
    (weight_norm, spectral_norm: a class of its own for each module, `Parametrized<Conv3d>`, adding the tensors'
    properties to the layer's class and no forward); None for any other module."""
    cls = type(module)
    base = cls.__bases__[0]
    if len(cls.__bases__) != 1 or base not in (nn.Conv3d, nn.ConvTranspose3d) or "forward" in vars(cls):
        return None
    if cls.__name__ != f"Parametrized{base.__name__}" or not parametrize.is_parametrized(module):
        return None
    return base


def _parametrized_drop_in(module: nn.Module, base: type) -> type:
    """The parametrized class of `module` (parametrized_base) over tconv3d's drop-in for `base`: what registering the
    parametrization on a converted layer makes, so that remove_parametrizations leaves the drop-in."""
    namespace = {key: value for key, value in vars(type(module)).items() if key not in ("__dict__", "__weakref__")}
    return type(type(module).__name__, (DROP_INS[base],), namespace)


def own_forward(cls: type) -> bool:
    """Whether an nn.Conv3d subclass has a forward of its own (or nn.Conv3d's `_conv_forward`, which its forward
    calls): one that may differ. A subclass that adds only a constructor (torchvision's video ResNets'
    Conv3DSimple and Conv3DNoTemporal) runs nn.Conv3d's forward, and is taken over as nn.Conv3d is."""
    below = cls.__mro__[: cls.__mro__.index(nn.Conv3d)]
    return any(name in vars(c) for c in below for name in ("forward", "_conv_forward"))


def unsupported_reason(module: nn.Module, subclasses: str) -> str | None:
    """Why convert leaves an nn.Conv3d (or another module with a drop-in) as it is; None if it takes it over."""
    if (reason := instance_forward_reason(module)) is not None:
        return reason
    if parametrized_base(module) is not None:  # its weight's dtype read from its sources, not computed
        dtype = next((t.dtype for t in weight_sources(module) if t.dtype not in SUPPORTED_DTYPES), None)
        return None if dtype is None else f"its weight is {dtype} (tconv3d runs float16, bfloat16 and float32)"
    if type(module) in (nn.LazyConv3d, nn.LazyConvTranspose3d):
        return (
            f"it is a {type(module).__name__}, whose parameters are made by its first forward, where it becomes an "
            f"nn.{type(module).cls_to_become.__name__}: convert after a first forward"
        )
    if isinstance(module, nn.Conv3d) and own_forward(type(module)) and subclasses == "skip":
        return (
            f"it is a {type(module).__qualname__}, a subclass of nn.Conv3d whose own forward may differ (convert("
            "model, subclasses='rebase') keeps its forward and runs its super().forward on tconv3d)"
        )
    if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)):
        return conv_reason(module)
    if getattr(module, "weight", None) is not None and module.weight.dtype not in SUPPORTED_DTYPES:
        return f"its weight is {module.weight.dtype} (tconv3d runs float16, bfloat16 and float32)"
    return None


def convert(
    model: nn.Module, filter: Callable[[str, nn.Module], bool] | None = None, subclasses: str = "skip"
) -> nn.Module:
    """Swap tconv3d in for every eligible layer of `model`, in place, and return `model`.

    - `nn.Conv3d`, `nn.ConvTranspose3d`, `nn.GroupNorm`, `nn.InstanceNorm3d` and `nn.BatchNorm3d` become
      tconv3d's drop-ins (NDHWC kernels, channels_last_3d outputs; BatchNorm3d's batch statistics on them),
      `nn.AvgPool3d` and `nn.Upsample` drop-ins that keep a channels_last_3d activation so (torch's values), and a
      GroupNorm, InstanceNorm3d or BatchNorm3d followed by `nn.SiLU`, `nn.ReLU`, `nn.LeakyReLU` or `nn.PReLU` in
      an `nn.Sequential` becomes one fused norm + activation (the activation's slot an `nn.Identity`, a PReLU's a
      FusedPReLU that keeps its weight; a dropout between them, as MONAI's blocks have, stays after it where the
      two commute).
    - The causal convolutions of diffusers' video VAEs (Wan, QwenImage, CogVideoX, Mochi, HunyuanVideo,
      LTX-Video, Cosmos, EasyAnimate, Kandinsky 5's KVAE, Kandinsky 6's SR VAE and latent upscalers, MiniMax-H3's
      encoder) are taken over with their padding, repeated frames and cached frames inside one op: no F.pad or
      torch.cat copy of an activation remains around them. Their forward signatures and results are diffusers'.
    - MONAI's networks (monai_nets): skip connections handed to their convolutions as `channels_after`, zero
      padding made before a convolution (EfficientNet's "same" padders, AutoencoderKL's and MAISI's downsamplers)
      padded inside it, MAISI's split convolutions and norms run whole, res blocks' norm + SiLU in one pass.
    - Other subclasses of nn.Conv3d with a forward of their own are left alone unless `subclasses="rebase"`: then
      their own forward still runs, and its super().forward runs tconv3d. One that adds only a constructor
      (torchvision's video ResNets' Conv3DSimple) runs nn.Conv3d's forward, and is taken over as nn.Conv3d is.

    Each layer keeps its identity and Parameters (its class is changed and a conv weight made channels_last_3d in
    place), so an optimizer built before the call keeps working and state_dicts load both ways.
    `filter(qualified_name, module)` returning False leaves a module alone (a VAE's conv wrapper, once taken
    over, takes its inner conv with it). What tconv3d cannot run (float64 weights,
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
                if hasattr(adapter, "prepare"):
                    adapter.prepare(module)
                inner = getattr(module, "conv", None)
                if getattr(adapter, "wraps_conv", False) and not is_converted(inner):
                    # A wrapper calls its conv's tconv3d op directly: the conv goes with it.
                    inner_adapter = KNOWN_CLASSES.get(class_name(type(inner)), _Rebased)
                    _swap(inner, Conv3d if type(inner) is nn.Conv3d else adapted_class(inner_adapter, type(inner)))
                converted += 1
            else:
                logger.warning("tconv3d.nn.convert left %s (%s) as it is: %s", label, type(module).__name__, reason)
            continue
        parametrized = parametrized_base(module)
        lazy = type(module) is nn.LazyConvTranspose3d  # (a LazyConv3d is an nn.Conv3d: it passes the test below)
        if type(module) not in DROP_INS and parametrized is None and not lazy and not isinstance(module, nn.Conv3d):
            continue
        reason = unsupported_reason(module, subclasses)
        if reason is not None:
            logger.warning("tconv3d.nn.convert left %s as it is: %s", label, reason)
            continue
        if parametrized is not None:
            _swap(module, _parametrized_drop_in(module, parametrized))
        else:
            _swap(module, DROP_INS.get(type(module)) or adapted_class(_Rebased, type(module)))
        converted += 1
    _fuse_norm_activations(model)
    fuse_norm_silu_blocks(model)
    _frame_convs_channels_last(model)
    monai_nets.fold_paddings(model)
    monai_nets.fuse_res_block_norms(model)
    logger.info("tconv3d.nn.convert took over %d module(s)", converted)
    return model


def shardable(model: nn.Module) -> nn.Module:
    """Let FSDP2's `fully_shard`, which takes only contiguous parameters, shard a converted `model`, and return it.

    tconv3d's conv layers then keep their weights in torch.contiguous_format, (Cout, Cin, kd, kh, kw) in memory
    as a stock nn.Conv3d's, converted in place on the same Parameters; every other parameter (the channels_last
    nn.Conv2d weights of a VAE's frame blocks) is made contiguous too. A call then reads its weight, all-gathered
    by FSDP, through a channels_last_3d copy made inside the op and freed after the kernel, so FSDP's resharding
    still frees the gathered weight after the forward; the weight gradient comes back in the parameter's
    strides. Per layer and training step that is three copies of the weight's bytes (one in the forward, two in
    the backward), next to FSDP's all-gather and reduce-scatter of the same bytes. Call after `convert` and before
    `fully_shard`. DDP and FSDP1's `FullyShardedDataParallel` (whose views of its flat buffer keep each parameter's
    strides) take a converted model as it is: there this only adds the copies.

    Anything else that takes only contiguous tensors takes the model after it too: diffusers' group offloading to
    disk (`enable_group_offload(..., offload_to_disk_path=...)`) saves each group's weights with safetensors'
    `save_file`, which refuses a channels_last_3d weight. A weight it loads back comes contiguous whatever the
    layer keeps, so a call lays it out either way: this costs nothing more there.
    """
    for module in model.modules():
        if isinstance(module, (Conv3d, ConvTranspose3d)):
            module.weight_format = "contiguous"
    for parameter in model.parameters():
        keep_memory_format(parameter, torch.contiguous_format)
    return model


def match_optimizer_state(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Lay `optimizer`'s per-parameter state out in its parameters' strides, now and after each later
    `optimizer.load_state_dict`, and return it.

    An optimizer makes a parameter's state (AdamW's moments, SGD's momentum) in the parameter's strides, so state
    made after `convert` is channels_last_3d as the conv weights are. State made before `convert` (an optimizer
    that stepped on the stock model) or loaded from a stock run's checkpoint stays NCDHW, and torch's fused
    optimizers (`fused=True`) do not take the mismatch: on CUDA they refuse it ("... must have same dtype, device,
    and layout"), on CPU they pair a parameter's elements with its state's by memory position and update wrongly,
    silently (docs/upstream.md). The for-loop and foreach paths compute right either way. Call it once the
    optimizer exists, after `convert` (and after `shardable`, which lays the weights out anew). State of another
    shape (a step count) and distributed tensors (FSDP2's) are left as they are.
    """
    if optimizer not in _MATCHED_OPTIMIZERS:
        optimizer.register_load_state_dict_post_hook(_match_state)
        _MATCHED_OPTIMIZERS.add(optimizer)
    _match_state(optimizer)
    return optimizer


_MATCHED_OPTIMIZERS: weakref.WeakSet = weakref.WeakSet()


def _match_state(optimizer: torch.optim.Optimizer) -> None:
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key, value in state.items():
                if _strided(value) and _strided(parameter) and value.shape == parameter.shape:
                    state[key] = in_strides_of(value, parameter.stride())


def _strided(t) -> bool:
    """A plain dense tensor (not a DTensor or other subclass, not a sparse tensor)."""
    return isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, nn.Parameter) and t.layout == torch.strided


def _swap(module: nn.Module, cls: type) -> None:
    module.__class__ = cls
    if isinstance(module, (Conv3d, ConvTranspose3d)):
        module._keep_stored_weight_format()


# Dropouts an activation may move in front of: each multiplies an element by 0 or 1 / (1 - p), never negative,
# which commutes with an activation f of f(0) = 0 and f(kx) = k f(x) for k >= 0 (ReLU, leaky ReLU, PReLU: the
# same random draws and, for finite inputs, values, a leaky ReLU's within a rounding), and at p = 0 with any
# activation (the identity: MONAI's ADN blocks put a Dropout(0.0) between their norm and activation).
# AlphaDropout's affine fill is neither.
SCALING_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
HOMOGENEOUS_ACTIVATIONS = {"relu", "leaky_relu", "prelu"}


def _fuse_norm_activations(model: nn.Module) -> None:
    """GroupNorm / InstanceNorm3d / BatchNorm3d then nn.SiLU, nn.ReLU, nn.LeakyReLU (in place or not: the norm's
    output is its own) or nn.PReLU in an nn.Sequential, next to each other or with dropouts between that commute
    with the activation (SCALING_DROPOUTS) -> one fused pass, the dropouts after it; the activation's slot an
    nn.Identity, a PReLU's a FusedPReLU (which keeps its weight)."""
    for parent in model.modules():
        if not isinstance(parent, nn.Sequential):
            continue
        items = list(parent._modules.items())
        for i, (_, norm) in enumerate(items):
            if not isinstance(norm, (GroupNorm, InstanceNorm3d, BatchNorm3d)) or norm.activation is not None:
                continue
            j = i + 1
            while j < len(items) and type(items[j][1]) in SCALING_DROPOUTS:
                j += 1
            if j == len(items) or (fused := activation_of(items[j][1])) is None:
                continue
            if fused.name not in HOMOGENEOUS_ACTIVATIONS and any(module.p != 0 for _, module in items[i + 1 : j]):
                continue
            if fused.name == "prelu":
                norm.fuse_prelu(items[j][1])
                continue
            norm.activation, norm.negative_slope = fused.name, fused.negative_slope
            parent._modules[items[j][0]] = nn.Identity()


def _frame_convs_channels_last(model: nn.Module) -> None:
    """The nn.Conv2d weights of known frame-by-frame blocks (video_vaes.FRAME_BLOCKS) made channels_last; those of
    the resamplers taken over (FRAME_CONV_BLOCKS) FrameConv2d, which their adapters call where hooks run."""
    for block in model.modules():
        if class_name(type(block)) in FRAME_BLOCKS:
            resampler = class_name(type(block)) in FRAME_CONV_BLOCKS and is_converted(block)
            for conv in block.modules():
                if isinstance(conv, nn.Conv2d):
                    keep_memory_format(conv.weight, torch.channels_last)
                    if resampler and type(conv) is nn.Conv2d and instance_forward_reason(conv) is None:
                        conv.__class__ = FrameConv2d
