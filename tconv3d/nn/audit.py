"""tconv3d.nn.audit: run a model once and report what of it tconv3d ran, and the copies left around its
convolutions.

It watches the dispatcher (a TorchDispatchMode: it sees each op a model calls at the top level, not what runs
inside tconv3d's ops) and the Conv3d-like modules (forward hooks), so it needs nothing from the model but a call.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .convert import KNOWN_CLASSES, is_converted, unsupported_reason
from .hooks import observer
from .modules import COPY_OBSERVERS, Conv3d
from .video_vaes import FRAME_CONV_BLOCKS, adapter_reason, class_name


@dataclass
class LayerAudit:
    """One Conv3d of the model (a VAE's conv wrapper counts as its conv) and what its calls did."""

    name: str
    kind: str  # the module's class
    converted: bool
    reason: str | None  # why tconv3d does not run it, when it does not
    calls: int = 0
    tconv3d_calls: int = 0
    aten_calls: int = 0  # aten convolutions (3-D; 2-D on the frames in a resampler's)
    layout_copies: int = 0  # tconv3d calls whose input (or second source) arrived not channels_last_3d
    # Copies of activations made in the layer's own forward (the padding of a VAE's conv wrapper or Conv3d
    # subclass) that fed its convolution: what convert takes into the op.
    pad_copies: int = 0  # F.pad
    concat_copies: int = 0  # torch.cat / repeat
    # Pad or concatenation copies made by model code before the layer was called that fed its convolution
    # (e.g. a VAE block concatenating cached frames itself): the model's, not the layer's.
    upstream_copies: int = 0
    # Copies of activations tconv3d itself wrote in the converted layer's forward, where no kernel reads the
    # input in place yet (HunyuanVideo's sub-pixel upsampler: its input's replicated borders).
    own_copies: int = 0


@dataclass
class Audit:
    layers: list[LayerAudit] = field(default_factory=list)
    aten_conv3d_calls: int = 0  # in the whole run, inside Conv3d layers or not
    aten_conv_transpose3d_calls: int = 0
    aten_frame_conv_calls: int = 0  # 2-D convolutions of a video's frames inside watched layers (VAE resamplers)
    tconv3d_calls: int = 0
    norm_calls: int = 0  # tconv3d group_norm / instance norm / rms_norm calls
    norm_layout_copies: int = 0  # ... whose input arrived not channels_last_3d (each pays a layout copy)
    pads: int = 0  # 5-D pads anywhere in the run
    concats: int = 0  # 5-D concatenations and repeats anywhere in the run

    @property
    def totals(self) -> dict:
        count = lambda attr: sum(getattr(layer, attr) for layer in self.layers)  # noqa: E731
        return {
            "layers": len(self.layers),
            "converted": sum(layer.converted for layer in self.layers),
            "tconv3d_calls": self.tconv3d_calls,
            "aten_conv3d_calls": self.aten_conv3d_calls,
            "aten_conv_transpose3d_calls": self.aten_conv_transpose3d_calls,
            "aten_frame_conv_calls": self.aten_frame_conv_calls,
            # the model's own F.conv3d / F.conv_transpose3d calls, outside any conv module: nothing convert can take
            # over (Cosmos's Haar wavelet transforms)
            "aten_convs_outside_layers": self.aten_conv3d_calls
            + self.aten_conv_transpose3d_calls
            + self.aten_frame_conv_calls
            - count("aten_calls"),
            "layout_copies": count("layout_copies"),
            "norm_calls": self.norm_calls,
            "norm_layout_copies": self.norm_layout_copies,
            "pad_copies_into_convs": count("pad_copies"),
            "concat_copies_into_convs": count("concat_copies"),
            "upstream_copies_into_convs": count("upstream_copies"),
            "tconv3d_copies_into_convs": count("own_copies"),
            "pads": self.pads,
            "concats": self.concats,
        }

    def table(self) -> str:
        head = ("layer", "class", "tconv3d", "calls", "aten", "not CL", "pad", "cat", "upstream", "own", "why not")
        rows = [
            (l.name, l.kind, "yes" if l.converted else "no", l.calls, l.aten_calls, l.layout_copies, l.pad_copies,
             l.concat_copies, l.upstream_copies, l.own_copies, l.reason or "")
            for l in self.layers
        ]  # fmt: skip
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head) - 1)]
        lines = ["  ".join(str(v).ljust(w) for v, w in zip(r[:-1], widths, strict=True)) + "  " + str(r[-1])
                 for r in [head, *rows]]  # fmt: skip
        totals = ", ".join(f"{k} {v}" for k, v in self.totals.items())
        return "\n".join([*lines, f"totals: {totals}"])

    def __str__(self) -> str:
        return self.table()


_PAD_OPS = ("constant_pad_nd", "replication_pad3d", "reflection_pad3d", "pad", "_pad_circular")
_CONCAT_OPS = ("cat", "concat", "repeat")


def _is_3d(args) -> bool:
    """aten.convolution's arguments are those of a 3-D (maybe transposed) convolution."""
    return isinstance(args[0], torch.Tensor) and args[0].dim() == 5


# Where the ops take their second source (cached frames in front, channels after): (name, position, keyword).
_SECOND_SOURCES = {"conv3d": ((8, "frames_before"), (9, "channels_after")),
                   "conv3d_input_grad": ((8, "channels_after"),)}  # fmt: skip


def _second_source(name: str, args, kwargs) -> torch.Tensor | None:
    """The tensor an op reads beside its input (frames_before or channels_after), if any."""
    for position, keyword in _SECOND_SOURCES[name]:
        source = args[position] if len(args) > position else kwargs.get(keyword)
        if source is not None:
            return source
    return None


def _is_ndhwc(t: torch.Tensor) -> bool:
    return t.dim() == 5 and (t.stride(1) == 1 or t.shape[1] == 1)


def _local_dispatch_keys() -> tuple:
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


class _CallerKeys(TorchFunctionMode):
    """Hands _Watcher the caller's thread-local dispatch keys at each torch function the model calls (autocast's as
    the model has them: one it turns off around an einsum), which a dispatch mode cannot read: below the
    dispatcher's Python key all keys above it are excluded."""

    def __init__(self, watcher: _Watcher):
        super().__init__()
        self.watcher = watcher

    def __torch_function__(self, func, types, args=(), kwargs=None):
        outer, self.watcher.dispatch_keys = self.watcher.dispatch_keys, _local_dispatch_keys()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.watcher.dispatch_keys = outer


class _Watcher(TorchDispatchMode):
    def __init__(self, report: Audit, layer_stack: list):
        super().__init__()
        self.report, self.layer_stack = report, layer_stack
        # the caller's thread-local dispatch keys (autocast's), for the composite ops (below): those of the torch
        # function now running (_CallerKeys), else the audit's start
        self.dispatch_keys = _local_dispatch_keys()
        # Tensors made by pad or concatenation copies -> the copies that led to them: (kind, the layer whose
        # forward made it or None).
        self.copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.copy_kinds: dict[int, tuple[tuple[str, LayerAudit | None], ...]] = {}

    def _chain(self, t) -> tuple:
        if isinstance(t, torch.Tensor) and self.copies.get(id(t)) is t:
            return self.copy_kinds[id(t)]
        return ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # Under torch.inference_mode() (tensors without autograd keys) a composite op reaches the mode whole
        # (aten.conv3d, F.pad's aten.pad, einsum) where torch.no_grad() decomposes it above the mode first. Its
        # decomposition runs here as it would have there: its ops dispatched from the top, under the mode and the
        # caller's dispatch keys (autocast's: below the mode an einsum of a float32 and a float16 operand raises,
        # and one the model runs with autocast off must not be cast), so the audit sees what it sees in no_grad.
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with torch._C._ForceDispatchKeyGuard(*self.dispatch_keys), self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        namespace = func.namespace
        layer = self.layer_stack[-1] if self.layer_stack else None
        first = args[0] if args else None
        if namespace == "tconv3d" and name in ("conv3d", "conv3d_input_grad"):  # the latter: conv_transpose3d
            self.report.tconv3d_calls += 1
            second = _second_source(name, args, kwargs)
            self._conv_call(layer, first, tconv3d=True, layout_copy=not _is_ndhwc(first) or (
                second is not None and not _is_ndhwc(second)), second=second)  # fmt: skip
        elif namespace == "tconv3d" and name in ("group_norm", "rms_norm"):
            self.report.norm_calls += 1
            self.report.norm_layout_copies += not first.is_contiguous(memory_format=torch.channels_last_3d)
        elif namespace == "aten" and name == "convolution" and _is_3d(args):
            if args[6]:
                self.report.aten_conv_transpose3d_calls += 1
            else:
                self.report.aten_conv3d_calls += 1
            self._conv_call(layer, first, tconv3d=False, layout_copy=False)
        elif namespace == "aten" and name == "convolution" and layer is not None and first.dim() == 4:
            self.report.aten_frame_conv_calls += 1  # a resampler's 2-D conv on the frames as a batch
            self._conv_call(layer, first, tconv3d=False, layout_copy=False)
        elif namespace == "aten" and isinstance(out, torch.Tensor) and out.dim() == 5:
            kind = "pad" if name in _PAD_OPS else "cat" if name in _CONCAT_OPS else None
            if kind is not None:
                self.copied(kind, out, args[0] if name in ("cat", "concat") else [first])
        return out

    def copied(self, kind: str, out: torch.Tensor, sources) -> None:
        """`out` is a pad ("pad"), concatenation ("cat") or tconv3d's own pad ("own") copy of `sources`, made in the
        layer now running."""
        if kind in ("pad", "own"):
            self.report.pads += 1
        else:
            self.report.concats += 1
        chain = tuple(k for s in sources for k in self._chain(s))
        self.copies[id(out)] = out
        self.copy_kinds[id(out)] = (*chain, (kind, self.layer_stack[-1] if self.layer_stack else None))

    def _conv_call(self, layer, x, tconv3d: bool, layout_copy: bool, second=None) -> None:
        if layer is None:
            return
        layer.calls += 1
        layer.tconv3d_calls += tconv3d
        layer.aten_calls += not tconv3d
        layer.layout_copies += layout_copy
        for kind, made_in in self._chain(x) + self._chain(second):
            if made_in is not layer:
                layer.upstream_copies += 1
            elif kind == "pad":
                layer.pad_copies += 1
            elif kind == "own":
                layer.own_copies += 1
            else:
                layer.concat_copies += 1


def _layers(model: nn.Module):
    """(name, the module whose calls are watched, its conv): Conv3d and ConvTranspose3d modules not inside a known
    wrapper, known wrappers (which pad before calling their .conv) as their conv, and the known resamplers that
    run a 2-D conv on a video's frames (video_vaes.FRAME_CONV_BLOCKS) as that conv."""
    wrapped = set()
    for name, module in model.named_modules():
        conv = getattr(module, "conv", None)
        if getattr(KNOWN_CLASSES.get(class_name(type(module))), "wraps_conv", False) and isinstance(conv, nn.Conv3d):
            wrapped.add(id(conv))
            yield name, module, conv
        elif class_name(type(module)) in FRAME_CONV_BLOCKS:
            conv = next((m for m in module.modules() if isinstance(m, nn.Conv2d)), None)
            if conv is not None:
                yield name, module, conv
    for name, module in model.named_modules():
        if isinstance(module, (nn.Conv3d, nn.ConvTranspose3d)) and id(module) not in wrapped:
            yield name, module, module


def _enter(stack, layer, module, args) -> None:
    stack.append(layer)


def _leave(stack, module, args, output) -> None:  # a hook returning something would replace the output
    stack.pop()


def _convolve_in(stack, layer, convolve, *args, **kwargs):
    """A converted conv's `convolve`, its op counted as the layer's (FramePack's history patch embedding calls it
    from its parent's forward)."""
    stack.append(layer)
    try:
        return convolve(*args, **kwargs)
    finally:
        stack.pop()


def audit(model: nn.Module, *example_args, run=None, verbose: bool = True, **example_kwargs) -> Audit:
    """Run `model(*example_args, **example_kwargs)` once under torch.no_grad (or `run(model, *example_args,
    **example_kwargs)`, e.g. encode then decode) and report, per Conv3d or ConvTranspose3d layer (a VAE's conv
    wrapper counts as its conv, a VAE resampler as the 2-D conv it runs on the frames): whether tconv3d runs it
    and if not why, its calls, the aten convolutions among them, the tconv3d calls whose input arrived not
    channels_last_3d (each pays a layout copy inside the op), the pad and concatenation copies its own forward
    made of its input (convert takes these into the op), those model code made before calling it, and those
    tconv3d's converted layer wrote itself ("own"); plus the run's totals. Prints the table unless verbose=False."""
    report = Audit()
    stack: list[LayerAudit] = []
    handles, patched = [], []
    for name, watched, conv in _layers(model):
        converted = is_converted(watched)
        reason = None
        if not converted:
            adapter = KNOWN_CLASSES.get(class_name(type(watched)))
            reason = adapter_reason(adapter, watched) if adapter else unsupported_reason(conv, "skip")
            reason = reason or "not converted (tconv3d.nn.convert would take it over)"
        layer = LayerAudit(name or type(watched).__name__, type(watched).__name__, converted, reason)
        report.layers.append(layer)
        handles.append(watched.register_forward_pre_hook(observer(functools.partial(_enter, stack, layer))))
        handles.append(watched.register_forward_hook(observer(functools.partial(_leave, stack))))
        if isinstance(watched, Conv3d):  # an adapter may call its op directly, past the module's hooks
            watched.convolve = functools.partial(_convolve_in, stack, layer, watched.convolve)
            patched.append(watched)
    watcher = _Watcher(report, stack)
    COPY_OBSERVERS.append(watcher.copied)  # the copies tconv3d's own modules make, by views the watcher sees apart
    try:
        with torch.no_grad(), _CallerKeys(watcher), watcher:
            if run is None:
                model(*example_args, **example_kwargs)
            else:
                run(model, *example_args, **example_kwargs)
    finally:
        COPY_OBSERVERS.remove(watcher.copied)
        for handle in handles:
            handle.remove()
        for watched in patched:
            del watched.convolve
    if verbose:
        print(report.table())
    return report
