"""Whether a module's call runs someone else's code around its forward (`hooked`). An adapter that would skip a
module's call (reading a submodule's weight, calling its convolution directly, handing a container's convolution
a second source) makes the call instead where it does, so that the hooks run as they do in the stock model:
torch's module hooks (an older weight_norm's pre-hook computes the weight), and a forward replaced on the
instance, as diffusers' hooks (layerwise casting: a weight stored in float8 and cast for each call; group
offloading) and accelerate's (a weight moved onto the device for the call) replace it."""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_module


def observer(hook):
    """`hook` marked as one that only observes (tconv3d.nn.audit's): `hooked` does not count it, so an adapter that
    runs otherwise for a hooked module runs as it does unobserved, and what the hook sees is the path the model
    takes without it. Returns the hook."""
    hook.tconv3d_observer = True
    return hook


def hooked(module: nn.Module) -> bool:
    """Whether calling `module` runs hooks: forward, forward pre-, full backward, its own or global, or a forward
    that replaces its class's on the instance. Hooks marked `observer` (tconv3d.nn.audit's) are not counted."""
    if "forward" in module.__dict__:
        return True
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks, module._backward_pre_hooks,
             torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks,
             torch_module._global_backward_hooks, torch_module._global_backward_pre_hooks)  # fmt: skip
    if not any(hooks):  # most calls: an adapter asks it of each layer whose call it would skip
        return False
    return any(not getattr(hook, "tconv3d_observer", False) for kind in hooks for hook in kind.values())


def wrapper(module: nn.Module) -> bool:
    """Whether `module` stands in for a layer it holds as `base_layer` and adds to that layer's call: peft's LoRA
    layers, which take a converted layer's place when adapters are added after convert. An adapter that would
    skip such a module's call (reading its weight) makes the call, as it does for a `hooked` one."""
    return isinstance(module._modules.get("base_layer"), nn.Module)


def wrapper_error(module: nn.Module) -> TypeError | None:
    """What a converted module's forward raises where a layer it reaches into (a conv's `convolve`, its padding)
    is now a `wrapper` (a LoRA layer, added after convert), which has neither; None where no layer of `module` is
    one."""
    name = next((name for name, child in module.named_modules() if child is not module and wrapper(child)), None)
    if name is None:
        return None
    return TypeError(
        f"{type(module).__name__}: its {name} is a {type(module.get_submodule(name)).__qualname__} standing in for "
        "the layer convert took over (a LoRA layer, peft's, added after tconv3d.nn.convert), and tconv3d's forward "
        "of this block calls that layer's convolution with its own padding and cached frames, which the LoRA "
        "layer does not take. Add the LoRA adapters before convert (convert then takes over their layers and "
        "leaves this block's forward as its library's), or merge them into the weights first (merge_and_unload)"
    )


class Handed:
    """A value an adapter hands a hooked layer's call for work the layer takes that stock's call does not (Conv3d's
    `convolving` and `upsampled`, FrameConv2d's `frames`, a causal conv's `upsampled_by` or `bottom_right`, a
    ConvTranspose3d's `output_size`), as one object: hooks that walk a call's arguments pass it as it is.
    accelerate's (send_to_device) recurse into tuples and lists and ask each item hasattr(item, "to"), which dynamo
    cannot trace on a symbolic int; and under torch.compile the ints handed a hooked call are symbolic in its hooks'
    frame (dynamic=True, or the default's automatic dynamic once another layer's call hands others). A tuple of them
    broke the compiled graph at each such call. torch.fx records the value itself (`received` reads either)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __fx_create_arg__(self, tracer):
        return tracer.create_arg(self.value)


def hand(module: nn.Module, value):
    """`value` as an adapter hands it to `module`'s call as a keyword argument of tconv3d's: in a Handed where that
    call runs hooks (`hooked`), else as it is."""
    return Handed(value) if hooked(module) else value


def received(value):
    """What `value`, a keyword argument of tconv3d's that a layer's call receives, holds (`hand`)."""
    return value.value if isinstance(value, Handed) else value


def instance_forward_reason(module: nn.Module) -> str | None:
    """Why convert leaves `module` (or the layer it holds): a forward replaced on the instance holds the forward of
    the class it had (diffusers' and accelerate's hooks keep it and call it), which convert cannot reach."""
    if "forward" in module.__dict__:
        return (
            "its forward is replaced on the instance, by hooks that keep calling its class's (diffusers' layerwise "
            "casting or offloading, accelerate's): convert first, then add them"
        )
    return None
