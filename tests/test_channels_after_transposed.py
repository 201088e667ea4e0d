"""A second source along C of a transposed convolution's input (`conv_transpose3d(x, w, channels_after=skip)`:
MONAI UNet's decoder, whose up path transposes torch.cat([x, subblock(x)], dim=1)): the input-gradient op reads
grad_output's second source in place. Forward and every gradient against float64 torch.cat +
conv_transpose3d through the pointer kernel (default and small split-K tiles, channel blocks that straddle the two
sources' ends, strides) and the TMA kernel, the launches that concatenate first (packed small channels, groups);
errors, opcheck, double backward, the module and unbatched forms, and compiled graphs with no concatenation of
activations."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import dtype_id, leaf_copy, outputs_and_grads, second_order_with_two_sources

import tconv3d
from tconv3d import settings
from tconv3d.kernels import config, conv_dgrad, tensors
from tconv3d.testing import TOLERANCE, rel_l2
from tconv3d.tune import choice

CL = torch.channels_last_3d
# (name, input shape, channels_after's channels, weight shape (Cin, Cout / groups, k...), stride, padding,
# output_padding, groups)
CASES = [
    ("unet_up", (1, 16, 2, 3, 4), 16, (32, 8, 3, 3, 3), 2, 1, 1, 1),
    ("straddling_blocks", (2, 20, 2, 3, 3), 12, (32, 8, 3, 3, 3), 1, 1, 0, 1),
    ("kernel_2_stride_2", (1, 24, 2, 2, 3), 8, (32, 16, 2, 2, 2), 2, 0, 0, 1),
    ("packed_concatenated", (1, 3, 2, 3, 3), 4, (7, 5, 3, 3, 3), 2, 1, 1, 1),
    # 4 channels a group: run as one dense block-diagonal group (kernels/grouped.py), which reads it in place
    ("grouped_side_by_side", (1, 8, 2, 3, 3), 8, (16, 4, 3, 3, 3), 1, 1, 0, 2),
    ("grouped_concatenated", (1, 16, 2, 3, 3), 16, (32, 16, 3, 3, 3), 1, 1, 0, 2),
]


def transposed_and_reference(case, dtype, device):
    """tconv3d's [y, dx, d channels_after, dw, db] and float64's of torch.cat + conv_transpose3d, under one random
    upstream gradient."""
    _name, x_shape, after, w_shape, stride, padding, output_padding, groups = case
    n, _, d, h, w_ = x_shape
    x = leaf_copy(torch.randn(x_shape, device=device).to(dtype).contiguous(memory_format=CL))
    skip = leaf_copy(torch.randn(n, after, d, h, w_, device=device).to(dtype).contiguous(memory_format=CL))
    w = leaf_copy((torch.randn(w_shape, device=device) / w_shape[0] ** 0.5).to(dtype).contiguous(memory_format=CL))
    b = leaf_copy(torch.randn(w_shape[1] * groups, device=device).to(dtype))
    tensors = (x, skip, w, b)
    x64, skip64, w64, b64 = (leaf_copy(t.double()) for t in tensors)
    args = (stride, padding, output_padding, groups)
    expected = F.conv_transpose3d(torch.cat([x64, skip64], dim=1), w64, b64, *args)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y = tconv3d.conv_transpose3d(x, w, b, *args, channels_after=skip)
    y.backward(grad_out.to(dtype))
    assert y.is_contiguous(memory_format=CL)
    return [y, *(t.grad for t in tensors)], [expected, x64.grad, skip64.grad, w64.grad, b64.grad]


def assert_close(ours, expected, dtype):
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        assert rel_l2(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("dtype", "tiles"),
    [(torch.float32, "default"), (torch.bfloat16, "default"), (torch.float32, "small")],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else v,
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_transposed_channels_after_matches_float64(case, dtype, tiles, device, request):
    """Default tiles, in fp32 and bf16, and 16-wide ones with split-K (several blocks per source, the last one of
    each partial, split boundaries inside a source)."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    assert_close(*transposed_and_reference(case, dtype, device), dtype)


def test_which_launches_concatenate(monkeypatch, device):
    """The pointer kernel reads grad_output's second source in place (a UNet up conv, groups of few channels run as
    one dense group: no launch concatenates); packed small channels and groups concatenate, once, in the forward
    (the backward's ops concatenate nothing: the compiled-graph test below)."""
    if device == "cpu" and tconv3d.CPU_BACKEND != "triton":
        pytest.skip("CPU tensors run aten's kernels here, which concatenate")
    concatenated = []
    monkeypatch.setattr(config, "cat_channels", lambda *a: concatenated.append(1) or tensors.cat_channels(*a))
    for case in CASES:
        concatenated.clear()
        transposed_and_reference(case, torch.float32, device)
        assert len(concatenated) == (1 if case[0].endswith("concatenated") else 0), case[0]


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("unet_up", "straddling_blocks", "kernel_2_stride_2")],
                         ids=lambda c: c[0])  # fmt: skip
def test_box_kernels_read_it_in_place(case, monkeypatch, device):
    """TCONV3D_KERNELS=tma: the input gradient's TMA kernel takes each channel block's box from one of two
    descriptors (grad_output's, channels_after's), at stride 1 and through the phase views of stride 2: no
    concatenation, the float64 result."""
    monkeypatch.setattr(settings, "KERNELS", "tma")
    monkeypatch.setattr(choice, "_memo", {})
    concatenated, launched = [], []
    monkeypatch.setattr(config, "cat_channels", lambda *a: concatenated.append(1) or tensors.cat_channels(*a))
    real = conv_dgrad.conv3d_tma
    monkeypatch.setattr(conv_dgrad, "conv3d_tma", lambda *a, **k: launched.append(k) or real(*a, **k))
    assert_close(*transposed_and_reference(case, torch.float32, device), torch.float32)
    assert not concatenated
    assert [k["channels_after"] is not None for k in launched] == [True]
    geom, grad_out, weight = _dgrad_problem(case, device)
    assert config.reads_channels_after("dgrad", geom, choice.launch_config("dgrad", geom, grad_out, weight))


def test_box_kernels_take_aligned_sources():
    """Each source's rows whole 16-byte units, or the pointer kernel: 20 + 12 bf16 channels are 40- and 24-byte
    rows."""
    from tconv3d.tune.configs import tma_eligible

    aligned, _, _ = _dgrad_problem(CASES[0], "cpu")
    straddling, _, _ = _dgrad_problem(CASES[1], "cpu")
    assert tma_eligible("dgrad", aligned, torch.bfloat16) and tma_eligible("dgrad", straddling, torch.float32)
    assert not tma_eligible("dgrad", straddling, torch.bfloat16)


def _dgrad_problem(case, device):
    """(geometry, grad_output, weight) of the input-gradient op a case's conv_transpose3d runs."""
    from tconv3d.geometry import check_input_grad, conv_transpose_arguments

    _name, x_shape, after, w_shape, stride, padding, output_padding, groups = case
    x = torch.randn(x_shape, device=device).contiguous(memory_format=CL)
    skip = torch.randn(x_shape[0], after, *x_shape[2:], device=device).contiguous(memory_format=CL)
    w = torch.randn(w_shape, device=device).contiguous(memory_format=CL)
    size, stride, padding, dilation, groups, _ = conv_transpose_arguments(
        x, w, None, stride, padding, output_padding, groups, 1, skip
    )
    return check_input_grad(x, w, size, stride, padding, dilation, "zeros", groups, skip), x, w


def test_heuristic_takes_the_gluon_kernel_off_timed_only(monkeypatch):
    """On sm_90 the input gradient with a second source takes the persistent Gluon kernel as a plain one does (the
    emulator and tests/test_gluon.py check it; bench's skip scenario times it), split on one warpgroup where its
    tiles are few as a plain one's; with timed_only (what a GPU has timed alone) the pointer kernel, where the plain
    one keeps its box kernel; never the Triton TMA kernel (it branches between two descriptors, its pipeliner then
    keeping one stage)."""
    from tconv3d.kernels import conv_gluon
    from tconv3d.tune.configs import heuristic_config, small_grid_twin

    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    geom, _, _ = _dgrad_problem(("s1", (1, 64, 4, 8, 8), 64, (128, 64, 3, 3, 3), 1, 1, 0, 1), "cpu")
    assert geom.out_after_channels == 64
    one_source = dataclasses.replace(geom, out_after_channels=0)
    chosen, plain = (heuristic_config("dgrad", g, torch.bfloat16, 132, 90) for g in (geom, one_source))
    assert chosen.gluon == 2 and chosen == plain  # 64 + 64 channels fill 64-deep steps as 128 do
    timed = heuristic_config("dgrad", geom, torch.bfloat16, 132, 90, timed_only=True)
    assert not timed.tma_box_w and chosen == small_grid_twin("dgrad", geom, timed, 132, 2)
    assert heuristic_config("dgrad", one_source, torch.bfloat16, 132, 90, timed_only=True).tma_box_w
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", "a Triton without Gluon")
    assert not heuristic_config("dgrad", geom, torch.bfloat16, 132, 90).tma_box_w


def test_module_and_unbatched_forms(device):
    conv = tconv3d.nn.ConvTranspose3d(24, 8, 3, stride=2, padding=1, output_padding=1).to(device)
    x, skip = torch.randn(16, 2, 3, 3, device=device), torch.randn(8, 2, 3, 3, device=device)
    want = F.conv_transpose3d(torch.cat([x, skip])[None].double(), conv.weight.double(), conv.bias.double(), 2, 1, 1)[0]
    assert rel_l2(conv(x, channels_after=skip), want) < TOLERANCE[torch.float32]
    got = tconv3d.conv_transpose3d(x, conv.weight, conv.bias, 2, 1, 1, channels_after=skip)
    assert rel_l2(got, want) < TOLERANCE[torch.float32]
    sized = conv(x[None], output_size=(4, 6, 6), channels_after=skip[None])  # output_size picks output_padding 1
    assert rel_l2(sized[0], want) < TOLERANCE[torch.float32]


def test_double_backward(device):
    x, skip = torch.randn(1, 3, 2, 3, 3, device=device), torch.randn(1, 2, 2, 3, 3, device=device)
    w = torch.randn(5, 4, 3, 3, 3, device=device)
    ours = second_order_with_two_sources(
        lambda x, skip, w: tconv3d.conv_transpose3d(x, w, None, 2, 1, 1, channels_after=skip),
        *(leaf_copy(t) for t in (x, skip, w)),
    )
    expected = second_order_with_two_sources(
        lambda x, skip, w: F.conv_transpose3d(torch.cat([x, skip], 1), w, None, 2, 1, 1),
        *(leaf_copy(t.double()) for t in (x, skip, w)),
    )
    for a, e in zip(ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32]


def test_opcheck(device):
    go = torch.randn(1, 3, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    skip = torch.randn(1, 2, 2, 3, 4, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(5, 4, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()
    args = ([1, 4, 3, 5, 7], [2, 2, 2], [1, 1, 1, 1, 1, 1], [1, 1, 1], "zeros", 1, skip)
    torch.library.opcheck(torch.ops.tconv3d.conv3d_input_grad.default, (go, w, *args))


@pytest.mark.parametrize(
    ("shape", "error", "message"),
    [
        ((1, 4, 2, 3, 4), ValueError, "must match the input"),
        ((1, 3, 2, 3, 3), ValueError, r"input and channels_after have 4 \+ 3 channels"),
        ((1, 0, 2, 3, 3), ValueError, "has no channels"),
    ],
)
def test_bad_channels_after(shape, error, message):
    x, w = torch.randn(1, 4, 2, 3, 3), torch.randn(8, 5, 3, 3, 3)
    with pytest.raises(error, match=message):
        tconv3d.conv_transpose3d(x, w, None, 2, 1, 1, channels_after=torch.randn(shape))
    with pytest.raises(TypeError, match="channels_after dtype"):
        tconv3d.conv_transpose3d(x, w, None, 2, 1, 1, channels_after=torch.randn(1, 4, 2, 3, 3).half())
    go = torch.randn(1, 4, 3, 3, 3)
    with pytest.raises(ValueError, match=r"and channels_after 3 channels after its 4\), but the convolution's output"):
        torch.ops.tconv3d.conv3d_input_grad(
            go, torch.randn(8, 2, 3, 3, 3), [1, 2, 3, 3, 3], [1] * 3, [1] * 6, [1] * 3, "zeros", 1,
            torch.randn(1, 3, 3, 3, 3),
        )  # fmt: skip


def test_compiled_graphs_hold_no_concatenation_of_activations(device):
    """torch.compile(fullgraph=True): the forward graph's one op; the backward's forward convolution and two weight
    gradients, whose rows alone are concatenated (weight-sized); the same values as eager."""
    from test_compile import capture_graphs

    graphs, backend = capture_graphs()
    x, skip = (torch.randn(1, 8, 2, 3, 3, device=device).contiguous(memory_format=CL) for _ in range(2))
    w = torch.randn(16, 4, 3, 3, 3, device=device).contiguous(memory_format=CL)

    conv = lambda x, skip, w: tconv3d.conv_transpose3d(x, w, None, 2, 1, 1, channels_after=skip)  # noqa: E731
    compiled = outputs_and_grads(torch.compile(conv, backend=backend, fullgraph=True), (x, skip, w))
    for got, want in zip(compiled, outputs_and_grads(conv, (x, skip, w)), strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.float32]
    forward, backward = graphs
    calls = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert [str(n.target) for n in forward.graph.nodes if n.op == "call_function"] == [
        "tconv3d.conv3d_input_grad.default"
    ]
    targets = [str(n.target) for n in backward.graph.nodes if n.op == "call_function"]
    assert targets.count("tconv3d.conv3d_weight_grad.default") == 2 and "tconv3d.conv3d.default" in targets
    for node in calls:
        if "cat" in str(node.target) or "copy" in str(node.target):
            assert tuple(node.meta["val"].shape) == tuple(w.shape), node.format_node()
