"""Realistic sizes on a CUDA device: forward and all gradients against float64, tensor-core dtypes, determinism.
Skipped without CUDA; `python -m pytest tests -m gpu` runs only these."""

import pytest
import torch
from helpers import DTYPES, Case, case_reference, conv_and_reference, dtype_id, leaf_copy

import tconv3d
from tconv3d.testing import TF32_TOLERANCE, TOLERANCE, rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPU_CASES = [
    Case("vae_3x3x3_c128", 1, 128, 128, (6, 30, 52), 3, padding=1),
    Case("unet_3x3x3_c64_b2", 2, 64, 64, (16, 16, 16), 3, padding=1),
    Case("causal_c96", 1, 96, 96, (5, 24, 40), 3, padding=(2, 0, 1, 1, 1, 1)),
    Case("aniso_1x3x3_c32", 2, 32, 32, (10, 48, 40), (1, 3, 3), padding=(0, 1, 1)),
    Case("down_s2_c64_to_128", 2, 64, 128, (16, 16, 16), 3, stride=2, padding=1),
    Case("first_cin3", 1, 3, 128, (9, 64, 64), 3, padding=1),
    Case("c320_small_volume", 2, 320, 320, (8, 8, 8), 3, padding=1),
    Case("dilated_odd_c17", 1, 17, 33, (9, 21, 23), 3, padding=2, dilation=2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_forward_and_gradients_match_float64(case, dtype):
    (y, gx, gw, gb), (ref, ex, ew, eb) = conv_and_reference(case, dtype, "cuda")
    assert y.is_contiguous(memory_format=torch.channels_last_3d)
    for name, ours, expected in (("output", y, ref), ("input", gx, ex), ("weight", gw, ew)):
        assert rel_l2(ours, expected) < TOLERANCE[dtype], name
    assert rel_l2(gb, eb) < TOLERANCE[dtype]


def test_tf32_forward_and_gradients():
    case = GPU_CASES[1]
    torch.backends.cudnn.allow_tf32 = True
    x, w = leaf_copy(case.input(torch.float32, "cuda")), leaf_copy(case.weight(torch.float32, "cuda"))
    x64, w64 = leaf_copy(x.double()), leaf_copy(w.double())
    ref = case_reference(x64, w64, None, case)
    grad_out = torch.randn_like(ref)
    ref.backward(grad_out)
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding)
    y.backward(grad_out.float())
    for ours, expected in ((y, ref), (x.grad, x64.grad), (w.grad, w64.grad)):
        assert rel_l2(ours, expected) < TF32_TOLERANCE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gradients_bitwise_deterministic_on_gpu(dtype):
    case = GPU_CASES[0]
    x, w = case.input(dtype, "cuda"), case.weight(dtype, "cuda")
    geom = tconv3d.geometry.check_conv3d(x, w, None, case.stride, case.padding, 1, 1)
    grad_out = (
        torch.randn(geom.output_shape(), device="cuda").to(dtype).contiguous(memory_format=torch.channels_last_3d)
    )
    conv_args = list(geom.stride), list(geom.padding), list(geom.dilation)
    wgrads = [torch.ops.tconv3d.conv3d_weight_grad(grad_out, x, list(w.shape), *conv_args) for _ in range(5)]
    dgrads = [torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), *conv_args) for _ in range(5)]
    assert all(torch.equal(wgrads[0], g) for g in wgrads[1:])
    assert all(torch.equal(dgrads[0], g) for g in dgrads[1:])


def test_output_written_everywhere():
    """Poison-free check: every output element comes from the kernel, not from uninitialised memory."""
    case = GPU_CASES[2]
    x, w = case.input(torch.bfloat16, "cuda"), case.weight(torch.bfloat16, "cuda")
    torch.cuda.empty_cache()
    filler = torch.full((64 * 1024 * 1024,), float("nan"), device="cuda")  # leave NaNs in the allocator's pool
    del filler
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding)
    assert torch.isfinite(y).all()


def _peak_fwd_bwd_mb(model, x) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = model(x)
    torch.autograd.grad(y, [x, *model.parameters()], torch.ones_like(y))
    del y
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _stack(cin, hidden, cout):
    return torch.nn.Sequential(
        torch.nn.Conv3d(cin, hidden, 3, padding=1, bias=False),
        torch.nn.Conv3d(hidden, hidden, 3, padding=1, bias=False),
        torch.nn.Conv3d(hidden, cout, 3, padding=1, bias=False),
    )


def _largest_split_k_workspace_mb(model, x) -> float:
    """The one workspace tconv3d allocates: fp32 weight-gradient partial sums, one slice per split-K split (the
    first H100 run measured the stack 2.5 MiB above cuDNN, within its 4.2 MiB workspace)."""
    geoms = []
    hooks = [
        m.register_forward_hook(
            lambda m, args, out: geoms.append(
                tconv3d.geometry.check_conv3d(args[0], m.weight, None, m.stride, m.padding, m.dilation, 1)
            )
        )
        for m in model.modules()
        if isinstance(m, torch.nn.Conv3d)
    ]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    sizes = [
        split * g.out_channels * g.taps * g.in_channels * 4
        for g in geoms
        if (split := tconv3d.tune.choice.pick_config("wgrad", g, x.dtype, x.device).split_k) > 1
    ]
    return max(sizes, default=0) / 2**20


@pytest.mark.parametrize(
    ("name", "make_model", "input_shape"),
    [
        ("stack", lambda: _stack(8, 64, 8), (2, 8, 32, 128, 128)),
        ("wan_dec_384a", lambda: torch.nn.Conv3d(384, 384, 3, padding=1), (1, 384, 6, 60, 104)),
        ("unet_64", lambda: torch.nn.Conv3d(64, 64, 3, padding=1), (2, 64, 64, 64, 64)),
    ],
)
def test_peak_memory_not_above_cudnn(name, make_model, input_shape):
    """No hidden workspace: forward + backward peak memory at most cuDNN's (channels_last_3d, bf16) plus the one
    workspace tconv3d owns up to, the weight gradient's split-K partial sums."""
    stock = make_model().cuda().bfloat16().to(memory_format=torch.channels_last_3d)
    ours = tconv3d.nn.convert(make_model().cuda().bfloat16())
    ours.load_state_dict(stock.state_dict())
    x = torch.randn(input_shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_()
    for model in (stock, ours):  # warm up: compilation, cuDNN algorithm search
        _peak_fwd_bwd_mb(model, x)
    cudnn_mb, tconv3d_mb = _peak_fwd_bwd_mb(stock, x), _peak_fwd_bwd_mb(ours, x)
    workspace_mb = _largest_split_k_workspace_mb(ours, x)
    print(f"{name}: peak fwd+bwd memory cuDNN {cudnn_mb:.1f} MiB, tconv3d {tconv3d_mb:.1f} MiB "
          f"(largest weight-grad split-K workspace {workspace_mb:.1f} MiB)")  # fmt: skip
    assert tconv3d_mb <= cudnn_mb * 1.001 + workspace_mb + 1
