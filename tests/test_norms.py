"""GroupNorm and InstanceNorm on NDHWC (tconv3d.group_norm op, tconv3d.nn.GroupNorm / InstanceNorm3d), with and
without the fused SiLU: forward and gradients against float64 torch, channels_last_3d outputs, determinism,
errors, opcheck, and the modules as drop-ins."""

import copy
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import triton
from helpers import DTYPES, dtype_id, leaf_copy
from torch import nn

import tconv3d
from tconv3d import settings
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
# (name, shape, groups); the 2 x 8 x 4 x 20 x 20 case spans several voxel splits of the reduction
CASES = [
    ("groups_1", (2, 6, 3, 5, 4), 1),
    ("groups_2_odd", (1, 10, 3, 7, 5), 2),
    ("groups_8", (2, 32, 2, 5, 3), 8),
    ("instance", (2, 5, 3, 4, 3), 5),
    ("several_splits", (2, 8, 4, 20, 20), 4),
]


# The fused activations as torch computes them (the ops' `activation` names; the modules' None is "none")
# (leaky_relu at the ops' default slope, torch's; test_leaky_relu_of_any_slope takes others)
ACTIVATE = {"none": lambda y: y, None: lambda y: y, "silu": F.silu, "relu": F.relu, "leaky_relu": F.leaky_relu}
FUSED = ["none", "silu", "relu", "leaky_relu"]
RMS_FUSED = FUSED[:3]  # the RMS norm's


def reference(x, weight, bias, groups, eps, activation, *slope):
    return ACTIVATE[activation](F.group_norm(x, groups, weight, bias, eps), *slope)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", FUSED)
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_group_norm_matches_float64(case, affine, activation, dtype, device):
    _name, shape, groups = case
    # An offset mean, so a one-pass sum of squares would lose digits the kernels must keep.
    x = leaf_copy((torch.randn(shape, device=device) * 2 + 3).to(dtype).contiguous(memory_format=CL))
    params = [leaf_copy(torch.randn(shape[1], device=device).to(dtype)) for _ in range(2)] if affine else [None] * 2
    y, mean, rstd = torch.ops.tconv3d.group_norm(x, *params, groups, 1e-5, activation)
    assert y.is_contiguous(memory_format=CL) and y.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    inputs = [x, *(p for p in params if p is not None)]
    copies = [leaf_copy(t.detach().double()) for t in inputs]
    expected = reference(copies[0], *(copies[1:] or [None, None]), groups, 1e-5, activation)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y.backward(grad_out.to(dtype))
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    for ours, ref in zip(inputs, copies, strict=True):
        assert rel_l2(ours.grad, ref.grad) < TOLERANCE[dtype]
    assert x.grad.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("read", ["mean", "rstd", "all"])
def test_gradients_through_the_statistics_match_float64(read, device):
    """The op's mean and rstd are differentiable outputs, as torch's native_group_norm's: a loss that reads them (with
    or without the normalized output) gets their gradients too, in torch's ops. Autograd hands the backward None for
    a statistic nothing read (no zeros made: two fills a backward, H200 run 11), and the kernels run then."""
    shape, groups = (2, 8, 3, 4, 5), 4
    x = leaf_copy((torch.randn(shape, device=device) * 2 + 1).contiguous(memory_format=CL))
    weight, bias = (leaf_copy(torch.randn(8, device=device)) for _ in range(2))
    y, mean, rstd = torch.ops.tconv3d.group_norm(x, weight, bias, groups, 1e-5, "silu")
    gy, gm, gr = torch.randn_like(y), torch.randn_like(mean), torch.randn_like(rstd)
    terms = {"mean": [(mean, gm)], "rstd": [(rstd, gr)], "all": [(y, gy), (mean, gm), (rstd, gr)]}[read]
    sum(((t * g).sum() for t, g in terms), torch.zeros((), device=device)).backward()

    x64, w64, b64 = (leaf_copy(t.detach().double()) for t in (x, weight, bias))
    per_group = x64.reshape(2, groups, -1)
    mean64 = per_group.mean(-1)
    rstd64 = (per_group.var(-1, unbiased=False) + 1e-5).rsqrt()
    y64 = reference(x64, w64, b64, groups, 1e-5, "silu")
    values = {"mean": [mean64], "rstd": [rstd64], "all": [y64, mean64, rstd64]}[read]
    sum((t * g.double()).sum() for t, (_, g) in zip(values, terms, strict=True)).backward()
    assert rel_l2(mean, mean64) < TOLERANCE[torch.float32] and rel_l2(rstd, rstd64) < TOLERANCE[torch.float32]
    assert rel_l2(x.grad, x64.grad) < TOLERANCE[torch.float32]
    if read == "all":
        assert rel_l2(weight.grad, w64.grad) < TOLERANCE[torch.float32]
        assert rel_l2(bias.grad, b64.grad) < TOLERANCE[torch.float32]
    else:  # the statistics read none of the affine parameters
        assert all(t.grad is None or not t.grad.any() for t in (weight, bias))


@pytest.mark.parametrize("activation", FUSED)
@pytest.mark.parametrize(("shape", "groups"), [((2, 32, 4, 4, 4), 32), ((2, 32, 4, 4, 4), 4), ((2, 16, 4, 20, 20), 4)])
def test_offset_activations_keep_their_digits(shape, groups, activation, device):
    """Activations whose mean is a thousand standard deviations: the norm centers x before it scales it, in both
    directions, so its float32 error against float64 is no worse than that of a float32 norm that centers (torch's
    instance_norm, over the groups as instances, then the affine). The folded form x * a + (b - mean * a) and
    backward sums of dy * x less mean * dy were 2-10x worse (torch's group_norm: 1e-1)."""

    def centered_torch(x, weight, bias):
        n, c = x.shape[:2]
        y = F.instance_norm(x.reshape(1, n * groups, -1), eps=1e-5).reshape(x.shape)
        y = y * weight.view(1, c, 1, 1, 1) + bias.view(1, c, 1, 1, 1)
        return ACTIVATE[activation](y)

    x = (1000 + torch.randn(shape, dtype=torch.float64)).contiguous(memory_format=CL)
    params = [torch.randn(shape[1], dtype=torch.float64) for _ in range(2)]
    grad = torch.randn(shape, dtype=torch.float64)

    def run(norm, dtype):
        leaves = [t.to(device, dtype).requires_grad_() for t in (x, *params)]
        y = norm(*leaves)
        return [y.detach(), *torch.autograd.grad(y, leaves, grad.to(device, dtype))]

    expected = run(lambda x, w, b: reference(x, w, b, groups, 1e-5, activation), torch.float64)
    ours = run(lambda x, w, b: torch.ops.tconv3d.group_norm(x, w, b, groups, 1e-5, activation)[0], torch.float32)
    centered = run(centered_torch, torch.float32)
    for name, mine, theirs, exact in zip(("y", "x", "weight", "bias"), ours, centered, expected, strict=True):
        assert rel_l2(mine, exact) <= 3 * rel_l2(theirs, exact) + 1e-6, name


def test_a_test_can_fail_on_the_fused_activation(device):
    """The fused SiLU and ReLU are really applied, each its own: without one, or with the other, the output is far
    from GroupNorm -> it, and so is the input gradient (ReLU's passes dy where the output is positive, nothing
    elsewhere). ReLU keeps a NaN (torch's; a max would answer 0)."""
    x = torch.randn(1, 4, 2, 3, 3, device=device)
    plain = torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5, "none")[0]
    for activation in ("silu", "relu"):
        fused = torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5, activation)[0]
        assert rel_l2(fused, ACTIVATE[activation](plain)) < TOLERANCE[torch.float32]
        others = {"none": plain, "silu": F.silu(plain), "relu": F.relu(plain)}
        assert all(rel_l2(fused, y) > 0.1 for name, y in others.items() if name != activation)
    leaf = x.clone().requires_grad_()
    grad = torch.randn_like(x)
    (ours,) = torch.autograd.grad(torch.ops.tconv3d.group_norm(leaf, None, None, 2, 1e-5, "relu")[0], leaf, grad)
    (theirs,) = torch.autograd.grad(F.relu(F.group_norm(leaf, 2, eps=1e-5)), leaf, grad)
    (unmasked,) = torch.autograd.grad(F.group_norm(leaf, 2, eps=1e-5), leaf, grad)
    assert rel_l2(ours, theirs) < TOLERANCE[torch.float32] and rel_l2(ours, unmasked) > 0.1
    nan = x.clone()
    nan[0, 0, 0, 0, 0] = float("nan")  # its group's statistics NaN: the group's outputs NaN, through ReLU too
    y = torch.ops.tconv3d.group_norm(nan.contiguous(memory_format=CL), None, None, 2, 1e-5, "relu")[0]
    assert y[:, :2].isnan().all() and not y[:, 2:].isnan().any()


@pytest.mark.parametrize("slope", [0.2, -0.5])
def test_leaky_relu_of_any_slope(slope, device):
    """group_norm's fused leaky ReLU takes its slope from negative_slope (its default torch's 0.01): output, the
    input and parameter gradients and the forward-mode tangent against float64 GroupNorm -> F.leaky_relu of that
    slope, and far from the default slope's; the GroupNorm module and convert carry it (nn.LeakyReLU(slope)).
    The RMS norm does not fuse it, and says so."""
    x = leaf_copy(torch.randn(2, 6, 2, 3, 4, device=device).contiguous(memory_format=CL))
    weight, bias = (leaf_copy(torch.randn(6, device=device)) for _ in range(2))
    y = torch.ops.tconv3d.group_norm(x, weight, bias, 3, 1e-5, "leaky_relu", None, slope)[0]
    copies = [leaf_copy(t.detach().double()) for t in (x, weight, bias)]
    normalized = F.group_norm(copies[0], 3, copies[1], copies[2], 1e-5)
    expected = F.leaky_relu(normalized, slope)
    grad = torch.randn_like(expected)
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]
    assert rel_l2(y, F.leaky_relu(normalized, 0.01)) > 0.05  # the slope is the call's, not the default
    got = torch.autograd.grad(y, (x, weight, bias), grad.float())
    want = torch.autograd.grad(expected, copies, grad)
    assert all(rel_l2(g, w) < TOLERANCE[torch.float32] for g, w in zip(got, want, strict=True))
    tangent = torch.randn_like(x)
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(x.detach(), tangent)
        out = torch.ops.tconv3d.group_norm(dual, weight.detach(), bias.detach(), 3, 1e-5, "leaky_relu", None, slope)
        t_y = torch.autograd.forward_ad.unpack_dual(out[0]).tangent
    _, t_expected = torch.func.jvp(lambda v: F.leaky_relu(F.group_norm(v, 3, *copies[1:], 1e-5), slope),
                                   (copies[0].detach().contiguous(),), (tangent.double().contiguous(),))  # fmt: skip
    assert rel_l2(t_y, t_expected) < TOLERANCE[torch.float32]

    module = tconv3d.nn.GroupNorm(3, 6, activation="leaky_relu", negative_slope=slope).to(device)
    assert f"negative_slope={slope}" in repr(module)
    stock = nn.Sequential(nn.GroupNorm(3, 6), nn.LeakyReLU(slope)).to(device)
    module.load_state_dict(stock[0].state_dict())
    reference_output = stock(x)
    tconv3d.nn.convert(stock)
    assert stock[0].activation == "leaky_relu" and stock[0].negative_slope == slope and type(stock[1]) is nn.Identity
    for ours in (module(x), stock(x)):
        assert rel_l2(ours, reference_output) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="rms_norm's activation must be one of 'none', 'silu', 'relu', got 'leaky"):
        torch.ops.tconv3d.rms_norm(x, None, None, 1e-6, "leaky_relu")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("weights", ["one", "per_channel"])
def test_prelu_weights_and_their_gradient(weights, dtype, device):
    """activation "prelu" with activation_weight (one weight, or one a channel of the concatenation with
    channels_after): output, the gradients of input, skip, weight, bias and the PReLU's weights (in their dtype and
    shape, from the backward's third moment) and the forward-mode tangent along all of them against float64
    GroupNorm -> F.prelu. A test that can fail: the weights are far from the leaky ReLU's default slope."""
    torch.manual_seed(0)
    x, skip = (leaf_copy(torch.randn(2, c, 2, 3, 4, device=device).to(dtype).contiguous(memory_format=CL))
               for c in (4, 2))  # fmt: skip
    weight, bias = (leaf_copy(torch.randn(6, device=device).to(dtype)) for _ in range(2))
    slopes = leaf_copy((torch.rand(1 if weights == "one" else 6, device=device) * 0.5 + 0.2).to(dtype))
    inputs = (x, skip, weight, bias, slopes)
    y = torch.ops.tconv3d.group_norm(x, weight, bias, 3, 1e-5, "prelu", skip, 0.01, slopes)[0]
    copies = [leaf_copy(t.detach().double()) for t in inputs]

    def reference(x, skip, weight, bias, slopes):
        return F.prelu(F.group_norm(torch.cat([x, skip], 1), 3, weight, bias, 1e-5), slopes)

    expected = reference(*copies)
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    assert rel_l2(y, F.leaky_relu(F.group_norm(torch.cat(copies[:2], 1), 3, *copies[2:4], 1e-5))) > 0.05
    grad = torch.randn_like(expected)
    got = torch.autograd.grad(y, inputs, grad.to(dtype))
    want = torch.autograd.grad(expected, copies, grad)
    for ours, theirs, t in zip(got, want, inputs, strict=True):
        assert ours.dtype == t.dtype and ours.shape == t.shape and rel_l2(ours, theirs) < TOLERANCE[dtype]
    tangents = [torch.randn_like(t) for t in copies]
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual
        duals = [dual(t.detach(), v.to(dtype)) for t, v in zip(inputs, tangents, strict=True)]
        out = torch.ops.tconv3d.group_norm(duals[0], *duals[2:4], 3, 1e-5, "prelu", duals[1], 0.01, duals[4])[0]
        t_y = torch.autograd.forward_ad.unpack_dual(out).tangent
    contiguous = [t.detach().contiguous() for t in copies]
    _, t_expected = torch.func.jvp(reference, tuple(contiguous), tuple(v.contiguous() for v in tangents))
    assert rel_l2(t_y, t_expected) < TOLERANCE[dtype]


def test_prelu_weights_are_checked(device):
    """A PReLU's weights go with activation "prelu" only, one or one a channel, on the input's device."""
    x = torch.randn(1, 6, 2, 3, 3, device=device)
    with pytest.raises(ValueError, match=r"activation_weight .* goes with activation 'prelu' only"):
        torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5, "prelu")
    with pytest.raises(ValueError, match=r"activation_weight .* goes with activation 'prelu' only"):
        torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5, "relu", None, 0.01, torch.ones(1, device=device))
    with pytest.raises(ValueError, match=r"activation_weight must have shape \(1,\) or \(6,\), got \(3,\)"):
        torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5, "prelu", None, 0.01, torch.ones(3, device=device))
    with pytest.raises(ValueError, match=r"a PReLU is fused by tconv3d\.nn\.convert"):
        tconv3d.nn.InstanceNorm3d(6, activation="prelu")


def test_input_in_any_layout_and_deterministic_gradients(device):
    x = torch.randn(2, 8, 3, 6, 5, device=device)  # NCDHW: converted once, output channels_last_3d
    w, b = torch.randn(8, device=device), torch.randn(8, device=device)
    y = torch.ops.tconv3d.group_norm(x, w, b, 4, 1e-5, "silu")[0]
    assert y.is_contiguous(memory_format=CL)
    assert rel_l2(y, reference(x.double(), w.double(), b.double(), 4, 1e-5, "silu")) < TOLERANCE[torch.float32]
    grads = []
    for _ in range(2):
        xs = leaf_copy(x)
        torch.ops.tconv3d.group_norm(xs, w, b, 4, 1e-5, "silu")[0].square().sum().backward()
        grads.append(xs.grad)
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("fold_channels", [1, 8, 4096], ids=["a_group_a_program", "two_groups", "every_group"])
@pytest.mark.parametrize("tile_splits", [1, 2], ids=["one_split_a_step", "two"])
def test_group_norm_folds_its_splits_a_tile_at_a_time(tile_splits, fold_channels, device, monkeypatch):
    """The fold of the groups' partials (group_norm._fold_kernel) walks the splits FOLD_SPLITS at a time: at 1 and
    2 of a volume's 3 splits (the last one short), forward and gradients still match float64, whether a program
    folds one of the 3 groups of 4 channels (FOLD_CHANNELS 1), two (8: the second program's other group masked) or
    all three (the interpreter's 4096: one masked)."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    from tconv3d.kernels import group_norm

    monkeypatch.setattr(group_norm, "FOLD_SPLITS", tile_splits)
    monkeypatch.setattr(group_norm, "FOLD_CHANNELS", fold_channels)
    assert group_norm._splits(5 * 20 * 25)[1] == 3
    x = leaf_copy(torch.randn(2, 12, 5, 20, 25, device=device).contiguous(memory_format=CL))
    w, b = (leaf_copy(torch.randn(12, device=device)) for _ in range(2))
    x64, w64, b64 = (leaf_copy(t.double()) for t in (x, w, b))
    want = reference(x64, w64, b64, 3, 1e-5, "silu")
    grad = torch.randn_like(want)
    want.backward(grad)
    got = torch.ops.tconv3d.group_norm(x, w, b, 3, 1e-5, "silu")[0]
    got.backward(grad.float())
    for ours, theirs in ((got, want), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, theirs) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("past", ["splits", "batch", "wide"])
def test_group_norm_launches_within_the_grids_limits(past, device, monkeypatch):
    """CUDA takes at most 65,535 programs along a grid's second and third axes (launch.MAX_GRID), where the
    reduction's voxel splits of a sample and the affine kernel's batch entries lie; the interpreter takes any grid.
    With those limits lowered to 2 (MAX_SPLITS, AFFINE_BATCH), a norm of 3 splits a sample (2,500 voxels) and of
    a batch of 5 launches within them: "splits", a split walks more voxel blocks (2 splits of 1,280 voxels);
    "batch", the affine kernel takes the batch from N0 in launches of 2, 2 and 1; "wide", both, with every voxel
    index int64 (INT32_VOXELS 0: WIDE). Forward and gradients of a concatenation's norm match float64."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    from tconv3d.kernels import group_norm

    grids = []

    def recorded(kernel, grid, *args, **kwargs):
        grids.append((kernel.__name__, grid, kwargs.get("WIDE")))
        return launch(kernel, grid, *args, **kwargs)

    launch = group_norm.launch
    monkeypatch.setattr(group_norm, "launch", recorded)
    monkeypatch.setattr(group_norm, "MAX_SPLITS", 2 if past != "batch" else group_norm.MAX_SPLITS)
    monkeypatch.setattr(group_norm, "AFFINE_BATCH", 2 if past != "splits" else group_norm.AFFINE_BATCH)
    if past == "wide":
        monkeypatch.setattr(group_norm, "INT32_VOXELS", 0)
    limit = 2
    assert group_norm._splits(5 * 20 * 25) == ((1280, 2) if past != "batch" else (1024, 3))
    x, skip = (leaf_copy(torch.randn(5, c, 5, 20, 25, device=device).contiguous(memory_format=CL)) for c in (4, 8))
    w, b = (leaf_copy(torch.randn(12, device=device)) for _ in range(2))
    copies = [leaf_copy(t.detach().double()) for t in (x, skip, w, b)]
    want = reference(torch.cat(copies[:2], dim=1), *copies[2:], 3, 1e-5, "silu")
    grad = torch.randn_like(want)
    want.backward(grad)
    got = torch.ops.tconv3d.group_norm(x, w, b, 3, 1e-5, "silu", skip)[0]
    got.backward(grad.float())
    for ours, theirs in zip((got, x.grad, skip.grad, w.grad, b.grad), (want, *(t.grad for t in copies)), strict=True):
        assert rel_l2(ours, theirs) < TOLERANCE[torch.float32]
    assert {name for name, *_ in grids} == {"_channel_reduce_kernel", "_fold_kernel", "_affine_kernel"}
    affine = [grid for name, grid, _ in grids if name == "_affine_kernel"]
    # a launch a source and direction, or three where the batch passes the limit
    assert len(affine) == (12 if past != "splits" else 4)
    if past != "batch":
        assert all(grid[2] <= limit for name, grid, _ in grids if name == "_channel_reduce_kernel")
    if past != "splits":
        assert all(grid[2] <= limit for grid in affine)
    assert all(wide == (past == "wide") for _, _, wide in grids)  # every launch, the fold's too


@pytest.mark.parametrize(
    ("shape", "groups", "weight_shape", "error", "message"),
    [
        ((1, 6, 2, 3, 3), 4, None, ValueError, "positive divisor of the 6 channels"),
        ((1, 6, 2, 3, 3), 0, None, ValueError, "positive divisor"),
        ((1, 6, 2, 3, 3), 2, (5,), ValueError, r"weight must have shape \(6,\)"),
        ((1, 6, 3, 3), 2, None, ValueError, "must be 5-D"),
    ],
)
def test_bad_group_norm_arguments(shape, groups, weight_shape, error, message):
    weight = torch.randn(weight_shape) if weight_shape else None
    with pytest.raises(error, match=message):
        torch.ops.tconv3d.group_norm(torch.randn(shape), weight, None, groups, 1e-5, "none")
    with pytest.raises(ValueError, match="activation must be one of 'none', 'silu', 'relu', 'leaky_relu', 'prelu',"):
        torch.ops.tconv3d.group_norm(torch.randn(1, 6, 2, 3, 3), None, None, 2, 1e-5, "gelu")


def test_opcheck_group_norm(device):
    x = torch.randn(2, 6, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(6, device=device, requires_grad=True)
    b = torch.randn(6, device=device, requires_grad=True)
    for activation in FUSED:
        torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, w, b, 3, 1e-5, activation))
        torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, None, None, 6, 1e-5, activation))
    torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, w, b, 3, 1e-5, "leaky_relu", None, 0.2))
    slopes = torch.rand(6, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, w, b, 3, 1e-5, "prelu", None, 0.01, slopes))


# (name, input's channels, channels_after's, groups, D, H, W): a group across the two sources (6 + 10 in 4 groups of
# 4), groups within each, channel blocks of the kernels past the first (40 + 24), and several voxel splits
SOURCES = [
    ("a_group_across", 6, 10, 4, 3, 5, 4),
    ("groups_within", 8, 8, 2, 2, 3, 5),
    ("instance", 3, 5, 8, 3, 4, 3),
    ("wide", 40, 24, 8, 2, 3, 3),
    ("several_splits", 4, 4, 2, 4, 20, 20),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", FUSED)
@pytest.mark.parametrize("case", SOURCES, ids=lambda c: c[0])
def test_group_norm_of_a_concatenation_read_in_place(case, activation, dtype, device):
    """group_norm(input, ..., channels_after) normalizes torch.cat([input, channels_after], dim=1) (a diffusion
    UNet's res block on its skip connection) without making it: values and the gradients of both sources, the
    weight and the bias against float64, channels_last_3d out."""
    _name, first, after, groups, *spatial = case
    x, skip = (
        leaf_copy((torch.randn(2, c, *spatial, device=device) * 2 + shift).to(dtype).contiguous(memory_format=CL))
        for c, shift in ((first, 3), (after, -1))
    )
    params = [leaf_copy(torch.randn(first + after, device=device).to(dtype)) for _ in range(2)]
    # the leaky ReLU's slope given (not the default, which the dispatcher drops): every argument, and a gradient
    # for each of the autograd Function's inputs
    slope = (0.2,) if activation == "leaky_relu" else ()
    y, mean, rstd = torch.ops.tconv3d.group_norm(x, *params, groups, 1e-5, activation, skip, *slope)
    assert y.shape == (2, first + after, *spatial) and y.is_contiguous(memory_format=CL)
    assert mean.shape == rstd.shape == (2, groups)
    copies = [leaf_copy(t.detach().double()) for t in (x, skip, *params)]
    expected = reference(torch.cat(copies[:2], dim=1), *copies[2:], groups, 1e-5, activation, *slope)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y.backward(grad_out.to(dtype))
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    for ours, ref in zip((x, skip, *params), copies, strict=True):
        assert rel_l2(ours.grad, ref.grad) < TOLERANCE[dtype]


def test_a_concatenation_test_can_fail(device):
    """The second source's channels are really normalized with the first's groups: normalizing each source alone
    gives other values where a group spans both."""
    x, skip = torch.randn(1, 2, 2, 3, 3, device=device), torch.randn(1, 2, 2, 3, 3, device=device) * 3 + 2
    together = torch.ops.tconv3d.group_norm(x, None, None, 1, 1e-5, "none", skip)[0]
    assert rel_l2(together, F.group_norm(torch.cat([x, skip], 1).double(), 1)) < TOLERANCE[torch.float32]
    apart = torch.cat([F.group_norm(x, 1), F.group_norm(skip, 1)], 1)
    assert rel_l2(together, apart) > 0.1


@pytest.mark.parametrize(
    ("after_shape", "after_dtype", "weight_shape", "message"),
    [
        ((1, 2, 2, 3, 4), torch.float32, (6,), r"channels_after has shape \(1, 2, 2, 3, 4\); it must match"),
        ((2, 2, 2, 3, 3), torch.float32, (6,), "must match the input"),
        ((1, 2, 2, 3, 3), torch.float16, (6,), "channels_after dtype torch.float16 does not match"),
        ((1, 2, 2, 3, 3), torch.float32, (4,), r"weight must have shape \(6,\)"),
        ((1, 0, 2, 3, 3), torch.float32, (4,), "channels_after has no channels"),
        ((1, 3, 2, 3, 3), torch.float32, (7,), "positive divisor of the 7 channels"),
    ],
)
def test_bad_channels_after_of_a_group_norm(after_shape, after_dtype, weight_shape, message):
    x = torch.randn(1, 4, 2, 3, 3)
    with pytest.raises((ValueError, TypeError), match=message):
        torch.ops.tconv3d.group_norm(x, torch.randn(weight_shape), None, 2, 1e-5, "none",
                                     torch.randn(after_shape).to(after_dtype))  # fmt: skip


def test_opcheck_group_norm_of_a_concatenation(device):
    x = torch.randn(2, 4, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    skip = torch.randn(2, 2, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    w, b = (torch.randn(6, device=device, requires_grad=True) for _ in range(2))
    torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, w, b, 3, 1e-5, "silu", skip))
    torch.library.opcheck(torch.ops.tconv3d.group_norm.default, (x, None, None, 6, 1e-5, "none", skip))


def test_group_norm_module_takes_channels_after(device):
    """tconv3d.nn.GroupNorm(x, channels_after=skip) is nn.GroupNorm of the concatenation, in place where both are
    5-D of one dtype and concatenated otherwise (4-D frames)."""
    torch.manual_seed(0)
    stock = nn.GroupNorm(3, 9).to(device)
    with torch.no_grad():
        stock.weight.normal_(), stock.bias.normal_()
    ours = tconv3d.nn.GroupNorm(3, 9, activation="silu").to(device)
    ours.load_state_dict(stock.state_dict())
    x, skip = torch.randn(2, 5, 3, 4, 5, device=device), torch.randn(2, 4, 3, 4, 5, device=device)
    expected = F.silu(stock(torch.cat([x, skip], 1)))
    assert rel_l2(ours(x, channels_after=skip), expected) < TOLERANCE[torch.float32]
    assert ours(x, channels_after=skip).is_contiguous(memory_format=CL)
    frames = torch.randn(2, 5, 4, 5, device=device), torch.randn(2, 4, 4, 5, device=device)
    assert rel_l2(ours(*frames), F.silu(stock(torch.cat(frames, 1)))) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("activation", [None, "silu", "relu", "leaky_relu"])
def test_group_norm_module_is_a_drop_in(activation, device):
    torch.manual_seed(0)
    stock = nn.GroupNorm(4, 8).to(device)
    with torch.no_grad():
        stock.weight.normal_(), stock.bias.normal_()
    ours = tconv3d.nn.GroupNorm(4, 8, activation=activation).to(device)
    ours.load_state_dict(stock.state_dict())
    assert list(ours.state_dict()) == list(stock.state_dict())
    x = torch.randn(2, 8, 3, 4, 5, device=device)
    assert rel_l2(ours(x), ACTIVATE[activation](stock(x))) < TOLERANCE[torch.float32]
    assert ours(x).is_contiguous(memory_format=CL)
    flat = torch.randn(2, 8, 6, device=device)  # not 5-D: torch's group_norm
    assert rel_l2(ours(flat), ACTIVATE[activation](stock(flat))) < TOLERANCE[torch.float32]
    assert f"activation={activation!r}" in repr(ours) or activation is None


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_group_norm_of_frames_in_the_batch_stays_channels_last(dtype, device, monkeypatch):
    """A (B*T, C, H, W) channels_last input, the frames of a channels_last_3d video flattened into the batch (as
    EasyAnimate's and Cosmos's per-frame norms do): tconv3d's kernel on its (N, C, 1, H, W) view, the result
    channels_last, values and gradients against float64; an NCHW input still runs torch's."""
    launched = []
    real = tconv3d.nn.modules.call_group_norm
    monkeypatch.setattr(tconv3d.nn.modules, "call_group_norm", lambda *a: launched.append(a[0].shape) or real(*a))
    torch.manual_seed(0)
    norm = tconv3d.nn.GroupNorm(2, 6, activation="silu").to(device)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    video = torch.randn(2, 6, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL)
    frames = leaf_copy(video.permute(0, 2, 1, 3, 4).flatten(0, 1))  # (6, 6, 4, 5), channels_last
    assert frames.is_contiguous(memory_format=torch.channels_last) and not frames.is_contiguous()
    out = norm(frames)
    assert launched == [(6, 6, 1, 4, 5)] and out.is_contiguous(memory_format=torch.channels_last)
    reference = leaf_copy(frames.double())
    params = [leaf_copy(p.double()) for p in (norm.weight, norm.bias)]
    expected = F.silu(F.group_norm(reference, 2, *params, norm.eps))
    assert rel_l2(out, expected) < TOLERANCE[dtype]
    grad = torch.randn_like(expected)
    out.backward(grad.to(dtype))
    expected.backward(grad)
    assert rel_l2(frames.grad, reference.grad) < TOLERANCE[dtype]
    assert rel_l2(norm.weight.grad, params[0].grad) < TOLERANCE[dtype]
    norm(frames.detach().float().contiguous())  # NCHW: torch's group_norm (on CUDA: parameters' dtype), not ours
    assert len(launched) == 1


@pytest.mark.parametrize("affine", [True, False])
def test_instance_norm_module_is_a_drop_in(affine, device):
    stock = nn.InstanceNorm3d(6, affine=affine).to(device)
    if affine:
        with torch.no_grad():
            stock.weight.normal_(), stock.bias.normal_()
    ours = tconv3d.nn.InstanceNorm3d(6, affine=affine).to(device)
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(2, 6, 3, 4, 5, device=device)
    assert rel_l2(ours(x), stock(x)) < TOLERANCE[torch.float32]
    assert ours(x).is_contiguous(memory_format=CL)
    tracking = tconv3d.nn.InstanceNorm3d(6, track_running_stats=True).to(device)  # torch's path, stats updated
    tracking(x + 5)
    assert tracking.running_mean.min() > 0.1  # updated from zeros


@pytest.mark.parametrize("case", ["running_stats", "unbatched", "float64"])
def test_instance_norms_torch_runs_take_a_channels_last_gradient_at_a_batch_of_one(case, device):
    """Where torch's instance_norm runs (running statistics, an unbatched input, float64), a batch of one and a
    gradient not laid out NCDHW (a converted model's channels_last_3d) give torch 2.13's CPU instance_norm a wrong
    input gradient, 1.4 from float64 (docs/upstream.md); tconv3d's module hands it the gradient contiguous."""
    dtype = torch.float64 if case == "float64" else torch.float32
    module = tconv3d.nn.InstanceNorm3d(4, affine=True, track_running_stats=case == "running_stats", activation="silu")
    module = module.to(device, dtype)
    with torch.no_grad():
        module.weight.normal_(), module.bias.normal_()
    x = torch.randn(1, 4, 3, 4, 5, device=device, dtype=dtype)
    g = torch.randn(1, 4, 3, 4, 5, device=device, dtype=dtype)
    x64, g64 = x.double().requires_grad_(), g.double()
    weight, bias = module.weight.detach().double(), module.bias.detach().double()
    (expected,) = torch.autograd.grad(F.silu(F.instance_norm(x64, weight=weight, bias=bias)), x64, g64)
    x, g = x.contiguous(memory_format=CL), g.contiguous(memory_format=CL)
    if case == "unbatched":  # (C, D, H, W), its channels innermost
        x, g, expected = x[0], g[0], expected[0]
    x.requires_grad_()
    bound = TOLERANCE[dtype if dtype != torch.float64 else torch.float32]
    (got,) = torch.autograd.grad(module(x), x, g)
    assert rel_l2(got, expected) < bound
    F.leaky_relu(module(x), inplace=True)  # an in-place activation after it: no view made inside a Function
    if case == "running_stats":  # traced by Dynamo, autograd's backward (torch.compile's backend "eager")
        (got,) = torch.autograd.grad(torch.compile(module, backend="eager", fullgraph=True)(x), x, g)
        assert rel_l2(got, expected) < bound


@pytest.mark.parametrize("affine", [True, False])
def test_a_float64_instance_norm_is_torchs(affine, device):
    """float64, which the kernels do not take, runs torch's InstanceNorm3d itself: the same bits. It ran torch's
    group_norm, whose backward of a constant input (variance 0, rstd 1/sqrt(eps)) and a constant gradient, as from
    y.sum(), answered 6e-14 where instance_norm's is exactly 0 (tests/fuzz_args.py, seed 401561)."""
    stock = nn.InstanceNorm3d(3, affine=affine).to(device).double()
    ours = tconv3d.nn.InstanceNorm3d(3, affine=affine).to(device).double()
    ours.load_state_dict(stock.state_dict())
    for x in (torch.randn(2, 3, 3, 4, 2, device=device), torch.full((2, 3, 3, 4, 2), 0.3, device=device)):
        x = x.double().contiguous(memory_format=CL).requires_grad_()
        g = torch.randn_like(x) if x.std() > 0 else torch.ones_like(x)
        assert torch.equal(ours(x), stock(x))
        ours_grads = torch.autograd.grad(ours(x), (x, *ours.parameters()), g)
        assert all(map(torch.equal, ours_grads, torch.autograd.grad(stock(x), (x, *stock.parameters()), g)))


def test_convert_swaps_norms_and_fuses_activations(device):
    """A norm (GroupNorm, InstanceNorm3d, BatchNorm3d) followed by nn.SiLU or nn.ReLU (in place or not: a
    DenseNet's) in an nn.Sequential becomes one fused norm, the activation's slot an nn.Identity; a norm followed by
    anything else (GELU, a conv, nothing) keeps it. Training, the output and the input gradient are stock's."""
    model = nn.Sequential(nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv3d(4, 4, 3, padding=1), nn.InstanceNorm3d(4),
                          nn.SiLU(), nn.BatchNorm3d(4), nn.ReLU(inplace=True), nn.GroupNorm(2, 4), nn.ReLU(),
                          nn.InstanceNorm3d(4), nn.GELU(), nn.GroupNorm(2, 4)).to(device)  # fmt: skip
    x = torch.randn(2, 4, 3, 5, 5, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    expected = model(x)
    (expected_grad,) = torch.autograd.grad(expected, x, grad)
    state = model.state_dict()
    tconv3d.nn.convert(model)
    fused = {0: "silu", 3: "silu", 5: "relu", 7: "relu", 9: None, 11: None}
    assert {i: model[i].activation for i in fused} == fused
    assert [type(model[i]) for i in (0, 3, 5, 7)] == [tconv3d.nn.GroupNorm, tconv3d.nn.InstanceNorm3d,
                                                       tconv3d.nn.BatchNorm3d, tconv3d.nn.GroupNorm]  # fmt: skip
    assert all(type(model[i]) is nn.Identity for i in (1, 4, 6, 8)) and type(model[10]) is nn.GELU
    assert list(model.state_dict()) == list(state)
    y = model(x)
    (y_grad,) = torch.autograd.grad(y, x, grad)
    assert rel_l2(y, expected) < TOLERANCE[torch.float32] and y.is_contiguous(memory_format=CL)
    assert rel_l2(y_grad, expected_grad) < TOLERANCE[torch.float32]


def test_convert_fuses_activations_across_dropouts_that_commute_with_them(device):
    """MONAI's ADN blocks put a dropout between the norm and the activation. A ReLU is fused across any scaling
    dropout (it commutes with one: the dropout stays, after the fused norm), a SiLU across a dropout of p = 0 only,
    and nothing across an AlphaDropout. Training, the converted model's output and input gradient are those of the
    same tconv3d modules unfused, run on the same random draws."""
    norms = [nn.GroupNorm(2, 4), nn.InstanceNorm3d(4), nn.BatchNorm3d(4), nn.GroupNorm(2, 4), nn.GroupNorm(2, 4)]
    stock = nn.Sequential(norms[0], nn.Dropout(0.0), nn.SiLU(), norms[1], nn.Dropout3d(0.5), nn.Dropout(0.2),
                          nn.ReLU(inplace=True), norms[2], nn.Dropout(0.3), nn.SiLU(), norms[3], nn.AlphaDropout(0.0),
                          nn.ReLU(), norms[4]).to(device)  # fmt: skip
    unfused = copy.deepcopy(stock)
    for i in (0, 3, 7, 10, 13):
        unfused[i].__class__ = {nn.GroupNorm: tconv3d.nn.GroupNorm, nn.InstanceNorm3d: tconv3d.nn.InstanceNorm3d,
                                nn.BatchNorm3d: tconv3d.nn.BatchNorm3d}[type(stock[i])]  # fmt: skip
        unfused[i].activation = None
    tconv3d.nn.convert(stock)
    fused = {0: "silu", 3: "relu", 7: None, 10: None, 13: None}
    assert {i: stock[i].activation for i in fused} == fused
    assert [type(stock[i]) for i in (2, 6, 9, 12)] == [nn.Identity, nn.Identity, nn.SiLU, nn.ReLU]
    x = torch.randn(2, 4, 3, 5, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    grad = torch.randn_like(x)
    outputs = []
    for model in (stock, unfused):
        torch.manual_seed(7)
        y = model(x)
        outputs += [y, *torch.autograd.grad(y, x, grad)]
    torch.manual_seed(8)
    assert rel_l2(stock(x), outputs[0]) > 1e-2  # the dropouts drop, at random
    assert rel_l2(outputs[0], outputs[2]) < TOLERANCE[torch.float32]
    assert rel_l2(outputs[1], outputs[3]) < TOLERANCE[torch.float32]


def test_convert_fuses_a_prelu_and_keeps_its_weight(device):
    """A PReLU after a norm (MONAI's UNet: InstanceNorm3d, Dropout(0.0), PReLU) is fused: the norm reads the
    PReLU's weight, one or one a channel, from the module left in its slot (a FusedPReLU, the identity), so the
    state_dict keys, the parameters and their gradients stay the PReLU's. Training, output and every gradient
    (the PReLU weights' too) match stock's; a deep copy's norm reads the copy's PReLU. (No conv bias before the
    BatchNorm: its true gradient is 0, both answers rounding noise.)"""
    torch.manual_seed(0)
    stock = nn.Sequential(nn.InstanceNorm3d(4, affine=True), nn.Dropout(0.0), nn.PReLU(),
                          nn.Conv3d(4, 4, 1, bias=False), nn.BatchNorm3d(4), nn.PReLU(4)).to(device)  # fmt: skip
    with torch.no_grad():
        stock[5].weight.uniform_(0.05, 0.5)
    model = copy.deepcopy(stock)
    tconv3d.nn.convert(model)
    assert model[0].activation == model[4].activation == "prelu"
    assert type(model[2]) is type(model[5]) is tconv3d.nn.modules.FusedPReLU
    assert model[0].fused_prelu is model[2] and list(model.state_dict()) == list(stock.state_dict())
    assert "fused into the norm before it" in repr(model[2])
    x = torch.randn(2, 4, 3, 4, 5, device=device, requires_grad=True)
    grad = torch.randn(2, 4, 3, 4, 5, device=device)
    got = torch.autograd.grad(model(x), [x, *model.parameters()], grad)
    want = torch.autograd.grad(stock(x), [x, *stock.parameters()], grad)
    assert rel_l2(model(x), stock(x)) < TOLERANCE[torch.float32]
    assert all(rel_l2(g, w) < TOLERANCE[torch.float32] for g, w in zip(got, want, strict=True))
    twin = copy.deepcopy(model)
    assert twin[0].fused_prelu is twin[2] and twin[2] is not model[2]
    with torch.no_grad():
        twin[2].weight.fill_(0.5)
    assert rel_l2(twin(x), model(x)) > 0.01  # the copy reads its own PReLU's weight


@pytest.mark.parametrize("activation", ["silu", "relu", "leaky_relu"])
def test_batch_norm_with_a_fused_activation(activation, device):
    """tconv3d.nn.BatchNorm3d(activation=...) is nn.BatchNorm3d then the activation: training on the kernels
    (output, input and parameter gradients, running statistics) and eval by the running statistics (torch's
    batch_norm, then the activation) against float64; an activation it does not fuse is refused by name."""
    torch.manual_seed(0)
    stock = nn.BatchNorm3d(6).to(device).double()
    with torch.no_grad():
        stock.weight.normal_(), stock.bias.normal_()
    ours = tconv3d.nn.BatchNorm3d(6, activation=activation).to(device)
    ours.load_state_dict(stock.state_dict())
    assert f"activation={activation!r}" in repr(ours)
    x = leaf_copy(torch.randn(2, 6, 3, 4, 5, device=device).contiguous(memory_format=CL))
    reference = leaf_copy(x.detach().double())
    for train in (True, False):
        ours.train(train), stock.train(train)
        y, expected = ours(x), ACTIVATE[activation](stock(reference))
        assert rel_l2(y, expected) < TOLERANCE[torch.float32]
        grad = torch.randn_like(expected)
        got = torch.autograd.grad(y, [x, *ours.parameters()], grad.float())
        want = torch.autograd.grad(expected, [reference, *stock.parameters()], grad)
        assert all(rel_l2(g, w) < TOLERANCE[torch.float32] for g, w in zip(got, want, strict=True))
        assert rel_l2(ours.running_var, stock.running_var) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="activation must be one of None, 'silu', 'relu', 'leaky_relu', got 'gelu'"):
        tconv3d.nn.BatchNorm3d(6, activation="gelu")


# ---------------------------------------------------------------------------------------------------------------
# rms_norm: each voxel's channels over their root mean square, eps under the root (torch's RMSNorm: LTX-Video's and
# LTX-2's) or the root clamped to eps (F.normalize * sqrt(C): Wan's, Qwen-Image's and HunyuanVideo 1.5's RMS_norm)

# (name, shape); 1,030 channels: a row wider than 1,024 (one row a program)
RMS_CASES = [
    ("c3", (2, 3, 3, 4, 5)),
    ("c8", (1, 8, 2, 5, 3)),
    ("c96", (2, 96, 2, 4, 3)),
    ("c130", (1, 130, 3, 3, 3)),
    ("c1030", (1, 1030, 1, 2, 3)),
]
RMS_EPS = {False: 1e-6, True: 1e-12}  # by clamp: torch's RMSNorm default-like, F.normalize's


def rms_reference(x, weight, bias, eps, activation, clamp):
    """torch's own functions: F.rms_norm over the channels, or F.normalize times sqrt(C) (eps scaled to match)."""
    root = x.shape[1] ** 0.5
    if clamp:
        y = F.normalize(x, dim=1, eps=eps * root) * root
    else:
        y = F.rms_norm(x.movedim(1, -1), (x.shape[1],), eps=eps).movedim(-1, 1)
    y = y * weight.view(1, -1, 1, 1, 1) if weight is not None else y
    y = y + bias.view(1, -1, 1, 1, 1) if bias is not None else y
    return ACTIVATE[activation](y)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", RMS_FUSED)
@pytest.mark.parametrize("params", ["weight_bias", "weight", "plain"])
@pytest.mark.parametrize("clamp", [False, True], ids=["rms", "clamp"])
@pytest.mark.parametrize("case", RMS_CASES, ids=lambda c: c[0])
def test_rms_norm_matches_float64(case, clamp, params, activation, dtype, device):
    """Output, input, weight and bias gradients against float64 F.rms_norm or F.normalize + affine (+ SiLU), with
    one voxel all zeros (its divisor sqrt(eps), or clamped to eps: a constant, no gradient through it; fp32 and
    bf16) and an offset mean."""
    _name, shape = case
    eps = RMS_EPS[clamp]
    x = (torch.randn(shape, device=device) * 2 + 1).to(dtype)
    if dtype != torch.float16:  # its gradient, g / eps, is past fp16's range (torch's F.normalize gives inf too)
        x[0, :, 0, 0, 0] = 0
    x = leaf_copy(x.contiguous(memory_format=CL))
    weight = leaf_copy(torch.randn(shape[1], device=device).to(dtype)) if params != "plain" else None
    bias = leaf_copy(torch.randn(shape[1], device=device).to(dtype)) if params == "weight_bias" else None
    y = torch.ops.tconv3d.rms_norm(x, weight, bias, eps, activation, clamp)
    assert y.is_contiguous(memory_format=CL) and y.dtype == dtype
    inputs = [t for t in (x, weight, bias) if t is not None]
    copies = [leaf_copy(t.detach().double()) for t in inputs]
    expected = rms_reference(copies[0], *[*copies[1:], None, None][:2], eps, activation, clamp)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y.backward(grad_out.to(dtype))
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    for ours, ref in zip(inputs, copies, strict=True):
        assert rel_l2(ours.grad, ref.grad) < TOLERANCE[dtype]
    assert x.grad.is_contiguous(memory_format=CL)


def test_rms_norm_a_test_can_fail():
    """The norm is over the channels (not the voxels), the clamped voxel's gradient is g / eps, and eps goes under
    the root unless clamped: a kernel that normalised the wrong way, let the gradient through the clamped norm, or
    mixed up the two ways of using eps, is far off."""
    x = torch.randn(1, 4, 2, 3, 3).contiguous(memory_format=CL)
    ours = torch.ops.tconv3d.rms_norm(x, None, None, 1e-12, "none", True)
    assert rel_l2(ours, F.normalize(x, dim=1) * 2) < TOLERANCE[torch.float32]
    assert rel_l2(ours, F.normalize(x.flatten(2), dim=2).view_as(x) * 2) > 0.1
    for clamp in (False, True):  # eps = 1: the two ways differ by a factor between 1 and sqrt(2) a voxel
        expected = rms_reference(x, None, None, 1.0, "none", clamp)
        assert rel_l2(torch.ops.tconv3d.rms_norm(x, None, None, 1.0, "none", clamp), expected) < 1e-6
        assert rel_l2(torch.ops.tconv3d.rms_norm(x, None, None, 1.0, "none", not clamp), expected) > 0.05


@pytest.mark.parametrize("path", ["kernels", "aten"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_rms_norm_of_one_channel_is_its_sign(dtype, path, device, monkeypatch):
    """F.normalize over one channel (Wan's test configs have such a norm) is x / |x| = +-1 exactly, and its
    gradient exactly 0: the kernels divide by the divisor, correctly rounded. Times its inverse, x^ came out 1 +- an
    ulp, and the input gradient (1 - x^^2) g / |x| of rounding alone, larger the nearer x is to 0: a converted Wan
    VAE's input gradient 1e-4-1e-2 off in fp32 (tests/fuzz_models.py)."""
    if path == "aten":
        monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
        device = "cpu"
    x = torch.randn(2, 1, 3, 4, 5, device=device) * torch.logspace(-6, 2, 120, device=device).view(2, 1, 3, 4, 5)
    x = leaf_copy(x.to(dtype).contiguous(memory_format=CL))
    weight, bias = (leaf_copy(torch.randn(1, device=device).to(dtype)) for _ in range(2))
    for activation in ("none", "silu"):
        y = torch.ops.tconv3d.rms_norm(x, weight, bias, 1e-12, activation, True)
        expected = x.detach().float().sign() * weight.detach().float() + bias.detach().float()
        if activation == "silu":  # SiLU's own rounding may differ by an ulp from torch's
            assert rel_l2(y, F.silu(expected)) < TOLERANCE[dtype]
        else:
            assert torch.equal(y, expected.to(dtype))
        (grad_x,) = torch.autograd.grad(y, x, torch.randn_like(y))
        assert torch.equal(grad_x, torch.zeros_like(grad_x))


@pytest.mark.parametrize("clamp", [False, True], ids=["rms", "clamp"])
def test_rms_norm_any_layout_and_deterministic_gradients(clamp, device):
    x = torch.randn(2, 16, 3, 6, 5, device=device)  # NCDHW: converted once, output channels_last_3d
    w, b = torch.randn(16, device=device), torch.randn(16, device=device)
    y = torch.ops.tconv3d.rms_norm(x, w, b, 1e-6, "silu", clamp)
    assert y.is_contiguous(memory_format=CL)
    expected = rms_reference(x.double(), w.double(), b.double(), 1e-6, "silu", clamp)
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]
    grads = []
    for _ in range(2):
        xs, ws = leaf_copy(x), leaf_copy(w)
        torch.ops.tconv3d.rms_norm(xs, ws, b, 1e-6, "silu", clamp).square().sum().backward()
        grads.append((xs.grad, ws.grad))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(
    ("shape", "eps", "message"),
    [
        ((1, 6, 3, 3), 1e-12, "must be 5-D"),
        ((1, 6, 2, 3, 3), 0.0, "eps must be a positive number"),
        ((1, 4097, 1, 1, 1), 1e-12, "at most 4096 channels"),
    ],
)
def test_bad_rms_norm_arguments(shape, eps, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.tconv3d.rms_norm(torch.randn(shape), None, None, eps, "none")
    with pytest.raises(ValueError, match=r"weight must have shape \(6,\)"):
        torch.ops.tconv3d.rms_norm(torch.randn(1, 6, 2, 3, 3), torch.randn(5), None, 1e-12, "none")


def test_opcheck_rms_norm(device):
    x = torch.randn(2, 6, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(6, device=device, requires_grad=True)
    b = torch.randn(6, device=device, requires_grad=True)
    for activation in RMS_FUSED:
        torch.library.opcheck(torch.ops.tconv3d.rms_norm.default, (x, w, b, 1e-12, activation, True))
        torch.library.opcheck(torch.ops.tconv3d.rms_norm.default, (x, None, None, 1e-6, activation))


@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_a_group_of_one_value_has_no_input_gradient(path, device, monkeypatch):
    """A group holding one value (one channel a group, one voxel, a batch past one, which torch takes) normalizes
    to 0 whatever the value: the input gradient is exactly 0. dy' * k1 + k3 left their rounding, rstd times dy's
    size, 1e-4 of dy at eps 1e-6 (tests/fuzz_args.py, seed 440726)."""
    if path == "aten":
        monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
        device = "cpu"
    norm = tconv3d.nn.GroupNorm(4, 4, eps=1e-6, activation="silu").to(device)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    for dtype in (torch.float16, torch.float32):
        x = leaf_copy(torch.randn(3, 4, 1, 1, 1, device=device, dtype=dtype))
        (grad,) = torch.autograd.grad(norm(x), x, torch.randn_like(x) * 100)
        assert not grad.any(), grad.flatten()


@pytest.mark.parametrize("eps", [0.0, -1.0])
@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_a_group_of_one_value_at_eps_not_above_zero_has_torchs_nan_gradient(eps, path, device, monkeypatch):
    """At eps <= 0 a group of one value has no finite rstd: the output is NaN, and so is the input gradient, as
    torch's, not the 0 of a finite rstd (tests/fuzz_args.py, seeds 3005125 and 3015176: eps -1)."""
    if path == "aten":
        monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
        device = "cpu"
    norm, stock = tconv3d.nn.GroupNorm(4, 4, eps=eps).to(device), torch.nn.GroupNorm(4, 4, eps=eps).to(device)
    for dtype in (torch.float16, torch.float32):
        x = leaf_copy(torch.randn(3, 4, 1, 1, 1, device=device, dtype=dtype))
        g = torch.randn_like(x)
        (grad,) = torch.autograd.grad(norm(x), x, g)
        (expected,) = torch.autograd.grad(stock.to(dtype)(x), x, g)
        assert expected.isnan().all() and grad.isnan().all(), grad.flatten()


@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_a_gradient_constant_over_a_channel_of_a_constant_input_has_no_input_gradient(path, device, monkeypatch):
    """With one channel a group (InstanceNorm3d, BatchNorm3d), a constant input and a gradient constant over each
    channel (y.sum()'s), the input gradient is exactly 0: dy' is centered before rstd scales it. dy' * k1 + k3
    left the rounding of two terms rstd times dy's size (tests/fuzz_args.py, seed 534638: 2.6e-3 of fp16's
    bound's floor at eps 1e-6). Values whose sums are exact, so that the means are."""
    if path == "aten":
        monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
        device = "cpu"
    torch.manual_seed(0)
    for module in (tconv3d.nn.InstanceNorm3d(3, eps=1e-6, affine=True), tconv3d.nn.BatchNorm3d(3, eps=1e-6)):
        module = module.to(device)
        for _ in range(4):
            with torch.no_grad():
                module.weight.normal_(), module.bias.normal_()
            for dtype in (torch.float16, torch.float32):
                x = leaf_copy(torch.full((2, 3, 3, 2, 4), 0.75, device=device, dtype=dtype))
                g = (torch.randint(-64, 64, (1, 3, 1, 1, 1), device=device) / 8).to(dtype).expand(x.shape)
                (grad,) = torch.autograd.grad(module(x), x, g)
                assert not grad.any(), (type(module).__name__, dtype, grad.abs().max())


@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_an_empty_batch_normalizes_as_torch_does(path, device, monkeypatch):
    """GroupNorm, InstanceNorm3d and BatchNorm3d of an empty batch (or an empty clip) answer an empty output and
    gradient, as torch's do, and zero gradients for their parameters, as torch's GroupNorm does for an empty batch
    (for an empty clip of a batch torch's are NaN, the NaN statistics times empty sums); aten's path (a CPU user's)
    split a group's values with reshape(n, groups, -1), which an empty batch makes ambiguous: a RuntimeError from
    reshape.
    An affine InstanceNorm3d answers so too, where torch's raises an IndexError (docs/upstream.md). From torch 2.14
    on, torch's group_norm refuses an input of no voxel (an empty clip); GroupNorm then refuses it as stock's."""
    if path == "aten":
        monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
        device = "cpu"
    for shape in ((0, 4, 2, 3, 2), (0, 4, 0, 3, 2), (2, 4, 2, 0, 2)):
        x = leaf_copy(torch.randn(shape, device=device).contiguous(memory_format=CL))
        modules = (tconv3d.nn.GroupNorm(2, 4), tconv3d.nn.InstanceNorm3d(4), tconv3d.nn.InstanceNorm3d(4, affine=True),
                   tconv3d.nn.BatchNorm3d(4))  # fmt: skip
        try:
            nn.GroupNorm(2, 4).to(device)(x)
        except RuntimeError as error:  # torch 2.14 on, an empty clip
            assert "HxW" in str(error) and 0 in shape[2:], error
            with pytest.raises(RuntimeError, match="HxW"):
                modules[0].to(device)(x)
            modules = modules[1:]
        for module in modules:
            y = module.to(device)(x)
            assert y.shape == x.shape and y.is_contiguous(memory_format=CL)
            grads = torch.autograd.grad(y, (x, *module.parameters()), torch.randn_like(y))
            assert grads[0].shape == x.shape
            for grad, parameter in zip(grads[1:], module.parameters(), strict=True):
                assert grad.shape == parameter.shape and not grad.any()


@pytest.mark.parametrize("refuses", [True, False], ids=["torch_2_14_on", "torch_2_13"])
def test_every_group_norm_of_no_voxel_answers_as_torchs(refuses, monkeypatch):
    """Where torch's group_norm refuses an input of no voxel (2.14 on), so does every group norm of tconv3d.nn: the
    module, and the video VAEs' adapters that call the group norm themselves (a norm over each frame, a norm then
    SiLU in one pass), which answered it empty, where their stock blocks refuse it. Instance norms answer it empty,
    as torch's instance_norm does, on every path; before 2.14 so do the group norms."""
    from tconv3d.nn import modules
    from tconv3d.nn.video_vaes import frame_group_norm, norm_then_activation

    monkeypatch.setattr(modules, "_group_norm_refuses_no_voxel", lambda: refuses)
    x = torch.randn(1, 4, 2, 0, 3).contiguous(memory_format=CL)
    group, instance = tconv3d.nn.GroupNorm(2, 4), tconv3d.nn.InstanceNorm3d(4, affine=True)
    for norm in (group, instance):
        calls = [partial(norm, x), partial(norm_then_activation, norm, nn.SiLU(), x)]
        if norm is group:
            calls += [partial(frame_group_norm, norm, x), partial(frame_group_norm, norm, x, "silu")]
        for call in calls:
            if refuses and norm is group:
                with pytest.raises(RuntimeError, match="Expected HxW to be greater than 0"):
                    call()
            else:
                assert call().shape == x.shape
    assert instance(x[0]).shape == x.shape[1:]  # unbatched (C, D, H, W)


# ---------------------------------------------------------------------------------------------------------------
# BatchNorm3d: batch statistics by the GroupNorm kernels over the batch folded into the frames


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("shape", [(2, 6, 3, 4, 5), (1, 5, 2, 3, 3), (3, 8, 2, 20, 20)], ids=["n2", "n1", "splits"])
def test_batch_norm_matches_float64(shape, affine, momentum, dtype, device):
    """Two training steps of tconv3d.nn.BatchNorm3d against nn.BatchNorm3d in float64 from the same state: the
    output (channels_last_3d), the input and parameter gradients, the running statistics (momentum, or their
    cumulative average) and num_batches_tracked; then eval, by the running statistics. The input's channels sit
    30 standard deviations off zero, so a one-pass variance would lose digits the kernels must keep."""
    torch.manual_seed(0)
    stock = nn.BatchNorm3d(shape[1], momentum=momentum, affine=affine).to(device).double()
    with torch.no_grad():
        if affine:
            stock.weight.normal_(), stock.bias.normal_()
        stock.running_mean.normal_(), stock.running_var.uniform_(0.5, 2.0)
    ours = tconv3d.nn.BatchNorm3d(shape[1], momentum=momentum, affine=affine).to(device)
    ours.load_state_dict(stock.state_dict())
    ours = ours.to(dtype) if dtype != torch.float32 else ours
    params = list(ours.parameters())
    for _ in range(2):
        offsets = torch.randn(1, shape[1], 1, 1, 1, device=device) * 30
        x = leaf_copy((torch.randn(shape, device=device) + offsets).to(dtype).contiguous(memory_format=CL))
        reference = leaf_copy(x.detach().double())
        y, expected = ours(x), stock(reference)
        assert y.is_contiguous(memory_format=CL) and y.dtype == dtype
        assert rel_l2(y, expected) < TOLERANCE[dtype]
        grad = torch.randn_like(expected)
        got = torch.autograd.grad(y, [x, *params], grad.to(dtype))
        want = torch.autograd.grad(expected, [reference, *stock.parameters()], grad)
        for g, w in zip(got, want, strict=True):
            assert rel_l2(g, w) < TOLERANCE[dtype]
        # the running statistics keep the module's dtype; their error is its rounding
        assert rel_l2(ours.running_mean, stock.running_mean) < TOLERANCE[dtype]
        assert rel_l2(ours.running_var, stock.running_var) < TOLERANCE[dtype]
        assert torch.equal(ours.num_batches_tracked, stock.num_batches_tracked)
    ours.eval(), stock.eval()
    assert rel_l2(ours(x), stock(reference)) < TOLERANCE[dtype]


@pytest.mark.parametrize("momentum", [0.1, 0.75, None], ids=["momentum", "momentum_past_half", "cumulative"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_running_statistics_launch_moves_them_as_torch_ops_do(dtype, momentum, device):
    """update_running_statistics (one launch: the count, then both statistics) against the torch ops the module
    runs where it is traced, from the same batch mean and rstd: bit for bit under triton 3.9's interpreter (IEEE
    divisions, torch's lerp on each side of a factor of 0.5, its products and sums fused as torch's CPU kernel
    fuses them); on a GPU (CUDA's lerp as nvcc contracts it) and under triton 3.6's interpreter (its tl.fma rounds
    the product first), within two ulps of the larger of the running value and the statistic it moves towards.
    Three steps, so that a cumulative average's factor is 1 / count at each."""
    from packaging.version import Version

    from tconv3d.kernels.group_norm import update_running_statistics

    torch.manual_seed(0)
    c, values, eps = 37, 96, 1e-5
    ours = [torch.randn(c, device=device).to(dtype), torch.rand(c, device=device).add(0.5).to(dtype)]
    theirs = [t.clone() for t in ours]
    count, their_count = (torch.tensor(3, device=device) for _ in range(2))
    for _ in range(3):
        mean = torch.randn(c, device=device) * 4
        rstd = torch.rand(c, device=device).add(0.2)
        rstd[0] = 1 / eps**0.5  # a constant channel: the variance 0 (clamped)
        update_running_statistics(mean, rstd, *ours, count, momentum, eps, values)
        their_count.add_(1)
        factor = 1.0 / float(their_count) if momentum is None else momentum
        variance = (rstd.pow(-2) - eps).clamp_min_(0).mul_(values / (values - 1))
        statistics = [mean.to(dtype), variance.to(dtype)]
        scales = [torch.maximum(t.abs(), s.abs()).float() for t, s in zip(theirs, statistics, strict=True)]
        torch._foreach_lerp_(theirs, statistics, factor)
        assert torch.equal(count, their_count)
        exact = device == "cpu" and Version(triton.__version__) >= Version("3.9")
        for got, expected, scale in zip(ours, theirs, scales, strict=True):
            if exact:
                assert torch.equal(got, expected), (got - expected).abs().max()
            else:
                assert ((got.float() - expected.float()).abs() <= 2 * torch.finfo(dtype).eps * scale).all()


def test_running_statistics_moved_in_place_as_torch_ops_move_them(device):
    """A graph that read the running statistics sees them moved by a training forward: autograd's version check
    refuses its backward, as it did after the torch ops that moved them before the launch (stock's batch_norm moves
    them without a version: such a backward reads the moved values); and buffers made in inference mode are moved
    there too."""
    module = tconv3d.nn.BatchNorm3d(4).to(device)
    x = torch.randn(2, 4, 3, 4, 5, device=device).contiguous(memory_format=CL)
    weight = torch.ones(4, device=device, requires_grad=True)
    read = (module.running_mean * weight).sum()  # saves running_mean for its backward
    module(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        read.backward()
    with torch.inference_mode():
        stock, ours = nn.BatchNorm3d(4).to(device), tconv3d.nn.BatchNorm3d(4).to(device)
        x = torch.randn(2, 4, 3, 4, 5, device=device).contiguous(memory_format=CL)
        stock(x), ours(x)
        assert rel_l2(ours.running_var, stock.running_var) < TOLERANCE[torch.float32]
        assert torch.equal(ours.num_batches_tracked, stock.num_batches_tracked)


def test_batch_norm_on_fake_tensors_moves_its_statistics_in_torch_ops(device):
    """A training BatchNorm3d traced on fake tensors (as Dynamo and AOTAutograd trace it: the norm's fake, the
    running statistics in torch's ops) answers the eager output's shape and layout; the launch that moves them
    eagerly takes no fake tensor (tests/fuzz_args.py, seed 660551: "Attempted to set the storage of a tensor on
    device meta")."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(2, 4, 3, 4, 5, device=device).contiguous(memory_format=CL)

    def faked(module):
        mode = FakeTensorMode(allow_non_fake_inputs=True)  # the module's parameters and buffers stay real
        with mode:
            return module(mode.from_tensor(x))

    y = faked(tconv3d.nn.BatchNorm3d(4).to(device))
    assert y.shape == x.shape and y.is_contiguous(memory_format=CL)
    # A cumulative average reads its count on the host, in stock's module as in the torch ops: refused alike where
    # torch refuses it (2.13), answered alike where it does not (2.14)
    try:
        want = faked(nn.BatchNorm3d(4, momentum=None).to(device))
    except Exception as error:
        with pytest.raises(type(error)):
            faked(tconv3d.nn.BatchNorm3d(4, momentum=None).to(device))
    else:
        got = faked(tconv3d.nn.BatchNorm3d(4, momentum=None).to(device))
        assert got.shape == want.shape and got.is_contiguous(memory_format=CL)


def test_norm_launches_and_allocations(device, monkeypatch):
    """What a norm call costs the host: GroupNorm's forward and backward three launches each, with a fused SiLU or
    without (a = rstd * weight and b = bias taken where they are read, no fold of them); the backward's k1, k2, k3
    one table; parameter gradients written in the parameters' dtype (no casts after): allocations, the forward's
    partials, mean, rstd and output, the backward's partials, table, two parameter gradients and input gradient. A
    BatchNorm3d's training forward one launch more, which moves both running statistics and counts the batch. The
    RMS norm's (Wan's: a weight, no bias) backward two launches: its kernel, and one sum of both parameter
    gradients' partials, written in the weight's dtype."""
    from tconv3d.kernels import group_norm, rms_norm, split_k

    launched, real, stubbed = [], group_norm.launch, [False]

    def recording(kernel, *args, **kwargs):
        launched.append(kernel.__name__.strip("_").removesuffix("_kernel"))
        return None if stubbed[0] else real(kernel, *args, **kwargs)

    made = ("aten::empty", "aten::empty_strided", "aten::empty_like")

    def host_ops(fn) -> list:  # the aten ops fn runs on the host, its launches stubbed; not an allocation's own
        stubbed[0] = True
        try:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
                fn()
        finally:
            stubbed[0] = False
        return [e.name for e in profile.events() if e.cpu_parent is None or e.cpu_parent.name not in made]

    def allocations(ops) -> int:
        return sum(ops.count(op) for op in made)

    for module in (group_norm, rms_norm, split_k):
        monkeypatch.setattr(module, "launch", recording)
    x = leaf_copy(torch.randn(2, 8, 3, 4, 5, device=device, dtype=torch.bfloat16).contiguous(memory_format=CL))
    passes = ["channel_reduce", "fold", "affine"]
    for activation in (None, "silu"):
        norm = tconv3d.nn.GroupNorm(2, 8, activation=activation).to(device, torch.bfloat16)
        launched.clear()
        y = norm(x)
        assert launched == passes
        grad = torch.randn_like(y)
        launched.clear()
        grads = torch.autograd.grad(y, (x, *norm.parameters()), grad, retain_graph=True)
        assert launched == passes, (activation, launched)
        assert all(g.dtype == torch.bfloat16 for g in grads)
        assert allocations(host_ops(lambda norm=norm: norm(x))) == 4
        ops = host_ops(lambda norm=norm, y=y, grad=grad: torch.autograd.grad(y, (x, *norm.parameters()), grad))
        assert "aten::_to_copy" not in ops and allocations(ops) == 5, ops
    batch_norm = tconv3d.nn.BatchNorm3d(8).to(device, torch.bfloat16)
    launched.clear()
    batch_norm(x)
    assert launched == [*passes, "running_statistics"]
    assert batch_norm.num_batches_tracked.item() == 1

    weight = leaf_copy(torch.randn(8, device=device, dtype=torch.bfloat16))
    launched.clear()
    y = torch.ops.tconv3d.rms_norm(x, weight, None, 1e-6, "silu", True)
    grad = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, weight), grad, retain_graph=True)
    assert launched == ["rms_norm_fwd", "rms_norm_bwd", "sum_splits"], launched
    assert all(g.dtype == torch.bfloat16 for g in grads)
    ops = host_ops(lambda: torch.autograd.grad(y, (x, weight), grad))
    assert "aten::_to_copy" not in ops and allocations(ops) == 4, ops  # partials, 2 parameter gradients, input's


def test_batch_norm_runs_the_kernels_where_batch_statistics_normalize(device, monkeypatch):
    """Training, and eval without running statistics, normalize by the batch's: one group_norm over the (1, C,
    N * D, H, W) view; eval with running statistics, float64 and vmap are torch's batch_norm."""
    launched = []
    real = tconv3d.nn.modules.call_group_norm
    monkeypatch.setattr(tconv3d.nn.modules, "call_group_norm", lambda *a: launched.append(a[0].shape) or real(*a))
    x = torch.randn(2, 4, 3, 5, 6, device=device).contiguous(memory_format=CL)
    norm = tconv3d.nn.BatchNorm3d(4).to(device)
    norm(x)
    assert launched == [(1, 4, 6, 5, 6)]
    norm.eval()(x)
    tconv3d.nn.BatchNorm3d(4, track_running_stats=False).to(device).eval()(x.contiguous())  # NCDHW in: copied
    assert launched == [(1, 4, 6, 5, 6)] * 2
    tconv3d.nn.BatchNorm3d(4).to(device).double()(x.double())
    # under vmap, torch's answer, whatever it is: torch 2.11's CUDA batch_norm refuses a batched input in training
    # ("NYI: querying is_contiguous inside of vmap", H200 run 6), as stock's module does
    try:
        expected = torch.func.vmap(nn.BatchNorm3d(4, track_running_stats=False).to(device))(x[None])
    except RuntimeError as refusal:
        with pytest.raises(RuntimeError, match=re.escape(str(refusal).splitlines()[0])):
            torch.func.vmap(tconv3d.nn.BatchNorm3d(4, track_running_stats=False).to(device))(x[None])
    else:
        got = torch.func.vmap(tconv3d.nn.BatchNorm3d(4, track_running_stats=False).to(device))(x[None])
        torch.testing.assert_close(got, expected)
    assert len(launched) == 2


def test_batch_norm_a_test_can_fail(device):
    """A BatchNorm whose variance is off by 1% (eps 2e-2 at unit variance) is 1e-2 away from float64: well past the
    float32 bound the module is held to."""
    x = torch.randn(2, 4, 3, 4, 5, device=device).contiguous(memory_format=CL)
    expected = nn.BatchNorm3d(4).to(device).double()(x.double())
    assert rel_l2(tconv3d.nn.BatchNorm3d(4, eps=2e-2).to(device)(x), expected) > 100 * TOLERANCE[torch.float32]


def test_batch_norm_of_one_value_a_channel_is_refused_as_torch_does(device):
    norm = tconv3d.nn.BatchNorm3d(3).to(device)
    x = torch.randn(1, 3, 1, 1, 1, device=device)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training") as ours:
        norm(x)
    with pytest.raises(ValueError) as stock:
        nn.BatchNorm3d(3).to(device)(x)
    assert str(ours.value) == str(stock.value)
    assert norm.eval()(x).shape == x.shape  # eval normalizes by the running statistics
    with pytest.raises(ValueError, match="expected 5D input"):
        norm.train()(torch.randn(2, 3, 4, 4, device=device))


def test_batch_norm_compiles_whole(device):
    """A training step of a converted conv + BatchNorm under torch.compile(fullgraph=True): the running statistics
    updated as eager updates them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU()).to(device)
    twin = tconv3d.nn.convert(copy.deepcopy(model))
    tconv3d.nn.convert(model)
    assert type(model[1]) is tconv3d.nn.BatchNorm3d
    x = torch.randn(2, 3, 3, 5, 5, device=device).contiguous(memory_format=CL)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    assert rel_l2(y, twin(x)) < TOLERANCE[torch.float32]
    assert rel_l2(model[1].running_var, twin[1].running_var) < TOLERANCE[torch.float32]
    assert model[1].num_batches_tracked.item() == twin[1].num_batches_tracked.item() == 1
