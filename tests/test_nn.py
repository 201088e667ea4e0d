"""tconv3d.nn.Conv3d, tconv3d.nn.convert and autocast."""

import copy
import itertools
import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import OpNames, OpsMade, count_launches
from torch import nn

import tconv3d
from tconv3d.nn.modules import resize_nearest
from tconv3d.testing import TOLERANCE, reference_conv3d, rel_l2

CL = torch.channels_last_3d


def stock_and_tconv3d(*args, **kwargs):
    """A stock nn.Conv3d and a tconv3d.nn.Conv3d with the same arguments and the same parameter values."""
    stock = nn.Conv3d(*args, **kwargs)
    ours = tconv3d.nn.Conv3d(*args, **kwargs)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def test_module_mirrors_nn_conv3d(device):
    stock, ours = stock_and_tconv3d(5, 7, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1), bias=True)
    stock, ours = stock.to(device), ours.to(device)
    assert isinstance(ours, nn.Conv3d)
    assert repr(ours) == repr(stock)
    assert list(ours.state_dict()) == list(stock.state_dict())
    assert all(a.shape == b.shape for a, b in zip(ours.state_dict().values(), stock.state_dict().values(), strict=True))
    assert ours.weight.is_contiguous(memory_format=CL)
    x = torch.randn(2, 5, 3, 9, 8, device=device)
    assert rel_l2(ours(x), stock(x).detach()) < TOLERANCE[torch.float32]


def test_weight_stays_channels_last_without_per_call_copies(device):
    conv = tconv3d.nn.Conv3d(4, 6, 3, padding=1).to(device)
    weight = conv.weight
    storage = weight.data_ptr()
    x = torch.randn(1, 4, 4, 5, 6, device=device)
    conv(x)
    conv(x)
    assert conv.weight is weight and weight.data_ptr() == storage  # nothing re-laid it out
    # load_state_dict from an NCDHW state copies into the same channels_last_3d Parameter.
    conv.load_state_dict({"weight": torch.randn(6, 4, 3, 3, 3, device=device), "bias": torch.randn(6, device=device)})
    assert conv.weight is weight and weight.is_contiguous(memory_format=CL)
    # Something that swaps the storage for an NCDHW one: converted again, once, on the same Parameter.
    weight.data = weight.data.contiguous()
    conv(x)
    assert conv.weight is weight and weight.is_contiguous(memory_format=CL)
    conv.half()
    assert conv.weight is weight and weight.dtype == torch.float16 and weight.is_contiguous(memory_format=CL)


def test_weights_kept_in_inference_mode_stay_trainable(device):
    """A weight laid out channels_last_3d inside torch.inference_mode(), by `convert` or by the first forward after
    its storage was replaced (a state dict loaded with assign=True, NCDHW), is a plain tensor, as stock's Parameter
    stays: a later training step saves it for backward and the optimizer updates it in place."""
    stock = nn.Sequential(nn.Conv3d(4, 6, 3, padding=1), nn.SiLU(), nn.ConvTranspose3d(6, 4, 2, stride=2)).to(device)
    state = copy.deepcopy(stock.state_dict())
    model = copy.deepcopy(stock)
    x = torch.randn(1, 4, 3, 4, 5, device=device).to(memory_format=CL)
    with torch.inference_mode():
        tconv3d.nn.convert(model)
    for _ in range(2):  # converted in inference mode; then the storage replaced, first called in inference mode
        assert not any(p.is_inference() for p in model.parameters())
        with torch.inference_mode():
            assert rel_l2(model(x), stock(x)) < TOLERANCE[torch.float32]
        assert not any(p.is_inference() for p in model.parameters())
        assert all(p.is_contiguous(memory_format=CL) for p in model.parameters() if p.dim() == 5)
        for m in (stock, model):
            m.zero_grad()
            m(x).square().sum().backward()
            torch.optim.SGD(m.parameters(), lr=1e-3).step()
        for ours, theirs in zip(model.parameters(), stock.parameters(), strict=True):
            assert rel_l2(ours, theirs) < TOLERANCE[torch.float32]
        stock.load_state_dict(state)
        model.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True)
        assert not model[0].weight.is_contiguous(memory_format=CL)


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
def test_padding_modes_match_nn_conv3d(padding_mode, device):
    stock, ours = stock_and_tconv3d(3, 4, 3, padding=(1, 2, 1), padding_mode=padding_mode)
    stock, ours = stock.to(device), ours.to(device)
    x = torch.randn(1, 3, 4, 5, 6, device=device)
    assert rel_l2(ours(x), stock(x).detach()) < TOLERANCE[torch.float32]


def test_same_padding_module(device):
    stock, ours = stock_and_tconv3d(3, 4, (2, 3, 4), padding="same")
    x = torch.randn(1, 3, 4, 5, 6, device=device)
    assert rel_l2(ours.to(device)(x), stock.to(device)(x).detach()) < TOLERANCE[torch.float32]


def test_module_rejects_groups_as_nn_conv3d_does():
    with pytest.raises(ValueError, match="divisible by groups"):
        tconv3d.nn.Conv3d(4, 6, 3, groups=4)


class _CustomConv(nn.Conv3d):
    def forward(self, x):
        return super().forward(x) * 2


def test_convert_swaps_in_place_and_keeps_parameters(device, caplog):
    model = nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1),
        nn.SiLU(),
        nn.Sequential(nn.Conv3d(8, 8, 3, padding=1, groups=2), nn.Conv3d(8, 8, 1)),
        _CustomConv(8, 4, 3, padding=1),
    ).to(device)
    x = torch.randn(1, 3, 4, 5, 6, device=device)
    before = model(x).detach()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model[0]
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        assert tconv3d.nn.convert(model) is model
    assert model[0] is first and type(first) is tconv3d.nn.Conv3d
    assert type(model[2][0]) is type(model[2][1]) is tconv3d.nn.Conv3d  # grouped and pointwise
    assert type(model[3]) is _CustomConv
    assert "3" in caplog.text and "_CustomConv" in caplog.text
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert rel_l2(model(x), before) < TOLERANCE[torch.float32]
    # The optimizer built before the swap still trains the swapped layers.
    weight_before = first.weight.detach().clone()
    model(x).square().mean().backward()
    optimizer.step()
    assert not torch.equal(first.weight.detach(), weight_before)


PARAMETRIZATIONS = {
    "weight_norm": lambda conv: nn.utils.parametrizations.weight_norm(conv),
    "spectral_norm": lambda conv: nn.utils.parametrizations.spectral_norm(conv),
    "weight_norm_hook": lambda conv: nn.utils.weight_norm(conv),  # the older API: a forward pre-hook
    "spectral_norm_hook": lambda conv: nn.utils.spectral_norm(conv),
}


@pytest.mark.filterwarnings("ignore:.*weight_norm. is deprecated:FutureWarning")
@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("kind", PARAMETRIZATIONS)
def test_convert_takes_weight_normed_and_spectral_normed_layers(kind, transposed, device, caplog):
    """A conv whose weight a parametrization computes (weight_norm, spectral_norm; torch.nn.utils.parametrize's
    or the older hooks') is taken over with its parametrization: the same outputs, parameter gradients and
    spectral_norm power-iteration state as stock over training steps (the weight read once a forward), the same
    state_dict keys, and remove_parametrizations leaves tconv3d's layer."""

    def model():  # twice from one seed: the older weight_norm's modules cannot be deep-copied
        torch.manual_seed(0)
        layer = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1) if transposed else nn.Conv3d(4, 6, 3, padding=1)
        return nn.Sequential(PARAMETRIZATIONS[kind](layer), nn.SiLU()).to(device)

    stock, ours = model(), model()
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(ours)
    assert "left" not in caplog.text, caplog.text
    assert isinstance(ours[0], tconv3d.nn.ConvTranspose3d if transposed else tconv3d.nn.Conv3d)
    assert type(ours[0]).__name__ == type(stock[0]).__name__
    assert list(ours.state_dict()) == list(stock.state_dict())
    for step in range(3):
        x = torch.randn(2, 4, 3, 5, 4, device=device).contiguous(memory_format=CL)
        expected, got = stock(x), ours(x)
        assert got.is_contiguous(memory_format=CL)
        assert rel_l2(got, expected.detach()) < TOLERANCE[torch.float32], step
        grad = torch.randn_like(expected)
        expected.backward(grad)
        got.backward(grad)
        for (name, a), b in zip(stock.named_parameters(), ours.parameters(), strict=True):
            assert rel_l2(b.grad, a.grad) < TOLERANCE[torch.float32], (step, name)
        for (name, a), b in zip(stock.named_buffers(), ours.buffers(), strict=True):  # spectral_norm's u, v
            torch.testing.assert_close(b, a, msg=lambda m, n=name: f"{n}: {m}")
    if kind in ("weight_norm", "spectral_norm"):
        nn.utils.parametrize.remove_parametrizations(ours[0], "weight")
        nn.utils.parametrize.remove_parametrizations(stock[0], "weight")
        assert type(ours[0]) is (tconv3d.nn.ConvTranspose3d if transposed else tconv3d.nn.Conv3d)
        x = torch.randn(2, 4, 3, 5, 4, device=device)
        assert rel_l2(ours(x), stock(x).detach()) < TOLERANCE[torch.float32]


def test_convert_reports_lazy_convs_and_takes_them_once_made(device, caplog):
    """A LazyConv3d / LazyConvTranspose3d has no weight until its first forward, where it becomes an nn.Conv3d /
    nn.ConvTranspose3d: convert names each and says to convert after a forward, then takes them over."""
    model = nn.Sequential(nn.LazyConv3d(4, 3), nn.LazyConvTranspose3d(4, 2, stride=2)).to(device)
    with caplog.at_level(logging.WARNING, logger="tconv3d"):
        tconv3d.nn.convert(model)
    assert caplog.text.count("convert after a first forward") == 2, caplog.text
    x = torch.randn(1, 2, 3, 4, 5, device=device)
    expected = model(x).detach()
    tconv3d.nn.convert(model)
    assert [type(m) for m in model] == [tconv3d.nn.Conv3d, tconv3d.nn.ConvTranspose3d]
    assert rel_l2(model(x), expected) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "ceil_mode"),
    [(2, 2, 0, False), (3, 2, 1, True), ((1, 2, 2), 1, 0, False), ((1, 2, 2), (1, 2, 2), 0, False), (2, 2, 0, True)],
)
def test_avg_pool_answers_channels_last_3d(kernel, stride, padding, ceil_mode, device):
    """convert swaps nn.AvgPool3d for tconv3d.nn.AvgPool3d: torch's values and gradients, answered channels_last_3d
    for a channels_last_3d input (torch's CPU kernel answers NCDHW), torch's layout for any other input. Windows
    that tile a channels_last_3d input are a mean over its view, with no avg_pool3d op (CUDA's copies its input
    NCDHW first): torch's values up to the order of a window's sum, against float64 as close as torch's."""
    stock = nn.AvgPool3d(kernel, stride, padding, ceil_mode=ceil_mode)
    ours = tconv3d.nn.convert(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(ours) is tconv3d.nn.AvgPool3d
    tiles = stock.kernel_size == stock.stride and not padding and not ceil_mode
    for memory_format in (torch.channels_last_3d, torch.contiguous_format):
        x = torch.randn(2, 8, 5, 6, 7, device=device).contiguous(memory_format=memory_format)
        ours_in, theirs_in = x.clone().requires_grad_(), x.clone().requires_grad_()
        with OpNames() as ops:
            out = ours(ours_in)
        expected = stock(theirs_in)
        assert out.is_contiguous(memory_format=memory_format)
        grad = torch.randn_like(expected)
        out.backward(grad)
        expected.backward(grad)
        by_view = tiles and memory_format == torch.channels_last_3d
        assert any("avg_pool3d" in name for name in ops.names) != by_view
        if not by_view:
            assert torch.equal(out, expected)
            if device == "cuda":  # CUDA's backward adds overlapping windows' shares atomically, in any order
                assert rel_l2(ours_in.grad, theirs_in.grad) < 1e-6
            else:
                assert torch.equal(ours_in.grad, theirs_in.grad)
            continue
        exact = nn.AvgPool3d(kernel, stride)(x.double())
        assert rel_l2(out.double(), exact) <= 2 * rel_l2(expected.double(), exact) + 1e-15
        assert rel_l2(ours_in.grad, theirs_in.grad) < 1e-6
        assert ours_in.grad.is_contiguous(memory_format=torch.channels_last_3d)


def _layouts(shape, device):
    """x of `shape` channels_last_3d, NCDHW, and a channel slice of a channels_last_3d tensor (not dense: torch's
    kernels still answer it channels_last_3d)."""
    wider = torch.randn(shape[0], shape[1] + 3, *shape[2:], device=device).contiguous(memory_format=CL)
    return {
        "channels_last_3d": torch.randn(shape, device=device).contiguous(memory_format=CL),
        "ncdhw": torch.randn(shape, device=device),
        "channel_slice": wider[:, 1 : 1 + shape[1]],
    }


# (input size, output size): grown by powers of two, shrunk by them, both, and sizes torch keeps (3x, 1.5x).
RESIZES = [((3, 4, 5), (6, 8, 10)), ((5, 4, 4), (5, 16, 16)), ((8, 16, 4), (4, 4, 8)), ((3, 8, 4), (12, 2, 4)),
           ((5, 4, 4), (15, 4, 4)), ((5, 6, 4), (5, 9, 8))]  # fmt: skip


@pytest.mark.parametrize(("source", "size"), RESIZES, ids=[f"{s}->{t}" for s, t in RESIZES])
@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
def test_resize_nearest_is_torch_interpolate_bit_for_bit(source, size, mode, device):
    """The latents' and segmentation maps' resizing (resize_nearest) and convert's nn.Upsample: F.interpolate's
    values, gradients and strides, for every layout torch answers; whole power-of-two factors without torch's
    3-D nearest kernel (on CUDA it copies a channels_last_3d input NCDHW and its output back)."""
    pairs = list(zip(source, size, strict=True))
    whole = all(max(a, b) % min(a, b) == 0 and max(a, b) // min(a, b) in (1, 2, 4) for a, b in pairs)
    shrinks = any(a > b for a, b in pairs)
    for layout, x in _layouts((2, 3, *source), device).items():
        ours_in, theirs_in = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with OpNames() as ops:
            out = resize_nearest(ours_in, size, mode)
        expected = F.interpolate(theirs_in, size=size, mode=mode)
        assert torch.equal(out, expected), layout
        assert out.stride() == expected.stride(), layout
        kernel = any("upsample_nearest" in name for name in ops.names)
        assert kernel == (not whole or (shrinks and mode != "nearest")), (layout, ops.names)
        grad = torch.randn_like(expected)
        out.backward(grad)
        expected.backward(grad)
        assert rel_l2(ours_in.grad, theirs_in.grad) < 1e-6, layout


@pytest.mark.parametrize("first_apart", [False, True])
@pytest.mark.parametrize("grad_layout", ["channels_last_3d", "ncdhw"])
def test_repeat_nearest_gradients_come_back_channels_last(first_apart, grad_layout, device):
    """The nearest repeats' backward sums each voxel's copies into a channels_last_3d gradient whatever the
    incoming gradient's layout (the expand's own backward, a reduction, answered NCDHW and handed every layer
    before it a gradient of another layout); the values are the sums; forward-mode AD and vmap give the repeat of
    the tangent and of each sample."""
    from tconv3d.nn.modules import repeat_nearest

    factors = (2, 2, 2)
    x = torch.randn(2, 3, 3, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    out = repeat_nearest(x, factors, first_apart=first_apart)
    assert out.shape[2] == (5 if first_apart else 6) and out.is_contiguous(memory_format=CL)
    grad = torch.randn(out.shape, device=device)
    grad = grad.contiguous(memory_format=CL) if grad_layout == "channels_last_3d" else grad
    (dx,) = torch.autograd.grad(out, x, grad)
    reference = x.detach().clone().requires_grad_()
    first = F.interpolate(reference[:, :, :1], scale_factor=(1, 2, 2)) if first_apart else None
    rest = F.interpolate(reference[:, :, 1:] if first_apart else reference, scale_factor=factors)
    expected = torch.cat([first, rest], dim=2) if first_apart else rest
    assert torch.equal(out, expected)
    (expected_dx,) = torch.autograd.grad(expected, reference, grad)
    assert dx.is_contiguous(memory_format=CL) and rel_l2(dx, expected_dx) < 1e-6
    tangent = torch.randn_like(x)
    _, out_tangent = torch.func.jvp(lambda t: repeat_nearest(t, factors, first_apart=first_apart), (x,), (tangent,))
    assert torch.equal(out_tangent, repeat_nearest(tangent, factors, first_apart=first_apart))
    batched = torch.func.vmap(lambda t: repeat_nearest(t, factors, first_apart=first_apart))(x.detach()[None])
    assert torch.equal(batched[0], out.detach())
    with torch.autograd.forward_ad.dual_level():  # autograd's own forward mode: the Function's jvp
        dual = torch.autograd.forward_ad.make_dual(x.detach(), tangent)
        dual_out = repeat_nearest(dual, factors, first_apart=first_apart)
        assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual_out).tangent, out_tangent)


@pytest.mark.parametrize("factors, first_apart", [((1, 2, 2), False), ((2, 1, 1), True), ((2, 2, 2), True)])
@pytest.mark.parametrize("grad_layout", ["channels_last_3d", "ncdhw"])
def test_add_repeated_adds_the_repeats_in_place(factors, first_apart, grad_layout, device):
    """add_repeated_ (Cosmos's upsampler's residual): out += repeat_nearest(x) in place (the same tensor back, no
    tensor of out's size made), out's gradient passed through and x's the repeats' sums, channels_last_3d whatever
    the incoming gradient's layout; autograd's forward mode and torch.func's jvp and vmap give the tangents' and
    samples' sums; a shape that is not x's repeat is refused by name."""
    from tconv3d.nn.modules import add_repeated_, repeat_nearest

    x = torch.randn(2, 3, 3, 4, 5, device=device).contiguous(memory_format=CL).requires_grad_()
    shape = repeat_nearest(x.detach(), factors, first_apart=first_apart).shape
    base = torch.randn(shape, device=device).contiguous(memory_format=CL).requires_grad_()
    out = base * 1  # a non-leaf, as a conv's output
    with OpsMade() as ops:
        summed = add_repeated_(out, x, factors, first_apart=first_apart)
    assert summed is out and tuple(shape) not in ops.fresh(), ops.made
    reference_x, reference_base = x.detach().clone().requires_grad_(), base.detach().clone().requires_grad_()
    expected = reference_base + repeat_nearest(reference_x, factors, first_apart=first_apart)
    assert torch.equal(summed, expected)
    grad = torch.randn(shape, device=device)
    grad = grad.contiguous(memory_format=CL) if grad_layout == "channels_last_3d" else grad
    dbase, dx = torch.autograd.grad(summed, (base, x), grad)
    expected_dbase, expected_dx = torch.autograd.grad(expected, (reference_base, reference_x), grad)
    assert torch.equal(dbase, expected_dbase) and dx.is_contiguous(memory_format=CL)
    assert rel_l2(dx, expected_dx) < 1e-6
    tangents = torch.randn_like(base), torch.randn_like(x)
    repeat = lambda t: repeat_nearest(t, factors, first_apart=first_apart)  # noqa: E731
    expected_tangent = tangents[0] + repeat(tangents[1])
    add = lambda o, t: add_repeated_(o.clone(), t, factors, first_apart=first_apart)  # noqa: E731
    _, func_tangent = torch.func.jvp(add, (base.detach(), x.detach()), tangents)
    assert torch.allclose(func_tangent, expected_tangent)
    batched = torch.func.vmap(add)(base.detach()[None], x.detach()[None])
    assert torch.equal(batched[0], expected.detach())
    with torch.autograd.forward_ad.dual_level():  # autograd's own forward mode: the Function's jvp, in place
        dual = torch.autograd.forward_ad.make_dual(base.detach().clone(), tangents[0].clone())
        dual_out = add_repeated_(dual, torch.autograd.forward_ad.make_dual(x.detach(), tangents[1]), factors,
                                 first_apart=first_apart)  # fmt: skip
        assert torch.allclose(torch.autograd.forward_ad.unpack_dual(dual_out).tangent, expected_tangent)
    with pytest.raises(ValueError, match="add_repeated_: out is"):
        add_repeated_(torch.zeros(2, 3, 3, 8, 8, device=device), x.detach(), factors, first_apart=first_apart)


def test_layout_of_traces_no_stride():
    """layout_of while dynamo traces (`_traced_layout`): no stride of x in the graph, where dynamo would pass a
    size-1 dimension's stride for a size equal to it (AOTAutograd's re-trace may give that stride another value:
    a failed view compiling KVAE's decode after Wan 2.2's), and the layout eager answers for dense NCDHW and
    channels_last_3d tensors and channel and frame slices of them."""
    from tconv3d.nn.modules import layout_of

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm.graph)
        return gm

    def laid_out(t):  # sizes equal to strides of t's size-1 H: C * W (channels_last_3d), D * W (NCDHW)
        _, c, d, _, w = t.shape
        return torch.empty(t.shape, memory_format=layout_of(t)), torch.empty(c * w, d * w)

    cl = torch.randn(2, 6, 3, 1, 5).contiguous(memory_format=CL)
    ncdhw = torch.randn(2, 6, 3, 1, 5)
    cases = {
        "channels_last_3d": (cl, CL),
        "ncdhw": (ncdhw, torch.contiguous_format),
        "channel slice of channels_last_3d": (cl[:, 1:4], CL),
        "channel slice of ncdhw": (ncdhw[:, 1:4], torch.contiguous_format),
        "frame slice of channels_last_3d": (cl[:, :, 1:], CL),
    }
    for name, (x, expected) in cases.items():
        torch._dynamo.reset()
        out, _ = torch.compile(laid_out, backend=capture, dynamic=True)(x)
        other = torch.contiguous_format if expected == CL else CL
        assert layout_of(x) == expected and not out.is_contiguous(memory_format=other), name
        strides = [node for node in graphs[-1].nodes if "stride" in str(node.target)]
        assert not strides, (name, strides)


@pytest.mark.parametrize("key", [(0, 1, None), (-2, None, None), (1, 4, None), (None, None, 2), (2, 2, None)])
def test_frame_slices_give_gradients_in_the_input_layout(key, device):
    """tconv3d.nn.modules.frames, the frame slice the VAE adapters take of activations (kept frames, a first frame
    apart): the slice's values as a view; its backward answers in the input's layout, where autograd's slice
    backward writes into NCDHW zeros; autograd's forward mode and torch.func give the tangent's slice; without
    grad it is the plain slice."""
    from tconv3d.nn.modules import frames

    for layout, x in _layouts((2, 3, 5, 4, 3), device).items():
        x = x.detach().requires_grad_()
        out = frames(x, *key)
        expected = x[:, :, slice(*key)]
        assert torch.equal(out, expected) and out.stride() == expected.stride(), layout
        grad = torch.randn(out.shape, device=device)  # NCDHW, whatever x's layout
        (dx,) = torch.autograd.grad(out, x, grad)
        (expected_dx,) = torch.autograd.grad(expected, x, grad)
        assert torch.equal(dx, expected_dx), layout
        assert dx.is_contiguous(memory_format=CL) != (layout == "ncdhw"), layout  # a channel slice: CL too
        tangent = torch.randn_like(x)
        with torch.autograd.forward_ad.dual_level():
            dual = frames(torch.autograd.forward_ad.make_dual(x.detach(), tangent), *key)
            assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual).tangent, tangent[:, :, slice(*key)])
        _, jvp = torch.func.jvp(lambda t: frames(t, *key), (x.detach(),), (tangent,))
        assert torch.equal(jvp, tangent[:, :, slice(*key)])
        with torch.no_grad():
            assert frames(x, *key)._base is x


@pytest.mark.parametrize(
    "kwargs",
    [{"scale_factor": 2}, {"scale_factor": (1, 2, 2)}, {"size": (6, 8, 8)},
     {"scale_factor": 2, "mode": "nearest-exact"}, {"scale_factor": 3}, {"scale_factor": 2, "mode": "trilinear"}],
    ids=["x2", "x1x2x2", "size", "exact", "x3", "trilinear"],
)  # fmt: skip
def test_upsample_answers_torch_values_in_the_input_layout(kwargs, device):
    """convert swaps nn.Upsample (MONAI's AutoencoderKL and DiffusionModelUNet decoders) for tconv3d.nn.Upsample:
    torch's values and gradients; nearest by whole power-of-two factors is one copy in the input's layout, any
    other interpolation torch's own."""
    stock = nn.Upsample(**kwargs)
    ours = tconv3d.nn.convert(nn.Sequential(copy.deepcopy(stock)))[0]
    assert type(ours) is tconv3d.nn.Upsample and repr(ours) == repr(stock)
    nearest = kwargs.get("mode", "nearest") in ("nearest", "nearest-exact")
    for layout, x in _layouts((2, 3, 3, 4, 4), device).items():
        # trilinear by 2 on channels_last_3d: tconv3d's upsample_linear (an NCDHW input: torch's, coalesced there)
        own = kwargs.get("scale_factor") != 3 and (nearest or layout != "ncdhw")
        ours_in, theirs_in = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
        with OpNames() as ops:
            out = ours(ours_in)
        expected = stock(theirs_in)
        same = torch.equal(out, expected) if nearest else rel_l2(out, expected) < 1e-6  # (fp32 sums' order)
        assert same and out.stride() == expected.stride(), layout
        assert any("aten.upsample" in name for name in ops.names) != own, (layout, ops.names)
        assert any("tconv3d.upsample_linear" in name for name in ops.names) == (own and not nearest), layout
        grad = torch.randn_like(expected)
        out.backward(grad)
        expected.backward(grad)
        assert rel_l2(ours_in.grad, theirs_in.grad) < 1e-6, layout
    if kwargs.get("scale_factor") == 2 and kwargs.get("mode") != "trilinear":  # 4-D frames: torch's
        frames = torch.randn(2, 3, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
        assert torch.equal(ours(frames), stock(frames))


@pytest.mark.parametrize("bias", [False, True])
def test_backward_lays_out_a_gradient_of_another_layout_once(bias, device):
    """A convolution whose output gradient arrives NCDHW (autograd summing an NCDHW and a channels_last_3d one at
    a residual, a slice's backward) lays it out channels_last_3d once, in its backward, and hands that to each
    gradient op (input, weight): one copy where each op made its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        copies, grads = 0, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "tconv3d":
                Seen.grads.append(args[0].is_contiguous(memory_format=CL))
            elif func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default) and out.shape == grad.shape:
                Seen.copies += 1
            return out

    conv = tconv3d.nn.Conv3d(4, 6, 3, padding=1, bias=bias).to(device)
    x = torch.randn(1, 4, 3, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_()
    y = conv(x)
    grad = torch.randn(y.shape, device=device)  # NCDHW
    with Seen():
        y.backward(grad)
    assert Seen.copies == 1 and len(Seen.grads) >= 2 and all(Seen.grads), (Seen.copies, Seen.grads)
    expected_x, expected_w = torch.autograd.grad(
        torch.nn.functional.conv3d(x.double(), conv.weight.double(), None, padding=1), (x, conv.weight),
        grad.double(),
    )  # fmt: skip
    assert rel_l2(x.grad, expected_x) < TOLERANCE[torch.float32] and rel_l2(conv.weight.grad, expected_w) < 1e-4


def test_convolve_runs_through_a_hooked_layers_call(device):
    """An adapter's `convolve` of a layer whose call runs hooks (hooks.hooked: a hook of its own or global, a forward
    replaced on the instance; not the audit's, which observe) is made through that call, so the hooks run: a
    forward pre-hook that scales the weight changes the result as it changes the call's. Unhooked, no call."""
    from tconv3d.nn.hooks import hooked, observer

    torch.manual_seed(0)
    conv = tconv3d.nn.Conv3d(4, 6, 3).to(device)
    x = torch.randn(1, 4, 5, 6, 7, device=device)
    padding = (1, 1, 1, 1, 1, 1)
    plain = conv.convolve(x, padding)
    assert not hooked(conv)
    handle = conv.register_forward_pre_hook(observer(lambda module, args: None))
    assert not hooked(conv)
    handle.remove()
    calls = []
    handle = conv.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    assert hooked(conv) and torch.equal(conv.convolve(x, padding), plain) and len(calls) == 1
    handle.remove()
    stock_forward = conv.forward

    def doubled(*args, **kwargs):  # what diffusers' layerwise casting does: the weight made for the call
        with torch.no_grad():
            conv.weight.mul_(2)
        try:
            return stock_forward(*args, **kwargs)
        finally:
            with torch.no_grad():
                conv.weight.div_(2)

    conv.forward = doubled
    assert hooked(conv)
    bias = conv.bias.view(1, -1, 1, 1, 1)
    assert rel_l2(conv.convolve(x, padding) - bias, 2 * (plain - bias)) < 1e-6
    del conv.forward
    assert not hooked(conv) and torch.equal(conv.convolve(x, padding), plain)


class _Convolving(nn.Module):
    """An adapter's shape: its conv's convolution with a padding of its own, the front frames' from the input's
    length (a symbolic size under torch.compile's dynamic shapes)."""

    def __init__(self):
        super().__init__()
        self.conv = tconv3d.nn.Conv3d(4, 6, 3)

    def forward(self, x):
        return self.conv.convolve(x, (x.shape[2] % 2 + 1, 0, 1, 1, 1, 1))


def test_a_hooked_layers_convolve_is_recorded_by_torch_fx(device):
    """torch.fx records a hooked layer's convolve (made through its call) as a call of the layer with the
    convolve's arguments, and the graph answers as the module does. Before, the record dropped them: the graph
    ran the layer's own padding (another shape)."""
    torch.manual_seed(0)
    model = _Convolving().to(device)
    model.conv.register_forward_pre_hook(lambda module, args: None)
    x = torch.randn(1, 4, 5, 6, 7, device=device)
    graph = torch.fx.symbolic_trace(model)
    assert [node.kwargs.keys() for node in graph.graph.nodes if node.op == "call_module"] == [{"convolving"}]
    assert torch.equal(graph(x), model(x))


def test_a_hooked_convolve_under_accelerates_offload_compiles_without_graph_breaks(device, aten_path):
    """accelerate's hooks walk a call's arguments (send_to_device: hasattr(item, "to") on each item of a tuple),
    which dynamo cannot trace on a symbolic size. A hooked layer's convolve handed its arguments as a tuple and
    broke the compiled graph at each call (LTX-Video's causal convs, CogVideoX's: the model fuzzer's --hooks
    --compile draws); it hands them as one object now (hooks.Handed): no break, the result as eager's."""
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = _Convolving().to(device)
    accelerate.cpu_offload(model, execution_device=torch.device(device))
    x = torch.randn(1, 4, 5, 6, 7, device=device)
    with torch.no_grad():
        eager = model(x)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, backend="eager", dynamic=True)(x)
        torch._dynamo.reset()
    breaks = [reason.splitlines()[0] for reason in torch._dynamo.utils.counters["graph_break"]]
    assert torch.equal(compiled, eager)
    assert not [reason for reason in breaks if "hasattr" in reason], breaks


def test_convert_filter_chooses_layers(device):
    model = nn.Sequential(nn.Conv3d(3, 4, 1), nn.Conv3d(4, 4, 1)).to(device)
    tconv3d.nn.convert(model, filter=lambda name, module: name != "1")
    assert type(model[0]) is tconv3d.nn.Conv3d and type(model[1]) is nn.Conv3d


def test_convert_patches_nothing_global():
    tconv3d.nn.convert(nn.Sequential(nn.Conv3d(3, 4, 1)))
    fresh = nn.Conv3d(3, 4, 1)
    assert type(fresh) is nn.Conv3d and nn.Conv3d.forward is not tconv3d.nn.Conv3d.forward
    assert torch.nn.functional.conv3d is not tconv3d.conv3d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_triton_kernel_in_autocast_dtype(dtype, device, monkeypatch):
    if device == "cpu" and dtype == torch.float16 and not torch.amp.autocast_mode.is_autocast_available("cpu"):
        pytest.skip("no CPU autocast")
    conv = tconv3d.nn.Conv3d(4, 6, 3, padding=1).to(device)
    x = torch.randn(1, 4, 4, 5, 6, device=device)
    launches = count_launches(monkeypatch, "conv3d_fwd")
    with torch.autocast(device, dtype=dtype):
        y = conv(x)
    assert y.dtype == dtype
    assert launches == ["conv3d_fwd"]
    expected = reference_conv3d(x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype), 1, 1)
    assert rel_l2(y, expected) < TOLERANCE[dtype]
    # Gradients flow back to the fp32 parameters through the casts.
    y.float().sum().backward()
    assert conv.weight.grad.dtype == torch.float32 and torch.isfinite(conv.weight.grad).all()


def test_autocast_conv_transpose_takes_a_bf16_activation_and_fp32_parameters(device):
    """Inside autocast a layer's input is the previous layer's bf16 output while its parameters stay fp32: the
    transposed convolution casts them as torch's does, instead of rejecting the mix."""
    up = tconv3d.nn.ConvTranspose3d(4, 3, 2, stride=2).to(device)
    x = torch.randn(1, 4, 2, 3, 3, device=device).to(torch.bfloat16)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = up(x)
        expected = torch.nn.functional.conv_transpose3d(x, up.weight, up.bias, 2)
    assert y.dtype == expected.dtype == torch.bfloat16
    assert rel_l2(y, expected) < TOLERANCE[torch.bfloat16]
    y.float().sum().backward()
    assert up.weight.grad.dtype == torch.float32 and torch.isfinite(up.weight.grad).all()
    with pytest.raises(TypeError, match="does not match"):  # outside autocast the dtypes must agree
        up(x)


@pytest.mark.parametrize(
    "memory_format, rank",
    [(torch.channels_last_3d, 5), (torch.channels_last, 4), (torch.contiguous_format, 5)],
    ids=["channels_last_3d", "channels_last", "contiguous"],
)
def test_kept_weight_strides_are_torch_empty_strides(memory_format, rank):
    """The modules keep weights in exactly the strides torch.empty gives (those of the gradients the ops return),
    size-0 and size-1 dims included, computed without torch so that torch.compile traces it silently."""
    from tconv3d.nn.modules import format_strides

    for shape in itertools.product((0, 1, 2, 3), repeat=rank):
        expected = torch.empty(shape, device="meta", memory_format=memory_format).stride()
        assert format_strides(shape, memory_format) == expected, shape


def test_a_warm_training_step_takes_no_data_from_the_host(device, monkeypatch):
    """What a CUDA-graph capture refuses (test_gpu.py's capture of this model found it on the hardware): once its
    kernels and configs are chosen, a converted model's training step makes no tensor from host data
    (torch.tensor(...), or a Python number written into a tensor: on a GPU a copy from pageable host memory) and
    reads no tensor back to the host (.item(), .tolist(), .cpu(), .numpy(), a tensor's truth or number value: on
    a GPU a synchronisation); tables made on the first call are cached."""
    from helpers import TinyUNet

    seen = []
    setitem, tensor = torch.Tensor.__setitem__, torch.tensor

    def recording_setitem(self, index, value):
        if not isinstance(value, torch.Tensor):
            seen.append(f"a number written into a {tuple(self.shape)} tensor")
        return setitem(self, index, value)

    def recording_tensor(*args, **kwargs):
        seen.append("torch.tensor")
        return tensor(*args, **kwargs)

    def reading(name):
        method = getattr(torch.Tensor, name)

        def recording(self, *args, **kwargs):
            seen.append(f"Tensor.{name}")
            return method(self, *args, **kwargs)

        return recording

    torch.manual_seed(0)
    norms = nn.InstanceNorm3d(3, affine=True), nn.BatchNorm3d(3, momentum=None)  # a cumulative average's count
    model = tconv3d.nn.convert(torch.nn.Sequential(TinyUNet(channels=3, width=8), *norms)).to(device)
    x = torch.randn(1, 3, 4, 6, 6, device=device).contiguous(memory_format=torch.channels_last_3d)

    def step():
        y = model(x)
        return torch.autograd.grad(y.square().mean(), list(model.parameters()))

    step()  # first use: kernels compiled (here: interpreted), configs chosen, tables cached
    monkeypatch.setattr(torch.Tensor, "__setitem__", recording_setitem)
    monkeypatch.setattr(torch, "tensor", recording_tensor)
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, reading(name))
    step()
    monkeypatch.undo()
    assert not seen, seen


def _frames_of(conv_args, x, pad):
    """F.pad(x, pad) then conv2d on the frames as a batch, the (B, C, T, H, W) result: diffusers' resamplers."""
    b, t = x.shape[0], x.shape[2]
    frames = F.pad(x, pad).permute(0, 2, 1, 3, 4)
    y = F.conv2d(frames.reshape(b * t, *frames.shape[2:]), *conv_args)
    return y.reshape(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize("upsampled", [False, True], ids=["padded", "upsampled"])
def test_a_hooked_frame_conv_runs_on_tconv3d_inside_its_call(upsampled, device):
    """A resampler's FrameConv2d whose call runs hooks (here a forward replaced on the instance that makes the
    weight for the call from a float16 copy, as diffusers' layerwise casting does from float8) is run through its
    call: frame_conv and upsampled_frame_conv (the sub-pixel form) inside it, on tconv3d, with the weight the hook
    made; the same values as the unhooked conv of that weight. Outside the call the weight is float16, which the
    frames (float32) cannot run with."""
    from tconv3d.nn.hooks import received
    from tconv3d.nn.video_vaes import FrameConv2d, frame_conv, upsampled_frame_conv

    torch.manual_seed(0)
    conv = nn.Conv2d(5, 6, 3, padding=1).to(device)
    conv.__class__ = FrameConv2d
    plain = copy.deepcopy(conv)
    with torch.no_grad():
        plain.weight.copy_(plain.weight.half().float())
    conv.weight.data = conv.weight.data.half()
    stock_forward, calls = conv.forward, []

    def cast_for_the_call(*args, **kwargs):
        calls.append(kwargs.get("frames"))
        conv.weight.data = conv.weight.data.float()
        try:
            return stock_forward(*args, **kwargs)
        finally:
            conv.weight.data = conv.weight.data.half()

    conv.forward = cast_for_the_call
    x = torch.randn(2, 5, 3, 7, 9, device=device).contiguous(memory_format=CL)
    run = (
        (lambda c: upsampled_frame_conv(c, x, 2, first_apart=True))
        if upsampled
        else (lambda c: frame_conv(c, x, (0, 1, 0, 1)))
    )
    with torch.no_grad(), OpNames() as ops:
        out = run(conv)
    assert len(calls) == 1 and received(calls[0])[0] == ("upsampled" if upsampled else "pad")
    assert conv.weight.dtype == torch.float16
    assert any(name.startswith("tconv3d.conv") for name in ops.names), ops.names
    with torch.no_grad():
        assert torch.equal(out, run(plain))


@pytest.mark.parametrize(
    "stride, padding, pad, dtype",
    [(1, 1, (0, 0, 0, 0), torch.float32), (2, 0, (0, 1, 0, 1), torch.float32), (2, 1, (1, 0, 2, 0), torch.float32),
     (2, 0, (0, 1, 0, 1), torch.float64)],
    ids=["upsampler", "downsampler", "uneven", "float64_as_stock"],
)  # fmt: skip
def test_frame_conv_is_the_conv2d_of_each_frame(device, stride, padding, pad, dtype):
    """video_vaes.frame_conv, what Wan's and CogVideoX's resamplers run (F.pad, then an nn.Conv2d on the frames as a
    batch): one tconv3d conv over the channels_last_3d video, the pad inside. Values and the gradients of input,
    weight and bias as F.pad + conv2d in float64; the result and input gradient channels_last_3d, the weight's in
    the Conv2d's channels_last. float64 (tconv3d's kernels do not run it) takes diffusers' path."""
    from tconv3d.nn.video_vaes import frame_conv, frame_conv_reason

    conv = nn.Conv2d(5, 6, 3, stride=stride, padding=padding).to(device, dtype)
    tconv3d.nn.modules.keep_memory_format(conv.weight, torch.channels_last)
    x = torch.randn(2, 5, 3, 7, 9, device=device, dtype=dtype).contiguous(memory_format=CL).requires_grad_()
    assert (frame_conv_reason(conv, x) is None) == (dtype != torch.float64)
    with OpNames() as ops:
        out = frame_conv(conv, x, pad)
    if dtype != torch.float64:  # the weight's view and the op: no pad, no copy
        assert ops.names == ["aten.unsqueeze.default", "tconv3d.conv3d.default"]
    else:
        assert "tconv3d.conv3d.default" not in ops.names and "aten.constant_pad_nd.default" in ops.names
    grad = torch.randn_like(out)
    out.backward(grad)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    expected = _frames_of((w64, b64, stride, padding), x64, pad)
    expected.backward(grad.double())
    # diffusers' path keeps torch's layouts: CUDA's float64 conv2d answers a channels_last input NCHW (H200 run 4)
    layouts = dtype != torch.float64 or device == "cpu"
    assert out.shape == expected.shape and (out.is_contiguous(memory_format=CL) or not layouts)
    assert rel_l2(out, expected) < TOLERANCE[torch.float32]
    assert x.grad.is_contiguous(memory_format=CL) or not layouts
    assert rel_l2(x.grad, x64.grad) < TOLERANCE[torch.float32]
    assert conv.weight.grad.is_contiguous(memory_format=torch.channels_last) or not layouts
    assert rel_l2(conv.weight.grad, w64.grad) < TOLERANCE[torch.float32]
    assert rel_l2(conv.bias.grad, b64.grad) < TOLERANCE[torch.float32]


# Grouped convs of one input channel a group and a channel multiplier, one frame, strided onto one output column:
# (C_in, C_out, groups, input D, H, W, kernel, stride, padding, padding_mode). The last is tests/fuzz_args.py's seed
# 1104655 (op.conv3d, bf16: 3e22 from float64).
ONE_OUTPUT_COLUMN = [
    (2, 4, 2, (1, 6, 3), (1, 3, 3), (1, 1, 2), (0, 0, 0), "zeros"),
    (4, 8, 4, (1, 4, 4), (1, 1, 3), (2, 1, 2), (0, 0, 0), "zeros"),
    (3, 9, 3, (1, 4, 4), (1, 3, 3), (1, 1, 2), (0, 1, 0), "zeros"),
    (2, 4, 2, (1, 4, 3), (1, 3, 3), (1, 1, 2), (0, 1, 0), "replicate"),
]


@pytest.mark.parametrize("case", ONE_OUTPUT_COLUMN, ids=lambda c: f"{c[0]}to{c[1]}_g{c[2]}_{c[7]}")
def test_grouped_bf16_convs_strided_onto_one_output_column(case, monkeypatch):
    """torch's CPU convolutions (2.13, oneDNN, bf16) answer garbage for these (a relative error ~1, values up to
    1e37, all three directions; docs/upstream.md), found by tests/fuzz_args.py. Where an output dimension is one
    voxel, aten's path convolves the extent it reads at stride 1: the same sums."""
    monkeypatch.setattr(tconv3d.settings, "CPU_BACKEND", "aten")
    c_in, c_out, groups, size, kernel, stride, padding, mode = case
    torch.manual_seed(0)
    for _ in range(3):  # (garbage from memory past the tensors: a wrong answer on every draw, of any size)
        x = torch.randn(2, c_in, *size).to(torch.bfloat16).contiguous(memory_format=CL).requires_grad_()
        w = torch.randn(c_out, c_in // groups, *kernel).to(torch.bfloat16).contiguous(memory_format=CL)
        w.requires_grad_()
        y = tconv3d.conv3d(x, w, None, stride, padding, 1, groups, padding_mode=mode)
        x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
        pads = [p for p in reversed(padding) for _ in range(2)]
        padded = F.pad(x64, pads, mode="constant" if mode == "zeros" else mode)
        expected = F.conv3d(padded, w64, None, stride, 0, 1, groups)
        assert rel_l2(y, expected) < TOLERANCE[torch.bfloat16]
        g = torch.randn_like(expected)
        grads = torch.autograd.grad(y, (x, w), g.to(y.dtype))
        for got, want in zip(grads, torch.autograd.grad(expected, (x64, w64), g), strict=True):
            assert rel_l2(got, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("padding, stride, dilation", [(1, 2, 2), (3, 2, 2), (2, 3, 3)])
def test_bf16_convs_of_a_dilated_unit_kernel_along_w(padding, stride, dilation, monkeypatch):
    """torch's CPU conv3d (2.13 and 2.14, oneDNN, bf16) crashes the process (a segmentation fault) for a
    channels_last_3d input one voxel wide, its kernel of 1 along W dilated (docs/upstream.md; found by
    tests/fuzz_args.py, seed 3211839). Along a kernel of 1 the dilation changes nothing computed: aten's path hands
    torch 1 there. Forward and both gradients against float64."""
    monkeypatch.setattr(tconv3d.settings, "CPU_BACKEND", "aten")
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3, 3, 1).to(torch.bfloat16).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(2, 3, 1, 3, 1).to(torch.bfloat16).contiguous(memory_format=CL).requires_grad_()
    y = tconv3d.conv3d(x, w, None, (1, 1, stride), (0, 1, padding), (1, 1, dilation))
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    expected = F.conv3d(x64, w64, None, (1, 1, stride), (0, 1, padding), (1, 1, dilation))
    assert y.shape == expected.shape and rel_l2(y, expected) < TOLERANCE[torch.bfloat16]
    g = torch.randn_like(expected)
    grads = torch.autograd.grad(y, (x, w), g.to(y.dtype))
    for got, want in zip(grads, torch.autograd.grad(expected, (x64, w64), g), strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("path", ["kernels", "aten"])
def test_one_channel_layers_with_a_unit_channel_stride(path, device, monkeypatch):
    """A weight of one input channel kept channels_last_3d has a channel stride of 1 (any stride fits a size-1
    dimension), as has a one-channel activation tconv3d answers. torch's CPU convolutions (2.13) answer garbage for
    such a tensor where W is strided by 2 onto one output column (a relative error ~1, values up to 1e33: found by
    tests/fuzz_args.py, seed 311315, a CausalConv3d); aten's path hands them a contiguous tensor's strides."""
    if path == "aten":
        monkeypatch.setattr(tconv3d.settings, "CPU_BACKEND", "aten")
        device = "cpu"
    torch.manual_seed(0)
    conv = tconv3d.nn.CausalConv3d(1, 3, (1, 3, 3), stride=(1, 1, 2), dilation=(1, 2, 1)).to(device)
    assert conv.weight.stride()[1] == 1  # the case: a weight of one input channel, channels_last_3d
    x = torch.randn(2, 1, 4, 8, 2, device=device)
    x = x.as_strided(x.shape, (64, 1, 16, 2, 1)).requires_grad_()  # one channel, channel stride 1 too
    y = conv(x)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, conv.weight, conv.bias))
    padded = F.pad(x64, (1, 1, 2, 2, 0, 0), mode="replicate")
    expected = F.conv3d(padded, w64, b64, (1, 1, 2), 0, (1, 2, 1))
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]
    g = torch.randn_like(expected)
    grads = torch.autograd.grad(y, (x, conv.weight), g.float())
    for got, want in zip(grads, torch.autograd.grad(expected, (x64, w64), g), strict=True):
        assert rel_l2(got, want) < TOLERANCE[torch.float32]
