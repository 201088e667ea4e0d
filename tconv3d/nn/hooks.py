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


class CallArguments:
    """The arguments an adapter hands a hooked layer's call for the work it takes (Conv3d's `convolving`,
    FrameConv2d's `frames`), as one object: hooks that walk a call's arguments pass it as it is. accelerate's
    (send_to_device) recurse into tuples and ask each item hasattr(item, "to"), which dynamo cannot trace on a
    symbolic size: a tuple of them broke a compiled graph at each such call. torch.fx records its arguments as a
    tuple (`arguments` reads either)."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __fx_create_arg__(self, tracer):
        return tracer.create_arg(self.args)


def arguments(handed) -> tuple:
    """The arguments `handed` holds: a CallArguments's, or a tuple's own (a torch.fx graph's call)."""
    return handed.args if isinstance(handed, CallArguments) else tuple(handed)


def instance_forward_reason(module: nn.Module) -> str | None:
    """Why convert leaves `module` (or the layer it holds): a forward replaced on the instance holds the forward of
    the class it had (diffusers' and accelerate's hooks keep it and call it), which convert cannot reach."""
    if "forward" in module.__dict__:
        return (
            "its forward is replaced on the instance, by hooks that keep calling its class's (diffusers' layerwise "
            "casting or offloading, accelerate's): convert first, then add them"
        )
    return None
