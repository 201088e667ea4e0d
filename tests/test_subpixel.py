"""tconv3d.nn.video_vaes.upsampled_frame_conv: nearest 2x in H and W (and a whole factor in D), then a 3x3 conv on
each frame, run as one transposed conv of the input itself (the sub-pixel form: 4 taps an output, nothing of the
upsampled size written), against float64 torch upsampling then convolving; its weight kept while unchanged. And
upsampled_causal_conv, HunyuanVideo's upsampler (nearest 2x in space and time, then a 3x3x3 causal conv with
replicate borders) in the same form, its input replicate-padded (tconv3d.nn.modules.replicate_padded); and
upsampled_kept_causal_conv, EasyAnimate's (nearest 2x in space, then a 3x3x3 causal conv that reads the frames
kept from the clip's call before), its input with those frames in front (tconv3d.nn.modules.frames_in_front); and
upsampled_cosmos_conv, Cosmos's upsampler's two steps (nearest 2x in time, then a 3x1x1 causal conv; nearest 2x
in space, then a 1x3x3 conv), each plus its repeated input, added by broadcasting (tconv3d.nn.modules.add_repeated_)."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import DTYPES, OpNames, OpsMade, dtype_id, leaf_copy
from torch import nn

from tconv3d.nn import subpixel
from tconv3d.nn.hooks import observer
from tconv3d.nn.modules import repeat_nearest, replicate_padded
from tconv3d.nn.subpixel import subpixel_weight
from tconv3d.nn.video_vaes import causal_subpixel_reason, subpixel_reason, upsampled_frame_conv
from tconv3d.testing import rel_l2, tolerance

CL = torch.channels_last_3d
# (time factor, first_apart): Wan's resample and CogVideoX's upsampler in space; CogVideoX's compressing time (an
# even count of frames: every frame twice; an odd count: the first frame once)
TIMES = [(1, False), (2, False), (2, True)]


def upsample_then_conv(conv: nn.Conv2d, x: torch.Tensor, time_factor: int, first_apart: bool) -> torch.Tensor:
    """diffusers' order, by torch alone: nearest upsampling, then the 2-D conv on the frames as a batch."""
    if first_apart:
        x = torch.cat([x[:, :, :1], x[:, :, 1:].repeat_interleave(time_factor, dim=2)], dim=2)
    else:
        x = x.repeat_interleave(time_factor, dim=2)
    x = x.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)
    b, c, t, h, w = x.shape
    y = conv(x.transpose(1, 2).reshape(b * t, c, h, w))
    return y.reshape(b, t, -1, h, w).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("time_factor, first_apart", TIMES, ids=["space", "time", "time_first_apart"])
def test_upsampled_frame_conv_matches_float64(time_factor, first_apart, dtype, device):
    """Output, input gradient and the conv's weight and bias gradients against float64 torch: one input-gradient
    op (the transposed conv) and no convolution of the upsampled size; the output channels_last_3d. Odd sizes
    (3 x 5 frames: the phases' borders differ), 5 -> 6 channels."""
    torch.manual_seed(0)
    conv = nn.Conv2d(5, 6, 3, padding=1).to(device=device, dtype=dtype)
    exact = nn.Conv2d(5, 6, 3, padding=1).to(device=device, dtype=torch.float64)
    exact.load_state_dict(conv.state_dict())
    x = leaf_copy(torch.randn(2, 5, 3, 3, 5, device=device).to(dtype).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    with OpNames() as ops:
        y = upsampled_frame_conv(conv, x, time_factor, first_apart)
    expected = upsample_then_conv(exact, x64, time_factor, first_apart)
    assert y.shape == expected.shape and y.dtype == dtype and y.is_contiguous(memory_format=CL)
    assert sum("tconv3d.conv3d_input_grad" in name for name in ops.names) == 1
    assert not any("tconv3d.conv3d." in name or "convolution" in name for name in ops.names), ops.names
    grad = torch.randn_like(expected)
    y.backward(grad.to(dtype))
    expected.backward(grad)
    bound = tolerance(dtype)
    for name, ours, theirs in (("output", y, expected), ("input", x.grad, x64.grad),
                               ("weight", conv.weight.grad, exact.weight.grad),
                               ("bias", conv.bias.grad, exact.bias.grad)):  # fmt: skip
        assert rel_l2(ours, theirs) < bound, (name, rel_l2(ours, theirs))


@pytest.mark.parametrize("variant", ["pointer", "gluon"])
def test_each_kernel_runs_it(variant, device, monkeypatch):
    """The transposed conv (stride (1, 2, 2), 4 x 4 taps: 2 x 2 live a phase) and its backward (a stride-2 forward,
    a weight gradient) with TCONV3D_KERNELS forced, bf16, 32 -> 32 channels (rows TMA and Gluon take), against
    float64. On a GPU with Gluon the forward is the Gluon input-gradient kernel (what the H100's heuristic picks
    for Wan's upsamplers); the interpreter runs the TMA kernel in its place."""
    launched = forced_launches(variant, monkeypatch)
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, padding=1).to(device=device, dtype=torch.bfloat16)
    exact = nn.Conv2d(32, 32, 3, padding=1).to(device=device, dtype=torch.float64)
    exact.load_state_dict(conv.state_dict())
    x = leaf_copy(torch.randn(1, 32, 2, 6, 7, device=device).to(torch.bfloat16).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    y, expected = upsampled_frame_conv(conv, x), upsample_then_conv(exact, x64, 1, False)
    grad = torch.randn_like(expected)
    y.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    for ours, theirs in ((y, expected), (x.grad, x64.grad), (conv.weight.grad, exact.weight.grad)):
        assert rel_l2(ours, theirs) < tolerance(torch.bfloat16)
    assert_launched(launched, variant, device)


def forced_launches(variant: str, monkeypatch) -> list[str]:
    """TCONV3D_KERNELS=`variant` from here on, and the list of the input-gradient launchers called after."""
    from tconv3d import settings
    from tconv3d.kernels import conv_dgrad
    from tconv3d.tune import choice

    monkeypatch.setattr(settings, "KERNELS", variant)
    monkeypatch.setattr(choice, "_memo", {})
    launched = []
    for launcher in ("conv3d_gluon", "conv3d_tma", "_launch_pointer_kernel"):
        real = getattr(conv_dgrad, launcher)
        record = lambda *a, n=launcher, real=real, **k: launched.append(n) or real(*a, **k)  # noqa: E731
        monkeypatch.setattr(conv_dgrad, launcher, record)
    return launched


def assert_launched(launched: list[str], variant: str, device, calls: int = 1):
    """The forced variant's input-gradient launcher ran the transposed conv(s): Gluon's on a GPU that has it, the
    TMA kernel in its place under the interpreter."""
    from tconv3d.tune import choice

    if variant == "pointer":
        assert launched == ["_launch_pointer_kernel"] * calls
    elif device == "cuda" and choice._gluon_runs(torch.device(device)):
        assert launched == ["conv3d_gluon"] * calls
    else:
        assert launched in (["conv3d_gluon"] * calls, ["conv3d_tma"] * calls), launched


def test_subpixel_weight_taps(device):
    """The transposed conv's 4 x 4 taps along H and W are sums of the conv's 3 (_SUBPIXEL_TAPS) and its channels
    swapped: checked tap by tap on a weight whose taps are powers of two (every sum exact)."""
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=False).to(device)
    with torch.no_grad():
        conv.weight.copy_(2.0 ** torch.arange(9, dtype=torch.float32, device=device).view(1, 1, 3, 3))
        conv.weight[1] *= 3
        conv.weight[:, 1] *= -1
    v = subpixel_weight(conv)
    assert v.shape == (2, 3, 1, 4, 4) and v.is_contiguous(memory_format=CL)
    w = conv.weight.detach()
    rows = ((2,), (1, 2), (0, 1), (0,))  # transposed tap k: which conv taps it sums
    for k, ks in enumerate(rows):
        for m, ms in enumerate(rows):
            summed = sum(w[:, :, a, b] for a in ks for b in ms)
            assert torch.equal(v[:, :, 0, k, m], summed.T), (k, m)


def test_subpixel_weight_is_kept_while_unchanged(device):
    """In inference the transposed weight is computed once and kept on the module until the weight changes (an in
    place update, a new tensor); where the weight takes a gradient it is computed each call, differentiably."""
    conv = nn.Conv2d(4, 4, 3, padding=1).to(device)
    with torch.no_grad():
        first = subpixel_weight(conv)
        assert subpixel_weight(conv) is first
        conv.weight.mul_(2)
        second = subpixel_weight(conv)
        assert second is not first and torch.allclose(second, 2 * first)
        conv.weight = nn.Parameter(conv.weight.detach().clone())
        assert subpixel_weight(conv) is not second
    trained = subpixel_weight(conv)
    assert trained.requires_grad and subpixel_weight(conv) is not trained
    fresh = nn.Conv2d(4, 4, 3, padding=1).to(device)
    with torch.inference_mode():
        kept = subpixel_weight(fresh)
        assert subpixel_weight(fresh) is kept and kept.is_inference()
    with torch.no_grad():  # an inference tensor is not handed out of inference mode
        assert not subpixel_weight(fresh).is_inference()


def test_a_weight_storage_freed_and_made_anew_is_not_taken_for_the_kept_one():
    """A weight whose storage is replaced by a fresh tensor (`.data` assigned: diffusers' layerwise casting and
    offloading hooks do it each call) can get the freed storage's memory and the same version: the kept sub-pixel
    weight was keyed by address and version, and a replaced weight of other values came back stale (17 of 50 draws
    of freeing and allocating on this CPU). Here each weight is a new storage over the same memory
    (torch.frombuffer), the case made every time. Keyed by the storage's identity now; a deep copy of the module
    keeps nothing of it."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1)
    memory = bytearray(conv.weight.numel() * 4)

    def fresh_storage(values: torch.Tensor) -> torch.Tensor:  # written without a tensor's version counting it
        memoryview(memory).cast("B")[:] = values.contiguous().numpy().tobytes()
        return torch.frombuffer(memory, dtype=torch.float32).view(values.shape)

    with torch.no_grad():
        conv.weight.data = fresh_storage(torch.randn(conv.weight.shape))
        address, version, kept = conv.weight.data_ptr(), conv.weight._version, subpixel_weight(conv)
        assert subpixel_weight(conv) is kept
        conv.weight.data = fresh_storage(torch.randn(conv.weight.shape))
        assert (conv.weight.data_ptr(), conv.weight._version) == (address, version)
        assert torch.equal(subpixel_weight(conv), subpixel_weight(copy.deepcopy(conv))), "a stale weight"
        kept = subpixel_weight(conv)
        assert subpixel_weight(copy.deepcopy(conv)) is not kept and subpixel_weight(conv) is kept


@pytest.mark.parametrize("time, space", [(None, True), ("repeated", False), ("kept", True)])
def test_taps_first_made_in_inference_mode_serve_a_training_step(time, space, device, monkeypatch):
    """The taps' tensors, kept per device (_subpixel_taps), are made outside inference mode whatever the first
    caller's: a decode under torch.inference_mode() first, then a training step's weight through the same taps
    (model fuzz run 66: Cosmos's time upsampler raised "Inference tensors cannot be saved for backward" where
    stock trained)."""
    from tconv3d.nn import subpixel

    monkeypatch.setattr(subpixel, "_TAP_TENSORS", {})
    shape = (3, 3, 3) if time is not None and space else (3, 1, 1) if time is not None else (3, 3)
    conv = (nn.Conv3d if time is not None else nn.Conv2d)(4, 4, shape, padding=1, bias=False).to(device)
    with torch.inference_mode():
        subpixel_weight(conv, time, space)
    assert subpixel._TAP_TENSORS and not any(t.is_inference() for t in subpixel._TAP_TENSORS.values())
    trained = subpixel_weight(conv, time, space)
    trained.square().sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0


def test_a_model_built_in_inference_mode_runs_the_subpixel_form(aten_path):
    """A model built inside torch.inference_mode() (its weights inference tensors, which have no version counter)
    converts and runs the sub-pixel form with stock's values; a state dict loaded into it in place, inside inference
    mode, is what the next call reads (nothing kept by a version it cannot have)."""
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    import tconv3d

    x = torch.randn(1, 4, 3, 5, 6).contiguous(memory_format=CL)
    with torch.inference_mode():
        torch.manual_seed(0)
        stock = WanResample(4, "upsample2d").eval()
        converted = tconv3d.nn.convert(WanResample(4, "upsample2d").eval())
        assert converted.resample[1].weight.is_inference()
        for scale in (1.0, -3.0):
            converted.load_state_dict({k: scale * v for k, v in stock.state_dict().items()})
            for _ in range(2):
                with OpsMade() as made:
                    y = converted(x)
                assert rel_l2(y, stock(x) * scale) < 1e-5
                assert "tconv3d.conv3d_input_grad.default" in made.names  # the sub-pixel form ran


@pytest.mark.parametrize(
    "conv, reason",
    [
        (nn.Conv2d(4, 4, 1), "its kernel is (1, 1) padded by (0, 0)"),
        (nn.Conv2d(4, 4, 3, padding=2, dilation=2), "its kernel is (3, 3) padded by (2, 2)"),
        (nn.Conv2d(4, 4, 3, padding=1, groups=2), "groups 2 is not 1"),
        (nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"), "its padding is"),
    ],
)
def test_other_convs_upsample_first(conv, reason, aten_path):
    """A conv the sub-pixel form does not cover says why, and upsamples first (the result still right)."""
    x = torch.randn(1, 4, 2, 3, 3).contiguous(memory_format=CL)
    assert reason in subpixel_reason(conv, x)
    assert rel_l2(upsampled_frame_conv(conv, x, 2, True), upsample_then_conv(conv, x, 2, True)) < 1e-5


def test_a_wrong_subpixel_weight_fails(monkeypatch, aten_path):
    """The float64 comparison sees a tap misplaced (the transposed conv's tap 0 summing the conv's first tap
    instead of its last)."""

    monkeypatch.setattr(subpixel, "_SUBPIXEL_TAPS", ((1, 0, 0), (0, 1, 1), (1, 1, 0), (1, 0, 0)))
    conv = nn.Conv2d(3, 3, 3, padding=1)
    x = torch.randn(1, 3, 2, 4, 4).contiguous(memory_format=CL)
    assert rel_l2(upsampled_frame_conv(conv, x), upsample_then_conv(conv, x, 1, False)) > 1e-2


def test_converted_wan_resample_runs_it(aten_path):
    """Wan's upsampler (nearest 2x, then a 3x3 Conv2d on each frame, 4 -> 2 channels) through convert: the
    transposed conv, nothing of the upsampled input's size made, the same values as diffusers'."""
    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResample

    import tconv3d

    torch.manual_seed(0)
    stock = WanResample(4, "upsample2d").eval()
    converted = tconv3d.nn.convert(WanResample(4, "upsample2d").eval())
    converted.load_state_dict(stock.state_dict())
    x = torch.randn(1, 4, 3, 5, 6).contiguous(memory_format=CL)
    with torch.no_grad(), OpsMade() as made:
        y = converted(x)
    with torch.no_grad():
        expected = stock(x)
    assert rel_l2(y, expected) < 1e-5 and y.shape == (1, 2, 3, 10, 12) and y.is_contiguous(memory_format=CL)
    assert "tconv3d.conv3d_input_grad.default" in made.names
    assert (1, 4, 3, 10, 12) not in made.shapes, made.names


def stock_and_converted(module: str, name: str, dtype, device, *args, **kwargs):
    """diffusers' `name` (from diffusers.models.autoencoders.`module`) built with args in float64, and converted in
    `dtype`, with the same weights."""
    pytest.importorskip("diffusers")
    import importlib

    import tconv3d

    build = getattr(importlib.import_module(f"diffusers.models.autoencoders.{module}"), name)
    torch.manual_seed(0)
    exact = build(*args, **kwargs).to(device=device, dtype=torch.float64)
    ours = tconv3d.nn.convert(build(*args, **kwargs).to(device=device, dtype=dtype))
    ours.load_state_dict(exact.state_dict())
    return exact, ours


def hunyuan_upsamplers(factors, dtype, device, channels=(5, 6)):
    """diffusers' HunyuanVideoUpsampleCausal3D in float64 and converted in `dtype`, with the same weights."""
    return stock_and_converted("autoencoder_kl_hunyuan_video", "HunyuanVideoUpsampleCausal3D", dtype, device,
                               *channels, upsample_factor=factors)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("factors", [(2, 2, 2), (1, 2, 2)], ids=["time", "space"])
def test_upsampled_causal_conv_matches_float64(factors, dtype, device):
    """HunyuanVideo's upsampler converted: output, input gradient and the conv's weight and bias gradients against
    diffusers' in float64: one input-gradient op (the transposed conv), no convolution and no tensor of the upsampled
    size; the output channels_last_3d. 3 frames (5 out at factor 2: the first once), odd H and W."""
    exact, ours = hunyuan_upsamplers(factors, dtype, device)
    x = leaf_copy(torch.randn(2, 5, 3, 3, 5, device=device).to(dtype).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    assert causal_subpixel_reason(ours.conv, x, factors) is None
    with OpsMade() as ops:
        y = ours(x)
    expected = exact(x64)
    assert y.shape == expected.shape == (2, 6, 5 if factors[0] == 2 else 3, 6, 10)
    assert y.dtype == dtype and y.is_contiguous(memory_format=CL)
    assert sum("tconv3d.conv3d_input_grad" in name for name in ops.names) == 1
    assert not any("tconv3d.conv3d." in name or "convolution" in name for name in ops.names), ops.names
    assert not any(shape[2:] == expected.shape[2:] for shape in ops.shapes if len(shape) == 5 and shape[1] == 5)
    grad = torch.randn_like(expected)
    y.backward(grad.to(dtype))
    expected.backward(grad)
    bound = tolerance(dtype)
    conv, conv64 = ours.conv.conv, exact.conv.conv
    for name, mine, theirs in (("output", y, expected), ("input", x.grad, x64.grad),
                               ("weight", conv.weight.grad, conv64.weight.grad),
                               ("bias", conv.bias.grad, conv64.bias.grad)):  # fmt: skip
        assert rel_l2(mine, theirs) < bound, (name, rel_l2(mine, theirs))
    assert x.grad.is_contiguous(memory_format=CL)


def test_a_wrong_reversed_time_tap_fails(monkeypatch, aten_path):
    """The float64 comparison sees the time taps of a kept time unreversed (the causal conv's future read as its
    past)."""

    monkeypatch.setattr(subpixel, "_REVERSED_TAPS", ((1, 0, 0), (0, 1, 0), (0, 0, 1)))
    exact, ours = hunyuan_upsamplers((1, 2, 2), torch.float32, "cpu")
    x = torch.randn(1, 5, 4, 3, 3).contiguous(memory_format=CL)
    with torch.no_grad():
        assert rel_l2(ours(x), exact(x.double())) > 1e-2


@pytest.mark.parametrize(
    "factors, reason",
    [((2, 1, 1), "its factors (2, 1, 1)"), ((2, 4, 4), "its factors (2, 4, 4)")],
)
def test_other_hunyuan_upsamplers_upsample_first(factors, reason, aten_path):
    """Factors the sub-pixel form does not cover say why, and upsample first (the result still right)."""
    exact, ours = hunyuan_upsamplers(factors, torch.float32, "cpu", channels=(3, 3))
    x = torch.randn(1, 3, 3, 2, 3).contiguous(memory_format=CL)
    assert reason in causal_subpixel_reason(ours.conv, x, factors)
    with torch.no_grad():
        assert rel_l2(ours(x), exact(x.double())) < 1e-5


@pytest.mark.parametrize("padding", [(1, 0, 1, 1, 1, 1), (2, 0, 1, 1, 1, 1), (0, 2, 3, 0, 1, 2)])
def test_replicate_padded_is_f_pad(padding, device):
    """Values as F.pad's (replicate) in float64, the layout kept channels_last_3d, and the gradient as F.pad's
    backward (each border's gradient folded onto the voxel it repeated), channels_last_3d too."""
    x = leaf_copy(torch.randn(2, 3, 2, 4, 3, device=device, dtype=torch.float64).contiguous(memory_format=CL))
    x_torch = leaf_copy(x.detach())
    df, db, ht, hb, wl, wr = padding
    y, expected = replicate_padded(x, padding), F.pad(x_torch, (wl, wr, ht, hb, df, db), mode="replicate")
    assert torch.equal(y, expected) and y.is_contiguous(memory_format=CL)
    grad = torch.randn_like(expected)
    y.backward(grad)
    expected.backward(grad)
    assert rel_l2(x.grad, x_torch.grad) < 1e-12 and x.grad.is_contiguous(memory_format=CL)


def test_a_one_voxel_frame_upsamples_first(aten_path):
    """Frames of one voxel in H or W: stock's output (its borders replicated) is then exactly constant along that
    dimension, and stays so here (upsampled first), where the sub-pixel phases' tap sums, rounded apart, would
    differ by an ulp that a decode's norms amplify (tests/fuzz_models.py, a 1 x 1 latent)."""
    exact, ours = hunyuan_upsamplers((2, 2, 2), torch.float32, "cpu", channels=(4, 4))
    x = torch.randn(1, 4, 3, 1, 1).contiguous(memory_format=CL)
    assert "one voxel along H or W" in causal_subpixel_reason(ours.conv, x, (2, 2, 2))
    with torch.no_grad():
        y = ours(x)
    assert torch.equal(y, y[:, :, :, :1, :1].expand_as(y))
    assert rel_l2(y, exact(x.double())) < 1e-5


def test_the_audit_counts_the_borders_copy(monkeypatch, aten_path):
    """The sub-pixel conv's input is a replicate-padded copy of the upsampler's, written by views and copy_ (no pad
    op a dispatcher mode sees): the audit counts it as the upsampler conv's own copy (tconv3d's), one a call;
    upsampled first, the conv pads in its op and no copy is counted."""
    import tconv3d

    _, ours = hunyuan_upsamplers((2, 2, 2), torch.float32, "cpu", channels=(4, 4))
    x = torch.randn(1, 4, 3, 4, 5).contiguous(memory_format=CL)
    report = tconv3d.nn.audit(ours, x, verbose=False)
    layers = [(layer.name, layer.calls, layer.pad_copies, layer.own_copies) for layer in report.layers]
    assert layers == [("conv", 1, 0, 1)] and report.pads == 1, report.table()
    monkeypatch.setattr(subpixel, "SUBPIXEL", False)
    report = tconv3d.nn.audit(ours, x, verbose=False)
    assert report.pads == report.totals["tconv3d_copies_into_convs"] == 0, report.table()


def easyanimate_upsamplers(temporal_upsample, dtype, device, channels=(5, 6)):
    """diffusers' EasyAnimateUpsampler3D in float64 and converted in `dtype`, with the same weights."""
    return stock_and_converted("autoencoder_kl_magvit", "EasyAnimateUpsampler3D", dtype, device, *channels,
                               temporal_upsample=temporal_upsample)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("temporal_upsample", [False, True], ids=["space", "time"])
def test_easyanimate_upsampler_matches_float64(temporal_upsample, dtype, device):
    """EasyAnimate's upsampler converted, three calls of a clip (3, 1 and 2 frames: the first frame repeated in front,
    then the frames kept from the call before, fewer than the two it keeps in the second) and a training step
    through all three: outputs, the inputs' gradients and the conv's weight and bias gradients against diffusers'
    in float64; one input-gradient op a call (the transposed conv), no convolution and no tensor of the upsampled
    size of the input's channels; the frames kept those of the input (a quarter of the upsampled ones)."""
    from tconv3d.nn.video_vaes import easyanimate_subpixel_reason

    exact, ours = easyanimate_upsamplers(temporal_upsample, dtype, device)
    xs = [
        leaf_copy(torch.randn(2, 5, t, 3, 5, device=device).to(dtype).contiguous(memory_format=CL)) for t in (3, 1, 2)
    ]
    x64s = [leaf_copy(x.detach().double()) for x in xs]
    ys, expected = [], []
    for x, x64 in zip(xs, x64s, strict=True):
        assert easyanimate_subpixel_reason(ours.conv, x) is None
        with OpsMade() as ops:
            ys.append(ours(x))
        expected.append(exact(x64))
        assert ys[-1].shape == expected[-1].shape and ys[-1].is_contiguous(memory_format=CL)
        assert sum("tconv3d.conv3d_input_grad" in name for name in ops.names) == 1
        assert not any("tconv3d.conv3d." in name or "convolution" in name for name in ops.names), ops.names
        assert not any(len(shape) == 5 and shape[1] == 5 and shape[3:] == (6, 10) for shape in ops.shapes)
        assert ours.conv.prev_features.shape == (2, 5, 2, 3, 5)
    grads = [torch.randn_like(e) for e in expected]
    torch.autograd.backward(ys, [g.to(dtype) for g in grads])
    torch.autograd.backward(expected, grads)
    bound = tolerance(dtype)
    conv, conv64 = ours.conv, exact.conv
    pairs = [*zip(ys, expected, strict=True), *((x.grad, x64.grad) for x, x64 in zip(xs, x64s, strict=True)),
             (conv.weight.grad, conv64.weight.grad), (conv.bias.grad, conv64.bias.grad)]  # fmt: skip
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < bound, (index, rel_l2(mine, theirs))


@pytest.mark.parametrize("first_subpixel", [True, False], ids=["subpixel_first", "upsampled_first"])
def test_easyanimate_kept_frames_cross_between_forms(first_subpixel, monkeypatch, aten_path):
    """A clip whose upsampler changes form between calls (SUBPIXEL switched): the frames kept by one form are read
    by the other (the input's frames repeated 2x, or the upsampled ones at every other row and column), so the
    clip's second call is diffusers' either way."""
    from tconv3d.nn import video_vaes

    exact, ours = easyanimate_upsamplers(False, torch.float32, "cpu")
    xs = [torch.randn(1, 5, t, 3, 4).contiguous(memory_format=CL) for t in (2, 3)]
    with torch.no_grad():
        for index, x in enumerate(xs):
            monkeypatch.setattr(subpixel, "SUBPIXEL", first_subpixel == (index == 0))
            assert (video_vaes.easyanimate_subpixel_reason(ours.conv, x) is None) == subpixel.SUBPIXEL
            assert rel_l2(ours(x), exact(x.double())) < 1e-5, index


def test_the_audit_counts_easyanimates_frames_in_front(monkeypatch, aten_path):
    """EasyAnimate's sub-pixel conv reads its input with the frames in front written before it (frames_in_front):
    the audit counts it as the upsampler conv's own copy, one a call; upsampled first, the op reads the kept frames
    in place and no copy is counted."""
    import tconv3d

    _, ours = easyanimate_upsamplers(False, torch.float32, "cpu", channels=(4, 4))
    x = torch.randn(1, 4, 3, 4, 5).contiguous(memory_format=CL)
    report = tconv3d.nn.audit(ours, x, verbose=False)
    layers = [(layer.name, layer.calls, layer.pad_copies, layer.own_copies) for layer in report.layers]
    assert layers == [("conv", 1, 0, 1)], report.table()
    monkeypatch.setattr(subpixel, "SUBPIXEL", False)
    ours.conv.prev_features = None
    report = tconv3d.nn.audit(ours, x, verbose=False)
    assert report.pads == report.totals["tconv3d_copies_into_convs"] == 0, report.table()


@pytest.mark.parametrize("variant", ["pointer", "gluon"])
def test_each_kernel_runs_easyanimates(variant, device, monkeypatch):
    """EasyAnimate's sub-pixel transposed conv (stride (1, 2, 2), 3 x 4 x 4 taps, padding (2, 1, 1)) and its
    backward with TCONV3D_KERNELS forced, bf16, 32 -> 32 channels, two calls of a clip, against float64."""
    exact, ours = easyanimate_upsamplers(False, torch.bfloat16, device, channels=(32, 32))
    launched = forced_launches(variant, monkeypatch)
    xs = [leaf_copy(torch.randn(1, 32, t, 5, 6, device=device).to(torch.bfloat16).contiguous(memory_format=CL))
          for t in (2, 3)]  # fmt: skip
    x64s = [leaf_copy(x.detach().double()) for x in xs]
    ys, expected = [ours(x) for x in xs], [exact(x64) for x64 in x64s]
    assert_launched(launched, variant, device, calls=2)
    grads = [torch.randn_like(e) for e in expected]
    torch.autograd.backward(ys, [g.to(torch.bfloat16) for g in grads])
    torch.autograd.backward(expected, grads)
    pairs = [*zip(ys, expected, strict=True), *((x.grad, x64.grad) for x, x64 in zip(xs, x64s, strict=True)),
             (ours.conv.weight.grad, exact.conv.weight.grad)]  # fmt: skip
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(torch.bfloat16), (index, rel_l2(mine, theirs))


def cosmos_upsamplers(space: bool, time: bool, dtype, device, channels=5):
    """diffusers' CosmosUpsample3d in float64 and converted in `dtype`, with the same weights."""
    return stock_and_converted("autoencoder_kl_cosmos", "CosmosUpsample3d", dtype, device, channels,
                               spatial_upsample=space, temporal_upsample=time)  # fmt: skip


COSMOS_STEPS = [(True, False), (False, True), (True, True)]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("space, time", COSMOS_STEPS, ids=["space", "time", "both"])
def test_cosmos_upsampler_matches_float64(space, time, dtype, device):
    """Cosmos's upsampler converted, on clips of 1, 2 and 3 frames (one frame is not repeated in time), and a
    training step: outputs, the input's gradient and the upsampled convs' weight and bias gradients against
    diffusers' in float64; each upsampled conv one input-gradient op (the transposed conv), the only convolutions
    the 1 x 1 x 1 conv after and, on one frame, the time conv; no copy of the repeated input's size (the time
    step's one copy, its input with a frame in front, is the input's size plus a frame)."""
    from tconv3d.nn.video_vaes import cosmos_subpixel_reason

    exact, ours = cosmos_upsamplers(space, time, dtype, device)
    for frames in (1, 2, 3):
        x = leaf_copy(torch.randn(2, 5, frames, 3, 4, device=device).to(dtype).contiguous(memory_format=CL))
        x64 = leaf_copy(x.detach().double())
        timed = time and frames > 1
        assert (cosmos_subpixel_reason(ours.conv1, x, True) is None) == timed
        with OpsMade() as ops:
            y = ours(x)
        expected = exact(x64)
        assert y.shape == expected.shape and y.is_contiguous(memory_format=CL)
        assert sum("tconv3d.conv3d_input_grad" in name for name in ops.names) == space + timed, ops.names
        convs = sum("tconv3d.conv3d." in name or "convolution" in name for name in ops.names)
        assert convs == 1 + (time and not timed), ops.names
        assert all(n <= x.numel() // frames * (frames + 1) for n in ops.copied()), (ops.copied(), x.shape)
        grad = torch.randn_like(expected)
        y.backward(grad.to(dtype))
        expected.backward(grad)
        pairs = [(y, expected), (x.grad, x64.grad)]
        for name in ("conv1",) * time + ("conv2",) * space:
            mine, theirs = getattr(ours, name), getattr(exact, name)
            pairs += [(mine.weight.grad, theirs.weight.grad), (mine.bias.grad, theirs.bias.grad)]
            mine.zero_grad(), theirs.zero_grad()
        assert x.grad.is_contiguous(memory_format=CL)
        for index, (mine, theirs) in enumerate(pairs):
            assert rel_l2(mine, theirs) < tolerance(dtype), (frames, index, rel_l2(mine, theirs))


def test_a_wrong_cosmos_time_tap_fails(monkeypatch, aten_path):
    """The float64 comparison sees the time step's taps misplaced (the transposed conv's first tap summing the
    conv's first frame tap instead of its last)."""

    exact, ours = cosmos_upsamplers(False, True, torch.float32, "cpu")
    x = torch.randn(1, 5, 3, 3, 4).contiguous(memory_format=CL)
    assert rel_l2(ours(x), exact(x.double())) < 1e-5  # the weights take gradients: the taps summed each call
    monkeypatch.setattr(subpixel, "_SUBPIXEL_TAPS", ((1, 0, 0), (0, 1, 1), (1, 1, 0), (1, 0, 0)))
    assert rel_l2(ours(x), exact(x.double())) > 1e-2


def _replicate_padded_conv2(module):
    module.conv2.pad_mode = "replicate"


def _dilated_conv1(module):
    module.conv1.dilation, module.conv1.temporal_pad = (2, 1, 1), 4


@pytest.mark.parametrize(
    "change, step, reason",
    [
        (None, "space", "subpixel.SUBPIXEL is off"),
        (_replicate_padded_conv2, "space", "is not ((1, 3, 3), 0, (1, 1, 1, 1), 'constant')"),
        (_dilated_conv1, "time", "is not ((3, 1, 1), 2, (0, 0, 0, 0), None)"),
    ],
)
def test_other_cosmos_upsamplers_upsample_first(change, step, reason, monkeypatch, aten_path):
    """An upsampler step the sub-pixel form does not cover says why and upsamples first (the result still
    diffusers'): SUBPIXEL off, the space conv replicate-padded, the time conv dilated."""
    from tconv3d.nn import video_vaes

    pytest.importorskip("diffusers")
    from diffusers.models.autoencoders.autoencoder_kl_cosmos import CosmosUpsample3d

    import tconv3d

    torch.manual_seed(0)
    stock = CosmosUpsample3d(4)
    if change is not None:
        change(stock)
    else:
        monkeypatch.setattr(subpixel, "SUBPIXEL", False)
    ours = tconv3d.nn.convert(copy.deepcopy(stock))
    x = torch.randn(1, 4, 3, 3, 4).contiguous(memory_format=CL)
    conv, upsampled = (
        (ours.conv1, x) if step == "time" else (ours.conv2, repeat_nearest(x, (2, 1, 1), first_apart=True))
    )
    assert reason in video_vaes.cosmos_subpixel_reason(conv, upsampled, step == "time")
    with torch.no_grad():
        assert rel_l2(ours(x), stock(x)) < 1e-5


@pytest.mark.parametrize("step", ["space", "time"])
def test_the_audit_counts_cosmos_time_copy(step, aten_path):
    """Cosmos's time step reads its input with a frame in front written before it (replicate_padded): the audit
    counts it as the time conv's own copy, one a call; the space step writes none."""
    import tconv3d

    _, ours = cosmos_upsamplers(step == "space", step == "time", torch.float32, "cpu", channels=4)
    report = tconv3d.nn.audit(ours, torch.randn(1, 4, 3, 4, 5).contiguous(memory_format=CL), verbose=False)
    layers = {layer.name: (layer.calls, layer.pad_copies, layer.own_copies) for layer in report.layers}
    expected = {"conv1": (1, 0, 1), "conv3": (1, 0, 0)} if step == "time" else {"conv2": (1, 0, 0), "conv3": (1, 0, 0)}
    assert layers == expected, report.table()


@pytest.mark.parametrize("variant", ["pointer", "gluon"])
def test_each_kernel_runs_cosmos(variant, device, monkeypatch):
    """Cosmos's two sub-pixel transposed convs (time: stride (2, 1, 1), 4 x 1 x 1 taps, padding (3, 0, 0); space:
    stride (1, 2, 2), 1 x 4 x 4 taps, padding (0, 1, 1)) and their backward with TCONV3D_KERNELS forced, bf16,
    32 -> 32 channels, against float64."""
    exact, ours = cosmos_upsamplers(True, True, torch.bfloat16, device, channels=32)
    launched = forced_launches(variant, monkeypatch)
    x = leaf_copy(torch.randn(1, 32, 3, 4, 5, device=device).to(torch.bfloat16).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    y, expected = ours(x), exact(x64)
    assert_launched(launched, variant, device, calls=2)
    grad = torch.randn_like(expected)
    y.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    pairs = [(y, expected), (x.grad, x64.grad), (ours.conv1.weight.grad, exact.conv1.weight.grad),
             (ours.conv2.weight.grad, exact.conv2.weight.grad)]  # fmt: skip
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(torch.bfloat16), (index, rel_l2(mine, theirs))


def monai_upsamples(dtype, device, wrapped=False, **changes):
    """MONAI's UpSample ("nontrainable", nearest 2x, then a 3 x 3 x 3 Convolution padded by 1, 4 -> 6 channels; the
    diffusion UNet's WrappedUpsample where `wrapped`) in float64 and converted in `dtype`, with the same weights;
    `changes` replace UpSample's or the post_conv Convolution's arguments (`conv_` prefixed)."""
    blocks = pytest.importorskip("monai.networks.blocks")
    import tconv3d

    conv_args = dict(spatial_dims=3, in_channels=4, out_channels=6, strides=1, kernel_size=3, padding=1, conv_only=True)
    conv_args |= {k[5:]: v for k, v in changes.items() if k.startswith("conv_")}
    args = dict(spatial_dims=3, mode="nontrainable", in_channels=4, out_channels=4, interp_mode="nearest",
                scale_factor=2.0, align_corners=None)  # fmt: skip
    args |= {k: v for k, v in changes.items() if not k.startswith("conv_")}
    if wrapped:
        build = pytest.importorskip("monai.networks.nets.diffusion_model_unet").WrappedUpsample
    else:
        build = blocks.UpSample
    torch.manual_seed(0)
    stock = build(post_conv=blocks.Convolution(**conv_args), **args)
    exact = copy.deepcopy(stock).to(device=device, dtype=torch.float64)
    ours = tconv3d.nn.convert(copy.deepcopy(stock).to(device=device, dtype=dtype))
    return exact, ours


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("wrapped", [False, True], ids=["upsample", "wrapped"])
def test_monai_upsample_matches_float64(wrapped, dtype, device):
    """MONAI's UpSample (and the diffusion UNet's WrappedUpsample, called with an embedding it drops) converted: one
    transposed conv of the input at stride 2 (4 x 4 x 4 taps, 8 live a phase), against MONAI in float64: output,
    the input's gradient, the convolution's weight and bias gradients; one input-gradient op, no convolution, and
    nothing of the upsampled input's size (2, 4, 6, 8, 10) made."""
    exact, ours = monai_upsamples(dtype, device, wrapped)
    x = leaf_copy(torch.randn(2, 4, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    extra = (torch.randn(2, 8, device=device),) if wrapped else ()
    with OpsMade() as ops:
        y = ours(x, *extra)
    expected = exact(x64, *extra)
    assert y.shape == expected.shape == (2, 6, 6, 8, 10) and y.is_contiguous(memory_format=CL)
    assert [name for name in ops.names if "tconv3d" in name] == ["tconv3d.conv3d_input_grad.default"], ops.names
    assert (2, 4, 6, 8, 10) not in ops.shapes, ops.shapes
    grad = torch.randn_like(expected)
    y.backward(grad.to(dtype))
    expected.backward(grad)
    conv, conv64 = ours.postconv.conv, exact.postconv.conv
    pairs = [
        (y, expected),
        (x.grad, x64.grad),
        (conv.weight.grad, conv64.weight.grad),
        (conv.bias.grad, conv64.bias.grad),
    ]
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(dtype), (index, rel_l2(mine, theirs))


def _hook_on_the_conv(module):
    module.postconv.conv.register_forward_hook(lambda *args: None)


@pytest.mark.parametrize(
    "changes, hook, why",
    [
        ({}, None, "SUBPIXEL off"),
        ({"interp_mode": "trilinear"}, None, "trilinear"),
        ({"out_channels": 6, "conv_in_channels": 6}, None, "a pre_conv (1x1x1, 4 -> 6) before the interpolation"),
        ({"conv_conv_only": False, "conv_norm": "batch"}, None, "a norm and activation after the convolution"),
        ({"conv_kernel_size": 1, "conv_padding": 0}, None, "a 1 x 1 x 1 convolution"),
        ({"conv_padding": 2, "conv_dilation": 2}, None, "a dilated convolution"),
        ({}, _hook_on_the_conv, "a hook on the convolution"),
    ],
)
def test_other_monai_upsamples_run_as_monais(changes, hook, why, monkeypatch, aten_path):
    """An UpSample the sub-pixel form does not cover runs as MONAI's (the same values, the hook seeing the
    upsampled input): SUBPIXEL off, trilinear, a pre_conv, a post_conv with a norm after it, a convolution of
    another kernel or dilation, a hook."""
    exact, ours = monai_upsamples(torch.float32, "cpu", **changes)
    if hook is not None:
        hook(exact), hook(ours)
    if why == "SUBPIXEL off":
        monkeypatch.setattr(subpixel, "SUBPIXEL", False)
    exact, ours = exact.eval(), ours.eval()
    x = torch.randn(2, 4, 3, 4, 5).contiguous(memory_format=CL)
    with torch.no_grad(), OpNames() as ops:
        y = ours(x)
    assert "tconv3d.conv3d_input_grad.default" not in ops.names, why
    with torch.no_grad():
        assert rel_l2(y, exact(x.double())) < 1e-5, why


def test_a_wrong_volume_tap_fails(monkeypatch, aten_path):
    """The float64 comparison sees a misplaced tap (the transposed conv's tap 0 summing the conv's first tap instead
    of its last, along D, H and W)."""
    exact, ours = monai_upsamples(torch.float32, "cpu")
    x = torch.randn(1, 4, 3, 3, 4).contiguous(memory_format=CL)
    assert rel_l2(ours(x), exact(x.double())) < 1e-5
    monkeypatch.setattr(subpixel, "_SUBPIXEL_TAPS", ((1, 0, 0), (0, 1, 1), (1, 1, 0), (1, 0, 0)))
    assert rel_l2(ours(x), exact(x.double())) > 1e-2


def test_conv3d_upsampled_refuses_what_it_cannot_take(aten_path):
    """tconv3d.nn.Conv3d's `upsampled` takes a 5-D input alone: a channels_after or an unbatched input is refused by
    name; a convolution or factors the sub-pixel form does not cover convolve the repetition (the same values); the
    ones it covers match it: (2, 2, 2) with 3 x 3 x 3, (1, 2, 2) with 1 x 3 x 3, zero-, reflect- or
    replicate-padded (circular refused; a bordered one also where x is one voxel along an upsampled dimension)."""
    from tconv3d.nn.modules import Conv3d, repeat_nearest

    conv = Conv3d(4, 4, 3, padding=1)
    x = torch.randn(1, 4, 2, 3, 3)
    with pytest.raises(ValueError, match="upsampled takes a 5-D input and no channels_after"):
        conv(x, channels_after=x, upsampled=(2, 2, 2))
    with pytest.raises(ValueError, match="upsampled takes a 5-D input"):
        conv(x[0], upsampled=(2, 2, 2))
    frame = Conv3d(4, 4, (1, 3, 3), padding=(0, 1, 1))
    replicate, reflect = (Conv3d(4, 4, 3, padding=1, padding_mode=mode) for mode in ("replicate", "reflect"))
    frame_reflect = Conv3d(4, 4, (1, 3, 3), padding=(0, 1, 1), padding_mode="reflect")
    circular = Conv3d(4, 4, 3, padding=1, padding_mode="circular")
    cases = [(conv, (2, 2, 2), True), (frame, (1, 2, 2), True), (frame, (2, 2, 2), False), (conv, (1, 2, 2), False),
             (conv, (2, 1, 1), False), (replicate, (2, 2, 2), True), (reflect, (2, 2, 2), True),
             (frame_reflect, (1, 2, 2), True), (circular, (2, 2, 2), False)]  # fmt: skip
    one_high = torch.randn(1, 4, 2, 1, 3)  # one voxel along an upsampled dimension: bordered modes upsample first
    cases += [(replicate, (2, 2, 2), False, one_high), (frame_reflect, (1, 2, 2), False, one_high),
              (frame, (1, 2, 2), True, one_high)]  # fmt: skip
    for layer, factors, subpixel_form, *given in cases:
        x_in = given[0] if given else x
        with torch.no_grad(), OpNames() as ops:
            y = layer(x_in, upsampled=factors)
        why = (layer.padding_mode, factors, tuple(x_in.shape))
        assert ("tconv3d.conv3d_input_grad.default" in ops.names) == subpixel_form, (why, ops.names)
        with torch.no_grad():
            assert rel_l2(y, layer(repeat_nearest(x_in, factors))) < 1e-6, why


@pytest.mark.parametrize("variant", ["pointer", "gluon"])
def test_each_kernel_runs_monais(variant, device, monkeypatch):
    """MONAI's sub-pixel transposed conv (stride 2, 4 x 4 x 4 taps, padding 1) and its backward with TCONV3D_KERNELS
    forced, bf16, 32 -> 32 channels, against float64."""
    exact, ours = monai_upsamples(torch.bfloat16, device, in_channels=32, out_channels=32, conv_in_channels=32,
                                  conv_out_channels=32)  # fmt: skip
    launched = forced_launches(variant, monkeypatch)
    x = leaf_copy(torch.randn(1, 32, 2, 3, 4, device=device).to(torch.bfloat16).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    y, expected = ours(x), exact(x64)
    assert_launched(launched, variant, device)
    grad = torch.randn_like(expected)
    y.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    pairs = [(y, expected), (x.grad, x64.grad), (ours.postconv.conv.weight.grad, exact.postconv.conv.weight.grad)]
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(torch.bfloat16), (index, rel_l2(mine, theirs))


def monai_up_res_blocks(dtype, device, out_channels=6, spade=False):
    """MONAI's diffusion res block with up=True (resblock_updown's upsampler: norm, SiLU, nearest 2x of it and of
    the input, a 3 x 3 x 3 conv, the embedding, norm, SiLU, conv, plus the skip connection of the upsampled input:
    a 1 x 1 x 1 conv from 4 to `out_channels`, nn.Identity at 4), or SPADE's (its norms read a segmentation map), in
    float64 and converted in `dtype`, with the same random weights (conv2 is zeroed at init), and how to call each."""
    if spade:
        nets = pytest.importorskip("monai.networks.nets.spade_diffusion_model_unet")
        block = nets.SPADEDiffResBlock(3, 4, 8, label_nc=3, out_channels=out_channels, up=True, norm_num_groups=2,
                                       spade_intermediate_channels=8)  # fmt: skip
    else:
        nets = pytest.importorskip("monai.networks.nets.diffusion_model_unet")
        block = nets.DiffusionUNetResnetBlock(3, 4, 8, out_channels=out_channels, up=True, norm_num_groups=2)
    import tconv3d

    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    exact = copy.deepcopy(block).to(device=device, dtype=torch.float64)
    ours = tconv3d.nn.convert(copy.deepcopy(block).to(device=device, dtype=dtype))
    emb, seg = torch.randn(2, 8, device=device), torch.rand(2, 3, 5, 5, 5, device=device)

    def call(module, x):
        args = (emb.to(x.dtype), seg.to(x.dtype)) if spade else (emb.to(x.dtype),)
        return module(x, *args)

    return exact, ours, call


def _inputs_kept(block) -> dict:
    """Holds, once `block` has run, the tensors its norm2 and conv1 read (conv1's output plus the embedding's
    projection; the normalized input, upsampled in MONAI's form and not in the sub-pixel one) with their gradients
    retained: forward hooks marked as observers (`hooks.hooked` skips them, as it does the audit's; no adapter
    consults norm2's hooks anyway)."""
    kept = {}

    def keeper(name):
        def keep(module, args, output):
            args[0].retain_grad()
            kept[name] = args[0]

        return observer(keep)

    block.norm2.register_forward_hook(keeper("norm2"))
    block.conv1.conv.register_forward_hook(keeper("conv1"))
    return kept


def _res_block_results(block, y, x, kept: dict, dtype) -> dict:
    """What test_monai_up_res_block_matches_float64 compares, after the backward: the output, the input's gradient,
    the gradients at norm2's and conv1's inputs (`_inputs_kept`; conv1's summed over each voxel's 8 repeats where
    conv1 read the upsampled input), the weight gradients of both convs and the skip conv (where there is one), and
    in float32 the weight gradients of the embedding's projection and norm1 (where not SPADE's). Those two sum
    the gradients at norm2's and norm1's outputs, over the voxels, times something; norm backward makes the sums
    cancel (the embedding's 16-220 times smaller than their terms, norm1's 5-21 times, over 30-40 draws), so in
    16-bit dtypes their error is the terms' rounding times that, ours and stock's alike and apart by up to 5.7x a
    draw. There the gradients they sum are compared instead, element by element (norm1's through the SiLU after
    it, inside tconv3d's fused pass in ours: the gradient at conv1's input)."""
    conv1_input = kept["conv1"].grad
    if conv1_input.shape[2:] != x.shape[2:]:  # MONAI's form: each voxel of x repeated 2 x 2 x 2
        conv1_input = conv1_input.unflatten(4, (-1, 2)).unflatten(3, (-1, 2)).unflatten(2, (-1, 2)).sum((3, 5, 7))
    results = {"output": y, "input": x.grad, "norm2_input": kept["norm2"].grad, "conv1_input": conv1_input,
               "conv1": block.conv1.conv.weight.grad, "conv2": block.conv2.conv.weight.grad}  # fmt: skip
    if not isinstance(block.skip_connection, nn.Identity):
        results["skip"] = block.skip_connection.conv.weight.grad
    if dtype == torch.float32:
        results["embedding"] = block.time_emb_proj.weight.grad
        if hasattr(block.norm1, "weight"):
            results["norm1"] = block.norm1.weight.grad
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize(
    "spade, out_channels", [(False, 6), (False, 4), (True, 6)], ids=["conv_skip", "identity_skip", "spade"]
)
def test_monai_up_res_block_matches_float64(spade, out_channels, dtype, device):
    """MONAI's diffusion res block with up=True (and SPADE's) converted: conv1 one transposed conv of the normalized
    input at stride 2 (8 live taps where 27), the skip connection of the input itself, repeated into the output by
    broadcasting; against MONAI in float64: output and gradients (`_res_block_results`); no tensor of the upsampled
    input's size (2, 4, 6, 8, 10) made. In 16-bit dtypes a weight gradient taken through norm2's backward (conv1's:
    sums over voxels of a gradient the norm makes cancel) is off float64's by up to 2.4% in stock MONAI itself
    (bfloat16): each result is held to the dtype's tolerance or, where stock MONAI run in the same dtype misses
    that, to 1.5 times stock's own error."""
    exact, ours, call = monai_up_res_blocks(dtype, device, out_channels, spade)
    stock = copy.deepcopy(exact).to(dtype)
    kept = {block: _inputs_kept(block) for block in (exact, ours, stock)}
    x = leaf_copy(torch.randn(2, 4, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL))
    x64, x_stock = leaf_copy(x.detach().double()), leaf_copy(x.detach())
    with OpsMade() as ops:
        y = call(ours, x)
    expected, y_stock = call(exact, x64), call(stock, x_stock)
    assert y.shape == expected.shape == (2, out_channels, 6, 8, 10) and y.is_contiguous(memory_format=CL)
    assert "tconv3d.conv3d_input_grad.default" in ops.names, ops.names
    if out_channels != 4:
        assert (2, 4, 6, 8, 10) not in ops.shapes, ops.shapes
    grad = torch.randn_like(expected)
    for output in (y, y_stock):
        output.backward(grad.to(dtype))
    expected.backward(grad)
    exacts = _res_block_results(exact, expected, x64, kept[exact], dtype)
    stocks = _res_block_results(stock, y_stock, x_stock, kept[stock], dtype)
    for name, mine in _res_block_results(ours, y, x, kept[ours], dtype).items():
        error = rel_l2(mine, exacts[name])
        assert error < max(tolerance(dtype), 1.5 * rel_l2(stocks[name], exacts[name])), (name, error)


@pytest.mark.parametrize("why", ["SUBPIXEL off", "a hook on the upsample", "a hook on conv1", "a hook on the skip"])
def test_other_monai_up_res_blocks_run_as_monais(why, monkeypatch, aten_path):
    """A diffusion res block with up=True runs as MONAI's (the same values, the hooks seeing the upsampled
    tensors) with SUBPIXEL off or a hook on its upsample, conv1 or skip connection."""
    exact, ours, call = monai_up_res_blocks(torch.float32, "cpu")
    seen = []
    for block in (exact, ours):
        part = {"a hook on the upsample": block.upsample, "a hook on conv1": block.conv1,
                "a hook on the skip": block.skip_connection}.get(why)  # fmt: skip
        if part is not None:
            part.register_forward_hook(lambda module, args, output: seen.append(tuple(args[0].shape)))
    if why == "SUBPIXEL off":
        monkeypatch.setattr(subpixel, "SUBPIXEL", False)
    x = torch.randn(2, 4, 3, 4, 5).contiguous(memory_format=CL)
    with torch.no_grad(), OpNames() as ops:
        y = call(ours, x)
    assert "tconv3d.conv3d_input_grad.default" not in ops.names, why
    with torch.no_grad():
        assert rel_l2(y, call(exact, x.double())) < 1e-5, why
    assert seen[: len(seen) // 2] == seen[len(seen) // 2 :], seen


@pytest.mark.parametrize("block", ["upsample", "up_res_block"])
def test_the_audit_sees_monais_subpixel_forms(block, aten_path):
    """tconv3d.nn.audit's hooks on every conv leave MONAI's sub-pixel forms on (a user's hook turns them off:
    hooks.hooked): the audit reports the path the model takes, one transposed conv counted as the conv's."""
    import tconv3d

    x = torch.randn(2, 4, 3, 4, 5).contiguous(memory_format=CL)
    if block == "upsample":
        ours, run, conv = monai_upsamples(torch.float32, "cpu")[1], None, "postconv.conv"
    else:
        _, ours, call = monai_up_res_blocks(torch.float32, "cpu")
        run, conv = call, "conv1.conv"
    with OpNames() as ops:
        report = tconv3d.nn.audit(ours, x, run=run, verbose=False)
    assert "tconv3d.conv3d_input_grad.default" in ops.names, ops.names
    layer = next(layer for layer in report.layers if layer.name == conv)
    assert layer.calls == layer.tconv3d_calls == 1 and not layer.own_copies, report.table()


PIXEL_UPSAMPLERS = ["kandinsky6_latent_upscaler", "kandinsky6_sr_vae", "kvae"]


# Each sub-pixel form's upsampler: its builder ((exact, ours) as the float64 tests build them) and input channels
AUTOCAST_UPSAMPLERS = {
    "wan": (functools.partial(stock_and_converted, "autoencoder_kl_wan", "WanResample", dim=4, mode="upsample2d"), 4),
    "hunyuan_video": (functools.partial(hunyuan_upsamplers, (2, 2, 2)), 5),
    "easyanimate": (functools.partial(easyanimate_upsamplers, False), 5),
    "cosmos": (functools.partial(cosmos_upsamplers, True, True), 5),
    "monai": (monai_upsamples, 4),
}


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32_input", "bf16_input"])
@pytest.mark.parametrize("name", sorted(AUTOCAST_UPSAMPLERS))
def test_subpixel_forms_run_under_autocast(name, input_dtype, aten_path):
    """Under bf16 autocast (float32 weights; a float32 input, or a bf16 activation from the layer before) each
    sub-pixel form runs (its input-gradient op) and answers stock's dtype (a float32 input's residual sum is
    float32: Cosmos's) and values to within twice stock's distance from float64. Until 2026-12-03 a bf16
    activation meeting float32 weights failed the forms' dtype checks: each upsampled first, and Wan's and
    CogVideoX's frame convs ran on torch's conv2d, with their layout copies."""
    build, channels = AUTOCAST_UPSAMPLERS[name]
    exact, ours = build(torch.float32, "cpu")
    stock = copy.deepcopy(exact).float()
    x = torch.randn(1, channels, 3, 4, 5).to(input_dtype).contiguous(memory_format=CL)
    seen = []  # the dtypes of the residual sums Cosmos's 1 x 1 x 1 conv3 takes (a hook elsewhere turns a form off)
    for model in (ours, stock) if name == "cosmos" else ():
        model.conv3.register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with OpsMade() as made:
            y = ours(x)
        expected = stock(x)
    assert "tconv3d.conv3d_input_grad.default" in made.names, made.names
    assert y.dtype == expected.dtype and y.shape == expected.shape
    assert len(set(seen)) <= 1, seen
    with torch.no_grad():
        reference = exact(x.double())
    assert rel_l2(y, reference) < max(tolerance(torch.bfloat16), 2 * rel_l2(expected, reference))


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "autocast"])
def test_subpixel_forms_compile_whole(context, aten_path):
    """Wan's upsampler converted compiles with fullgraph=True where the sub-pixel weight is kept or asked about
    (inference: is_inference, which Dynamo cannot trace, is not asked while compiling) and under autocast (the
    forms' conv_dtype), answering eager's values."""
    _, ours = AUTOCAST_UPSAMPLERS["wan"][0](torch.float32, "cpu")
    x = torch.randn(1, 4, 3, 5, 6).contiguous(memory_format=CL)
    contexts = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
                "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}  # fmt: skip
    torch._dynamo.reset()
    with torch.no_grad(), contexts[context]():
        y = torch.compile(ours, fullgraph=True, backend="aot_eager")(x)
        expected = ours(x)
    assert y.dtype == expected.dtype and rel_l2(y, expected) < tolerance(expected.dtype)


def pixel_upsamplers(kind: str, dtype, device, channels=6, filter=None):
    """A video upsampler that repeats pixels 2x and adds a 1 x 3 x 3 spatial conv of the repetition, then a 1 x 1 x 1
    conv: Kandinsky 6's latent upscalers' (`kind` "kandinsky6_latent_upscaler"), its SR VAE's space step
    ("kandinsky6_sr_vae"), their spatial convs zero-padded, or Kandinsky 5's KVAE's ("kvae", without its time
    step), reflect-padded; in float64 and converted in `dtype` (by convert's `filter`), with the same weights, and
    how to call each."""
    pytest.importorskip("diffusers")
    import tconv3d

    if kind == "kandinsky6_latent_upscaler":
        from diffusers.models.latent_upscaler.latent_upscaler_kandinsky6_sr import Kandinsky6SRLatentUpscalerUpsample

        stock, call = Kandinsky6SRLatentUpscalerUpsample(channels), lambda module, x: module(x)
    elif kind == "kandinsky6_sr_vae":
        from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRUpsample

        stock, call = Kandinsky6SRUpsample(channels, compress_time=False), lambda module, x: module(x, {})
    else:
        from diffusers.models.autoencoders.autoencoder_kl_kvae_video import KVAECachedPXSUpsample

        stock, call = KVAECachedPXSUpsample(channels, compress_time=False), lambda module, x: module(x, {})
    exact = copy.deepcopy(stock).to(device=device, dtype=torch.float64)
    ours = tconv3d.nn.convert(copy.deepcopy(stock).to(device=device, dtype=dtype), filter=filter)
    return exact, ours, call


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("kind", PIXEL_UPSAMPLERS)
def test_pixel_upsamplers_match_float64(kind, dtype, device):
    """Kandinsky 6's and KVAE's upsamplers (nearest 2x in space, plus a 1 x 3 x 3 conv of it, then a 1 x 1 x 1
    conv): the spatial conv one sub-pixel transposed conv of the input and the repetition added by broadcasting,
    against diffusers' in float64 (output, input gradient, the spatial conv's weight and bias gradients); one
    input-gradient op and one convolution (the 1 x 1 x 1), nothing of the repeated input's size made but the conv's
    output; KVAE's reflect-padded conv reads the input replicate-padded by 1 in H and W, its one copy."""
    torch.manual_seed(0)
    exact, ours, call = pixel_upsamplers(kind, dtype, device)
    x = leaf_copy(torch.randn(2, 6, 3, 4, 5, device=device).to(dtype).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    with OpsMade() as ops:
        y = call(ours, x)
    expected = call(exact, x64)
    assert y.shape == expected.shape == (2, 6, 3, 8, 10) and y.is_contiguous(memory_format=CL)
    tconv3d_ops = [name for name in ops.names if "tconv3d" in name]
    assert tconv3d_ops == ["tconv3d.conv3d_input_grad.default", "tconv3d.conv3d.default"], ops.names
    assert sum(ops.copied()) == (2 * 6 * 3 * 6 * 7 if kind == "kvae" else 0), ops.copied()  # x with its borders
    grad = torch.randn_like(expected)
    y.backward(grad.to(dtype))
    expected.backward(grad)
    conv, conv64 = ours.spatial_conv, exact.spatial_conv
    pairs = [(y, expected), (x.grad, x64.grad), (conv.weight.grad, conv64.weight.grad),
             (conv.bias.grad, conv64.bias.grad)]  # fmt: skip
    assert x.grad.is_contiguous(memory_format=CL)
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(dtype), (index, rel_l2(mine, theirs))


@pytest.mark.parametrize("kind", PIXEL_UPSAMPLERS)
def test_pixel_upsamplers_left_alone_upsample_first(kind, monkeypatch, aten_path):
    """A spatial conv convert left alone (its filter) takes the repetition, as does any where SUBPIXEL is off, and
    KVAE's where a frame is one pixel high (its reflected borders make stock's output exactly constant along H):
    no transposed conv, diffusers' values."""
    cases = [(True, (1, 6, 2, 3, 4)), (False, (1, 6, 2, 3, 4))]
    if kind == "kvae":
        cases.append((False, (1, 6, 2, 1, 4)))
    for left_alone, shape in cases:
        torch.manual_seed(0)
        keep = (lambda name, module: name != "spatial_conv") if left_alone else None
        exact, ours, call = pixel_upsamplers(kind, torch.float32, "cpu", filter=keep)
        monkeypatch.setattr(subpixel, "SUBPIXEL", left_alone or shape[3] == 1)
        x = torch.randn(shape).contiguous(memory_format=CL)
        with torch.no_grad(), OpNames() as ops:
            y = call(ours, x)
        assert "tconv3d.conv3d_input_grad.default" not in ops.names, (left_alone, shape)
        with torch.no_grad():
            assert rel_l2(y, call(exact, x.double())) < 1e-5, (left_alone, shape)


@pytest.mark.parametrize("variant", ["pointer", "gluon"])
def test_each_kernel_runs_kvaes(variant, device, monkeypatch):
    """KVAE's sub-pixel transposed conv (stride (1, 2, 2), 1 x 4 x 4 taps, cropped by 3 in space: its input
    replicate-padded by 1) and its backward with TCONV3D_KERNELS forced, bf16, 32 -> 32 channels, against
    float64."""
    exact, ours, call = pixel_upsamplers("kvae", torch.bfloat16, device, channels=32)
    launched = forced_launches(variant, monkeypatch)
    x = leaf_copy(torch.randn(1, 32, 2, 3, 4, device=device).to(torch.bfloat16).contiguous(memory_format=CL))
    x64 = leaf_copy(x.detach().double())
    y, expected = call(ours, x), call(exact, x64)
    assert_launched(launched, variant, device)
    grad = torch.randn_like(expected)
    y.backward(grad.to(torch.bfloat16))
    expected.backward(grad)
    pairs = [(y, expected), (x.grad, x64.grad), (ours.spatial_conv.weight.grad, exact.spatial_conv.weight.grad)]
    for index, (mine, theirs) in enumerate(pairs):
        assert rel_l2(mine, theirs) < tolerance(torch.bfloat16), (index, rel_l2(mine, theirs))
