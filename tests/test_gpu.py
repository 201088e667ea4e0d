"""Realistic sizes on a CUDA device: forward and all gradients against float64, tensor-core dtypes, determinism.
Skipped without CUDA; `python -m pytest tests -m gpu` runs only these."""

import copy
import threading

import pytest
import torch
from helpers import DTYPES, Case, TinyUNet, case_reference, conv_and_reference, dtype_id, leaf_copy, train_unet

import tconv3d
from tconv3d.kernels.config import k_splits
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


@pytest.mark.parametrize("kernels", ["auto", "tma"])
def test_first_launches_on_a_new_thread(kernels, monkeypatch):
    """A backward's first launch on autograd's device thread can be a box kernel's, whose TMA descriptors Triton
    encodes before its launch code makes a CUDA context current: on the H200 (run 4) unet_320's Gluon input
    gradient failed there, "Failed to create tensor map descriptor: invalid device context". A new Python thread
    has no current context either: the small-volume layer's forward and backward (Gluon on sm_90, as chosen, and
    on the Triton TMA kernels) first launched there give the main thread's results."""
    from tconv3d import settings
    from tconv3d.tune import choice

    monkeypatch.setattr(settings, "KERNELS", kernels)
    monkeypatch.setattr(choice, "_memo", {})  # choices made under another setting
    case = GPU_CASES[6]  # c320_small_volume: unet_320's layer
    x, w = case.input(torch.bfloat16, "cuda"), case.weight(torch.bfloat16, "cuda")

    def step(out: list):
        xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
        y = tconv3d.functional.conv3d(xg, wg, None, case.stride, case.padding)
        seeded = torch.Generator(device="cuda").manual_seed(0)  # the same gradient on both threads
        y.backward(torch.randn(y.shape, generator=seeded, device="cuda").to(y.dtype))
        out += [y.detach(), xg.grad, wg.grad]

    here, there = [], []
    step(here)
    worker = threading.Thread(target=step, args=(there,))
    worker.start()
    worker.join()
    assert len(there) == 3, "the step on the new thread raised (its traceback is above)"
    assert all(torch.equal(a, b) for a, b in zip(here, there, strict=True))


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
    """The one workspace tconv3d allocates: fp32 split-K partial sums, one slice per split (the weight gradient's
    over the weight; the forward's and input gradient's over their output, where a small grid splits). The
    first H100 run measured the stack 2.5 MiB above cuDNN, within its 4.2 MiB workspace."""
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
    sizes = []
    for g in geoms:
        wgrad = tconv3d.tune.choice.pick_config("wgrad", g, x.dtype, x.device)
        if wgrad.split_k > 1:
            sizes.append(wgrad.split_k * g.out_channels * g.taps * g.in_channels * 4)
        for direction, numel in (("fwd", g.output_voxels * g.out_channels), ("dgrad", g.input_voxels * g.in_channels)):
            config = tconv3d.tune.choice.pick_config(direction, g, x.dtype, x.device)
            splits = k_splits(direction, g, config)[1] if not config.direct else 1
            if splits > 1:
                sizes.append(splits * numel * 4)
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


def _small_volume_block():
    """Two convolutions on an 8^3 volume of 320 channels (unet_320's layer): few enough tiles that the forward and
    input gradient split their reduction (split-K workspaces from the allocator on every call)."""
    return torch.nn.Sequential(
        torch.nn.Conv3d(64, 320, 3, padding=1), torch.nn.SiLU(), torch.nn.Conv3d(320, 320, 3, padding=1)
    )


@pytest.mark.parametrize("make_model", [_small_volume_block, lambda: TinyUNet(channels=3, width=16)],
                         ids=["small_volume", "tiny_unet"])  # fmt: skip
def test_cuda_graph_replay_matches_eager(make_model):
    """Issue 29: a converted model captured in a CUDA graph, forward and backward of a training step, replays
    with eager's results bit for bit, on new inputs too: no host synchronisation in the launch path, the split-K
    workspaces from the graph's pool, TMA descriptors valid across replays."""
    torch.manual_seed(0)
    model = tconv3d.nn.convert(make_model()).cuda().bfloat16()
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Conv3d))
    shape = (2, first.in_channels, 8, 8, 8) if first.in_channels == 64 else (1, 3, 8, 16, 16)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x):
        y = model(x)
        grads = torch.autograd.grad(y.float().square().mean(), params)
        return y, grads

    def fresh():
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)

    static_x = fresh()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up: every kernel compiled and every config chosen before the capture
        for _ in range(2):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y, static_grads = step(static_x)
    for _ in range(2):
        x = fresh()
        static_x.copy_(x)
        graph.replay()
        y, grads = step(x)
        torch.cuda.synchronize()
        assert torch.equal(static_y, y)
        assert all(torch.equal(a, b) for a, b in zip(static_grads, grads, strict=True))


def test_reduce_overhead_compile_matches_eager():
    """torch.compile(mode="reduce-overhead") (CUDA graphs under Inductor) of a converted block with split-K
    layers: the replayed forward equals eager's within bf16 rounding of whatever Inductor fuses around it."""
    torch.manual_seed(0)
    model = tconv3d.nn.convert(_small_volume_block()).cuda().bfloat16().eval()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for _ in range(3):  # record, then replay
            x = torch.randn(2, 64, 8, 8, 8, device="cuda", dtype=torch.bfloat16)
            x = x.contiguous(memory_format=torch.channels_last_3d)
            assert rel_l2(compiled(x).clone(), model(x)) < TOLERANCE[torch.bfloat16]


def test_first_use_tuning_refuses_capture(monkeypatch):
    """TCONV3D_AUTOTUNE=1 times kernels, which a capture cannot: a key first met inside one raises, naming the
    way out, instead of failing inside the driver."""
    monkeypatch.setattr(tconv3d.settings, "AUTOTUNE", True)
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    conv = tconv3d.nn.convert(torch.nn.Conv3d(24, 40, 3, padding=1)).cuda()
    x = torch.randn(1, 24, 5, 7, 9, device="cuda").contiguous(memory_format=torch.channels_last_3d)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="capture"), torch.cuda.graph(graph):
        conv(x)


@pytest.mark.parametrize("kernels", ["auto", "pointer"])
def test_inductor_launches_the_kernels_itself(monkeypatch, kernels):
    """Issue 29, TCONV3D_INDUCTOR_KERNELS=1: a converted TinyUNet's training step compiled by Inductor, whose
    generated code launches tconv3d's Triton kernels itself (with TCONV3D_KERNELS=pointer every convolution and
    norm; with auto, those not on TMA or Gluon), equals eager's within bf16 rounding of what Inductor fuses around
    them; the forward's generated code calls no tconv3d op where every layer was handed over."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(tconv3d.settings, "INDUCTOR_KERNELS", True)
    monkeypatch.setattr(tconv3d.settings, "KERNELS", kernels)
    monkeypatch.setattr(tconv3d.tune.choice, "_memo", {})
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tconv3d.nn.convert(TinyUNet(channels=3, width=16)).cuda().bfloat16()
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x):
        y = model(x)
        return (y, *torch.autograd.grad(y.float().square().mean(), params))

    x = torch.randn(1, 3, 8, 16, 16, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last_3d)
    compiled = torch.compile(step)
    results, (forward_code, *_) = run_and_get_code(compiled, x)
    for ours, expected in zip(results, step(x), strict=True):
        assert rel_l2(ours, expected) < TOLERANCE[torch.bfloat16]
    assert "_conv3d_fwd_kernel" in forward_code or "_conv3d_tma" in forward_code or "_gluon" in forward_code
    if kernels == "pointer":
        assert "torch.ops.tconv3d" not in forward_code, forward_code


def test_fused_adamw_resumes_a_stock_checkpoint_after_match(device="cuda"):
    """A stock run's AdamW state (NCDHW moments) loaded into a converted TinyUNet's fused CUDA AdamW: torch's fused
    kernels refuse (or, on CPU, misread) state of other strides than the weights'; after
    `tconv3d.nn.match_optimizer_state` the fused step ends where the foreach step ends (docs/training.md)."""
    x = torch.randn(2, 3, 4, 8, 8, device=device).contiguous(memory_format=torch.channels_last_3d)
    target = torch.randn(2, 3, 4, 8, 8, device=device)

    torch.manual_seed(0)
    stock = TinyUNet().to(device)
    stock_optimizer = torch.optim.AdamW(stock.parameters(), lr=0.01, fused=True)
    train_unet(stock, x, target, steps=2, optimizer=stock_optimizer)
    ends = []
    for fused in (True, False):
        model = tconv3d.nn.convert(TinyUNet()).to(device)
        model.load_state_dict(stock.state_dict())
        optimizer = tconv3d.nn.match_optimizer_state(torch.optim.AdamW(model.parameters(), lr=0.01))
        checkpoint = copy.deepcopy(stock_optimizer.state_dict())  # a load shares the tensors it can (the steps)
        for group in checkpoint["param_groups"]:  # the checkpoint's groups replace the optimizer's, flags included
            group.update(fused=fused or None, foreach=not fused)
        optimizer.load_state_dict(checkpoint)
        weight = model.stem[0].weight
        assert optimizer.state[weight]["exp_avg"].stride() == weight.stride()
        train_unet(model, x, target, steps=1, optimizer=optimizer)
        ends.append([p.detach().clone() for p in model.parameters()])
    for fused, foreach in zip(*ends, strict=True):
        torch.testing.assert_close(fused, foreach)


@pytest.mark.parametrize(
    ("shape", "groups"),
    [((1, 2, 64, 1024, 1025), 1), ((70000, 8, 1, 2, 2), 2)],
    ids=["voxels_67M", "batch_70000"],
)
def test_group_norm_past_the_grids_limits_matches_float64(shape, groups):
    """A GroupNorm whose reduction has more voxel splits (67.2M voxels a sample: 65,600 of 1,024) or whose batch
    more entries than CUDA's grid takes along its third axis (65,535) runs, capped and in slices (test_launch's
    stubbed twin), and matches float64: forward and the input, weight and bias gradients."""
    x = leaf_copy(torch.randn(shape, device="cuda").contiguous(memory_format=torch.channels_last_3d))
    w, b = (leaf_copy(torch.randn(shape[1], device="cuda")) for _ in range(2))
    out = torch.ops.tconv3d.group_norm(x, w, b, groups, 1e-5, "silu")[0]
    grad = torch.randn_like(out)
    out.backward(grad)
    x64, w64, b64 = (leaf_copy(t.detach().double()) for t in (x, w, b))
    want = torch.nn.functional.silu(torch.nn.functional.group_norm(x64, groups, w64, b64, 1e-5))
    want.backward(grad.double())
    for ours, theirs in ((out, want), (x.grad, x64.grad), (w.grad, w64.grad), (b.grad, b64.grad)):
        assert rel_l2(ours, theirs) < TOLERANCE[torch.float32]
