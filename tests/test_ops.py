"""The torch.library ops: opcheck, fake strides, and the aten path CPU tensors take without the interpreter."""

import copy

import pytest
import torch
from helpers import CASES, case_reference, leaf_copy

import tconv3d
from tconv3d import settings
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
CONV_ARGS = ([1, 2, 1], [1, 0, 1, 1, 0, 2], [1, 1, 2])  # stride, 6-value padding, dilation


def small_problem(device, requires_grad=True):
    x = torch.randn(1, 3, 4, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_(requires_grad)
    w = torch.randn(2, 3, 2, 2, 3, device=device).contiguous(memory_format=CL).requires_grad_(requires_grad)
    b = torch.randn(2, device=device).requires_grad_(requires_grad)
    return x, w, b


def test_opcheck_conv3d(device):
    x, w, b = small_problem(device)
    torch.library.opcheck(torch.ops.tconv3d.conv3d.default, (x, w, b, *CONV_ARGS, 1))
    torch.library.opcheck(
        torch.ops.tconv3d.conv3d.default, (x.detach(), w.detach(), None, [1, 1, 1], [1, 1, 1], [1] * 3, 1)
    )


def test_opcheck_gradient_ops(device):
    x, w, _ = small_problem(device)
    y = torch.ops.tconv3d.conv3d(x.detach(), w.detach(), None, *CONV_ARGS, 1)
    grad_out = torch.randn_like(y).requires_grad_()
    torch.library.opcheck(torch.ops.tconv3d.conv3d_input_grad.default, (grad_out, w, list(x.shape), *CONV_ARGS))
    bias = torch.randn(x.shape[1], device=device).requires_grad_()  # conv_transpose3d's, one per input channel
    torch.library.opcheck(
        torch.ops.tconv3d.conv3d_input_grad.default, (grad_out, w, list(x.shape), *CONV_ARGS, "zeros", 1, None, bias)
    )
    torch.library.opcheck(torch.ops.tconv3d.conv3d_weight_grad.default, (grad_out, x, list(w.shape), *CONV_ARGS))


def test_fake_outputs_are_channels_last():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(2, 3, 8, 9, 10).contiguous(memory_format=CL)
        w = torch.empty(5, 3, 3, 3, 3)
        y = torch.ops.tconv3d.conv3d(x, w, None, [1, 1, 1], [2, 0, 1, 1, 1, 1], [1, 1, 1], 1)
        assert y.shape == (2, 5, 8, 9, 10) and y.is_contiguous(memory_format=CL)
        gi = torch.ops.tconv3d.conv3d_input_grad(y, w, list(x.shape), [1, 1, 1], [2, 0, 1, 1, 1, 1], [1, 1, 1])
        assert gi.shape == x.shape and gi.is_contiguous(memory_format=CL)
        gw = torch.ops.tconv3d.conv3d_weight_grad(y, x, list(w.shape), [1, 1, 1], [2, 0, 1, 1, 1, 1], [1, 1, 1])
        assert gw.shape == w.shape and gw.is_contiguous(memory_format=CL)


def _strides(out) -> list:
    """Each tensor's strides in an op's output (a tensor or a tuple); None for a tensor of no element (any strides
    address it) or an absent one."""
    outs = out if isinstance(out, tuple) else (out,)
    return [t.stride() if isinstance(t, torch.Tensor) and t.numel() else None for t in outs]


# (batch, channels in, channels out, D, H, W): a dimension of one somewhere in the input or the output
ONE_SIZED = [(2, 1, 1, 4, 4, 2), (1, 4, 1, 3, 4, 5), (2, 3, 4, 1, 4, 4), (1, 3, 2, 1, 1, 1), (1, 1, 3, 2, 1, 3)]


@pytest.mark.parametrize("backend", ["aten", "triton"])
@pytest.mark.parametrize("shape", ONE_SIZED, ids=lambda s: "x".join(map(str, s)))
def test_outputs_have_their_fakes_strides(shape, backend, monkeypatch):
    """Every op's outputs have the strides its fake answers, those of dimensions of one too: torch.cat lays out a
    concatenation of one-channel tensors channels_last_3d or NCDHW by their channel stride, and a compiled graph,
    traced on the fakes, views the real one by what the fakes said. torch's one-channel convolution output is NCDHW,
    which the aten path answered as it was until 2026-12-06 (MONAI AHNet compiled, in training: 'view size is not
    compatible' at its BatchNorm's folded batch, behind its pyramid's concatenation of one-channel branches)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(settings, "CPU_BACKEND", backend)
    n, cin, cout, d, h, w = shape
    x = torch.randn(n, cin, d, h, w).contiguous(memory_format=CL)
    # the aten path's outputs as torch's convolutions answer them: an NCDHW input of one channel, an NCDHW gradient
    x_plain = torch.randn(n, cin, d, h, w)
    wt = torch.randn(cout, cin, 3, 1, 3).contiguous(memory_format=CL)
    conv = ([1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 1])
    y = torch.ops.tconv3d.conv3d(x, wt, None, *conv, 1)
    calls = {
        "conv3d": (torch.ops.tconv3d.conv3d, (x, wt, torch.randn(cout), *conv, 1)),
        "conv3d of an NCDHW input": (torch.ops.tconv3d.conv3d, (x_plain, wt, None, *conv, 1)),
        "input_grad": (torch.ops.tconv3d.conv3d_input_grad, (torch.randn_like(y), wt, list(x.shape), *conv)),
        "input_grad of NCDHW": (torch.ops.tconv3d.conv3d_input_grad, (torch.randn(y.shape), wt, list(x.shape), *conv)),
        "input_grad, circular": (
            torch.ops.tconv3d.conv3d_input_grad,
            (torch.randn_like(y), wt, list(x.shape), *conv, "circular"),
        ),  # its border fold
        "weight_grad": (torch.ops.tconv3d.conv3d_weight_grad, (torch.randn_like(y), x, list(wt.shape), *conv)),
        "group_norm": (torch.ops.tconv3d.group_norm, (x_plain, None, None, 1, 1e-5)),
        "rms_norm": (torch.ops.tconv3d.rms_norm, (x_plain, None, None, 1e-6)),
        "upsample_linear": (torch.ops.tconv3d.upsample_linear, (x_plain, [2, 1, 2])),
    }
    for name, (op, args) in calls.items():
        real = op(*args)
        mode = FakeTensorMode()
        with mode:
            fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
        assert _strides(real) == _strides(fake), name
    # BatchNorm3d in training (its batch folded into the frames): eager torch and the fakes viewed a clip of one
    # channel back with other channel strides
    if n * d * h * w == 1:
        return  # one value a channel: refused in training
    norm = tconv3d.nn.convert(torch.nn.Sequential(torch.nn.BatchNorm3d(cin))).train()
    real = norm(x_plain)
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the parameters as they are
    with mode:
        fake = norm(mode.from_tensor(x_plain))
    assert _strides(real) == _strides(fake), "BatchNorm3d"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the aten path is what CPU tensors take without the interpreter")
def test_cpu_aten_path_matches_reference(monkeypatch):
    """Without TRITON_INTERPRET, CPU tensors run torch's conv3d: same results, same layouts, any padding."""
    monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
    launched = []
    for launcher in ("conv3d_fwd", "conv3d_dgrad", "conv3d_wgrad"):
        monkeypatch.setattr(tconv3d.ops, launcher, lambda *a, name=launcher: launched.append(name))
    case = CASES[-1]  # asymmetric padding, stride and dilation
    x, w, b = (leaf_copy(t) for t in (case.input(torch.float32, "cpu"), case.weight(torch.float32, "cpu"),
                                       case.bias(torch.float32, "cpu")))  # fmt: skip
    x64, w64, b64 = (leaf_copy(t.double()) for t in (x, w, b))
    ref = case_reference(x64, w64, b64, case)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y = tconv3d.conv3d(x, w, b, case.stride, case.padding, case.dilation)
    y.backward(grad_out.float())
    assert launched == []
    assert y.is_contiguous(memory_format=CL)
    assert rel_l2(y, ref) < TOLERANCE[torch.float32]
    for ours, expected in ((x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, expected) < TOLERANCE[torch.float32]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the aten path is what CPU tensors take without the interpreter")
@pytest.mark.parametrize("padding", [0, (1, 0, 0)], ids=["no_padding", "padding_in_d_batch_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_aten_input_grad_is_a_fresh_tensor(padding, dtype, monkeypatch):
    """The aten path's input gradient trims the zeros border with narrow: where that leaves a contiguous view (no
    border at all, or a border only along D with a batch of one), the op must still return a tensor of its own.
    A view made a converted UNet's ConvTranspose3d raise (its bias was added in place then, the op's gradient
    recorded; now the op adds it, and an in-place activation after it would raise the same way)."""
    monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
    x = torch.randn(1, 6, 3, 4, 5).to(dtype).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(6, 4, 2, 2, 2).to(dtype).contiguous(memory_format=CL).requires_grad_()  # as tconv3d.nn keeps it
    b = torch.randn(4).to(dtype).requires_grad_()
    y = tconv3d.conv_transpose3d(x, w, b, stride=2, padding=padding)
    x64, w64, b64 = (t.detach().double() for t in (x, w, b))
    ref = torch.nn.functional.conv_transpose3d(x64, w64, b64, 2, padding)
    assert rel_l2(y, ref) < TOLERANCE[dtype]
    y.square().sum().backward()
    assert x.grad is not None and w.grad is not None and b.grad is not None
    geom = tconv3d.geometry.conv_geometry((1, 4, 6, 8, 10), (6, 4, 2, 2, 2), 2, 0, 1)
    grad_out = torch.randn(1, 6, 3, 4, 5).to(dtype).contiguous(memory_format=CL)
    grad = tconv3d.kernels.aten.conv3d_dgrad(grad_out, w.detach(), geom)
    assert grad._base is None and grad.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("input_grad", [True, False], ids=["input_grad", "no_input_grad"])
def test_flop_counter_counts_the_convolutions_as_stocks(input_grad, device):
    """torch.utils.flop_counter.FlopCounterMode (MFU's bookkeeping) counts a converted model's convolutions, their
    input and weight gradients included, as it counts stock's aten.convolution and its backward: the same FLOPs a
    module for a plain, a strided (1, 3, 3) and a transposed convolution, with the input's gradient asked for or
    not (the first layer's input gradient then not run). A grouped replicate-bordered one counts its forward's
    three times, where stock's counter counts its weight gradient `groups` times over (docs/upstream.md)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    stock = torch.nn.Sequential(
        torch.nn.Conv3d(3, 8, 3, padding=1),
        torch.nn.Conv3d(8, 8, 3, padding=1, groups=4, padding_mode="replicate"),
        torch.nn.ConvTranspose3d(8, 4, 2, stride=2),
        torch.nn.Conv3d(4, 2, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), bias=False),
    ).to(device)
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    assert all(type(m).__module__.startswith("tconv3d") for m in converted)
    x = torch.randn(2, 3, 3, 6, 5, device=device).contiguous(memory_format=CL).requires_grad_(input_grad)

    def flops(model, backward=True):
        counter = FlopCounterMode(display=False)
        with counter:
            y = model(x)
            if backward:
                y.sum().backward()
        return {module: sum(by_op.values()) for module, by_op in counter.get_flop_counts().items()}

    stocks, ours, grouped = flops(stock), flops(converted), "Sequential.1"
    forward = flops(stock, backward=False)[grouped]
    assert ours[grouped] == 3 * forward > 0  # the forward, the input gradient and the weight gradient
    assert stocks[grouped] == 6 * forward  # stock's: the weight gradient 4 times (its groups)
    excess = stocks[grouped] - ours[grouped]
    assert ours.keys() == stocks.keys()
    for module, count in stocks.items():
        assert ours[module] == (count - excess if module in ("Global", "Sequential", grouped) else count), module
