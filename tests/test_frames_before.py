"""A second source along D (`frames_before`: a video VAE's cached frames, read in place in front of the clip) and
per-dimension padding modes ("replicate,zeros,zeros": repeat the edge frames in time, zeros in space): forward
and every gradient against float64 torch.cat + F.pad + conv3d, in both gather forms (one tap per step and
packed taps), errors, opcheck, and no copy of the concatenation."""

import pytest
import torch
import torch.nn.functional as F
from helpers import dtype_id, leaf_copy, second_order_with_two_sources

import tconv3d
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
# (name, input shape, frames before, weight shape, stride, 6-value padding, dilation, padding_mode)
CASES = [
    ("wan_cache_2", (1, 20, 3, 5, 4), 2, (6, 20, 3, 3, 3), 1, (0, 0, 1, 1, 1, 1), 1, "zeros"),
    ("wan_cache_1_plus_pad", (2, 20, 2, 4, 5), 1, (5, 20, 3, 3, 3), 1, (1, 0, 1, 1, 1, 1), 1, "zeros"),
    ("packed_cin3_cache", (1, 3, 3, 5, 4), 2, (8, 3, 3, 3, 3), 1, (0, 0, 1, 1, 1, 1), 1, "zeros"),
    ("strided_cache", (1, 18, 4, 6, 5), 1, (4, 18, 3, 1, 1), (2, 1, 1), (0, 0, 0, 0, 0, 0), 1, "zeros"),
    ("ltx_repeat_first", (1, 20, 3, 5, 4), 0, (6, 20, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1, "replicate,zeros,zeros"),
    ("ltx_both_ends_packed", (1, 4, 3, 5, 4), 0, (6, 4, 3, 3, 3), 1, (1, 1, 1, 1, 1, 1), 1, "replicate,zeros,zeros"),
    ("cache_then_replicate", (1, 20, 2, 4, 4), 1, (5, 20, 3, 3, 3), 1, (1, 0, 1, 1, 1, 1), 1, "replicate"),
    ("mixed_reflect_circular", (1, 5, 3, 5, 6), 2, (4, 5, 3, 3, 3), 1, (1, 1, 2, 1, 1, 2), 1, "zeros,reflect,circular"),
]


def reference(x, frames_before, w, b, stride, padding, dilation, mode):
    """torch.cat in front along D, then F.pad dimension by dimension in each one's mode, then conv3d."""
    if frames_before is not None:
        x = torch.cat([frames_before, x], dim=2)
    modes = mode.split(",") if "," in mode else [mode] * 3
    for dim, dim_mode in enumerate(modes):
        pads = [0] * 6
        pads[4 - 2 * dim : 6 - 2 * dim] = padding[2 * dim : 2 * dim + 2]
        x = F.pad(x, pads, mode="constant" if dim_mode == "zeros" else dim_mode)
    return F.conv3d(x, w, b, stride, 0, dilation)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_frames_before_and_per_dimension_modes_match_float64(case, dtype, device):
    _name, x_shape, frames, w_shape, stride, padding, dilation, mode = case
    n, c, _, h, w_ = x_shape
    x = leaf_copy(torch.randn(x_shape, device=device).to(dtype).contiguous(memory_format=CL))
    before = leaf_copy(torch.randn(n, c, frames, h, w_, device=device).to(dtype).contiguous(memory_format=CL))
    before = before if frames else None
    w = leaf_copy((torch.randn(w_shape, device=device) / w_shape[1] ** 0.5).to(dtype).contiguous(memory_format=CL))
    b = leaf_copy(torch.randn(w_shape[0], device=device).to(dtype))
    tensors = [t for t in (x, before, w, b) if t is not None]
    copies = [leaf_copy(t.double()) for t in tensors]
    x64, before64 = copies[0], copies[1] if frames else None
    w64, b64 = copies[-2], copies[-1]
    expected = reference(x64, before64, w64, b64, stride, padding, dilation, mode)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)

    y = tconv3d.conv3d(x, w, b, stride, padding, dilation, padding_mode=mode, frames_before=before)
    y.backward(grad_out.to(dtype))
    assert y.is_contiguous(memory_format=CL)
    for t, ref in zip(tensors, copies, strict=True):
        assert t.grad is not None and t.grad.shape == t.shape
        assert rel_l2(t.grad, ref.grad) < TOLERANCE[dtype]
    assert rel_l2(y, expected) < TOLERANCE[dtype]


def test_mode_as_a_tuple_equals_the_string(device):
    x = torch.randn(1, 4, 3, 4, 4, device=device)
    w = torch.randn(5, 4, 3, 3, 3, device=device)
    as_tuple = tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode=("replicate", "zeros", "zeros"))
    as_string = tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode="replicate,zeros,zeros")
    zeros = tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1))
    assert torch.equal(as_tuple, as_string)
    assert not torch.allclose(as_tuple, zeros)  # the time border is the first frame, not zeros


def test_second_source_may_be_a_strided_view(device):
    """A stride-0 expand of the first frame (repeat it k times) is read as it is: the same as replicate in time."""
    x = torch.randn(1, 20, 3, 4, 5, device=device).contiguous(memory_format=CL)
    w = torch.randn(6, 20, 3, 3, 3, device=device)
    repeated = x[:, :, :1].expand(-1, -1, 2, -1, -1)
    via_view = tconv3d.conv3d(x, w, padding=(0, 0, 1, 1, 1, 1), frames_before=repeated)
    via_mode = tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode="replicate,zeros,zeros")
    assert rel_l2(via_view, via_mode) < TOLERANCE[torch.float32]


def test_double_backward_through_frames_before(device):
    """Second derivatives in input, cached frames and weight through the gradient ops' autograd, against float64."""
    padding, mode = (1, 0, 1, 1, 0, 2), "replicate,zeros,zeros"

    x, before = torch.randn(1, 3, 3, 4, 5, device=device), torch.randn(1, 3, 2, 4, 5, device=device)
    w = torch.randn(4, 3, 3, 3, 3, device=device)
    ours = second_order_with_two_sources(
        lambda x, before, w: tconv3d.conv3d(x, w, padding=padding, padding_mode=mode, frames_before=before),
        *(leaf_copy(t) for t in (x, before, w)),
    )
    expected = second_order_with_two_sources(
        lambda x, before, w: reference(x, before, w, None, 1, padding, 1, mode),
        *(leaf_copy(t.double()) for t in (x, before, w)),
    )
    for a, e in zip(ours, expected, strict=True):
        assert rel_l2(a, e) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("shape", "dtype", "error", "message"),
    [
        ((1, 4, 2, 5, 4), torch.float32, ValueError, "must match the input"),
        ((1, 3, 2, 4, 4), torch.float32, ValueError, "must match the input"),
        ((1, 4, 2, 4), torch.float32, ValueError, "must be 5-D"),
        ((1, 4, 2, 4, 4), torch.float16, TypeError, "frames_before dtype"),
    ],
)
def test_bad_frames_before(shape, dtype, error, message):
    x = torch.randn(1, 4, 3, 4, 4)
    w = torch.randn(5, 4, 3, 3, 3)
    with pytest.raises(error, match=message):
        tconv3d.conv3d(x, w, padding=1, frames_before=torch.randn(shape).to(dtype))


@pytest.mark.parametrize(
    ("mode", "error", "message"),
    [
        ("replicate,zeros", ValueError, "three of them"),
        ("zeros,zeros,mirror", ValueError, "three of them"),
        (("zeros", "zeros"), TypeError, "3 strs"),
        (3, TypeError, "3 strs"),
    ],
)
def test_bad_padding_modes(mode, error, message):
    with pytest.raises(error, match=message):
        tconv3d.conv3d(torch.randn(1, 2, 3, 4, 4), torch.randn(2, 2, 3, 3, 3), padding=1, padding_mode=mode)


def test_reflect_limit_checked_per_dimension():
    x, w = torch.randn(1, 2, 2, 6, 6), torch.randn(2, 2, 3, 3, 3)
    tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode="zeros,reflect,reflect")  # time pads zeros
    with pytest.raises(ValueError, match="reflect padding must be smaller"):
        tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode="reflect,zeros,zeros")


def test_opcheck_with_frames_before(device):
    x = torch.randn(1, 3, 2, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    before = torch.randn(1, 3, 2, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(4, 3, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()
    args = ([1, 1, 1], [1, 0, 1, 1, 2, 1], [1, 1, 1])
    for mode in ("zeros", "replicate,zeros,zeros"):
        torch.library.opcheck(torch.ops.tconv3d.conv3d.default, (x, w, None, *args, 1, mode, before))
        y = torch.ops.tconv3d.conv3d(x.detach(), w.detach(), None, *args, 1, mode, before.detach())
        grad_out = torch.randn_like(y).requires_grad_()
        torch.library.opcheck(
            torch.ops.tconv3d.conv3d_weight_grad.default, (grad_out, x, list(w.shape), *args, mode, before)
        )


@pytest.mark.skipif(tconv3d.CPU_BACKEND != "triton", reason="CPU tensors run aten's conv3d here, which pads")
def test_forward_allocates_only_its_output():
    """The concatenation is never made: the forward's only allocation is its output (torch.cat of these would
    take 1.7x the input's bytes)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 8, 3, 20, 20).contiguous(memory_format=CL)
    before = torch.randn(1, 8, 2, 20, 20).contiguous(memory_format=CL)
    w = torch.randn(8, 8, 3, 3, 3).contiguous(memory_format=CL)
    run = lambda: tconv3d.conv3d(x, w, padding=(0, 0, 1, 1, 1, 1), frames_before=before)  # noqa: E731
    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = run()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert 0 < allocated <= y.numel() * y.element_size()


def test_explain_takes_frames_before(monkeypatch, device):
    """explain(..., frames_before=) checks it as conv3d does and, under TCONV3D_KERNELS=tma, says a forward whose
    frames_before a descriptor cannot cover (its base 4 bytes off 16) runs the pointer kernel, as the launch would."""
    if device == "cpu" and tconv3d.CPU_BACKEND != "triton":
        pytest.skip("CPU tensors run aten's conv3d here")
    from tconv3d import settings
    from tconv3d.tune import choice

    monkeypatch.setattr(settings, "KERNELS", "tma")
    monkeypatch.setattr(choice, "_memo", {})
    x = torch.randn(1, 8, 2, 4, 4, device=device).contiguous(memory_format=CL)
    w = torch.randn(8, 8, 3, 3, 3, device=device).contiguous(memory_format=CL)
    padding = (0, 0, 1, 1, 1, 1)
    aligned = torch.randn(1, 8, 2, 4, 4, device=device).contiguous(memory_format=CL)
    storage = torch.randn(aligned.numel() + 1, device=device)[1:]
    shifted = storage.as_strided(aligned.shape, aligned.stride())
    plans = [tconv3d.explain(x, w, padding=padding, frames_before=f) for f in (aligned, shifted)]
    assert [plan["fwd"]["variant"] for plan in plans] == ["tma", "pointer"]
    assert [plan["wgrad"]["variant"] for plan in plans] == ["tma", "pointer"]
    assert plans[1]["dgrad"]["variant"] == "tma"  # the concatenation's gradient: one source, its own buffer
    with pytest.raises(ValueError, match="frames_before has shape"):
        tconv3d.explain(x, w, padding=padding, frames_before=torch.randn(1, 4, 2, 4, 4, device=device))
