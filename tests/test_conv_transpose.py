"""ConvTranspose3d on NDHWC: tconv3d.conv_transpose3d (the input-gradient op run forward) and
tconv3d.nn.ConvTranspose3d, against float64 F.conv_transpose3d, gradients included; errors; convert."""

import pytest
import torch
import torch.nn.functional as F
from helpers import dtype_id, leaf_copy
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
