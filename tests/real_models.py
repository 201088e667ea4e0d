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
    converted one breaks (Dynamo's time on it was half of such a test's)."""
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
