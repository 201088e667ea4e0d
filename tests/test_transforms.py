"""Forward-mode AD (torch.func.jvp and jacfwd, torch.autograd.forward_ad's dual tensors) and torch.func's other
transforms (grad, vmap of grad, jacrev) through tconv3d's ops, against float64 torch. The kernels compute primals
only: each op's tangent is its own rule in ops.py (the convolution and its two gradient ops by the ops again, the
norms in torch ops). Without the rules a tangent through a convolution came out zero, silently, and torch.func.grad
raised inside autograd.Function."""

import collections
import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from test_norms import rms_reference
from torch import nn
from torch.func import functional_call, grad, jacrev, jvp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

import tconv3d
from tconv3d.ops import call_group_norm, call_rms_norm, varying
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
TOL = TOLERANCE[torch.float32]
APIS = ["func", "forward_ad"]


def randn(*shape, device, scale=1.0):
    t = torch.randn(shape, device=device) * scale
    return t.contiguous(memory_format=CL) if t.dim() == 5 else t


def jvp_of(f, primals, tangents, api="func"):
    """f's output and tangent at `primals` along `tangents` (None: that input is held constant), by torch.func.jvp
    or by forward_ad's dual tensors."""
    moving = [i for i, t in enumerate(tangents) if t is not None]
    along = varying(f, primals, moving)
    if api == "func":
        return jvp(along, tuple(primals[i] for i in moving), tuple(tangents[i] for i in moving))
    with fwAD.dual_level():
        out = along(*(fwAD.make_dual(primals[i], tangents[i]) for i in moving))
        primal, tangent = fwAD.unpack_dual(out)
        assert tangent is not None, "the output lost its tangent"
        return primal.clone(), tangent.clone()


def assert_jvp_matches(ours, reference, primals, tangents, api):
    """ours' output and tangent against reference's in float64 on the upcast primals and tangents."""
    out, tangent = jvp_of(ours, primals, tangents, api)
    up = lambda ts: [t.double() if isinstance(t, torch.Tensor) else t for t in ts]  # noqa: E731
    expected_out, expected_tangent = jvp_of(reference, up(primals), up(tangents))
    assert rel_l2(out, expected_out) < TOL
    assert rel_l2(tangent, expected_tangent) < TOL, "tangent"
    assert tangent.is_contiguous(memory_format=CL)


def pick(moving: str, names: tuple, tensors: list, device) -> list:
    """Random tangents for the inputs `moving` names ("all": every one), None for the others."""
    return [
        randn(*t.shape, device=device) if moving in ("all", name) else None
        for name, t in zip(names, tensors, strict=True)
    ]


# (d_front, d_back, h_top, h_bottom, w_left, w_right) and the order F.pad takes them in
PADDING = (1, 0, 1, 1, 0, 2)
F_PAD = (0, 2, 1, 1, 1, 0)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("moving", ["input", "weight", "bias", "all"])
def test_conv3d_tangent_matches_float64(moving, api, device):
    """Tangents of the input, the weight, the bias (alone: broadcast, no convolution), or all three, through a
    strided, replicate-padded convolution with asymmetric padding."""
    primals = [randn(1, 3, 4, 5, 6, device=device), randn(4, 3, 3, 2, 3, device=device, scale=0.3)]
    primals.append(randn(4, device=device))
    tangents = pick(moving, ("input", "weight", "bias"), primals, device)

    def ours(x, w, b):
        return tconv3d.conv3d(x, w, b, (1, 2, 1), PADDING, padding_mode="replicate")

    def reference(x, w, b):
        return F.conv3d(F.pad(x, F_PAD, mode="replicate"), w, b, (1, 2, 1))

    assert_jvp_matches(ours, reference, primals, tangents, api)


def test_grouped_dilated_conv3d_tangent_matches_float64(device):
    primals = [randn(1, 4, 5, 4, 6, device=device), randn(6, 2, 2, 3, 2, device=device, scale=0.3)]
    tangents = [randn(*t.shape, device=device) for t in primals]

    def ours(x, w):
        return tconv3d.conv3d(x, w, None, 1, 1, dilation=(2, 1, 2), groups=2)

    def reference(x, w):
        return F.conv3d(x, w, None, 1, 1, dilation=(2, 1, 2), groups=2)

    assert_jvp_matches(ours, reference, primals, tangents, "func")


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("moving", ["second", "all"])
@pytest.mark.parametrize("source", ["frames_before", "channels_after"])
def test_second_source_tangent_matches_float64(source, moving, api, device):
    """A second source read in place (a video VAE's cached frames, a UNet's skip connection): its tangent alone (the
    input's zeros) or with the input's and the weight's."""
    x = randn(1, 3, 3, 4, 5, device=device)
    if source == "frames_before":
        second, w = randn(1, 3, 2, 4, 5, device=device), randn(4, 3, 3, 3, 3, device=device, scale=0.2)
    else:
        second, w = randn(1, 2, 3, 4, 5, device=device), randn(4, 5, 3, 3, 3, device=device, scale=0.2)
    primals = [x, second, w]
    tangents = pick(moving, ("input", "second", "weight"), primals, device)

    def ours(x, second, w):
        return tconv3d.conv3d(x, w, None, 1, (2, 0, 1, 1, 1, 1), **{source: second})

    def reference(x, second, w):
        whole = torch.cat([second, x], dim=2) if source == "frames_before" else torch.cat([x, second], dim=1)
        return F.conv3d(F.pad(whole, (1, 1, 1, 1, 2, 0)), w)

    assert_jvp_matches(ours, reference, primals, tangents, api)


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("moving", ["weight", "after", "bias", "all"])
def test_conv_transpose3d_tangent_matches_float64(moving, api, device):
    """conv_transpose3d is the input gradient op: its tangents in grad_output (with its channels_after, a UNet's skip
    connection), in the weight and in the bias (the op's, broadcast where it moves alone)."""
    primals = [randn(1, 3, 3, 2, 3, device=device), randn(1, 2, 3, 2, 3, device=device)]
    primals += [randn(5, 4, 2, 3, 2, device=device, scale=0.3), randn(4, device=device)]
    tangents = pick(moving, ("input", "after", "weight", "bias"), primals, device)

    def ours(x, after, w, b):
        return tconv3d.conv_transpose3d(x, w, b, stride=(1, 2, 2), padding=(0, 1, 0), channels_after=after)

    def reference(x, after, w, b):
        return F.conv_transpose3d(torch.cat([x, after], dim=1), w, b, stride=(1, 2, 2), padding=(0, 1, 0))

    assert_jvp_matches(ours, reference, primals, tangents, api)


@pytest.mark.parametrize("source", ["frames_before", "channels_after"])
def test_hessian_vector_products_match_float64(source, device):
    """Forward over reverse (jvp of grad: Hessian-vector products, as sCM's and MeanFlow's training takes them)
    through the backward's two gradient ops, with tangents in every argument of each: grad_output's (it depends on
    the input and the weight), the weight's or input's, and the second source's."""
    x, second = randn(1, 3, 3, 4, 5, device=device), randn(1, 3, 2, 4, 5, device=device)
    if source == "channels_after":
        second = randn(1, 2, 3, 4, 5, device=device)
    w = randn(4, 3 + second.shape[1] * (source == "channels_after"), 3, 3, 3, device=device, scale=0.2)
    primals = (x, second, w)
    tangents = tuple(randn(*t.shape, device=device) for t in primals)
    weights = lambda y: torch.linspace(-1, 2, y.numel(), dtype=y.dtype, device=y.device).view(y.shape)  # noqa: E731

    def loss(conv):
        def of(x, second, w):
            y = conv(x, second, w)
            return (y.square() * weights(y)).sum()

        return of

    def ours(x, second, w):
        return tconv3d.conv3d(x, w, None, (1, 1, 2), (2, 0, 1, 1, 1, 1), **{source: second})

    def reference(x, second, w):
        whole = torch.cat([second, x], dim=2) if source == "frames_before" else torch.cat([x, second], dim=1)
        return F.conv3d(F.pad(whole, (1, 1, 1, 1, 2, 0)), w, None, (1, 1, 2))

    hvp = jvp(grad(loss(ours), argnums=(0, 1, 2)), primals, tangents)[1]
    up = lambda ts: tuple(t.double() for t in ts)  # noqa: E731
    expected = jvp(grad(loss(reference), argnums=(0, 1, 2)), up(primals), up(tangents))[1]
    for a, e in zip(hvp, expected, strict=True):
        assert rel_l2(a, e) < TOL


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("moving", ["weight", "all"])
def test_group_norm_tangents_match_float64(moving, api, device):
    """GroupNorm + SiLU of a concatenation read in place (a diffusion UNet's skip connection): the output's tangent,
    and the op's mean and rstd tangents, with an offset mean."""
    primals = [randn(2, 4, 2, 3, 3, device=device) * 2 + 3, randn(2, 2, 2, 3, 3, device=device)]
    primals += [randn(6, device=device), randn(6, device=device)]
    tangents = pick(moving, ("input", "after", "weight", "bias"), primals, device)

    norm = tconv3d.nn.GroupNorm(3, 6, activation="silu").to(device)

    def ours(x, after, w, b):
        return functional_call(norm, {"weight": w, "bias": b}, (x,), {"channels_after": after})

    def reference(x, after, w, b):
        return F.silu(F.group_norm(torch.cat([x, after], dim=1).contiguous(), 3, w, b, 1e-5))  # torch: NCDHW

    assert_jvp_matches(ours, reference, primals, tangents, api)

    def statistics(x, after, w, b):
        return call_group_norm(x, w, b, 3, 1e-5, "silu", after)[1:]

    def reference_statistics(x, after, w, b):
        var, mean = torch.var_mean(torch.cat([x, after], dim=1).reshape(2, 3, -1), dim=2, unbiased=False)
        return mean, torch.rsqrt(var + 1e-5)

    tangents = [randn(*t.shape, device=device) for t in primals]
    ours_t = jvp(statistics, tuple(primals), tuple(tangents))[1]
    up = lambda ts: tuple(t.double() for t in ts)  # noqa: E731
    expected = jvp(reference_statistics, up(primals), up(tangents))[1]
    for a, e in zip(ours_t, expected, strict=True):
        assert rel_l2(a, e) < TOL


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("clamp", [False, True], ids=["rms", "clamp"])
def test_rms_norm_tangent_matches_float64(clamp, api, device):
    """The RMS norm + SiLU (LTX-2's, or Wan's clamped one), one voxel all zeros (clamped: no tangent through its
    divisor)."""
    x = randn(1, 5, 2, 3, 4, device=device) * 2 + 1
    x[0, :, 0, 0, 0] = 0
    primals = [x.contiguous(memory_format=CL), randn(5, device=device), randn(5, device=device)]
    tangents = [randn(*t.shape, device=device) for t in primals]
    eps = 1e-12 if clamp else 1e-6

    def ours(x, w, b):
        return call_rms_norm(x, w, b, eps, "silu", clamp)

    def reference(x, w, b):
        return rms_reference(x, w, b, eps, "silu", clamp)

    assert_jvp_matches(ours, reference, primals, tangents, api)


def test_every_op_under_compiled_jvp_and_grad_matches_float64(device, monkeypatch):
    """Each op with its second source and a padding mode (a causal reflect-padded convolution of cached frames,
    GroupNorm + SiLU of a concatenation, a transposed convolution of a skip connection, the clamped RMS norm) in one
    function, its jvp and its gradient under torch.compile(fullgraph=True): traced as the ops' torch ops. (Not
    replicate: torch 2.13's compiled backward of F.pad(mode="replicate") fails on CPU for a channels_last_3d input,
    stock's too, pytorch/pytorch#179442.) Dynamo traces tconv3d's Python here, and says nothing of it: torch 2.15's
    warns at each functools.lru_cache it traces into (geometry.split_padding_mode's was one; earlier torches say
    nothing, so the check bites from 2.15 on). Its warn_once memory is emptied first, so that an earlier test in the
    process cannot have spent the warning."""
    x, frames = randn(1, 3, 3, 4, 4, device=device), randn(1, 3, 2, 4, 4, device=device)
    skip = randn(1, 2, 5, 4, 4, device=device)  # the convolution's 5 frames: 2 cached, 3 new
    w1, w2 = randn(4, 3, 3, 3, 3, device=device, scale=0.3), randn(6, 3, 1, 2, 2, device=device, scale=0.3)
    gamma, beta = randn(6, device=device) + 1, randn(6, device=device)
    primals = (x, frames, skip, w1, w2, gamma, beta)
    tangents = tuple(randn(*t.shape, device=device) for t in primals)

    def ours(x, frames, skip, w1, w2, gamma, beta):
        y = tconv3d.conv3d(x, w1, None, 1, (2, 0, 1, 1, 1, 1), padding_mode="reflect", frames_before=frames)
        y = call_group_norm(y, gamma, beta, 3, 1e-5, "silu", skip)[0]
        y = tconv3d.conv_transpose3d(y[:, :4], w2, None, stride=(1, 2, 2), channels_after=y[:, 4:])
        return call_rms_norm(y, None, None, 1e-3, "none", True)

    def reference(x, frames, skip, w1, w2, gamma, beta):
        y = F.conv3d(F.pad(torch.cat([frames, x], dim=2), (1, 1, 1, 1, 2, 0), mode="reflect"), w1)
        y = F.silu(F.group_norm(torch.cat([y, skip], dim=1), 3, gamma, beta, 1e-5))
        y = F.conv_transpose3d(y, w2, None, stride=(1, 2, 2))
        return rms_reference(y, None, None, 1e-3, "none", True)

    def both(f):
        def of(*primals_and_tangents):
            primals, tangents = primals_and_tangents[:7], primals_and_tangents[7:]
            tangent = jvp(f, primals, tangents)[1]
            grads = grad(lambda *p: (f(*p) * tangent.detach()).sum(), argnums=tuple(range(7)))(*primals)
            return tangent, *grads

        return of

    # Dynamo and AOTAutograd (what this tests); Inductor's code for aten's ops, torch's own, compiles in the model
    # cases below (6x the time here).
    if hasattr(torch._dynamo.utils, "warn_once_cache"):
        monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours_results = torch.compile(both(ours), fullgraph=True, backend="aot_eager")(*primals, *tangents)
    assert not [str(w.message) for w in caught if "lru_cache" in str(w.message)]
    expected = both(reference)(*(t.double() for t in primals + tangents))
    for a, e in zip(ours_results, expected, strict=True):
        assert rel_l2(a, e) < TOL


def _model(device):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv3d(8, 4, 3, stride=2, padding=1)
    ).to(device)


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("norm", ["group", "group_of_concatenation", "rms"])
def test_gradient_penalty_through_a_norm_matches_float64(norm, activation, device):
    """Double backward through a norm, as a discriminator's gradient penalty (R1) takes it: the norms' kernels have
    no differentiable backward, so a backward that is itself differentiated (create_graph=True) recomputes the
    norm's gradients in torch ops. Before, autograd warned and differentiated it as a constant: wrong gradients.
    Without an activation the group norm's backward keeps no bias (its gradients read none of it)."""
    x, skip = randn(1, 3, 3, 4, 4, device=device), randn(1, 2, 3, 4, 4, device=device)
    w1, b1 = randn(4, 3, 3, 3, 3, device=device, scale=0.3), randn(4, device=device)
    channels = 6 if norm == "group_of_concatenation" else 4
    gamma, beta = randn(channels, device=device) + 1, randn(channels, device=device)
    w2 = randn(2, channels, 3, 3, 3, device=device, scale=0.3)
    leaves = [x, skip, w1, b1, gamma, beta, w2]

    def ours(x, skip, w1, b1, gamma, beta, w2):
        y = tconv3d.conv3d(x, w1, b1, 1, 1)
        if norm == "rms":
            y = call_rms_norm(y, gamma, beta, 1e-6, activation)
        else:
            after = skip if norm == "group_of_concatenation" else None
            y = call_group_norm(y, gamma, beta, 2, 1e-5, activation, after)[0]
        return tconv3d.conv3d(y, w2, None, 1, 1)

    def reference(x, skip, w1, b1, gamma, beta, w2):
        y = F.conv3d(x, w1, b1, 1, 1)
        if norm == "rms":
            y = rms_reference(y, gamma, beta, 1e-6, activation, False)
        else:
            y = torch.cat([y, skip], dim=1) if norm == "group_of_concatenation" else y
            y = F.group_norm(y, 2, gamma, beta, 1e-5)
            y = F.silu(y) if activation == "silu" else y
        return F.conv3d(y, w2, None, 1, 1)

    def penalty_gradients(f, tensors):
        tensors = [t.detach().requires_grad_() for t in tensors]
        out = f(*tensors)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view(out.shape)  # H200 run 11
        input_grad = torch.autograd.grad((out * weights).sum(), tensors[0], create_graph=True)[0]
        used = tensors if norm == "group_of_concatenation" else [t for i, t in enumerate(tensors) if i != 1]
        # without an activation the input's gradient does not depend on the bias (or on b1, which the norm removes)
        grads = torch.autograd.grad(input_grad.square().sum(), used, allow_unused=True)
        return [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, used, strict=True)]

    expected = penalty_gradients(reference, [t.double() for t in leaves])
    for ours_grad, want in zip(penalty_gradients(ours, leaves), expected, strict=True):
        assert want.abs().max() < 1e-9 if ours_grad.abs().max() == 0 else rel_l2(ours_grad, want) < TOL


TRANSFORMS = ["jvp", "jacfwd_bias", "grad", "per_sample_grad", "jacrev", "hvp", "grad_of_grad"]
# The transforms training recipes compile, under torch.compile(fullgraph=True): a jvp (consistency models,
# MeanFlow), per-sample gradients (differential privacy), a Hessian-vector product.
COMPILED = ["compiled_jvp", "compiled_per_sample_grad", "compiled_hvp"]


@pytest.mark.parametrize("transform", TRANSFORMS + COMPILED)
def test_transforms_of_a_converted_model_match_stock(transform, device):
    """torch.func over a converted model (convolutions and the norm on tconv3d) and over stock in float64, through
    functional_call: a jvp along the input and the parameters, jacfwd in one bias, grad of a loss in the parameters,
    per-sample gradients (vmap of grad over the batch), jacrev in the last bias, and second order through the
    norm's backward: Hessian-vector products (jvp of grad) and the gradient of the squared gradient. A compiled case
    runs the converted model's transform under torch.compile(fullgraph=True), which traces tconv3d's ops as their
    torch ops (dynamo traces no autograd Function with a jvp): before, such a graph did not compile."""
    stock = _model(device)
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    reference = copy.deepcopy(stock).double()
    x = randn(2, 3, 4, 6, 6, device=device)
    params = {name: p.detach() for name, p in converted.named_parameters()}
    params64 = {name: p.detach().double() for name, p in reference.named_parameters()}
    t_params = {name: torch.randn_like(p) for name, p in params.items()}
    t_x = randn(*x.shape, device=device)
    compiled = transform.startswith("compiled_")

    def run(model, params, x):
        return functional_call(model, params, (x,))

    def loss(model):
        return lambda p, x: run(model, p, x).square().mean()

    def transformed(model):
        """The transform under test over `model`: a function of (params, x, the parameters' and x's tangents)."""
        kind = transform.removeprefix("compiled_")
        if kind == "jvp":
            return lambda p, x, t_p, t_x: jvp(lambda p, x: run(model, p, x), (p, x), (t_p, t_x))[1]
        if kind in ("jacfwd_bias", "jacrev"):
            name = "0.bias" if kind == "jacfwd_bias" else "3.bias"
            jac = torch.func.jacfwd if kind == "jacfwd_bias" else jacrev
            return lambda p, x, *_: jac(lambda b: run(model, {**p, name: b}, x).sum(dim=(0, 2, 3, 4)))(p[name])
        if kind == "hvp":  # forward over reverse, through the norm's backward too
            return lambda p, x, t_p, _: jvp(lambda p: grad(loss(model))(p, x), (p,), (t_p,))[1]
        if kind == "grad_of_grad":
            squared_gradient = lambda p, x: sum(g.square().sum() for g in grad(loss(model))(p, x).values())  # noqa: E731
            return lambda p, x, *_: grad(squared_gradient)(p, x)
        if kind == "grad":
            return lambda p, x, *_: grad(loss(model))(p, x)
        per_sample = vmap(grad(lambda p, x: loss(model)(p, x[None])), in_dims=(None, 0))
        return lambda p, x, *_: per_sample(p, x)

    ours = transformed(converted)
    ours = (torch.compile(ours, fullgraph=True) if compiled else ours)(params, x, t_params, t_x)
    up = {name: t.double() for name, t in t_params.items()}
    expected = transformed(reference)(params64, x.double(), up, t_x.double())
    if isinstance(expected, dict):
        ours, expected = [ours[name] for name in params], [expected[name] for name in params]
    else:
        ours, expected = [ours], [expected]
    for a, e in zip(ours, expected, strict=True):
        assert rel_l2(a, e) < TOL


class _CountedOps(TorchDispatchMode):
    """The tconv3d ops called below every transform, by name."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "tconv3d":
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def test_vmap_runs_an_op_once_for_the_whole_batch(device):
    """vmap folds the vmapped dimension into the ops' batch where the weight is shared: per-sample gradients (vmap
    of grad) run each forward, input gradient and norm once whatever the batch (the weight gradient, a sum over the
    batch, once a sample), with the in-place ops models run on their outputs (conv_transpose3d's bias, an in-place
    SiLU after a norm); per-sample weights (an ensemble's) run once a sample. Before, every op ran once a sample
    (the dispatcher's fallback, with a performance warning)."""
    torch.manual_seed(0)
    stock = nn.Sequential(
        nn.Conv3d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.SiLU(inplace=True),
        nn.Conv3d(8, 4, 3, stride=2, padding=1), nn.ConvTranspose3d(4, 2, 2, stride=2),
    ).to(device)  # fmt: skip
    converted = tconv3d.nn.convert(copy.deepcopy(stock))
    reference = copy.deepcopy(stock).double()

    def per_sample(model, x):
        params = {name: p.detach() for name, p in model.named_parameters()}
        loss = lambda p, x: functional_call(model, p, (x[None],)).square().mean()  # noqa: E731
        return vmap(grad(loss), in_dims=(None, 0))(params, x)

    counts = []
    for batch in (2, 3):
        x = randn(batch, 3, 4, 6, 6, device=device)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*performance drop")
            with _CountedOps() as counted:
                ours = per_sample(converted, x)
        counts.append(counted.counts)
        expected = per_sample(reference, x.double())
        for name, want in expected.items():
            assert rel_l2(ours[name], want) < TOL, name
    fixed = {name: n for name, n in counts[0].items() if name != "conv3d_weight_grad"}
    assert fixed == {"conv3d": 3, "conv3d_input_grad": 2, "group_norm": 1}
    assert {name: n for name, n in counts[1].items() if name != "conv3d_weight_grad"} == fixed
    assert (counts[0]["conv3d_weight_grad"], counts[1]["conv3d_weight_grad"]) == (6, 9)

    x = randn(2, 3, 4, 5, 5, device=device)
    weights = randn(3, 4, 3, 3, 3, 3, device=device, scale=0.3)
    ensemble = vmap(lambda w: call_rms_norm(tconv3d.conv3d(x, w, None, 1, 1), None, None, 1e-6, "silu"))(weights)
    expected = vmap(lambda w: rms_reference(F.conv3d(x.double(), w, None, 1, 1), None, None, 1e-6, "silu", False))(
        weights.double()
    )
    assert rel_l2(ensemble, expected) < TOL


def test_an_op_called_directly_under_a_transform_names_the_way(device):
    x, w = randn(1, 2, 3, 3, 3, device=device), randn(2, 2, 1, 1, 1, device=device)
    with pytest.raises(RuntimeError, match=r"called directly under a torch\.func transform.*tconv3d\.functional"):
        grad(lambda w: torch.ops.tconv3d.conv3d(x, w, None, [1] * 3, [0] * 3, [1] * 3, 1).sum())(w)
