"""Graphs of converted models for runtimes without tconv3d: every op's decomposition into torch's own ops
(`tconv3d.ops.decompositions`, for `ExportedProgram.run_decompositions` and `torch.onnx.export`), and
`torch.jit.trace`, which records the ops; torch.fx's symbolic tracing, which records tconv3d's modules as it records
torch's."""

import copy
import functools
import io
import os
import tempfile

import pytest
import torch

import tconv3d
from tconv3d import ops
from tconv3d.testing import rel_l2

CL = torch.channels_last_3d


def _defined_ops() -> set[str]:
    return {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("tconv3d::")}


def test_every_op_has_a_decomposition():
    """An op added without one would leave an exported converted model unrunnable without tconv3d."""
    assert {op._schema.name.split("::")[1] for op in ops.decompositions()} == _defined_ops() != set()


def _ndhwc(*shape, generator):
    t = torch.randn(shape, generator=generator)
    return t.contiguous(memory_format=CL) if t.dim() == 5 else t


def _op_calls(generator):
    """(name, the call, its tensors): every op, with the arguments that take its torch ops off aten's plain
    convolution (per-dimension padding modes, frames_before, channels_after, groups, a transposed bias under a
    folded border, fused activations, a second channel source)."""
    t = lambda *shape: _ndhwc(*shape, generator=generator)  # noqa: E731
    tc = torch.ops.tconv3d
    pad, mode = [2, 0, 1, 1, 1, 2], "replicate,reflect,circular"
    return [
        ("conv3d", lambda x, w, b, before: tc.conv3d(x, w, b, [1, 2, 1], pad, [1, 1, 1], 1, mode, before),
         (t(2, 3, 4, 6, 7), t(5, 3, 3, 3, 3), t(5), t(2, 3, 2, 6, 7))),
        ("conv3d_channels_after", lambda x, w, after: tc.conv3d(x, w, None, [1] * 3, pad, [1] * 3, 1, mode, None,
                                                               after),
         (t(2, 3, 4, 6, 7), t(5, 5, 3, 3, 3), t(2, 2, 4, 6, 7))),
        ("conv3d_groups", lambda x, w: tc.conv3d(x, w, None, [2, 1, 1], [1] * 6, [1, 2, 1], 2, "zeros"),
         (t(1, 4, 5, 6, 6), t(6, 2, 3, 3, 3))),
        ("conv3d_one_output_channel", lambda x, w: tc.conv3d(x, w, None, [1] * 3, [1] * 6, [1] * 3, 1),
         (t(1, 3, 3, 4, 5), t(1, 3, 3, 3, 3))),
        ("conv3d_input_grad", lambda g, w, b: tc.conv3d_input_grad(g, w, [2, 3, 5, 6, 7], [1, 2, 1], pad, [1, 1, 1],
                                                                   mode, 1, None, b),
         (t(2, 4, 5, 3, 8), t(4, 3, 3, 3, 3), t(3))),
        ("conv_transpose3d", lambda x, w, b: tconv3d.conv_transpose3d(x, w, b, 2, 1, 1),
         (t(1, 4, 3, 4, 5), t(4, 3, 3, 3, 3), t(3))),
        ("conv3d_weight_grad", lambda g, x, before: tc.conv3d_weight_grad(g, x, [4, 3, 3, 3, 3], [1, 2, 1], pad,
                                                                          [1, 1, 1], mode, before),
         (t(2, 4, 6, 3, 8), t(2, 3, 4, 6, 7), t(2, 3, 2, 6, 7))),
        ("group_norm", lambda x, w, b, after: tc.group_norm(x, w, b, 3, 1e-5, "silu", after),
         (t(2, 4, 3, 4, 5), t(6), t(6), t(2, 2, 3, 4, 5))),
        ("group_norm_backward", lambda g, x, w, b: tc.group_norm_backward(
            g, x, *tc.group_norm(x, w, b, 2, 1e-5, "silu")[1:], w, b, 2, "silu"),
         (t(2, 4, 3, 4, 5), t(2, 4, 3, 4, 5), t(4), t(4))),
        ("rms_norm", lambda x, w, b: tc.rms_norm(x, w, b, 1e-6, "silu"), (t(2, 4, 3, 4, 5), t(4), t(4))),
        ("rms_norm_backward", lambda g, x, w, b: tc.rms_norm_backward(g, x, w, b, 1e-6, "silu"),
         (t(2, 4, 3, 4, 5), t(2, 4, 3, 4, 5), t(4), t(4))),
        ("upsample_linear", lambda x: tc.upsample_linear(x, [2, 1, 2]), (t(2, 3, 3, 4, 5),)),
        ("upsample_linear_backward", lambda g: tc.upsample_linear_backward(g, [2, 3, 3, 4, 5], [2, 1, 2]),
         (t(2, 3, 6, 4, 10),)),
    ]  # fmt: skip


class _Call(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, *tensors):
        return self.call(*tensors)


@pytest.mark.parametrize("name", [name for name, _, _ in _op_calls(torch.Generator())])
def test_decompositions_leave_torch_ops_that_compute_the_op(name):
    """Exported and decomposed with the table, as torch.onnx.export decomposes: no tconv3d op and nothing written
    in place is left in the graph (a decomposition runs below functionalization: the aten path's buffers, the
    concatenation of two channel sources and the folded border's gradient, failed ONNX's translation), and the
    graph computes what the op does (both in float32: tconv3d takes no float64)."""
    generator = torch.Generator().manual_seed(sum(map(ord, name)))
    _, call, tensors = next(c for c in _op_calls(generator) if c[0] == name)
    exported = torch.export.export(_Call(call), tensors).run_decompositions(ops.decompositions())
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    overloads = [t for t in targets if isinstance(t, torch._ops.OpOverload)]
    assert not [t for t in overloads if t.namespace == "tconv3d"]
    assert not [t for t in overloads if t._schema.is_mutable], "written in place"
    assert any(t.namespace == "aten" for t in overloads)
    expected = call(*tensors)
    got = exported.module()(*tensors)
    for e, g in zip(*(x if isinstance(x, tuple) else (x,) for x in (expected, got)), strict=True):
        if e is None:  # group_norm_backward's PReLU weight's gradient, without one
            assert g is None
            continue
        assert e.shape == g.shape
        assert rel_l2(g, e) < 1e-6


def test_exported_programs_keep_the_ops_without_the_table():
    """torch.export's own decompositions (and AOTInductor's) keep tconv3d's ops: they run its kernels."""
    generator = torch.Generator().manual_seed(3)
    _, call, tensors = _op_calls(generator)[0]
    exported = torch.export.export(_Call(call), tensors).run_decompositions()
    assert torch.ops.tconv3d.conv3d.default in [node.target for node in exported.graph.nodes]


def _layers():
    """The layers convert takes over, in a model of its own: padding modes, a norm with its SiLU fused, a
    transposed conv, a one-channel output, trilinear upsampling."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv3d(2, 8, 3, padding=1, padding_mode="replicate"),
        torch.nn.GroupNorm(2, 8),
        torch.nn.SiLU(),
        torch.nn.Conv3d(8, 8, 3, stride=2, padding=1, padding_mode="reflect"),
        torch.nn.ConvTranspose3d(8, 4, 2, stride=2),
        torch.nn.Upsample(scale_factor=2, mode="trilinear"),
        torch.nn.Conv3d(4, 1, 3, padding=1, padding_mode="circular"),
    )


def _monai_net(name):
    from test_integrations import _monai_nets

    torch.manual_seed(0)
    return _monai_nets()[name]()


def _converted_and_exact(build, x):
    """The model `build` makes, converted (from a copy), and the stock model's output for x in float64."""
    stock = build().eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    with torch.no_grad():
        return converted, copy.deepcopy(stock).double()(x.double())


def _onnx_outputs(model, x, inputs=None, **export_options) -> list[torch.Tensor]:
    """onnxruntime's outputs for `inputs` (default: x) of torch.onnx.export(model, (x,), **export_options); the
    test is skipped without the ONNX packages."""
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.onnx")
        torch.onnx.export(model, (x,), path, verbose=False, **export_options)
        session = ort.InferenceSession(path)
    name = session.get_inputs()[0].name
    return [torch.from_numpy(session.run(None, {name: t.numpy()})[0]) for t in inputs or [x]]


@pytest.mark.parametrize("dynamo", [True, False], ids=["torch_export", "torchscript"])
@pytest.mark.parametrize(
    "name, build, shape",
    [
        ("layers", _layers, (1, 2, 4, 6, 8)),
        ("monai_unet", functools.partial(_monai_net, "unet"), (1, 1, 16, 12, 16)),
        ("monai_basic_unet", functools.partial(_monai_net, "basic_unet"), (1, 1, 32, 16, 16)),
    ],
)
def test_onnx_export_of_a_converted_model(name, build, shape, dynamo):
    """torch.onnx.export of a converted model, by both its exporters (dynamo=False: the TorchScript one, which
    torch deprecates): the eager callers trace each tconv3d op as its torch ops there (ONNX has functions for
    those; for tconv3d's it had none, and exporting stopped at the first op). onnxruntime's output is stock's
    (float64) to float32's rounding."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    converted, exact = _converted_and_exact(build, x)
    (got,) = _onnx_outputs(converted, x, dynamo=dynamo)
    assert rel_l2(got, exact) < 1e-5


class _AllegroTemporalConv(torch.nn.Module):
    """Allegro's temporal conv layer on (B*T, C, H, W) frames, as its VAE's blocks call it (convert's adapter views
    the frames as a video)."""

    def __init__(self):
        super().__init__()
        from diffusers.models.autoencoders.autoencoder_kl_allegro import AllegroTemporalConvLayer

        self.layer = AllegroTemporalConvLayer(8, norm_num_groups=4)

    def forward(self, frames):
        return self.layer(frames.contiguous(memory_format=torch.channels_last), batch_size=2)


def _allegro_temporal_conv():
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return _AllegroTemporalConv()


def _monai_attention():
    pytest.importorskip("monai")
    from monai.networks.blocks.spatialattention import SpatialAttentionBlock

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 8, 3, padding=1), SpatialAttentionBlock(3, 8, norm_num_groups=4))


@pytest.mark.parametrize(
    "build, shape", [(_allegro_temporal_conv, (6, 8, 5, 7)), (_monai_attention, (1, 1, 4, 5, 6))],
    ids=["allegro_temporal_conv", "monai_attention"],
)  # fmt: skip
def test_onnx_export_of_restriding_views(build, shape):
    """Views convert's adapters make by restriding a channels-last tensor in place (Allegro's frames viewed as a
    video; MONAI's attention output given channels_last_3d's own strides) read other elements in ONNX, whose
    as_strided takes the logical order: under torch.onnx.export they are plain views (Allegro's VAE exported
    1.2 off stock, MONAI's AutoencoderKL 1.0 and diffusion UNet 0.41, before)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    converted, exact = _converted_and_exact(build, x)
    (got,) = _onnx_outputs(converted, x, dynamo=True)
    assert rel_l2(got, exact) < 1e-5


def test_export_of_a_converted_maisi_res_block():
    """A converted MAISI block returned its output as_subclass(torch.Tensor) (to unwrap MONAI's MetaTensor), which
    took torch.export's fake tensor out of the trace: exporting a converted MAISI raised ("We found a fake tensor
    in the exported program constant's list"; torch.export, AOTInductor and torch.onnx.export alike). Exported,
    it runs as eager does, and its ONNX as stock does."""
    maisi = pytest.importorskip("monai.apps.generation.maisi.networks.autoencoderkl_maisi")
    torch.manual_seed(0)
    stock = maisi.MaisiResBlock(3, 8, 4, 1e-6, 8, num_splits=2, dim_split=1).eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    x = torch.randn(1, 8, 6, 8, 5, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(torch.export.export(converted, (x,)).module()(x), converted(x))
        expected = stock(x)  # float32: MAISI's norms cast their input to it
    (got,) = _onnx_outputs(converted, x, dynamo=True)
    assert rel_l2(got, expected) < 1e-5


def test_jit_trace_records_the_ops():
    """torch.jit.trace of a converted model records tconv3d's ops (the eager callers, which otherwise run an op's
    implementation directly, pass the dispatcher under a trace: inside, shapes were tensors to the tracer and the
    trace raised from an as_strided with wrong strides). The traced module runs them as eager does, saved and
    loaded too (where tconv3d is imported), on inputs other than the traced one."""
    model = tconv3d.nn.convert(_layers().eval())
    generator = torch.Generator().manual_seed(2)
    x, other = (torch.randn(1, 2, 4, 6, 8, generator=generator) for _ in range(2))
    with torch.no_grad():
        traced = torch.jit.trace(model, (x,))
        graph = str(traced.inlined_graph)
        assert "tconv3d::conv3d" in graph and "tconv3d::group_norm" in graph and "aten::_convolution" not in graph
        buffer = io.BytesIO()
        torch.jit.save(traced, buffer)
        buffer.seek(0)
        loaded = torch.jit.load(buffer)
        for module in (traced, loaded):
            assert torch.equal(module(other), model(other))


def test_onnx_export_with_dynamic_sizes():
    """The exported model of dynamic batch and spatial sizes (the padding modes, a strided conv, a transposed
    conv and trilinear upsampling among its layers) exports once and runs at other sizes than the traced one."""
    from torch.export import Dim

    stock = _layers().eval()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    sizes = {0: Dim("batch", max=8), **{d: 2 * Dim(f"half{d}", min=1, max=32) for d in (2, 3, 4)}}
    generator = torch.Generator().manual_seed(4)
    inputs = [torch.randn(shape, generator=generator) for shape in [(1, 2, 4, 6, 8), (3, 2, 6, 10, 12)]]
    outputs = _onnx_outputs(converted, torch.randn(2, 2, 4, 6, 8), inputs, dynamic_shapes={"input": sizes})
    for x, got in zip(inputs, outputs, strict=True):
        with torch.no_grad():
            exact = copy.deepcopy(stock).double()(x.double())
        assert rel_l2(got, exact) < 1e-5, x.shape


def _fx_nodes(graph_module) -> list[tuple[str, str]]:
    """A traced graph's nodes as (op, target) pairs, a function target by name."""
    return [(node.op, getattr(node.target, "__name__", node.target)) for node in graph_module.graph.nodes]


def test_fx_symbolic_trace_records_converted_layers_as_torchs():
    """torch.fx.symbolic_trace of a converted model (what torch.fx's fuse, FX quantization and torchvision's feature
    extractor run) raised at the first layer: fx traces into a module of another library, and tconv3d's forwards
    test shapes, which a Proxy refuses. Its layers are now recorded whole, one call_module node each, as fx records
    torch's own: the graph is stock's node for node. It runs the converted layers: the converted model's output
    and gradients, bit for bit, on inputs other than any traced one (the trace has none)."""
    stock = _layers()
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    traced = torch.fx.symbolic_trace(converted)
    assert _fx_nodes(traced) == _fx_nodes(torch.fx.symbolic_trace(stock))
    assert [type(module) for module in traced.modules()][1:] == [type(module) for module in converted.modules()][1:]
    x = torch.randn(2, 2, 4, 6, 8, generator=torch.Generator().manual_seed(7), requires_grad=True)
    got, expected = traced(x), converted(x)
    assert torch.equal(got, expected) and got.is_contiguous(memory_format=CL)
    grads = [torch.autograd.grad(y.square().sum(), [x, *converted.parameters()]) for y in (got, expected)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


class _PaddedConv(torch.nn.Conv3d):
    """An nn.Conv3d subclass of its own forward: a pad, then super().forward (convert's subclasses="rebase")."""

    def forward(self, x):
        return super().forward(torch.nn.functional.pad(x, (1, 1, 1, 1, 2, 0)))


def test_fx_symbolic_trace_of_a_rebased_subclass():
    """A subclass's forward that reaches tconv3d's by super() (subclasses="rebase") is traced as stock's is, up to
    that call, which is recorded as tconv3d.nn.Conv3d's forward of the layer (not the layer's call: that would pad
    twice); keyword arguments of tconv3d's layers pass through (channels_after). The graph runs as the converted
    model, after pickling too; a converted layer traced by itself is refused, naming what to trace instead."""
    torch.manual_seed(0)
    stock = torch.nn.Sequential(_PaddedConv(4, 8, 3), torch.nn.GroupNorm(2, 8), torch.nn.Conv3d(8, 6, 1))
    converted = tconv3d.nn.convert(copy.deepcopy(stock), subclasses="rebase")
    traced = torch.fx.symbolic_trace(converted)
    nodes = _fx_nodes(traced)
    assert ("call_function", "pad") in nodes and ("call_function", "conv3d_forward") in nodes
    assert ("call_module", "0") not in nodes and ("call_module", "1") in nodes
    x = torch.randn(1, 4, 3, 5, 4, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = converted(x)
        assert torch.equal(traced(x), expected)
        assert rel_l2(expected, stock(x)) < 1e-5
        buffer = io.BytesIO()
        torch.save(traced, buffer)
        buffer.seek(0)
        assert torch.equal(torch.load(buffer, weights_only=False)(x), expected)

    class Fed(torch.nn.Module):  # a GroupNorm fed its skip connection as channels_after
        def __init__(self):
            super().__init__()
            self.norm = tconv3d.nn.GroupNorm(2, 8)

        def forward(self, x):
            return self.norm(x, channels_after=x.flip(1))

    fed = Fed()
    traced = torch.fx.symbolic_trace(fed)
    assert next(node.kwargs for node in traced.graph.nodes if node.op == "call_module").keys() == {"channels_after"}
    x = torch.randn(1, 4, 3, 5, 4, generator=torch.Generator().manual_seed(9))
    assert torch.equal(traced(x), fed(x))
    for layer, name in ((converted[2], "Conv3d"), (converted[0], "_PaddedConv")):
        with pytest.raises(TypeError, match=f"symbolic_trace records a converted {name} as one call.*nn.Sequential"):
            torch.fx.symbolic_trace(layer)


@pytest.mark.parametrize("name, size", [("unet", 16), ("dynunet", 16), ("vnet", 16), ("mednext", 32)])
def test_fx_symbolic_trace_of_monai_networks(name, size, aten_path):
    """The MONAI networks stock traces (most do) trace converted: the blocks convert adapts as one node each
    (DynUNet's, VNet's and MedNeXt's raised inside them), a whole network's adapter (UNet's) traced into. The
    graph runs as the converted network, channels_last_3d to the end."""
    from test_integrations import _monai_nets, _more_monai_nets, _vnet

    if name == "mednext" and not hasattr(pytest.importorskip("monai.networks.nets"), "MedNeXt"):
        pytest.skip("this MONAI has no MedNeXt")
    builds = {"vnet": _vnet, "mednext": _more_monai_nets()["mednext"][0], **_monai_nets()}
    torch.manual_seed(0)
    converted = tconv3d.nn.convert(builds[name]().eval())
    traced = torch.fx.symbolic_trace(converted)
    x = torch.randn(1, 1, size, size, size, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        got = traced(x)
        assert torch.equal(got, converted(x)) and got.is_contiguous(memory_format=CL)
    adapted = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert any(hasattr(type(traced.get_submodule(target)), "tconv3d_adapter") for target in adapted) == (name != "unet")
