"""torch.compile on converted models: fullgraph, no recompiles, dynamic shapes, and graphs free of layout copies.

The model is the reported one: three stacked Conv3d(kernel 3, padding 1, no bias) layers on channels_last_3d
input, whose stock compiled graph gained nhwcToNchw/nchwToNhwc conversions between every pair of layers.
"""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import tconv3d
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
# FX targets that would mean a layout conversion or a stock convolution crept in between tconv3d ops.
FORBIDDEN = ("permute", "clone", "copy", "contiguous", "convolution", "transpose", "as_strided")


class ReportedStack(nn.Module):
    def __init__(self, channels=4, hidden=8, out=3, check_layout=True):
        super().__init__()
        self.check_layout = check_layout
        self.conv1 = nn.Conv3d(channels, hidden, 3, padding=1, bias=False)
        self.conv2 = nn.Conv3d(hidden, hidden, 3, padding=1, bias=False)
        self.conv3 = nn.Conv3d(hidden, out, 3, padding=1, bias=False)

    def forward(self, x):
        x = self.conv3(self.conv2(self.conv1(x)))
        if self.check_layout:
            assert x.is_contiguous(memory_format=torch.channels_last_3d)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def stack_input(device, size=(4, 5, 6), batch=1):
    return torch.randn(batch, 4, *size, device=device).contiguous(memory_format=CL).requires_grad_()


def forward_backward(model, x):
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(torch.ones_like(y))
    grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return y.detach(), grads


def test_reported_stack_eager_and_compiled(device):
    # The stock layers serve as the reference only: their output layout varies by device and backend.
    stock = ReportedStack(check_layout=False).to(device)
    model = tconv3d.nn.convert(ReportedStack().to(device))
    model.load_state_dict(stock.state_dict())
    x = stack_input(device)
    stock_y, stock_grads = forward_backward(stock, x)
    eager_y, eager_grads = forward_backward(model, x)
    compiled_y, compiled_grads = forward_backward(torch.compile(model, fullgraph=True), x)
    assert compiled_y.is_contiguous(memory_format=CL)
    assert rel_l2(eager_y, stock_y) < TOLERANCE[torch.float32]
    assert rel_l2(compiled_y, eager_y) < TOLERANCE[torch.float32]
    for ours, compiled, reference in zip(eager_grads, compiled_grads, stock_grads, strict=True):
        assert rel_l2(ours, reference) < TOLERANCE[torch.float32]
        assert rel_l2(compiled, ours) < TOLERANCE[torch.float32]


def capture_graphs():
    """An aot_autograd backend that records the forward and backward FX graphs and runs them as they are."""
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    return graphs, aot_autograd(fw_compiler=record, bw_compiler=record)


def call_targets(graph_module):
    return [str(node.target) for node in graph_module.graph.nodes if node.op == "call_function"]


def test_aot_graphs_hold_no_layout_conversions(device):
    graphs, backend = capture_graphs()
    model = torch.compile(tconv3d.nn.convert(ReportedStack().to(device)), backend=backend, fullgraph=True)
    forward_backward(model, stack_input(device))
    assert len(graphs) == 2  # one forward graph, one backward graph
    forward, backward = (call_targets(g) for g in graphs)
    assert forward == ["tconv3d.conv3d.default"] * 3
    assert sorted(backward) == sorted(
        ["tconv3d.conv3d_input_grad.default"] * 3 + ["tconv3d.conv3d_weight_grad.default"] * 3
    )
    for target in forward + backward:
        assert not any(word in target for word in FORBIDDEN), target


def test_no_recompile_on_second_call(device):
    model = torch.compile(tconv3d.nn.convert(ReportedStack().to(device)), fullgraph=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        first = forward_backward(model, stack_input(device))
        second = forward_backward(model, stack_input(device))
    assert not torch.equal(first[0], second[0])  # fresh inputs, one compiled graph


def test_dynamic_shapes_without_recompiles_or_fallback(device):
    model = tconv3d.nn.convert(ReportedStack().to(device))
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch._dynamo.config.patch(error_on_recompile=True):
        # No dimension of 1 (dynamo specialises those, whatever the op) and none equal to Cin = 4: the channel
        # count is specialised against the weight, and duck sizing would give an equal dimension the same symbol.
        for size, batch in (((5, 6, 7), 2), ((6, 9, 5), 3)):
            x = stack_input(device, size, batch)
            y, grads = forward_backward(compiled, x)
            eager_y, eager_grads = forward_backward(model, x)
            assert y.shape == (batch, 3, *size)
            assert rel_l2(y, eager_y) < TOLERANCE[torch.float32]
            for ours, expected in zip(grads, eager_grads, strict=True):
                assert rel_l2(ours, expected) < TOLERANCE[torch.float32]


def test_compiled_autocast_bf16(device):
    graphs, backend = capture_graphs()
    model = tconv3d.nn.convert(ReportedStack().to(device))
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = stack_input(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = compiled(x)
        eager = model(x)
    assert y.dtype == torch.bfloat16
    assert rel_l2(y, eager) < TOLERANCE[torch.bfloat16]
    assert call_targets(graphs[0]).count("tconv3d.conv3d.default") == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["max-autotune", "reduce-overhead"])
def test_compile_modes_on_gpu(mode):
    model = tconv3d.nn.convert(ReportedStack(4, 32, 4).cuda())
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    x = stack_input("cuda", (8, 32, 32), batch=2)
    eager_y, eager_grads = forward_backward(model, x)
    for _ in range(3):  # reduce-overhead records CUDA graphs on the first calls and replays after
        y, grads = forward_backward(compiled, x)
    assert rel_l2(y, eager_y) < TOLERANCE[torch.float32]
    for ours, expected in zip(grads, eager_grads, strict=True):
        assert rel_l2(ours, expected) < TOLERANCE[torch.float32]


LAYOUT_KERNEL_NAMES = ("nhwcToNchw", "nchwToNhwc", "copy", "permute", "transpose")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_profiler_sees_no_conversion_kernels_on_gpu():
    model = torch.compile(tconv3d.nn.convert(ReportedStack(8, 64, 8).cuda().bfloat16()), fullgraph=True)
    x = torch.randn(1, 8, 8, 64, 64, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)
    x.requires_grad_()
    # A dense channels_last_3d upstream gradient, as a following layer gives: `.sum().backward()` would hand
    # the compiled backward an expanded tangent, which AOTAutograd copies into the traced layout (seen on an
    # H100 as one bf16 direct_copy_kernel, not a conversion between the layers).
    grad_out = torch.randn(1, 8, 8, 64, 64, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL)

    def step():
        torch.autograd.grad(model(x), [x, *model.parameters()], grad_out)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    conversions = [n for n in names if any(word.lower() in n.lower() for word in LAYOUT_KERNEL_NAMES)]
    assert conversions == [], conversions


def test_functional_api_compiles_fullgraph(device):
    """tconv3d.conv3d itself (argument checks included) traces into one graph."""
    graphs, backend = capture_graphs()
    w = torch.randn(4, 3, 3, 3, 3, device=device).contiguous(memory_format=CL)

    def f(x):
        return tconv3d.conv3d(x, w, None, 1, (2, 0, 1, 1, 1, 1)).relu()

    x = torch.randn(2, 3, 5, 6, 7, device=device).contiguous(memory_format=CL)
    assert rel_l2(torch.compile(f, backend=backend, fullgraph=True)(x), f(x)) < TOLERANCE[torch.float32]
    assert call_targets(graphs[0]).count("tconv3d.conv3d.default") == 1


class CausalStack(nn.Module):
    """Three causal replicate-padded layers, as a video VAE's decoder stacks them."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(tconv3d.nn.CausalConv3d(4, 4, 3, bias=False) for _ in range(3)))

    def forward(self, x):
        return self.layers(x)


def test_compiled_causal_stack_has_no_pad_or_layout_ops(device):
    graphs, backend = capture_graphs()
    model = CausalStack().to(device)
    x = stack_input(device)
    eager_y, eager_grads = forward_backward(model, x)
    compiled_y, compiled_grads = forward_backward(torch.compile(model, backend=backend, fullgraph=True), x)
    assert len(graphs) == 2
    forward, backward = (call_targets(g) for g in graphs)
    assert forward == ["tconv3d.conv3d.default"] * 3
    assert sorted(backward) == sorted(
        ["tconv3d.conv3d_input_grad.default"] * 3 + ["tconv3d.conv3d_weight_grad.default"] * 3
    )
    for target in forward + backward:
        assert "pad" not in target and not any(word in target for word in FORBIDDEN), target
    assert compiled_y.is_contiguous(memory_format=CL)
    assert rel_l2(compiled_y, eager_y) < TOLERANCE[torch.float32]
    for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
        assert rel_l2(compiled, eager) < TOLERANCE[torch.float32]


class NormConvUpStack(nn.Module):
    """A decoder block as video VAEs and 3D UNets stack it: GroupNorm -> SiLU -> Conv3d -> ConvTranspose3d."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(
            nn.GroupNorm(2, 4), nn.SiLU(), nn.Conv3d(4, 4, 3, padding=1), nn.ConvTranspose3d(4, 4, 2, stride=2)
        )

    def forward(self, x):
        return self.layers(x)


def test_compiled_norm_conv_upsample_stack_has_no_layout_ops(device):
    graphs, backend = capture_graphs()
    model = tconv3d.nn.convert(NormConvUpStack().to(device))
    x = stack_input(device)
    eager_y, eager_grads = forward_backward(model, x)
    compiled_y, compiled_grads = forward_backward(torch.compile(model, backend=backend, fullgraph=True), x)
    assert len(graphs) == 2
    forward, backward = (call_targets(g) for g in graphs)
    tconv3d_ops = [t for t in forward if t.startswith("tconv3d.")]
    assert tconv3d_ops == [
        "tconv3d.group_norm.default", "tconv3d.conv3d.default", "tconv3d.conv3d_input_grad.default"
    ]  # fmt: skip
    assert "tconv3d.group_norm_backward.default" in backward
    for target in forward + backward:
        assert not any(word in target for word in FORBIDDEN), target
    assert compiled_y.is_contiguous(memory_format=CL)
    assert rel_l2(compiled_y, eager_y) < TOLERANCE[torch.float32]
    for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
        assert rel_l2(compiled, eager) < TOLERANCE[torch.float32]


class SkipResBlock(nn.Module):
    """A diffusion UNet decoder's res block on its skip connection: GroupNorm -> SiLU -> Conv3d of
    torch.cat([x, skip]), plus a 1x1x1 shortcut of the same concatenation, each reading both sources in place."""

    def __init__(self):
        super().__init__()
        self.norm = tconv3d.nn.GroupNorm(3, 6, activation="silu")
        self.conv = tconv3d.nn.Conv3d(6, 4, 3, padding=1)
        self.shortcut = tconv3d.nn.Conv3d(6, 4, 1)

    def forward(self, x, skip):
        return self.conv(self.norm(x, channels_after=skip)) + self.shortcut(x, channels_after=skip)


def test_compiled_norm_of_a_concatenation_has_no_concatenation(device):
    graphs, backend = capture_graphs()
    model = SkipResBlock().to(device)
    x, skip = stack_input(device), torch.randn(1, 2, 4, 5, 6, device=device).contiguous(memory_format=CL)

    def step(run):
        inputs = [t.detach().requires_grad_() for t in (x, skip)]
        y = run(*inputs)
        y.backward(torch.ones_like(y))
        grads = [t.grad for t in inputs] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return y.detach(), grads

    eager_y, eager_grads = step(model)
    compiled_y, compiled_grads = step(torch.compile(model, backend=backend, fullgraph=True))
    assert len(graphs) == 2
    forward, backward = (call_targets(g) for g in graphs)
    assert [t for t in forward if t.startswith("tconv3d.")] == [
        "tconv3d.group_norm.default", "tconv3d.conv3d.default", "tconv3d.conv3d.default"
    ]  # fmt: skip
    assert "tconv3d.group_norm_backward.default" in backward
    for target in forward + backward:
        assert "cat" not in target and not any(word in target for word in FORBIDDEN), target
    assert rel_l2(compiled_y, eager_y) < TOLERANCE[torch.float32]
    expected = model.conv(F.silu(F.group_norm(torch.cat([x, skip], 1), 3, model.norm.weight, model.norm.bias)))
    assert rel_l2(compiled_y, expected + model.shortcut(torch.cat([x, skip], 1))) < TOLERANCE[torch.float32]
    for compiled, eager in zip(compiled_grads, eager_grads, strict=True):
        assert rel_l2(compiled, eager) < TOLERANCE[torch.float32]
