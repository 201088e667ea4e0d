"""The eager host path (issue 19): the eager callers' shortcut around the dispatcher computes what the op does
and steps aside whenever something may intercept ops; the memoised checks never accept what a fresh check
rejects; the TMA descriptor memo checks what it skips and keeps no tensor alive."""

import gc
import sys
import weakref

import pytest
import torch
from helpers import OpNames

import tconv3d
from tconv3d import geometry
from tconv3d.geometry import check_conv3d, check_input_grad
from tconv3d.kernels import utils as kernel_utils

CL = torch.channels_last_3d
ARGS = ([1, 1, 1], [1, 0, 1, 1, 0, 1], [1, 1, 1])  # stride, 6-value padding, dilation


@pytest.fixture(autouse=True)
def room_in_the_memos():
    """The memoised checks remember up to geometry._MAX_CHECKED problems a process, then check afresh: a worker
    that ran other test files first (the integration tests' models) may have filled them."""
    geometry._checked.clear()
    geometry._resolved.clear()


def layer_and_input(device, requires_grad):
    layer = tconv3d.nn.Conv3d(3, 4, 3, padding=(1, 0, 1)).to(device)
    x = torch.randn(2, 3, 4, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_(requires_grad)
    return layer, x


@pytest.mark.parametrize("requires_grad", [False, True])
def test_eager_shortcut_computes_what_the_op_computes(requires_grad, device):
    layer, x = layer_and_input(device, requires_grad)
    padding = layer._op_padding()
    args = (x, layer.weight, layer.bias, list(layer.stride), list(padding), list(layer.dilation), 1, "zeros", None)
    shortcut = layer(x)
    dispatched = torch.ops.tconv3d.conv3d(*args)
    assert shortcut.is_contiguous(memory_format=CL)
    assert torch.equal(shortcut, dispatched)
    if requires_grad:
        grad = torch.randn_like(shortcut)
        via_shortcut = torch.autograd.grad(shortcut, (x, layer.weight, layer.bias), grad)
        via_op = torch.autograd.grad(dispatched, (x, layer.weight, layer.bias), grad)
        for ours, op in zip(via_shortcut, via_op, strict=True):
            assert torch.equal(ours, op)
        assert via_shortcut[1].stride() == layer.weight.stride()


def test_interceptors_see_the_op(device):
    """A dispatch mode, the profiler and autocast each see torch.ops.tconv3d.conv3d, as without the shortcut."""
    layer, x = layer_and_input(device, requires_grad=True)
    with OpNames() as mode:
        layer(x)
    assert "tconv3d.conv3d.default" in mode.names
    with torch.autograd.profiler.profile() as profile:
        layer(x)
    assert any(event.name == "tconv3d::conv3d" for event in profile.function_events)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16


def test_plain_backward_runs_no_op_through_the_dispatcher(device, monkeypatch):
    """The backward computes its gradients through the eager callers, as the forward does: under a plain backward
    no torch.ops call (its dispatcher layers cost ~40 us a gradient, bench/NOTES.md); under a dispatch mode the
    gradient ops are seen, and with create_graph the result is differentiable again."""
    layer, x = layer_and_input(device, requires_grad=True)
    y = layer(x)
    grad = torch.randn_like(y)
    expected = torch.autograd.grad(y, (x, layer.weight), grad, retain_graph=True)

    def refuse(*args, **kwargs):
        raise AssertionError("the backward went through torch.ops")

    with monkeypatch.context() as patch:
        for name in ("conv3d", "conv3d_input_grad", "conv3d_weight_grad"):
            patch.setattr(torch.ops.tconv3d, name, refuse)
        ours = torch.autograd.grad(y, (x, layer.weight), grad, retain_graph=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, expected, strict=True))
    with OpNames() as mode:
        torch.autograd.grad(y, (x, layer.weight), grad, retain_graph=True)
    assert {"tconv3d.conv3d_input_grad.default", "tconv3d.conv3d_weight_grad.default"} <= set(mode.names)
    (gx,) = torch.autograd.grad(y, x, grad, create_graph=True)
    assert gx.requires_grad  # recorded: double backward goes on


NORMS = {
    "group_norm": lambda x: tconv3d.nn.GroupNorm(2, 8, activation="silu")(x),
    "batch_norm": lambda x: tconv3d.nn.BatchNorm3d(8, activation="relu")(x),
    "rms_norm": lambda x: tconv3d.ops.call_rms_norm(x, torch.rand(8) + 0.5, torch.randn(8), 1e-6, "silu"),
}


@pytest.mark.parametrize("norm", NORMS)
def test_a_plain_norm_backward_runs_no_op_through_the_dispatcher(norm, monkeypatch):
    """A norm's backward calls its backward op's implementation itself where nothing intercepts, as a convolution's
    does (the dispatcher and the dynamo-disable wrapper: ~6 us a backward): the same gradients as through
    torch.ops; a dispatch mode sees the op, and with create_graph the result is differentiable again."""
    x = torch.randn(2, 8, 3, 4, 5).contiguous(memory_format=CL).requires_grad_()
    torch.manual_seed(0)
    y = NORMS[norm](x)
    grad = torch.randn_like(y)
    expected = torch.autograd.grad(y, x, grad, retain_graph=True)

    def refuse(*args, **kwargs):
        raise AssertionError("the backward went through torch.ops")

    name = "rms_norm_backward" if norm == "rms_norm" else "group_norm_backward"
    with monkeypatch.context() as patch:
        patch.setattr(torch.ops.tconv3d, name, refuse)
        (ours,) = torch.autograd.grad(y, x, grad, retain_graph=True)
    assert torch.equal(ours, expected[0])
    with OpNames() as mode:
        torch.autograd.grad(y, x, grad, retain_graph=True)
    assert f"tconv3d.{name}.default" in mode.names
    (gx,) = torch.autograd.grad(y, x, grad, create_graph=True)
    assert gx.requires_grad


def python_calls(run) -> list[str]:
    """The names of the Python functions run() calls, in order (sys.setprofile: not torch's profiler, which
    would count as something intercepting ops)."""
    names = []
    sys.setprofile(lambda frame, event, arg: names.append(frame.f_code.co_name) if event == "call" else None)
    try:
        run()
    finally:
        sys.setprofile(None)
    return names


@pytest.mark.parametrize("op", ["conv3d", "conv3d_input_grad", "group_norm"])
def test_an_op_called_with_plain_tensors_is_dispatched_once(op, device):
    """torch.ops.tconv3d.* called with plain tensors and nothing intercepting (what Inductor's generated code calls,
    AOTAutograd having taken the gradients): its autograd kernel runs the implementation itself, not the op again
    below autograd (a second trip through the dispatcher: ~6 us a call on the host), with the same result bit for
    bit; a dispatch mode still sees the op dispatched below autograd."""
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 4, 5, device=device).contiguous(memory_format=CL)
    w = torch.randn(8, 8, 3, 3, 3, device=device).contiguous(memory_format=CL)
    g = torch.randn(2, 8, 2, 4, 4, device=device).contiguous(memory_format=CL)  # the output's gradient (ARGS)
    calls = {
        "conv3d": lambda: torch.ops.tconv3d.conv3d(x, w, None, *ARGS, 1, "zeros"),
        "conv3d_input_grad": lambda: torch.ops.tconv3d.conv3d_input_grad(g, w, [2, 8, 3, 4, 5], *ARGS, "zeros"),
        "group_norm": lambda: torch.ops.tconv3d.group_norm(x, w[:, 0, 0, 0, 0], None, 4, 1e-5)[0],
    }
    with torch.no_grad():
        names = python_calls(calls[op])
        assert "below_autograd" not in names and op in names, names
        with OpNames() as mode:
            names = python_calls(calls[op])
            dispatched = calls[op]()
        assert "below_autograd" in names and f"tconv3d.{op}.default" in mode.names
        assert torch.equal(calls[op](), dispatched)


@pytest.mark.parametrize("second", ["frames_before", "channels_after"])
def test_a_backward_is_one_call_computing_what_the_ops_do(second, device, monkeypatch):
    """A plain backward computes the gradients it needs (the input's, the weight's, the bias's) in one call
    (ops._gradients: one plan on a GPU): the input's and weight's bit for bit what the gradient ops compute, a second
    source's split from the input's as before, the bias's torch's sum in fp32 (in another order: within fp32's
    rounding); a weight gradient alone is such a call too; a dispatch mode and create_graph take the ops."""
    from tconv3d import ops

    calls = []
    gradients = ops._gradients
    record = lambda ctx, needs, *args: calls.append(needs) or gradients(ctx, needs, *args)  # noqa: E731
    monkeypatch.setattr(ops, "_gradients", record)
    x = torch.randn(2, 8, 4, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_()
    shape = (2, 8, 2, 5, 6) if second == "frames_before" else (2, 4, 4, 5, 6)
    other = torch.randn(*shape, device=device).contiguous(memory_format=CL).requires_grad_()
    cin = 12 if second == "channels_after" else 8
    w = torch.randn(6, cin, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()
    b = torch.randn(6, device=device, requires_grad=True)
    padding = [0, 1, 1, 1, 1, 1]
    y = tconv3d.conv3d(x, w, b, 1, padding, **{second: other})
    grad = torch.randn_like(y)
    ours = torch.autograd.grad(y, (x, other, w, b), grad, retain_graph=True)
    assert calls == [(True, True, True)]
    before, after = (other, None) if second == "frames_before" else (None, other)
    concat = torch.ops.tconv3d.conv3d_input_grad(grad, w, [2, cin, 4 + 2 * (before is not None), 5, 6], [1] * 3,
                                                 padding, [1] * 3)  # fmt: skip
    weight = torch.ops.tconv3d.conv3d_weight_grad(grad, x, list(w.shape), [1] * 3, padding, [1] * 3, "zeros", before,
                                                  1, after)  # fmt: skip
    if before is not None:
        expected = (concat[:, :, 2:], concat[:, :, :2], weight)
    else:
        expected = (concat[:, :8], concat[:, 8:], weight)
    for got, want in zip(ours[:3], expected, strict=True):
        assert got.shape == want.shape and torch.equal(got, want)
    bias = grad.double().sum(dim=(0, 2, 3, 4))
    assert ours[3].dtype == b.dtype and torch.allclose(ours[3].double(), bias, rtol=1e-5, atol=1e-5)
    calls.clear()
    alone = tconv3d.conv3d(x.detach(), w, None, 1, padding, **{second: other.detach()})  # the weight's alone
    torch.autograd.grad(alone, w, grad)
    assert calls == [(False, True, False)]
    torch.autograd.grad(y, (x, w), grad, retain_graph=True, create_graph=True)  # recorded: the ops' Functions
    with OpNames() as mode:
        torch.autograd.grad(y, (x, w), grad, retain_graph=True)
    assert calls == [(False, True, False)] and "tconv3d.conv3d_weight_grad.default" in mode.names


def test_a_layers_repeated_steps_check_nothing_afresh(device, monkeypatch):
    """Every check of a layer's forward and backward is remembered after its first step: the gradient checks
    take a tensor's shape (a torch.Size) as one of their sizes, and that is a key too."""
    layer, x = layer_and_input(device, requires_grad=True)
    torch.autograd.grad(layer(x).sum(), (x, layer.weight))
    fresh = []
    conv_geometry = geometry.conv_geometry
    monkeypatch.setattr(
        geometry, "conv_geometry", lambda *args, **kwargs: fresh.append(args) or conv_geometry(*args, **kwargs)
    )
    torch.autograd.grad(layer(x).sum(), (x, layer.weight))
    assert fresh == []


def test_memoised_check_rejects_what_a_fresh_check_rejects(device):
    """1.0 and True equal 1 as dict keys: after a problem passed with ints, the same problem with a float or a
    bool where an int belongs must still be rejected, and a wrong bias shape must not ride on a good call."""
    x = torch.randn(1, 3, 4, 5, 6, device=device).contiguous(memory_format=CL)
    w = torch.randn(4, 3, 3, 3, 3, device=device).contiguous(memory_format=CL)
    b = torch.randn(4, device=device)
    good = check_conv3d(x, w, b, *ARGS, 1)
    assert check_conv3d(x, w, b, *ARGS, 1) is good  # remembered
    with pytest.raises(TypeError, match="stride"):
        check_conv3d(x, w, b, [1.0, 1, 1], *ARGS[1:], 1)
    with pytest.raises(TypeError, match="groups"):
        check_conv3d(x, w, b, *ARGS, True)
    with pytest.raises(ValueError, match="bias"):
        check_conv3d(x, w, torch.randn(3, device=device), *ARGS, 1)
    with pytest.raises(TypeError, match="dtype"):
        check_conv3d(x, w.double(), b, *ARGS, 1)
    grad_out = torch.randn(good.output_shape(), device=device).contiguous(memory_format=CL)
    size = list(x.shape)
    assert check_input_grad(grad_out, w, size, *ARGS, "zeros", 1) == good
    with pytest.raises(ValueError, match="grad_output"):
        check_input_grad(grad_out[:, :, 1:], w, size, *ARGS, "zeros", 1)


def test_memo_holds_only_plain_problems(device, monkeypatch):
    monkeypatch.setattr(geometry, "_checked", {})
    x = torch.randn(1, 3, 4, 5, 6, device=device)
    w = torch.randn(4, 3, 3, 3, 3, device=device)
    check_conv3d(x, w, None, 1, 1, 1, 1)  # ints where sequences go: checked, not remembered
    assert not geometry._checked
    check_conv3d(x, w, None, *ARGS, 1)
    assert len(geometry._checked) == 1
    (key,) = geometry._checked
    assert not any(isinstance(part, torch.Tensor) for part in key)  # shapes, dtypes and devices, no tensor


def test_cached_geometry_values_leave_equality_and_hash_alone():
    first = geometry.conv_geometry((1, 3, 4, 5, 6), (4, 3, 3, 3, 3), (1, 1, 1), (1,) * 6, (1, 1, 1))
    second = geometry.conv_geometry((1, 3, 4, 5, 6), (4, 3, 3, 3, 3), (1, 1, 1), (1,) * 6, (1, 1, 1))
    assert first.output_voxels == 1 * 4 * 5 * 6 and first.pad_mode_indices == (0, 0, 0)
    assert first == second and hash(first) == hash(second)


def test_descriptor_memo_checks_alignment_and_keeps_no_tensor(monkeypatch):
    monkeypatch.setattr(kernel_utils, "_descriptors", {})
    t = torch.randn(1, 32, 2, 4, 8).contiguous(memory_format=CL)
    alive = weakref.ref(t)
    first = kernel_utils.ndhwc_descriptor(t, (1, 1, 2, 8, 16))
    # N has size 1: it gets the packed stride, the D dimension's extent (2 x 1024)
    fresh = kernel_utils.TensorDescriptor(t, [1, 2, 4, 8, 32], [2048, 1024, 256, 32, 1], [1, 1, 2, 8, 16])
    assert first.base is t
    assert (first.shape, first.strides, first.block_shape) == (fresh.shape, fresh.strides, fresh.block_shape)
    other = torch.randn(1, 32, 2, 4, 8).contiguous(memory_format=CL)
    assert kernel_utils.ndhwc_descriptor(other, (1, 1, 2, 8, 16)).base is other
    del t, first, fresh
    gc.collect()
    assert alive() is None
    storage = torch.randn(1 + 32 * 2 * 4 * 8)
    misaligned = storage[1:].view(1, 2, 4, 8, 32).permute(0, 4, 1, 2, 3)  # 4 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16-byte"):
        kernel_utils.ndhwc_descriptor(misaligned, (1, 1, 2, 8, 16))
