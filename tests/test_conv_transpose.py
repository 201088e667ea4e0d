"""ConvTranspose3d on NDHWC: tconv3d.conv_transpose3d (the input-gradient op run forward) and
tconv3d.nn.ConvTranspose3d, against float64 F.conv_transpose3d, gradients included; errors; convert."""

import pytest
import torch
import torch.nn.functional as F
from helpers import OpNames, dtype_id, leaf_copy
from torch import nn

import tconv3d
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
# (name, input shape, Cout, kernel, stride, padding, output_padding, dilation)
CASES = [
    ("stride_1", (1, 4, 3, 4, 5), 6, 3, 1, 1, 0, 1),
    ("stride_2_output_padding", (2, 5, 3, 3, 4), 3, 3, 2, 1, 1, 1),
    ("stride_122", (1, 4, 2, 3, 4), 4, (3, 2, 2), (1, 2, 2), (1, 0, 0), (0, 1, 1), 1),
    ("upsample_2x2x2", (1, 20, 2, 3, 3), 6, 2, 2, 0, 0, 1),
    ("dilation_2", (1, 3, 3, 4, 4), 5, 3, 1, 2, 0, 2),
    # output_padding of a stride or more, which a larger dilation allows: outputs no input voxel writes, and the
    # convolution it transposes has more outputs than the input has voxels (found by tests/fuzz.py)
    ("output_padding_past_stride", (1, 4, 3, 4, 3), 5, (2, 3, 2), (1, 2, 1), (0, 1, 1), (1, 2, 1), (2, 3, 2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_conv_transpose3d_matches_float64(case, dtype, device):
    _name, shape, cout, kernel, stride, padding, output_padding, dilation = case
    k = (kernel,) * 3 if isinstance(kernel, int) else kernel
    x = leaf_copy(torch.randn(shape, device=device).to(dtype).contiguous(memory_format=CL))
    w = leaf_copy((torch.randn(shape[1], cout, *k, device=device) / shape[1] ** 0.5).to(dtype))
    b = leaf_copy(torch.randn(cout, device=device).to(dtype))
    x64, w64, b64 = (leaf_copy(t.detach().double()) for t in (x, w, b))
    expected = F.conv_transpose3d(x64, w64, b64, stride, padding, output_padding, 1, dilation)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y = tconv3d.conv_transpose3d(x, w, b, stride, padding, output_padding, 1, dilation)
    y.backward(grad_out.to(dtype))
    assert y.shape == expected.shape and y.is_contiguous(memory_format=CL)
    for ours, ref in ((y, expected), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("weight_shape", "groups", "launcher"),
    [((12, 6, 2, 2, 2), 1, "_launch_pointer_kernel"), ((8, 1, 3, 3, 3), 4, "depthwise_dgrad")],
    ids=["implicit_gemm", "depthwise"],
)
def test_the_bias_is_added_by_the_kernels(weight_shape, groups, launcher, device, monkeypatch):
    """conv_transpose3d is one input-gradient op, its bias added in the kernel's epilogue (the implicit-GEMM
    kernel's; the depthwise direct kernel's, a transposed convolution of one output channel a group): no add over
    the output after it. The values, and the bias's gradient (summed by the op's backward), against float64."""
    from tconv3d.kernels import conv_dgrad

    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    monkeypatch.setattr(tconv3d.settings, "KERNELS", "pointer")
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    biases = []
    real = getattr(conv_dgrad, launcher)
    bias_at = 3 if launcher == "_launch_pointer_kernel" else 2  # the launchers' bias argument
    monkeypatch.setattr(conv_dgrad, launcher, lambda *a, **k: biases.append(a[bias_at]) or real(*a, **k))
    x = leaf_copy(torch.randn(2, weight_shape[0], 2, 3, 3, device=device).contiguous(memory_format=CL))
    w = leaf_copy(torch.randn(weight_shape, device=device).contiguous(memory_format=CL) / 3)
    b = leaf_copy(torch.randn(weight_shape[1] * groups, device=device))
    with OpNames() as ops:  # at the top level: an op's own implementation runs beneath, unseen
        y = tconv3d.conv_transpose3d(x, w, b, stride=2, padding=1, output_padding=1, groups=groups)
    assert ops.names == ["tconv3d.conv3d_input_grad.default"]
    assert len(biases) == 1 and torch.equal(biases[0], b.detach())
    x64, w64, b64 = (leaf_copy(t.detach().double()) for t in (x, w, b))
    expected = F.conv_transpose3d(x64, w64, b64, 2, 1, 1, groups)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y.backward(grad_out.float())
    for ours, ref in ((y, expected), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, ref) < TOLERANCE[torch.float32]


@pytest.fixture(params=["triton", "aten"])
def backend(request, device, monkeypatch):
    """The kernels (the interpreter's on CPU) or the aten path (CPU tensors, aten inside the ops)."""
    if request.param == "triton" and tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    if request.param == "aten":
        if device != "cpu":
            pytest.skip("the aten path is CPU tensors'")
        monkeypatch.setattr(tconv3d.settings, "CPU_BACKEND", "aten")
    return request.param


def test_a_16_bit_transposed_conv_rounds_once_with_its_bias(backend, device):
    """bf16: the bias is added to the float32 sum and the result rounded once, on the kernels and on the aten path
    (the aten path rounded the sum, then added the bias: a sum within half a rounding of -bias landed on exactly 0,
    and a norm over one channel behind it, Wan's test config's, took a gradient of 1e12 there). Here the sum is
    -0.25 + 2^-14 (bf16 rounds it to -0.25) and the bias 0.25: 2^-14 once, 0 twice."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    x = torch.tensor([1.0, 2.0**-7], **bf16).view(1, 2, 1, 1, 1)
    w = torch.tensor([-0.25, 2.0**-7], **bf16).view(2, 1, 1, 1, 1)
    y = tconv3d.conv_transpose3d(x, w, torch.tensor([0.25], **bf16))
    assert y.item() == 2.0**-14


def test_input_gradient_op_bias_with_a_padding_mode(backend, device):
    """The op's bias where its input gradient folds a border (replicate, reflect: each border voxel's gradient
    summed onto the voxel it read): added once per voxel, after the fold; on the kernels and on the aten path."""
    x = torch.randn(1, 3, 3, 4, 5, device=device, dtype=torch.float64)
    w = torch.randn(6, 3, 3, 3, 2, device=device, dtype=torch.float64) / 4
    b = torch.randn(3, device=device, dtype=torch.float64)
    x64 = x.clone().requires_grad_()
    padded = F.pad(F.pad(x64, (1, 0, 1, 1, 0, 0), mode="replicate"), (0, 0, 0, 0, 1, 1), mode="reflect")
    y = F.conv3d(padded, w)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    args = ([1, 1, 1], [1, 1, 1, 1, 1, 0], [1, 1, 1], "reflect,replicate,replicate", 1, None)
    grad_out, w = (t.float().contiguous(memory_format=CL) for t in (grad_out, w))
    got = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), *args, b.float())
    assert rel_l2(got, x64.grad + b.view(1, -1, 1, 1, 1)) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\), one per input channel"):
        torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), *args, torch.zeros(6, device=device))
    with pytest.raises(TypeError, match=r"bias dtype torch\.float16"):
        torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), *args, b.half())


@pytest.mark.parametrize("mode", ["replicate", "zeros"])
def test_a_16_bit_input_gradient_op_rounds_once_with_its_bias_at_any_border(mode, backend, device):
    """bf16, the op's bias where its input gradient folds a border (replicate along D, 1 on each side: x[0] reads
    grad_out[0] and [1], x[1] grad_out[2]) or drops one (zeros, 2 in front only: the aten path's padded gradient;
    x[0] reads grad_out[2], x[1] grad_out[3]): the bias is added with the sum and rounded once, at a voxel no border
    reads (x[1]) and at x[0] (replicate: the border's gradient folded onto it, the fold taking the border's copy of
    the bias off in float32). Each voxel's sum is -0.25 + 2^-14 (bf16 rounds it to -0.25), the bias 0.25: 2^-14
    once, 0 twice."""
    bf16 = dict(device=device, dtype=torch.bfloat16)
    w = torch.tensor([-0.25, 2.0**-7], **bf16).view(2, 1, 1, 1, 1)
    grad_out = torch.zeros(1, 2, 5, 1, 1, **bf16)
    read = (0, 2) if mode == "replicate" else (2, 3)  # x[0]'s border (its own grad_out[1] stays 0) or x[0]; x[1]
    grad_out[0, :, read, 0, 0] = torch.tensor([1.0, 2.0**-7], **bf16)[:, None]
    padding = [1, 1, 0, 0, 0, 0] if mode == "replicate" else [2, 0, 0, 0, 0, 0]
    args = ([1, 1, 1], padding, [1, 1, 1], "replicate,zeros,zeros" if mode == "replicate" else "zeros", 1, None)
    grad_out, w = (t.contiguous(memory_format=CL) for t in (grad_out, w))
    got = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, [1, 1, 3, 1, 1], *args, torch.tensor([0.25], **bf16))
    assert got[0, 0, :2, 0, 0].tolist() == [2.0**-14] * 2, got.flatten().tolist()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"output_padding": 2, "stride": 2}, ValueError, "output_padding"),
        ({"groups": 3}, ValueError, "groups=3 must divide"),
        ({"groups": 0}, ValueError, "positive"),
        ({"padding": -1}, ValueError, "non-negative"),
        ({"padding": 5}, ValueError, "not positive"),
    ],
)
def test_bad_conv_transpose_arguments(kwargs, error, message):
    x, w = torch.randn(1, 4, 2, 3, 3), torch.randn(4, 2, 3, 3, 3)
    with pytest.raises(error, match=message):
        tconv3d.conv_transpose3d(x, w, **kwargs)
    with pytest.raises(ValueError, match="channel mismatch"):
        tconv3d.conv_transpose3d(torch.randn(1, 3, 2, 3, 3), w)


def test_module_is_a_drop_in_with_output_size(device):
    torch.manual_seed(0)
    stock = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1).to(device)
    ours = tconv3d.nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1).to(device)
    ours.load_state_dict(stock.state_dict())
    assert ours.weight.is_contiguous(memory_format=CL)
    x = torch.randn(1, 4, 3, 4, 5, device=device)
    for output_size in (None, (6, 8, 10)):
        expected = stock(x, output_size=output_size)
        y = ours(x, output_size=output_size)
        assert y.shape == expected.shape and rel_l2(y, expected) < TOLERANCE[torch.float32]


def test_convert_swaps_conv_transpose(device):
    model = nn.Sequential(nn.ConvTranspose3d(4, 4, 2, stride=2), nn.ConvTranspose3d(4, 4, 2, stride=2, groups=2))
    model = model.to(device)
    x = torch.randn(1, 4, 2, 3, 3, device=device)
    expected = model(x).detach()
    tconv3d.nn.convert(model)
    assert type(model[0]) is type(model[1]) is tconv3d.nn.ConvTranspose3d
    assert rel_l2(model(x), expected) < TOLERANCE[torch.float32]


def test_conv_transpose3d_on_the_meta_device():
    """Shapes traced on the meta device (a model built there, or a census of its layers): conv_transpose3d, the
    module and the op take meta tensors as F.conv_transpose3d does, autocast asked only of devices that have it."""
    x = torch.empty(1, 8, 3, 4, 5, device="meta").contiguous(memory_format=CL)
    skip = torch.empty(1, 2, 3, 4, 5, device="meta").contiguous(memory_format=CL)
    w = torch.empty(10, 6, 2, 2, 2, device="meta")
    expected = F.conv_transpose3d(torch.cat([x, skip], 1), w, stride=2)
    y = tconv3d.conv_transpose3d(x, w, None, stride=2, channels_after=skip)
    assert y.device.type == "meta" and y.shape == expected.shape
    module = tconv3d.nn.ConvTranspose3d(8, 6, 2, stride=2, device="meta")
    assert module(x).shape == F.conv_transpose3d(x, module.weight, module.bias, stride=2).shape
