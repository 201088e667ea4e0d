"""torch.ops.tconv3d.upsample_linear and its gradient op: F.interpolate(mode="trilinear", align_corners=False) by 1
or 2 along each of D, H and W, on channels_last_3d tensors (kernels/resample.py), against float64 torch."""

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, dtype_id, leaf_copy

import tconv3d
from tconv3d.nn.modules import upsample_linear
from tconv3d.ops import call_upsample_linear
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
FACTORS = [(2, 2, 2), (2, 1, 1), (1, 2, 2), (1, 1, 2)]
# (name, shape): single voxels along an axis (both outputs read it), 130 channels (two channel blocks a voxel)
CASES = [("c5", (2, 5, 3, 4, 5)), ("ones", (1, 3, 1, 1, 2)), ("c130", (1, 130, 2, 3, 2))]


def reference(x: torch.Tensor, factors) -> torch.Tensor:
    return F.interpolate(x, scale_factor=[float(f) for f in factors], mode="trilinear")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("factors", FACTORS, ids=lambda f: "x".join(map(str, f)))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_upsample_linear_matches_float64(case, factors, dtype, device):
    """Output and input gradient against float64 trilinear interpolation, both channels_last_3d."""
    _, shape = case
    x = leaf_copy(torch.randn(shape, device=device).to(dtype).contiguous(memory_format=CL))
    y = call_upsample_linear(x, list(factors))
    assert y.is_contiguous(memory_format=CL) and y.dtype == dtype
    x64 = leaf_copy(x.detach().double())
    expected = reference(x64, factors)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    y.backward(grad.to(dtype))
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    assert rel_l2(x.grad, x64.grad) < TOLERANCE[dtype]
    assert x.grad.is_contiguous(memory_format=CL)


def test_upsample_linear_a_test_can_fail():
    """The weights are torch's align_corners=False ones: aligned corners, or nearest (weights 1 and 0), are far
    off."""
    x = torch.randn(1, 4, 3, 4, 5).contiguous(memory_format=CL)
    ours = call_upsample_linear(x, [2, 1, 2])
    assert rel_l2(ours, reference(x, (2, 1, 2))) < 1e-6
    aligned = F.interpolate(x, scale_factor=(2.0, 1.0, 2.0), mode="trilinear", align_corners=True)
    assert rel_l2(ours, aligned) > 0.05
    assert rel_l2(ours, F.interpolate(x, scale_factor=(2.0, 1.0, 2.0), mode="nearest")) > 0.05


def test_upsample_linear_any_layout_deterministic_and_linear(device):
    """An NCDHW input is laid out once (the output channels_last_3d); gradients are bit-identical between runs (a
    gather, no atomics); the gradient op is the op's adjoint: <up(x), g> = <x, up^T(g)>."""
    x = torch.randn(2, 6, 3, 4, 2, device=device)
    y = call_upsample_linear(x, [2, 2, 2])
    assert y.is_contiguous(memory_format=CL) and rel_l2(y, reference(x.double(), (2, 2, 2))) < 1e-5
    g = torch.randn(y.shape, device=device)
    grads = [torch.ops.tconv3d.upsample_linear_backward(g, list(x.shape), [2, 2, 2]) for _ in range(2)]
    assert torch.equal(*grads)
    assert torch.allclose((y.double() * g.double()).sum(), (x.double() * grads[0].double()).sum(), rtol=1e-5)


def test_upsample_linear_transforms(device):
    """Forward-mode AD (the op on the tangent), vmap (the vmapped dimension folded into the batch), double backward
    (the gradient op's gradient is the op), and torch.compile(fullgraph=True), each against torch's trilinear."""
    x = torch.randn(2, 3, 2, 3, 2, device=device).contiguous(memory_format=CL)
    tangent = torch.randn_like(x)
    _, jvp = torch.func.jvp(lambda t: upsample_linear(t, (2, 1, 2)), (x,), (tangent,))
    assert rel_l2(jvp, reference(tangent, (2, 1, 2))) < 1e-6
    with torch.autograd.forward_ad.dual_level():
        dual = call_upsample_linear(torch.autograd.forward_ad.make_dual(x, tangent), [2, 1, 2])
        assert rel_l2(torch.autograd.forward_ad.unpack_dual(dual).tangent, jvp) < 1e-6
    batched = torch.func.vmap(lambda t: call_upsample_linear(t, [2, 2, 2]))(torch.stack([x, 2 * x]))
    assert rel_l2(batched[1], 2 * reference(x, (2, 2, 2))) < 1e-6
    leaf = leaf_copy(x)
    (grad,) = torch.autograd.grad(call_upsample_linear(leaf, [2, 2, 2]).square().sum(), leaf, create_graph=True)
    (second,) = torch.autograd.grad(grad.sum(), leaf)
    ref = leaf_copy(x.double())
    (ref_grad,) = torch.autograd.grad(reference(ref, (2, 2, 2)).square().sum(), ref, create_graph=True)
    (ref_second,) = torch.autograd.grad(ref_grad.sum(), ref)
    assert rel_l2(second, ref_second) < 1e-5
    compiled = torch.compile(lambda t: call_upsample_linear(t, [2, 2, 2]), fullgraph=True, backend="aot_eager")
    out = compiled(x)
    assert rel_l2(out, reference(x, (2, 2, 2))) < 1e-6 and out.is_contiguous(memory_format=CL)


def test_opcheck_upsample_linear(device):
    x = torch.randn(2, 5, 2, 3, 2, device=device).contiguous(memory_format=CL).requires_grad_()
    torch.library.opcheck(torch.ops.tconv3d.upsample_linear.default, (x, [2, 1, 2]))
    g = torch.randn(2, 5, 4, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    torch.library.opcheck(torch.ops.tconv3d.upsample_linear_backward.default, (g, [2, 5, 2, 3, 2], [2, 1, 2]))


@pytest.mark.parametrize(
    ("shape", "factors", "message"),
    [((1, 6, 3, 3), [2, 2, 2], "must be 5-D"), ((1, 6, 2, 3, 3), [2, 3, 2], "each 1 or 2"),
     ((1, 6, 2, 3, 3), [2, 2], "each 1 or 2")],
)  # fmt: skip
def test_bad_upsample_linear_arguments(shape, factors, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.tconv3d.upsample_linear(torch.randn(shape), factors)
    with pytest.raises(ValueError, match="is not the output of an input of size"):
        torch.ops.tconv3d.upsample_linear_backward(torch.randn(1, 2, 4, 4, 4), [1, 2, 2, 2, 3], [2, 2, 2])
    with pytest.raises(TypeError, match="float64"):
        torch.ops.tconv3d.upsample_linear(torch.randn(1, 2, 2, 2, 2, dtype=torch.float64), [2, 2, 2])


def test_converted_upsample_takes_it(aten_path):
    """tconv3d.nn.Upsample (what convert swaps in for nn.Upsample: SegResNet's decoder) runs trilinear x2 on a
    channels_last_3d activation as upsample_linear, and torch's interpolation elsewhere."""
    stock = torch.nn.Upsample(scale_factor=2, mode="trilinear")
    ours = tconv3d.nn.convert(torch.nn.Sequential(stock))[0]
    assert type(ours) is tconv3d.nn.Upsample
    x = torch.randn(1, 4, 3, 4, 4).contiguous(memory_format=CL)
    assert rel_l2(ours(x), stock(x)) < 1e-6 and ours(x).is_contiguous(memory_format=CL)
    aligned = torch.nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True)
    assert torch.equal(tconv3d.nn.convert(torch.nn.Sequential(aligned))[0](x), aligned(x))
    sized = tconv3d.nn.convert(torch.nn.Sequential(torch.nn.Upsample(size=(3, 8, 8), mode="trilinear")))[0]
    assert rel_l2(sized(x), F.interpolate(x, size=(3, 8, 8), mode="trilinear")) < 1e-6
