"""A second source along C (`channels_after`: a UNet decoder's skip connection, read in place of torch.cat([x,
skip], dim=1)): forward and every gradient against float64 torch.cat + conv3d through the pointer kernels (default
and small split-K tiles, channel blocks that straddle the two sources' ends), the TMA kernels, and the launches
that concatenate first (packed small channels, groups); errors, opcheck, double backward, the module and
functional forms, and no copy of the concatenation."""

import pytest
import torch
import torch.nn.functional as F
from helpers import dtype_id, leaf_copy, outputs_and_grads, second_order_with_two_sources

import tconv3d
from tconv3d import settings
from tconv3d.kernels import config, conv_fwd, conv_wgrad, tensors
from tconv3d.testing import TOLERANCE, rel_l2
from tconv3d.tune import choice

CL = torch.channels_last_3d
# (name, input shape, channels_after's channels, weight shape, stride, padding, dilation, groups, padding_mode)
CASES = [
    ("unet_skip", (1, 16, 3, 4, 5), 16, (8, 32, 3, 3, 3), 1, 1, 1, 1, "zeros"),
    ("straddling_blocks", (2, 20, 2, 4, 3), 12, (8, 32, 3, 3, 3), 1, 1, 1, 1, "zeros"),
    ("residual_1x1", (1, 24, 2, 3, 5), 8, (16, 32, 1, 1, 1), 1, 0, 1, 1, "zeros"),
    ("strided_dilated", (1, 8, 5, 7, 6), 24, (4, 32, 3, 3, 3), (2, 2, 1), 1, (1, 2, 1), 1, "zeros"),
    ("replicate_borders", (1, 12, 3, 4, 4), 20, (6, 32, 3, 3, 3), 1, 1, 1, 1, "replicate"),
    ("one_channel_image", (1, 1, 2, 4, 4), 17, (8, 18, 3, 3, 3), 1, 1, 1, 1, "zeros"),
    ("packed_concatenated", (1, 3, 2, 4, 4), 4, (5, 7, 3, 3, 3), 1, 1, 1, 1, "zeros"),
    # 8 channels a group: run as one dense block-diagonal group (kernels/grouped.py), which reads it in place
    ("grouped_side_by_side", (1, 8, 2, 4, 4), 8, (8, 8, 3, 3, 3), 1, 1, 1, 2, "zeros"),
    ("grouped_concatenated", (1, 16, 2, 3, 4), 16, (8, 16, 3, 3, 3), 1, 1, 1, 2, "zeros"),
]


def conv_and_reference(case, dtype, device, x_format=CL):
    """tconv3d's [y, dx, d channels_after, dw, db] and float64's of torch.cat + F.pad + conv3d, under one random
    upstream gradient."""
    _name, x_shape, after, w_shape, stride, padding, dilation, groups, mode = case
    n, _, d, h, w_ = x_shape
    x = leaf_copy(torch.randn(x_shape, device=device).to(dtype).contiguous(memory_format=x_format))
    skip = leaf_copy(torch.randn(n, after, d, h, w_, device=device).to(dtype).contiguous(memory_format=CL))
    w = leaf_copy((torch.randn(w_shape, device=device) / w_shape[1] ** 0.5).to(dtype).contiguous(memory_format=CL))
    b = leaf_copy(torch.randn(w_shape[0], device=device).to(dtype))
    tensors = (x, skip, w, b)
    x64, skip64, w64, b64 = (leaf_copy(t.double()) for t in tensors)
    joined = torch.cat([x64, skip64], dim=1)
    if mode == "zeros":
        expected = F.conv3d(joined, w64, b64, stride, padding, dilation, groups)
    else:
        expected = F.conv3d(F.pad(joined, (padding,) * 6, mode=mode), w64, b64, stride, 0, dilation, groups)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y = tconv3d.conv3d(x, w, b, stride, padding, dilation, groups, mode, channels_after=skip)
    y.backward(grad_out.to(dtype))
    assert y.is_contiguous(memory_format=CL)
    ours = [y, *(t.grad for t in tensors)]
    return ours, [expected, x64.grad, skip64.grad, w64.grad, b64.grad]


@pytest.mark.parametrize(
    ("dtype", "tiles"),
    [(torch.float32, "default"), (torch.bfloat16, "default"), (torch.float32, "small")],
    ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else v,
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_channels_after_matches_float64(case, dtype, tiles, device, request):
    """Default tiles (one block per source at most), in fp32 and bf16, and 16-wide ones with split-K (several
    blocks per source, the last one of each partial, split boundaries inside a source)."""
    if tiles == "small":
        request.getfixturevalue("small_tiles")
    ours, expected = conv_and_reference(case, dtype, device)
    for got, want in zip(ours, expected, strict=True):
        assert got.shape == want.shape
        assert rel_l2(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("case", [CASES[0], CASES[5]], ids=lambda c: c[0])
def test_input_in_another_layout(case, device):
    """An NCDHW input: the op copies x to channels_last_3d, or, with one channel, reads it as it is (its channel
    stride, arbitrary, set to 1: the kernels address channels_after with x's)."""
    ours, expected = conv_and_reference(case, torch.float32, device, x_format=torch.contiguous_format)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.float32]


@pytest.fixture
def tma_launches(monkeypatch):
    """TCONV3D_KERNELS=tma, recording the TMA forwards that read channels_after in place and the TMA weight-gradient
    launches (one per source)."""
    monkeypatch.setattr(settings, "KERNELS", "tma")
    monkeypatch.setattr(choice, "_memo", {})
    launches = []
    real_fwd, real_wgrad = conv_fwd.conv3d_tma, conv_wgrad.conv3d_wgrad_tma

    def forward(*args, **kwargs):
        if args[-1] is not None:  # channels_after, the last argument
            launches.append("fwd")
        return real_fwd(*args, **kwargs)

    monkeypatch.setattr(conv_fwd, "conv3d_tma", forward)
    monkeypatch.setattr(conv_wgrad, "conv3d_wgrad_tma", lambda *a, **k: launches.append("wgrad") or real_wgrad(*a, **k))
    return launches


# 16 + 16 channels bordered by replicate: the box kernels' interior, one source a weight-gradient launch, and the
# border ring's pointer launches reading both sources
REPLICATE_ALIGNED = ("replicate_aligned", (1, 16, 3, 5, 6), 16, (8, 32, 3, 3, 3), 1, 1, 1, 1, "replicate")


@pytest.mark.parametrize(
    "case",
    [*(c for c in CASES if c[0] in ("unet_skip", "straddling_blocks", "residual_1x1")), REPLICATE_ALIGNED],
    ids=lambda c: c[0],
)
def test_channels_after_through_tma(case, tma_launches, device):
    """Each forward channel block from one of two descriptors (blocks past a source's channels read the TMA unit's
    zeros); the weight gradient one launch per source, into its columns (bordered in H and W: over the interior,
    the ring's one pointer launch reading both sources)."""
    ours, expected = conv_and_reference(case, torch.float32, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.float32]
    assert tma_launches == ["fwd", "wgrad", "wgrad"]


def test_tma_takes_aligned_sources_at_stride_one_in_h_and_w():
    from tconv3d.geometry import conv_geometry
    from tconv3d.tune.configs import tma_eligible

    def eligible(direction, cin, after, stride=1):
        geom = conv_geometry((1, cin, 4, 8, 8), (16, cin + after, 3, 3, 3), stride, 1, 1, after_channels=after)
        return tma_eligible(direction, geom, torch.bfloat16)

    assert eligible("fwd", 16, 16) and eligible("wgrad", 16, 16) and eligible("dgrad", 16, 16)
    assert not eligible("fwd", 12, 20) and not eligible("wgrad", 12, 20)  # 24-byte rows: no descriptor
    assert eligible("dgrad", 12, 20)  # its output is the concatenation's gradient, 32 channels
    assert not eligible("fwd", 16, 16, (1, 2, 2)) and eligible("fwd", 16, 16, (2, 1, 1))


def test_forward_reads_both_sources_in_place(monkeypatch):
    """The forward's only allocation is its output: no concatenation (pointer kernels, default tiles)."""
    if tconv3d.CPU_BACKEND != "triton":
        pytest.skip("CPU tensors run aten's conv3d here, which concatenates")
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 16, 2, 12, 12).contiguous(memory_format=CL)
    skip = torch.randn(1, 16, 2, 12, 12).contiguous(memory_format=CL)
    w = torch.randn(4, 32, 3, 3, 3).contiguous(memory_format=CL)
    run = lambda: tconv3d.conv3d(x, w, padding=1, channels_after=skip)  # noqa: E731
    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = run()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert 0 < allocated <= y.numel() * y.element_size()


def test_launches_that_cannot_read_it_concatenate(monkeypatch, device):
    """Packed small channels and groups: tensors.cat_channels makes the concatenation, once per launch (forward,
    weight gradient); a UNet conv reads channels_after in place, and so do groups of few channels run side by side
    as one dense group."""
    if device == "cpu" and tconv3d.CPU_BACKEND != "triton":
        pytest.skip("CPU tensors run aten's conv3d here, which concatenates")
    concatenated = []
    monkeypatch.setattr(config, "cat_channels", lambda *a: concatenated.append(1) or tensors.cat_channels(*a))
    names = ("unet_skip", "packed_concatenated", "grouped_concatenated", "grouped_side_by_side")
    for case in (c for c in CASES if c[0] in names):
        concatenated.clear()
        conv_and_reference(case, torch.float32, device)
        want = 2 if case[0] in ("packed_concatenated", "grouped_concatenated") else 0
        assert len(concatenated) == want, case[0]


def test_module_and_unbatched_forms(device):
    conv = tconv3d.nn.Conv3d(24, 8, 3, padding=1).to(device)
    x, skip = torch.randn(16, 2, 4, 4, device=device), torch.randn(8, 2, 4, 4, device=device)
    want = F.conv3d(torch.cat([x, skip])[None].double(), conv.weight.double(), conv.bias.double(), padding=1)[0]
    assert rel_l2(conv(x, channels_after=skip), want) < TOLERANCE[torch.float32]
    assert rel_l2(tconv3d.conv3d(x, conv.weight, conv.bias, padding="same", channels_after=skip), want) < 1e-5


def test_double_backward_through_channels_after(device):
    x, skip = torch.randn(1, 3, 3, 4, 5, device=device), torch.randn(1, 2, 3, 4, 5, device=device)
    w = torch.randn(4, 5, 3, 3, 3, device=device)
    ours = second_order_with_two_sources(
        lambda x, skip, w: tconv3d.conv3d(x, w, padding=1, channels_after=skip), *(leaf_copy(t) for t in (x, skip, w))
    )
    expected = second_order_with_two_sources(
        lambda x, skip, w: F.conv3d(torch.cat([x, skip], 1), w, padding=1),
        *(leaf_copy(t.double()) for t in (x, skip, w)),
    )
    for a, e in zip(ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32]


def test_opcheck_with_channels_after(device):
    x = torch.randn(1, 3, 2, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    skip = torch.randn(1, 2, 2, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(4, 5, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()
    args = ([1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1])
    torch.library.opcheck(torch.ops.tconv3d.conv3d.default, (x, w, None, *args, 1, "zeros", None, skip))
    y = torch.ops.tconv3d.conv3d(x.detach(), w.detach(), None, *args, 1, "zeros", None, skip.detach())
    grad_out = torch.randn_like(y).requires_grad_()
    torch.library.opcheck(
        torch.ops.tconv3d.conv3d_weight_grad.default, (grad_out, x, list(w.shape), *args, "zeros", None, 1, skip)
    )


@pytest.mark.parametrize(
    ("shape", "kwargs", "error", "message"),
    [
        ((1, 4, 2, 4, 5), {}, ValueError, "must match the input"),
        ((2, 4, 2, 4, 4), {}, ValueError, "must match the input"),
        ((1, 4, 2, 4), {}, ValueError, "must be 5-D"),
        ((1, 3, 2, 4, 4), {}, ValueError, r"input and channels_after have 4 \+ 3 channels"),
        ((1, 0, 2, 4, 4), {}, ValueError, "has no channels"),
        ((1, 4, 2, 4, 4), {"frames_before": torch.randn(1, 4, 1, 4, 4)}, ValueError, "together are not supported"),
    ],
)
def test_bad_channels_after(shape, kwargs, error, message):
    x, w = torch.randn(1, 4, 2, 4, 4), torch.randn(5, 8, 3, 3, 3)
    with pytest.raises(error, match=message):
        tconv3d.conv3d(x, w, padding=1, channels_after=torch.randn(shape), **kwargs)
    with pytest.raises(TypeError, match="channels_after dtype"):
        tconv3d.conv3d(x, w, padding=1, channels_after=torch.randn(1, 4, 2, 4, 4).half())


def test_compiled_graphs_hold_no_concatenation(device):
    """torch.compile(fullgraph=True): the forward graph is the one op, the backward its two gradient ops and the
    split of the input gradient into views; no cat, no copy; the same values as eager."""
    from test_compile import call_targets, capture_graphs

    graphs, backend = capture_graphs()
    x, skip = (torch.randn(1, 8, 2, 4, 4, device=device).contiguous(memory_format=CL) for _ in range(2))
    w = torch.randn(4, 16, 3, 3, 3, device=device).contiguous(memory_format=CL)

    conv = lambda x, skip, w: tconv3d.conv3d(x, w, padding=1, channels_after=skip)  # noqa: E731
    compiled = outputs_and_grads(torch.compile(conv, backend=backend, fullgraph=True), (x, skip, w))
    for got, want in zip(compiled, outputs_and_grads(conv, (x, skip, w)), strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.float32]
    forward, backward = (call_targets(g) for g in graphs)
    assert forward == ["tconv3d.conv3d.default"]
    assert {"tconv3d.conv3d_input_grad.default", "tconv3d.conv3d_weight_grad.default"} <= set(backward)
    assert not any("cat" in target or "copy" in target or "clone" in target for target in forward + backward)


def test_explain_says_whether_the_launches_read_it_in_place(device):
    if device == "cpu" and tconv3d.CPU_BACKEND != "triton":
        pytest.skip("CPU tensors run aten's conv3d here")
    x, w = torch.randn(1, 16, 2, 4, 4, device=device), torch.randn(8, 32, 3, 3, 3, device=device)
    plan = tconv3d.explain(x, w, padding=1, channels_after=torch.randn(1, 16, 2, 4, 4, device=device))
    assert plan["fwd"]["reads_in_place"] and plan["wgrad"]["reads_in_place"] and "reads_in_place" not in plan["dgrad"]
    grouped = tconv3d.explain(
        x, w[:, :16], padding=1, groups=2, channels_after=torch.randn(1, 16, 2, 4, 4, device=device)
    )
    assert not grouped["fwd"]["reads_in_place"]
