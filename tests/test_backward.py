"""Input, weight and bias gradients against float64 autograd of F.conv3d, determinism, and double backward."""

import pytest
import torch
from helpers import (
    CASES,
    DTYPES,
    Case,
    case_reference,
    conv_and_reference,
    count_launches,
    dtype_id,
    leaf_copy,
    poison_aten_convolution,
)

import tconv3d
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d


def tconv3d_and_reference_grads(case: Case, dtype, device, memory_format=CL, bias=True):
    """(tconv3d's grads, float64 reference grads) of (x, w, b) under one random upstream gradient."""
    ours, expected = conv_and_reference(case, dtype, device, memory_format, bias)
    return ours[1:], expected[1:]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_float64_reference(case, dtype, device):
    (gx, gw, gb), (ex, ew, eb) = tconv3d_and_reference_grads(case, dtype, device)
    for name, ours, expected in (("input", gx, ex), ("weight", gw, ew), ("bias", gb, eb)):
        assert ours.dtype == dtype, name
        assert ours.shape == expected.shape, name
        assert rel_l2(ours, expected) < TOLERANCE[dtype], name
    assert gx.is_contiguous(memory_format=CL)
    assert gw.is_contiguous(memory_format=CL)  # the weight was channels_last_3d: so is its gradient


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_gradients_of_ncdhw_input_and_weight(dtype, device):
    case = CASES[2]  # stride 2
    x = leaf_copy(case.input(dtype, device, torch.contiguous_format))
    w = leaf_copy(case.weight(dtype, device).contiguous())
    x64, w64 = leaf_copy(x.double()), leaf_copy(w.double())
    ref = case_reference(x64, w64, None, case)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    tconv3d.conv3d(x, w, None, case.stride, case.padding).backward(grad_out.to(dtype))
    assert rel_l2(x.grad, x64.grad) < TOLERANCE[dtype]
    assert rel_l2(w.grad, w64.grad) < TOLERANCE[dtype]
    assert w.grad.is_contiguous()  # gradient in the weight's own memory format


def test_triton_backward_kernels_ran_not_aten(monkeypatch, device):
    case = CASES[2]
    x, w = leaf_copy(case.input(torch.float32, device)), leaf_copy(case.weight(torch.float32, device))
    x64, w64 = leaf_copy(x.double()), leaf_copy(w.double())
    ref = case_reference(x64, w64, None, case)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    poison_aten_convolution(monkeypatch)
    dgrad_launches = count_launches(monkeypatch, "conv3d_dgrad")
    wgrad_launches = count_launches(monkeypatch, "conv3d_wgrad")
    tconv3d.conv3d(x, w, None, case.stride, case.padding).backward(grad_out.float())
    assert dgrad_launches == ["conv3d_dgrad"] and wgrad_launches == ["conv3d_wgrad"]
    assert rel_l2(x.grad, x64.grad) < TOLERANCE[torch.float32]
    assert rel_l2(w.grad, w64.grad) < TOLERANCE[torch.float32]


def test_only_needed_gradients_are_computed(monkeypatch, device):
    case = CASES[0]
    x = case.input(torch.float32, device)  # no grad wanted for the input
    w = leaf_copy(case.weight(torch.float32, device))
    dgrad_launches = count_launches(monkeypatch, "conv3d_dgrad")
    wgrad_launches = count_launches(monkeypatch, "conv3d_wgrad")
    tconv3d.conv3d(x, w, None, case.stride, case.padding).sum().backward()
    assert dgrad_launches == [] and wgrad_launches == ["conv3d_wgrad"]


# Under the interpreter programs run one after another, so what this can catch there (a workspace read before it
# is written, an order that depends on memory) does not depend on the dtype: bf16 alone keeps CI short.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if torch.cuda.is_available() else [torch.bfloat16],
                         ids=dtype_id)  # fmt: skip
def test_gradients_are_bitwise_deterministic(small_tiles, dtype, device):
    # small_tiles forces split-K (3 splits): the heuristic gives this small problem one split on an H100.
    # Two batches, partial tiles along every axis, a few K steps a split: no more (the interpreter runs the
    # programs' steps one by one, ~15 ms each)
    case = Case("determinism", 2, 24, 20, (4, 5, 6), 3, stride=(1, 2, 1), padding=(2, 0, 1, 1, 1, 1))
    x, w = case.input(dtype, device), case.weight(dtype, device)
    geom = tconv3d.geometry.check_conv3d(x, w, None, case.stride, case.padding, 1, 1)
    tiles = tconv3d.tune.choice.pick_config("wgrad", geom, dtype, x.device)
    assert geom.output_voxels // tiles.split_k >= 2 * tiles.block_k  # each split reduces over 2+ steps
    grad_out = torch.randn(geom.output_shape(), device=device).to(dtype).contiguous(memory_format=CL)
    conv_args = list(geom.stride), list(geom.padding), list(geom.dilation)
    wgrads = [torch.ops.tconv3d.conv3d_weight_grad(grad_out, x, list(w.shape), *conv_args) for _ in range(2)]
    dgrads = [torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), *conv_args) for _ in range(2)]
    assert tiles.split_k > 1  # the split-K path ran
    assert all(torch.equal(wgrads[0], g) for g in wgrads[1:])
    assert all(torch.equal(dgrads[0], g) for g in dgrads[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_many_tiles_and_splits(small_tiles, dtype, device):
    case = Case("many_tiles", 1, 33, 20, (3, 6, 7), (2, 1, 3), stride=(1, 2, 1), padding=(1, 0, 1, 1, 2, 0))
    grads, expected = tconv3d_and_reference_grads(case, dtype, device)
    for ours, ref in zip(grads, expected, strict=True):
        assert rel_l2(ours, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_gpu_heuristic_tiles(gpu_heuristic_tiles, dtype, device):
    case = Case("heuristic_tiles", 2, 20, 36, (4, 9, 26), (2, 3, 3), stride=(1, 2, 1), padding=(1, 0, 1, 1, 1, 1))
    x, w = case.input(dtype, device), case.weight(dtype, device)
    geom = tconv3d.geometry.check_conv3d(x, w, None, case.stride, case.padding, 1, 1)
    assert tconv3d.tune.choice.pick_config("wgrad", geom, dtype, x.device).split_k > 1
    fwd = tconv3d.tune.choice.pick_config("fwd", geom, dtype, x.device)
    # partial tiles along M (voxels), N (Cout 36) and K (Cin 20)
    assert geom.output_voxels % fwd.block_m and 36 % fwd.block_n and 20 % fwd.block_k
    grads, expected = tconv3d_and_reference_grads(case, dtype, device)
    for ours, ref in zip(grads, expected, strict=True):
        assert rel_l2(ours, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("tiles", ["chosen", "gpu_heuristic_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_patch_embedding_matches_float64(dtype, tiles, device, request):
    """A video transformer's patch embedding (Wan's, HunyuanVideo's: kernel = stride = (1, 2, 2), 16 latent channels,
    no padding; every input voxel read by exactly one tap) on an NCDHW latent, as the interpreter's and an H100's
    tiles launch it: the output and the three gradients against float64."""
    if tiles != "chosen":
        request.getfixturevalue(tiles)
    case = Case("patch_embedding", 1, 16, 40, (3, 8, 12), (1, 2, 2), stride=(1, 2, 2), padding=0)
    ours, expected = conv_and_reference(case, dtype, device, memory_format=torch.contiguous_format)
    for name, a, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert a.shape == e.shape, name
        assert rel_l2(a, e) < TOLERANCE[dtype], name


@pytest.mark.parametrize("tiles", ["chosen", "gpu_heuristic_tiles"])
def test_empty_batch_gradients(tiles, device, request):
    """An empty batch leaves the weight gradient nothing to reduce; the H100 heuristic once divided by it."""
    if tiles != "chosen":
        request.getfixturevalue(tiles)
    x = leaf_copy(torch.randn(0, 3, 4, 5, 6, device=device))
    w = leaf_copy(torch.randn(5, 3, 3, 3, 3, device=device))
    tconv3d.conv3d(x, w, padding=1).sum().backward()
    assert x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_double_backward_matches_float64(device):
    """Second derivatives through the gradient ops' own autograd, against float64 F.conv3d."""
    case = Case("double_backward", 1, 3, 4, (4, 5, 6), 3, stride=(1, 2, 1), padding=(1, 0, 1, 1, 0, 2))

    def second_order(conv, x, w):
        y = conv(x, w)
        grad_out = torch.ones_like(y).cumsum(-1) / y.shape[-1]  # fixed, so both sides see the same one
        gx, gw = torch.autograd.grad((y * grad_out).sum(), (x, w), create_graph=True)
        u = torch.linspace(-1, 1, gx.numel(), dtype=gx.dtype, device=gx.device).view_as(gx)
        v = torch.linspace(1, -1, gw.numel(), dtype=gw.dtype, device=gw.device).view_as(gw)
        return torch.autograd.grad((gx * u).sum() + (gw.square() * v).sum(), (x, w))

    x, w = leaf_copy(case.input(torch.float32, device)), leaf_copy(case.weight(torch.float32, device))
    ours = second_order(lambda a, b: tconv3d.conv3d(a, b, None, case.stride, case.padding), x, w)
    expected = second_order(lambda a, b: case_reference(a, b, None, case), leaf_copy(x.double()), leaf_copy(w.double()))
    for a, e in zip(ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("out_size", "strided_grad"),
    [((1, 2, 1), False), ((3, 1, 5), False), ((2, 3, 4), True)],
    ids=["volume_below_block_k", "unit_dims", "strided_grad_output"],
)
def test_weight_grad_voxel_walk(small_tiles, out_size, strided_grad, device):
    """The weight gradient advances its voxel coordinates by BLOCK_K per step in mixed radix: volumes smaller than
    one step (so the batch digit moves), unit dims, and a grad_output that is not dense (a channel slice)."""
    n, c_in, c_out = 40, 5, 6  # enough voxels for several BLOCK_K steps in each of the 3 splits
    x = torch.randn(n, c_in, *out_size, device=device).contiguous(memory_format=CL)
    wide = torch.randn(n, 2 * c_out if strided_grad else c_out, *out_size, device=device)
    grad_out = wide.contiguous(memory_format=CL)[:, :c_out]
    assert tconv3d.kernels.utils.dense_ndhwc(grad_out) != strided_grad
    w_shape = [c_out, c_in, 1, 1, 1]
    ours = torch.ops.tconv3d.conv3d_weight_grad(grad_out, x, w_shape, [1, 1, 1], [0, 0, 0], [1, 1, 1])
    expected = torch.einsum("nodhw,nidhw->oi", grad_out.double(), x.double()).reshape(w_shape)
    assert rel_l2(ours, expected) < TOLERANCE[torch.float32]
