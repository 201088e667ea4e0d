"""What the real-model tests (tests/test_integrations.py: diffusers' video models and MONAI's networks) share:
building a stock model and its converted copy, the checks that every convolution runs on tconv3d and that
gradients agree, and what a training step keeps (conftest's `aten_path` runs them with aten inside the ops)."""

import copy

import torch

import tconv3d
from tconv3d.testing import rel_l2

MATCH = 1e-4  # fp32, relative L2 of a whole encode + decode


def stock_and_converted(build):
    torch.manual_seed(0)
    stock = build().eval()
    return stock, tconv3d.nn.convert(copy.deepcopy(stock))


def assert_all_on_tconv3d(report, every_layer_called=True):
    for layer in report.layers:
        assert layer.converted and layer.tconv3d_calls == layer.calls, layer
        assert layer.calls or not every_layer_called, layer
        assert layer.pad_copies == layer.concat_copies == 0, layer
    assert report.aten_conv3d_calls == 0 and report.tconv3d_calls > 0


# The layers that read a VAE's own inputs (the clip, the latent): the only places a layout copy may stay.
# Cosmos's input edge is its Haar patcher's conv (outside any layer the audit watches): its first projection reads
# the patcher's channels_last_3d output.
INPUT_EDGES = {"encoder.conv_in", "decoder.conv_in"}
# Encoders that run once per chunk of frames: their input edge takes one layout copy a chunk, and their chunks'
# latents are concatenated in front of quant_conv (model code).
CHUNKED_ENCODERS = {"wan", "wan22", "easyanimate", "qwenimage"}


# Layers whose converted forward still writes one copy of its input a call (the audit's own copies), by model:
# HunyuanVideo's upsamplers (tconv3d.nn.video_vaes.upsampled_causal_conv: the sub-pixel conv's replicated borders,
# about its input's size, where stock writes its input upsampled 4x or 8x and then padded) and EasyAnimate's
# (upsampled_kept_causal_conv: its input with the two frames in front, where stock writes both upsampled 4x);
# Cosmos's time step's and KVAE's spatial conv's (its reflect padding, as replicate, of its input: tconv3d.nn.Conv3d's
# `upsampled`).
OWN_PAD_COPIES = {
    "hunyuan_video": ".upsamplers.0.conv",
    "easyanimate": ".upsampler.conv",
    "cosmos": ".upsamplers.0.conv1",
    "kvae_video": ".upsample.spatial_conv",
}


def assert_stays_channels_last(report, input_edges=INPUT_EDGES, upstream_copies=False, own_pad_copies=None):
    """Activations channels_last_3d from the first layer to the last: only `input_edges` reach a tconv3d op in
    another layout (at most once a call; None: at most one copy in all, the input's, where the edge has no fixed
    name), no norm gets one, no pad or concatenation copy feeds a convolution, tconv3d writes none itself but one a
    call in the layers whose names end with `own_pad_copies` (OWN_PAD_COPIES), and (unless `upstream_copies`) no
    copy model code made in front of one."""
    copied = {layer.name: layer for layer in report.layers if layer.layout_copies}
    if input_edges is None:
        assert report.totals["layout_copies"] <= 1, report.table()
    else:
        assert set(copied) <= input_edges, report.table()
        assert all(layer.layout_copies <= layer.calls for layer in copied.values()), report.table()
    assert report.norm_layout_copies == 0, report.table()
    assert report.totals["pad_copies_into_convs"] == report.totals["concat_copies_into_convs"] == 0, report.table()
    own = [layer for layer in report.layers if layer.own_copies]
    assert all(own_pad_copies and layer.name.endswith(own_pad_copies) and layer.own_copies <= layer.calls
               for layer in own), report.table()  # fmt: skip
    assert upstream_copies or report.totals["upstream_copies_into_convs"] == 0, report.table()


def saved_for_backward(model, run, x) -> int:
    """The bytes autograd keeps for the backward of run(model, x): each saved tensor's storage counted once (a
    view of it does not add), parameters included."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(model, x)
    return sum(storages.values())


def assert_keeps_no_more_than_stock(stock, converted, run, x):
    """Leaner: for run(model, x)'s backward, the converted model keeps no more than the stock one (and something)."""
    stock_bytes, ours = (saved_for_backward(model, run, x) for model in (stock, converted))
    assert 0 < ours <= stock_bytes, (ours, stock_bytes)


# How much farther from float64 than stock's own float32 a converted model's float32 results may land where MATCH
# fails against stock (the model fuzzer's rule and the real-model tests'): a ReLU network's eval-mode gradients move
# by 1e-4 to 1e-3 where one activation input of the millions rounds to the other side of zero (a kink; SENet154 at
# 64^3: 3 of them).
ILL_CONDITIONED = 10


def assert_gradients_as_near_float64(stock, converted, run, x):
    """The parameter gradients of run(model, x).square().mean(), the converted model's within MATCH of stock's or
    no more than ILL_CONDITIONED times farther from a float64 copy of stock's than stock's own."""
    reference = copy.deepcopy(stock).double()
    for model, input in ((stock, x), (converted, x), (reference, x.double())):
        model.zero_grad(set_to_none=True)
        run(model, input).square().mean().backward()
    grads = [torch.cat([p.grad.double().flatten() for p in model.parameters() if p.grad is not None])
             for model in (stock, converted, reference)]  # fmt: skip
    apart, stock_off, ours_off = rel_l2(grads[1], grads[0]), rel_l2(grads[0], grads[2]), rel_l2(grads[1], grads[2])
    assert apart < MATCH or ours_off <= ILL_CONDITIONED * stock_off, (apart, ours_off, stock_off)


def assert_same_gradients(stock, converted):
    """Parameter gradients agree; those a normalisation makes zero in exact arithmetic (a bias right before it)
    are fp32 noise on both sides, so each may also differ by a few fp32 ulps of the whole gradient's norm."""
    pairs = [(key, theirs.grad, ours.grad) for (key, theirs), ours in
             zip(stock.named_parameters(), converted.parameters(), strict=True) if theirs.grad is not None]  # fmt: skip
    scale = torch.cat([g.flatten() for _, g, _ in pairs]).norm()
    assert rel_l2(torch.cat([g.flatten() for _, _, g in pairs]), torch.cat([g.flatten() for _, g, _ in pairs])) < MATCH
    for key, theirs, ours in pairs:
        assert (ours - theirs).norm() <= MATCH * theirs.norm() + 1e-6 * scale, key


def explained_without_new_graph_breaks(run, stock, converted, *args):
    """torch._dynamo.explain of run(converted, *args), which breaks its graph no more often than run(stock, *args).
    A converted model traced whole breaks no more than any model, so the stock one is traced only where the
    converted one breaks (Dynamo's time on it was half of such a test's). Both under a recompile limit of 64: past
    the default 8 Dynamo runs a frame eagerly and traces its callees one by one, so the count says where the limit
    struck, not where the graphs break (DiNTS: one cell forward met with each depth's channels, stock 14 and
    converted 16 "breaks" at 8, 19 and 16 at 64)."""
    with torch._dynamo.config.patch(recompile_limit=64):
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda *a: run(converted, *a))(*args)
        if explained.graph_break_count:
            torch._dynamo.reset()
            stock_breaks = torch._dynamo.explain(lambda *a: run(stock, *a))(*args).graph_break_count
            assert explained.graph_break_count <= stock_breaks, (explained.graph_break_count, stock_breaks)
    return explained


def perturbed(build):
    """build, its all-zero parameters (a diffusion UNet's zero-initialised output convolutions) drawn at random:
    else the output is zeros, which says nothing."""

    def made():
        model = build()
        with torch.no_grad():
            for parameter in model.parameters():
                if not parameter.any():
                    parameter.normal_(0, 0.1)
        return model

    return made
