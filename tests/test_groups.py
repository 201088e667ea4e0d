"""Grouped and depthwise convolution in every entry point, against float64; unbatched inputs; PyTorch's own
OpInfo samples for nn.functional.conv3d."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, dtype_id, leaf_copy, poison_aten_convolution
from test_compile import FORBIDDEN, call_targets, capture_graphs, forward_backward
from torch import nn

import tconv3d
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import grouped
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d


# (name, batch, cin, cout, groups, size, kernel, stride, padding, dilation): odd channel counts per group (3, 5),
# channel multipliers 1, 2, 3, 4 and 32 (the depthwise kernels read a power of two's channels as one run and gather
# the others, and the input gradient gathers where the run would pass _DGRAD_REPEAT_COLUMNS), sizes no tile divides.
GROUP_CASES = [
    ("groups2_odd", 2, 6, 10, 2, (4, 5, 6), 3, 1, 1, 1),
    ("groups4_mult2", 1, 8, 16, 4, (3, 5, 4), 3, 2, 1, 1),
    ("groups2_stride_1_2_2", 1, 10, 6, 2, (3, 6, 7), 3, (1, 2, 2), (0, 1, 1), 1),
    ("groups2_dilation2_asym", 1, 4, 4, 2, (5, 6, 5), 3, 1, (2, 1, 0, 2, 1, 2), 2),
    # 16 channels a group keep their own GEMMs; 8 a group run 8 groups side by side (kernels/grouped.py), here as
    # 2 coarse groups, where the cases above become one dense block-diagonal convolution
    ("groups2_16_a_group", 1, 32, 32, 2, (3, 4, 5), 3, 1, 1, 1),
    ("groups16_8_a_group", 1, 128, 64, 16, (2, 3, 4), 3, 1, 1, 1),
    # 3 input and 2 output channels a group, 16 side by side: blocks of 3 along 48 channels, at stride 2
    ("groups32_3_a_group_s2", 1, 96, 64, 32, (4, 5, 6), 3, 2, 1, 1),
    # 17 input and 3 output channels a group: the weight gradient's (tap, output channel) rows, a group a program
    ("groups2_few_out", 1, 34, 6, 2, (3, 5, 6), 3, 1, 1, 1),
    ("depthwise", 2, 5, 5, 5, (4, 5, 6), 3, 1, 1, 1),
    ("depthwise_mult2_stride2", 1, 3, 6, 3, (5, 6, 7), 3, 2, 1, 1),
    ("depthwise_stride_1_2_2_k133", 1, 4, 4, 4, (3, 7, 6), (1, 3, 3), (1, 2, 2), (0, 1, 1), 1),
    ("depthwise_dilation2_asym", 1, 3, 6, 3, (6, 5, 7), 3, 1, (2, 0, 1, 2, 2, 1), 2),
    ("depthwise_mult3", 1, 4, 12, 4, (3, 5, 6), 3, 1, 1, 1),
    ("depthwise_mult4_stride2", 1, 5, 20, 5, (5, 6, 5), 3, 2, 1, 1),
    ("depthwise_mult32_k133", 1, 2, 64, 2, (2, 3, 5), (1, 3, 3), 1, (0, 1, 1), 1),
]


def _kernel(k):
    return (k,) * 3 if isinstance(k, int) else k


def _reference_conv(x, w, b, stride, padding, dilation, groups):
    if isinstance(padding, tuple) and len(padding) == 6:  # F.pad takes (w, h, d) pairs
        x = F.pad(x, (padding[4], padding[5], padding[2], padding[3], padding[0], padding[1]))
        padding = 0
    return F.conv3d(x, w, b, stride, padding, dilation, groups)


def _run(case, dtype, device, before_ours=None):
    _, batch, cin, cout, groups, size, kernel, stride, padding, dilation = case
    x = leaf_copy(torch.randn(batch, cin, *size, device=device).to(dtype).contiguous(memory_format=CL))
    fan_in = cin // groups * _kernel(kernel)[0] * _kernel(kernel)[1] * _kernel(kernel)[2]
    w = leaf_copy((torch.randn(cout, cin // groups, *_kernel(kernel), device=device) / fan_in**0.5).to(dtype))
    b = leaf_copy(torch.randn(cout, device=device).to(dtype))
    x64, w64, b64 = (leaf_copy(t.double()) for t in (x, w, b))
    ref = _reference_conv(x64, w64, b64, stride, padding, dilation, groups)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    if before_ours is not None:
        before_ours()
    y = tconv3d.conv3d(x, w, b, stride, padding, dilation, groups)
    y.backward(grad_out.to(dtype))
    return (y, x.grad, w.grad, b.grad), (ref, x64.grad, w64.grad, b64.grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c[0])
def test_grouped_and_depthwise_match_float64(case, dtype, device, monkeypatch):
    kernels_run = tconv3d.CPU_BACKEND == "triton" or device == "cuda"
    poison = (lambda: poison_aten_convolution(monkeypatch)) if kernels_run else None  # the kernels must do it
    ours, expected = _run(case, dtype, device, poison)
    for name, o, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert o.shape == e.shape and o.dtype == dtype, name
        assert rel_l2(o, e) < TOLERANCE[dtype], name
    assert ours[0].is_contiguous(memory_format=CL) and ours[1].is_contiguous(memory_format=CL)


@pytest.mark.parametrize("case", GROUP_CASES, ids=lambda c: c[0])
def test_depthwise_runs_the_direct_kernels(case, device):
    _, batch, cin, cout, groups, size, kernel, stride, padding, dilation = case
    x = torch.randn(batch, cin, *size, device=device)
    w = torch.randn(cout, cin // groups, *_kernel(kernel), device=device)
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    plan = tconv3d.explain(x, w, None, stride, padding, dilation, groups)
    variants = {direction: p["variant"] for direction, p in plan.items()}
    if cin == groups:
        assert variants == dict.fromkeys(plan, "direct")
    else:  # a grouped GEMM, on whichever GEMM kernel the device's heuristic takes (on an H100: the TMA input gradient)
        assert set(variants.values()) <= {"pointer", "tma", "gluon"}, variants


@pytest.mark.parametrize(
    "groups, channels, factor",
    [(32, 8, 8), (16, 4, 16), (64, 2, 16), (6, 4, 6), (2, 3, 2), (2, 16, 1), (4, 64, 1), (8, 1, 1), (1, 8, 1)],
)
def test_groups_side_by_side_where_a_group_has_few_channels(groups, channels, factor):
    """The fewest neighbouring groups whose channels reach a 128-byte row, else the most within MAX_FACTOR;
    depthwise (the direct kernels'), dense and 16+ channels a group are left as they are."""
    geom = conv_geometry((1, groups * channels, 4, 4, 4), (groups * 8, channels, 3, 3, 3), 1, 1, 1, groups=groups)
    assert grouped.factor(geom) == factor
    coarse = grouped.coarsened(geom)
    assert (coarse is geom) == (factor == 1)
    again = dataclasses.replace(geom)  # equal, not the same: what a memo of the first must not answer for
    assert (grouped.coarsened(again) is again) == (factor == 1)
    assert coarse.groups == groups // factor and coarse.group_in_channels == channels * factor
    assert coarse.weight_shape()[1:] == (channels * factor, 3, 3, 3)


def test_block_diagonal_weights_compute_the_grouped_convolution():
    """In float64 through aten: the coarse convolution of the block-diagonal weight is the grouped one, and the
    diagonal blocks of the coarse weight gradient are the grouped weight gradient."""
    geom = conv_geometry((2, 64, 3, 4, 5), (96, 2, 3, 1, 3), 1, (1, 0, 1), 1, groups=32)
    coarse = grouped.coarsened(geom)
    assert coarse.groups == 2  # 16 groups of 2 input and 3 output channels side by side, twice
    x = torch.randn(geom.input_shape(), dtype=torch.float64).contiguous(memory_format=CL)
    w = torch.randn(geom.weight_shape(), dtype=torch.float64).contiguous(memory_format=CL)
    dense = grouped.block_diagonal(w, coarse, 16)
    assert dense.shape == coarse.weight_shape() and dense.is_contiguous(memory_format=CL)
    assert torch.count_nonzero(dense) == w.numel()
    args = (1, (1, 0, 1), 1)
    assert rel_l2(F.conv3d(x, dense, None, *args, coarse.groups), F.conv3d(x, w, None, *args, geom.groups)) < 1e-14
    grad_out = torch.randn(geom.output_shape(), dtype=torch.float64)
    coarse_grad = torch.nn.grad.conv3d_weight(x, coarse.weight_shape(), grad_out, *args, coarse.groups)
    grad = grouped.diagonal_blocks(coarse_grad.contiguous(memory_format=CL), coarse, 16)
    assert grad.is_contiguous(memory_format=CL)
    expected = torch.nn.grad.conv3d_weight(x, geom.weight_shape(), grad_out, *args, geom.groups)
    assert rel_l2(grad, expected) < 1e-14


@pytest.mark.parametrize("tiles", ["chosen", "gpu_heuristic_tiles"])
@pytest.mark.parametrize(
    "case", [c for c in GROUP_CASES if c[0].startswith(("groups16", "groups32"))], ids=lambda c: c[0]
)
def test_side_by_side_groups_read_their_weight_in_place(case, tiles, device, request, monkeypatch):
    """The pointer kernels' forward and input gradient read a grouped weight's blocks where they lie (DIAG_CI), and
    the weight gradient stores its blocks alone: no block-diagonal weight is made, no coarse gradient copied, and
    the results match float64."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    if tiles != "chosen":
        request.getfixturevalue(tiles)
    monkeypatch.setattr(tconv3d.settings, "KERNELS", "pointer")
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    made = []
    monkeypatch.setattr(grouped, "block_diagonal", lambda *args: made.append(args[1:]))
    monkeypatch.setattr(grouped, "diagonal_blocks", lambda *args: made.append(args[1:]))
    ours, expected = _run(case, torch.float32, device)
    assert not made
    for name, o, e in zip(("output", "input grad", "weight grad", "bias grad"), ours, expected, strict=True):
        assert rel_l2(o, e) < TOLERANCE[torch.float32], name


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_side_by_side_groups_of_odd_channels_in_views_of_even_rows(dtype, device, monkeypatch):
    """A transposed conv of 3 groups of 9 input channels (run side by side, the weight's blocks read in place)
    over a channel slice of a 28-channel tensor: its rows' strides are even, its groups' 9 channels odd, and the
    input-gradient kernel ran them in runs of 2, one channel short a group (a wrong output, 0.13 off: fuzz run
    51). The forward and gradients against float64."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    monkeypatch.setattr(tconv3d.settings, "KERNELS", "pointer")
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    wide = torch.randn(2, 28, 2, 3, 4, device=device).to(dtype).contiguous(memory_format=CL)
    x = wide[:, 1:].requires_grad_()  # a view (leaf_copy would clone it dense)
    w = leaf_copy((torch.randn(27, 2, 3, 3, 1, device=device) / 5).to(dtype))
    args = ((3, 2, 1), (0, 4, 1), (1, 1, 0), 3, (1, 2, 1))  # stride, padding, output padding, groups, dilation
    y = tconv3d.conv_transpose3d(x, w, None, *args)
    x64, w64 = (leaf_copy(t.double()) for t in (x, w))
    ref = F.conv_transpose3d(x64, w64, None, *args)
    _backward_matches(y, ref, {"input grad": (x, x64), "weight grad": (w, w64)})


def _backward_matches(y, ref, leaves: dict) -> None:
    """y (of its dtype) and its float64 reference `ref`, then, after one random output gradient through both, each
    named (leaf, float64 leaf) pair's gradients, within the dtype's bound."""
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y.backward(grad_out.to(y.dtype))
    assert rel_l2(y, ref) < TOLERANCE[y.dtype], "output"
    for name, (leaf, leaf64) in leaves.items():
        assert rel_l2(leaf.grad, leaf64.grad) < TOLERANCE[y.dtype], name


def test_explain_says_which_groups_run_side_by_side(device):
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    x = torch.randn(1, 128, 2, 3, 4, device=device)
    plan = tconv3d.explain(x, torch.randn(64, 8, 3, 3, 3, device=device), None, 1, 1, 1, 16)
    assert {direction: p["block_diagonal"] for direction, p in plan.items()} == dict.fromkeys(plan, 8)
    in_place = {d: p["weight_in_place"] for d, p in plan.items()}
    assert in_place == {d: plan[d]["variant"] == "pointer" for d in ("fwd", "dgrad", "wgrad")}, plan
    plan = tconv3d.explain(x, torch.randn(64, 16, 3, 3, 3, device=device), None, 1, 1, 1, 8)
    assert not any("block_diagonal" in p for p in plan.values())


def test_depthwise_weight_gradient_is_deterministic(device):
    x = torch.randn(2, 8, 6, 7, 8, device=device).contiguous(memory_format=CL)
    w = torch.randn(16, 1, 3, 3, 3, device=device, requires_grad=True)
    grad_out = torch.randn(2, 16, 6, 7, 8, device=device)
    grads = []
    for _ in range(2):
        tconv3d.conv3d(x, w, None, 1, 1, 1, 8).backward(grad_out)
        grads.append(w.grad.clone())
        w.grad = None
    assert torch.equal(grads[0], grads[1])


def test_depthwise_kernels_index_in_int64_past_int32(monkeypatch):
    """The direct kernels index in int32 unless an offset into one of their tensors may pass 2^31 - 1 (WIDE):
    the decision on shapes and strides alone, and the WIDE kernels (forced here on small tensors) as right."""
    from tconv3d.kernels import conv_depthwise

    assert conv_depthwise._wide(torch.empty(2**15, 2**16, device="meta"))  # last offset 2^31 - 1
    assert not conv_depthwise._wide(torch.empty(2**31 - 1, device="meta"), torch.empty(7))  # 2^31 - 2
    assert conv_depthwise._wide(torch.empty(3, device="meta").as_strided((2, 2), (2**31, 1)))  # strides, not numel
    assert not conv_depthwise._wide(torch.empty(1, device="meta").expand(2**32))  # stride 0: every offset 0
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("no kernels run on this path")
    monkeypatch.setattr(conv_depthwise, "_INT32_ELEMENTS", 0)
    for case in GROUP_CASES:
        if case[2] == case[4] and case[3] in (case[2], 2 * case[2]):  # depthwise, multipliers 1 and 2
            ours, expected = _run(case, torch.float32, "cpu")
            assert all(rel_l2(o, e) < TOLERANCE[torch.float32] for o, e in zip(ours, expected, strict=True)), case[0]


def test_depthwise_under_other_padding_modes_and_cached_frames(device):
    """Depthwise forward and weight gradient with replicate padding and frames_before run the grouped GEMM
    kernels (the direct kernels take zeros padding only); the input gradient borders and runs direct."""
    x = leaf_copy(torch.randn(1, 4, 3, 5, 6, device=device))
    frames = leaf_copy(torch.randn(1, 4, 2, 5, 6, device=device))
    w = leaf_copy(torch.randn(8, 1, 3, 3, 3, device=device))
    y = tconv3d.conv3d(x, w, None, 1, (2, 0, 1, 1, 1, 1), 1, 4, "replicate", frames)
    x64, f64, w64 = (leaf_copy(t.double()) for t in (x, frames, w))
    padded = F.pad(torch.cat([f64, x64], 2), (1, 1, 1, 1, 2, 0), mode="replicate")
    ref = F.conv3d(padded, w64, None, 1, 0, 1, 4)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y.backward(grad_out.float())
    for ours, expected in ((y, ref), (x.grad, x64.grad), (frames.grad, f64.grad), (w.grad, w64.grad)):
        assert rel_l2(ours, expected) < TOLERANCE[torch.float32]


def test_grouped_double_backward(device):
    x = torch.randn(1, 4, 3, 4, 5, device=device, requires_grad=True)
    w = torch.randn(6, 2, 3, 3, 3, device=device, requires_grad=True)
    y = tconv3d.conv3d(x, w, None, 1, 1, 1, 2)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    (ggw,) = torch.autograd.grad(gx.square().sum(), w)
    x64, w64 = leaf_copy(x.double()), leaf_copy(w.double())
    (ex,) = torch.autograd.grad(F.conv3d(x64, w64, None, 1, 1, 1, 2).square().sum(), x64, create_graph=True)
    (egw,) = torch.autograd.grad(ex.square().sum(), w64)
    assert rel_l2(ggw, egw) < TOLERANCE[torch.float32]


def test_opcheck_grouped_ops(device):
    x = torch.randn(1, 6, 3, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(6, 1, 3, 3, 3, device=device).requires_grad_()  # depthwise
    wg = torch.randn(9, 2, 1, 3, 3, device=device).requires_grad_()  # 3 groups
    go = torch.randn(1, 9, 3, 4, 5, device=device).contiguous(memory_format=CL)
    ops = torch.ops.tconv3d
    for args in (
        (ops.conv3d.default, (x, w, None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 6)),
        (ops.conv3d.default, (x, wg, None, [1, 1, 1], [0, 1, 1], [1, 1, 1], 3)),
        (ops.conv3d_input_grad.default, (go, wg, [1, 6, 3, 4, 5], [1, 1, 1], [0, 1, 1], [1, 1, 1], "zeros", 3)),
        (ops.conv3d_weight_grad.default, (go, x, [9, 2, 1, 3, 3], [1, 1, 1], [0, 1, 1], [1, 1, 1], "zeros", None, 3)),
    ):
        torch.library.opcheck(*args)


def test_fakes_report_grouped_shapes():
    with torch._subclasses.FakeTensorMode():
        x = torch.empty(2, 8, 4, 5, 6)
        y = torch.ops.tconv3d.conv3d(x, torch.empty(16, 2, 3, 3, 3), None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 4)
        gw = torch.ops.tconv3d.conv3d_weight_grad(
            y, x, [16, 2, 3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], "zeros", None, 4
        )
    assert y.shape == (2, 16, 4, 5, 6) and y.is_contiguous(memory_format=CL)
    assert gw.shape == (16, 2, 3, 3, 3) and gw.is_contiguous(memory_format=CL)


class MixedStack(nn.Module):
    """Dense, grouped and depthwise layers, as a channel-separated video block stacks them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv3d(4, 8, 1), nn.Conv3d(8, 8, 3, padding=1, groups=2), nn.Conv3d(8, 16, 3, padding=1, groups=8)
        )

    def forward(self, x):
        return self.layers(x)


def test_convert_takes_grouped_and_depthwise_layers(device):
    torch.manual_seed(0)
    stock = MixedStack().to(device)
    converted = tconv3d.nn.convert(MixedStack().to(device))
    converted.load_state_dict(stock.state_dict())
    assert all(type(layer) is tconv3d.nn.Conv3d for layer in converted.layers)
    x = torch.randn(1, 4, 3, 5, 6, device=device)
    stock_y, stock_grads = forward_backward(stock, x)
    ours_y, ours_grads = forward_backward(converted, x.contiguous(memory_format=CL))
    assert rel_l2(ours_y, stock_y) < TOLERANCE[torch.float32]
    for ours, reference in zip(ours_grads, stock_grads, strict=True):
        assert rel_l2(ours, reference) < TOLERANCE[torch.float32]


def test_compiled_mixed_stack_has_no_layout_ops(device):
    graphs, backend = capture_graphs()
    model = tconv3d.nn.convert(MixedStack().to(device))
    x = torch.randn(1, 4, 3, 5, 6, device=device).contiguous(memory_format=CL)
    eager_y, _ = forward_backward(model, x)
    compiled_y, _ = forward_backward(torch.compile(model, backend=backend, fullgraph=True), x)
    forward, backward = (call_targets(g) for g in graphs)
    assert forward == ["tconv3d.conv3d.default"] * 3
    assert sorted({t for t in backward if t.startswith("tconv3d.")}) == [
        "tconv3d.conv3d_input_grad.default", "tconv3d.conv3d_weight_grad.default"
    ]  # fmt: skip
    for target in forward + backward:
        assert not any(word in target for word in FORBIDDEN), target
    assert rel_l2(compiled_y, eager_y) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grouped_convs_of_a_skip_connection(transposed, dtype, device, monkeypatch):
    """A grouped conv (and transposed conv) of [x, skip] with skip passed as channels_after: 4 groups of 8
    channels run side by side as one group of 32, which then spans both sources (24 + 8). The pointer kernels read
    a group's diagonal blocks of one source only (DIAG_CI): such a launch failed its kernel's assertion (found by
    the argument fuzzer, tests/fuzz_args.py). Now it takes the block-diagonal weight and reads both sources in
    place. Output and every gradient against float64."""
    if tconv3d.CPU_BACKEND != "triton" and device == "cpu":
        pytest.skip("no kernels run on this path")
    monkeypatch.setattr(tconv3d.settings, "KERNELS", "pointer")
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    x = leaf_copy(torch.randn(2, 24, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL))
    skip = leaf_copy(torch.randn(2, 8, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL))
    w = leaf_copy((torch.randn(32, 8, 3, 3, 3, device=device) / 10).to(dtype))  # either way: 32 = 24 + 8, 8 a group
    if transposed:
        y = tconv3d.conv_transpose3d(x, w, None, 1, 1, 0, 4, channels_after=skip)
        call = lambda a, b: F.conv_transpose3d(torch.cat([a, b], 1), w64, None, 1, 1, 0, 4)  # noqa: E731
    else:
        y = tconv3d.conv3d(x, w, None, 1, 1, 1, 4, channels_after=skip)
        call = lambda a, b: F.conv3d(torch.cat([a, b], 1), w64, None, 1, 1, 1, 4)  # noqa: E731
    x64, skip64, w64 = (leaf_copy(t.double()) for t in (x, skip, w))
    _backward_matches(
        y, call(x64, skip64), {"input grad": (x, x64), "skip grad": (skip, skip64), "weight grad": (w, w64)}
    )


def test_grouped_conv_transpose(device):
    x = leaf_copy(torch.randn(1, 6, 3, 4, 5, device=device))
    w = leaf_copy(torch.randn(6, 2, 3, 3, 3, device=device))
    b = leaf_copy(torch.randn(6, device=device))
    y = tconv3d.conv_transpose3d(x, w, b, (1, 2, 2), 1, (0, 1, 1), 3)
    x64, w64, b64 = (leaf_copy(t.double()) for t in (x, w, b))
    ref = F.conv_transpose3d(x64, w64, b64, (1, 2, 2), 1, (0, 1, 1), 3)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y.backward(grad_out.float())
    for ours, expected in ((y, ref), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, expected) < TOLERANCE[torch.float32]
    module = tconv3d.nn.ConvTranspose3d(6, 6, 3, stride=2, groups=3).to(device)
    assert module(x).shape == nn.ConvTranspose3d(6, 6, 3, stride=2, groups=3).to(device)(x).shape


def test_unbatched_inputs(device):
    x = torch.randn(4, 3, 5, 6, device=device)
    w = torch.randn(8, 2, 3, 3, 3, device=device)
    y = tconv3d.conv3d(x, w, None, 1, 1, 1, 2)
    assert y.shape == (8, 3, 5, 6) and rel_l2(y, F.conv3d(x.double(), w.double(), None, 1, 1, 1, 2)) < 1e-5
    module = tconv3d.nn.Conv3d(4, 8, 3, padding=1, groups=2).to(device)
    stock = nn.Conv3d(4, 8, 3, padding=1, groups=2).to(device)
    stock.load_state_dict(module.state_dict())
    assert rel_l2(module(x), stock(x).detach()) < TOLERANCE[torch.float32]
    frames = torch.randn(4, 2, 5, 6, device=device)
    cached = tconv3d.conv3d(x, w, None, 1, (0, 0, 1, 1, 1, 1), 1, 2, frames_before=frames)
    expected = F.conv3d(F.pad(torch.cat([frames, x], 1), (1, 1, 1, 1)), w, None, 1, 0, 1, 2)
    assert rel_l2(cached, expected) < TOLERANCE[torch.float32]
    up = tconv3d.conv_transpose3d(x, torch.randn(4, 3, 2, 2, 2, device=device), None, 2)
    assert up.shape == (3, 6, 10, 12)


def _opinfo_samples(dtype):
    pytest.importorskip("expecttest")  # torch.testing._internal needs it
    frozen = torch.backends.flags_frozen()
    from torch.testing._internal.common_methods_invocations import op_db

    if not frozen:  # importing PyTorch's test utilities freezes the cudnn flags for the rest of the process
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True

    op = next(o for o in op_db if o.name == "nn.functional.conv3d")
    return list(op.sample_inputs("cpu", dtype, requires_grad=True))


def _call(fn, sample, tensors):
    """fn(sample's arguments), its tensors (input first, then in argument order) replaced by `tensors`."""
    rest = iter(tensors[1:])
    args = [next(rest) if isinstance(a, torch.Tensor) else a for a in sample.args]
    kwargs = {k: next(rest) if isinstance(v, torch.Tensor) else v for k, v in sample.kwargs.items()}
    return fn(tensors[0], *args, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_pytorch_opinfo_samples(dtype, device):
    """PyTorch's own sample inputs for nn.functional.conv3d (unbatched inputs, groups, 'same'/'valid' padding,
    strides, dilations), run as a user would: every one accepted, and forward and gradients match float64."""
    samples = _opinfo_samples(dtype)
    assert len(samples) >= 20
    for sample in samples:
        tensors = [sample.input, *(a for a in sample.args if isinstance(a, torch.Tensor))]
        tensors += [v for v in sample.kwargs.values() if isinstance(v, torch.Tensor)]
        ours = [leaf_copy(t.to(device)) for t in tensors]
        refs = [leaf_copy(t.double()) for t in tensors]

        y, ref = _call(tconv3d.conv3d, sample, ours), _call(F.conv3d, sample, refs)
        grad_out = torch.randn_like(ref).to(dtype).double()  # the same upstream gradient, exactly, for both
        ref.backward(grad_out)
        y.backward(grad_out.to(device, dtype))
        label = f"{tuple(sample.input.shape)} {sample.args[1:] if len(sample.args) > 1 else ''} {sample.kwargs}"
        assert y.shape == ref.shape and rel_l2(y, ref) < TOLERANCE[dtype], label
        for t, r in zip(ours, refs, strict=True):
            assert rel_l2(t.grad, r.grad) < TOLERANCE[dtype], label
