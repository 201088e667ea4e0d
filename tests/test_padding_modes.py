"""padding_mode inside the kernels: F.pad(input, padding, mode) then an unpadded convolution, with no padded copy
of the input; gradients of input, weight and bias; errors; nn.Conv3d(padding_mode=...) and CausalConv3d."""

import pytest
import torch
import torch.nn.functional as F
from helpers import OpNames, dtype_id, leaf_copy

import tconv3d
from tconv3d.geometry import PADDING_MODES
from tconv3d.testing import TOLERANCE, rel_l2

CL = torch.channels_last_3d
MODES = [m for m in PADDING_MODES if m != "zeros"]

# (name, input shape, weight shape, stride, 6-value padding, dilation)
GEOMETRIES = [
    ("symmetric_1", (2, 3, 4, 5, 6), (5, 3, 3, 3, 3), 1, (1, 1, 1, 1, 1, 1), 1),
    ("asymmetric_2_stride2", (1, 20, 5, 6, 7), (6, 20, 3, 3, 3), 2, (2, 0, 1, 2, 2, 1), 1),
    ("causal_dilation2", (1, 4, 6, 5, 5), (17, 4, 3, 3, 3), 1, (4, 0, 2, 2, 2, 2), (2, 2, 2)),
    ("pad_dim_minus_1", (1, 5, 3, 3, 4), (4, 5, 3, 2, 3), (1, 2, 1), (2, 2, 2, 1, 3, 3), 1),
    ("depth_1", (2, 18, 1, 6, 5), (3, 18, 1, 3, 3), 1, (0, 0, 1, 1, 2, 1), 1),
]
ONE_FRAME = ("one_frame", (1, 3, 1, 4, 5), (4, 3, 3, 3, 3), 1, (1, 1, 1, 1, 1, 1), 1)


def reference(x, w, b, stride, padding, dilation, mode):
    df, db, ht, hb, wl, wr = padding
    return F.conv3d(F.pad(x, (wl, wr, ht, hb, df, db), mode=mode), w, b, stride, 0, dilation)


def check_against_float64(geometry, mode, dtype, device):
    _name, x_shape, w_shape, stride, padding, dilation = geometry
    x = leaf_copy(torch.randn(x_shape, device=device).to(dtype).contiguous(memory_format=CL))
    w = leaf_copy((torch.randn(w_shape, device=device) / w_shape[1] ** 0.5).to(dtype).contiguous(memory_format=CL))
    b = leaf_copy(torch.randn(w_shape[0], device=device).to(dtype))
    x64, w64, b64 = (leaf_copy(t.double()) for t in (x, w, b))
    expected = reference(x64, w64, b64, stride, padding, dilation, mode)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    y = tconv3d.conv3d(x, w, b, stride, padding, dilation, padding_mode=mode)
    y.backward(grad_out.to(dtype))
    assert y.is_contiguous(memory_format=CL) and x.grad.is_contiguous(memory_format=CL)
    for name, ours, ref in (("output", y, expected), ("input", x.grad, x64.grad), ("weight", w.grad, w64.grad),
                            ("bias", b.grad, b64.grad)):  # fmt: skip
        assert ours.shape == ref.shape and ours.dtype == dtype, name
        assert rel_l2(ours, ref) < TOLERANCE[dtype], name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g[0])
@pytest.mark.parametrize("mode", MODES)
def test_padding_modes_match_float64(mode, geometry, dtype, device):
    if mode == "reflect" and geometry[0] == "depth_1":
        pytest.skip("reflect cannot pad a dimension of 1 (F.pad rejects it too): see test_out_of_range_padding")
    check_against_float64(geometry, mode, dtype, device)


@pytest.mark.parametrize("mode", ["replicate", "circular"])
def test_a_single_frame_padded_in_time(mode, device):
    """D = 1 padded by 1 on both sides: replicate repeats the frame, circular wraps onto it."""
    check_against_float64(ONE_FRAME, mode, torch.float32, device)


def test_padding_modes_with_the_gpu_heuristic_tiles(gpu_heuristic_tiles, device):
    for mode in MODES:
        check_against_float64(GEOMETRIES[1], mode, torch.float32, device)


@pytest.mark.parametrize(
    "mode, padding, size, message",
    [
        ("reflect", (3, 3, 1, 1, 1, 1), (3, 5, 5), "reflect padding must be smaller"),
        ("circular", (1, 1, 6, 0, 1, 1), (3, 5, 5), "circular padding must not exceed"),
        ("mirror", 1, (3, 5, 5), "padding_mode must be one of"),
    ],
)
def test_out_of_range_padding(mode, padding, size, message, device):
    x, w = torch.randn(1, 2, *size, device=device), torch.randn(3, 2, 3, 3, 3, device=device)
    with pytest.raises(ValueError, match=message):
        tconv3d.conv3d(x, w, padding=padding, padding_mode=mode)
    with pytest.raises(TypeError, match="padding_mode must be a str"):
        tconv3d.conv3d(x, w, padding=1, padding_mode=None)


@pytest.mark.parametrize("mode", PADDING_MODES)
def test_nn_conv3d_padding_mode_runs_fused(mode, device):
    torch.manual_seed(0)
    stock = torch.nn.Conv3d(4, 6, 3, padding=(1, 2, 1), padding_mode=mode).to(device)
    ours = tconv3d.nn.convert(torch.nn.Sequential(torch.nn.Conv3d(4, 6, 3, padding=(1, 2, 1), padding_mode=mode)))
    ours[0].load_state_dict(stock.state_dict())
    ours = ours.to(device)
    assert repr(ours[0]).endswith(repr(stock)[len("Conv3d") :])
    x = torch.randn(2, 4, 5, 6, 7, device=device).contiguous(memory_format=CL).requires_grad_()
    with OpNames() as seen:
        y = ours(x)
        y.sum().backward()
    assert not [name for name in seen.names if "pad" in name], seen.names
    expected = stock.double()(x.detach().double())
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]


def test_causal_conv3d_is_fused_and_loads_a_conv3d_checkpoint(device):
    torch.manual_seed(0)
    causal = tconv3d.nn.CausalConv3d(3, 8, (3, 3, 3), dilation=(2, 1, 1)).to(device)
    plain = torch.nn.Conv3d(3, 8, 3, dilation=(2, 1, 1))
    assert causal.state_dict().keys() == plain.state_dict().keys()
    causal.load_state_dict(plain.state_dict())
    assert causal.causal_padding == (4, 0, 1, 1, 1, 1) and "causal_padding" in repr(causal)
    x = torch.randn(1, 3, 5, 6, 7, device=device).contiguous(memory_format=CL).requires_grad_()
    with OpNames() as seen:
        y = causal(x)
        y.sum().backward()
    assert not [name for name in seen.names if "pad" in name], seen.names
    plain = plain.double().to(device)
    expected = plain(F.pad(x.detach().double(), (1, 1, 1, 1, 4, 0), mode="replicate"))
    assert y.shape == expected.shape == (1, 8, 5, 6, 7)  # every frame kept, none sees the future
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]
    with pytest.raises(ValueError, match="must be odd"):
        tconv3d.nn.CausalConv3d(3, 8, (3, 2, 3))


def test_opcheck_with_padding_modes(device):
    x = torch.randn(1, 3, 4, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(4, 3, 3, 3, 3, device=device).contiguous(memory_format=CL).requires_grad_()
    args = ([1, 2, 1], [2, 0, 1, 1, 2, 1], [1, 1, 1])
    for mode in MODES:
        torch.library.opcheck(torch.ops.tconv3d.conv3d.default, (x, w, None, *args, 1, mode))
        y = torch.ops.tconv3d.conv3d(x.detach(), w.detach(), None, *args, 1, mode)
        grad_out = torch.randn_like(y).requires_grad_()
        torch.library.opcheck(torch.ops.tconv3d.conv3d_input_grad.default, (grad_out, w, list(x.shape), *args, mode))
        torch.library.opcheck(torch.ops.tconv3d.conv3d_weight_grad.default, (grad_out, x, list(w.shape), *args, mode))


FOLDS = [  # (mode, input size, padding)
    ("replicate", (1, 1, 3), (0, 0, 60, 60, 0, 0)),
    ("circular", (3, 2, 2), (3, 2, 0, 0, 0, 0)),
    ("reflect", (2, 2, 9), (0, 0, 0, 0, 8, 8)),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("mode, size, padding", FOLDS, ids=lambda v: v if isinstance(v, str) else None)
def test_border_gradients_are_summed_then_rounded(mode, size, padding, dtype, device):
    """The input gradient's border fold (fold_padding: each border voxel's gradient added to the voxel its mode
    read) of a half-precision bordered gradient sums in float32 and rounds once: within one rounding (2^-8 bf16,
    2^-11 fp16) of float64's sum of the same values, F.pad's own backward. A running sum in the dtype rounded at
    every add (121 replicated rows of a one-voxel dimension: over 3x that) does not hold it."""
    from tconv3d.geometry import conv_geometry
    from tconv3d.kernels.tensors import fold_padding

    shape = (2, 8, *size)
    x = torch.randn(shape, dtype=torch.float64, device=device).contiguous(memory_format=CL).requires_grad_()
    df, db, ht, hb, wl, wr = padding
    bordered = F.pad(x, (wl, wr, ht, hb, df, db), mode=mode)
    grad = torch.randn(bordered.shape, device=device).to(dtype).contiguous(memory_format=CL)
    (exact,) = torch.autograd.grad(bordered, x, grad.double())
    geom = conv_geometry(shape, (4, 8, 1, 1, 1), 1, padding, 1, padding_mode=mode)
    folded = fold_padding(grad, geom)
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
    assert folded.dtype == dtype and folded.is_contiguous(memory_format=CL)
    assert rel_l2(folded, exact) <= unit


CANCELLING = [  # (mode, input size, kernel, padding): every output reads one input voxel through all its taps
    ("replicate", (1, 1, 1), (1, 1, 2), (0, 0, 0, 0, 1, 1)),
    ("replicate", (1, 1, 1), (2, 2, 2), (1, 0, 1, 0, 0, 1)),
    ("circular", (2, 1, 1), (1, 1, 3), (0, 0, 0, 0, 1, 1)),
]


@pytest.mark.parametrize("backend", ["kernels", "aten"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("mode, size, kernel, padding", CANCELLING, ids=lambda v: v if isinstance(v, str) else None)
def test_cancelling_border_gradients_are_rounded_once(mode, size, kernel, padding, dtype, backend, device, request):
    """A 16-bit input gradient whose border terms cancel: each output reads the same voxels through taps whose
    weights almost cancel (w and -(1 - 2^-5) w), so the gradient is some 2^-5 of the terms the fold adds. The
    kernels (and aten's path) write the bordered gradient in float32 (config.destination_dtype) and the fold rounds
    each sum once: bf16 0.0015-0.0019 from float64, fp16 0.0002. Rounded to 16 bits before the fold (as found by
    the fifty-third session's fuzz_args seeds 711173 and 663129), bf16 missed by 0.03-0.08 and fp16 by 0.005-0.011,
    past their bounds in every case here, on both paths."""
    if backend == "aten":
        if torch.device(device).type != "cpu":
            pytest.skip("aten's path runs for CPU tensors")
        request.getfixturevalue("aten_path")
    torch.manual_seed(5)
    c = 16
    half = torch.randn(c, c, *kernel, device=device) / (c * kernel[2]) ** 0.5
    taps = kernel[0] * kernel[1] * kernel[2]
    signs = torch.tensor([1.0 if t % 2 == 0 else -(1 - 2**-5) for t in range(taps)], device=device)
    w = (half.flatten(2)[..., :1] * signs).view(c, c, *kernel)  # one weight a pair of channels, taps alternating
    if taps % 2:  # an odd count: the last tap's sign makes the sum small too
        w[..., -1] *= 2**-5
    w = w.to(dtype).contiguous(memory_format=CL)
    x = torch.randn(2, c, *size, device=device).to(dtype).contiguous(memory_format=CL)
    y64 = reference(x.double(), w.double(), None, 1, padding, 1, mode)
    grad_out = torch.randn_like(y64).to(dtype).contiguous(memory_format=CL)
    geom_args = (list(x.shape), [1, 1, 1], list(padding), [1, 1, 1])
    ours = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, *geom_args, mode)
    x64 = x.double().requires_grad_()
    (exact,) = torch.autograd.grad(reference(x64, w.double(), None, 1, padding, 1, mode), x64, grad_out.double())
    assert ours.dtype == dtype and ours.is_contiguous(memory_format=CL)
    assert rel_l2(ours, exact) < TOLERANCE[dtype]


def test_the_fold_indexes_voxels_in_int64_past_int32(device, monkeypatch):
    """fold_bordered's WIDE form (2^31 voxels or more: here the threshold lowered to the test's 24) gives the int32
    form's bits."""
    from tconv3d.geometry import conv_geometry
    from tconv3d.kernels import fold

    geom = conv_geometry((2, 8, 2, 3, 4), (4, 8, 1, 1, 1), 1, (2, 0, 1, 1, 1, 1), 1, padding_mode="replicate")
    grad = torch.randn(2, 8, 4, 5, 6, device=device).contiguous(memory_format=CL)
    narrow = fold.fold_bordered(grad, geom, None, torch.bfloat16)
    monkeypatch.setattr(fold, "INT32_VOXELS", 24)
    assert torch.equal(fold.fold_bordered(grad, geom, None, torch.bfloat16), narrow)


def fold_dimension_by_dimension(grad, geom, bias=None):
    """The fold as it was written first: each dimension folded into a new tensor of the gradient less that
    dimension's borders (a copy of the gradient's size per dimension), summed in float32 and rounded once a
    dimension, each border's copy of the bias taken off as it is added."""
    from tconv3d.kernels.tensors import source_index

    sum_dtype = torch.promote_types(grad.dtype, torch.float32)
    for dim, (size, mode) in enumerate(zip(geom.in_size, geom.dim_modes, strict=True)):
        front, back = geom.padding[2 * dim], geom.padding[2 * dim + 1]
        if mode == "zeros" or not (front or back):
            continue
        axis = 2 + dim
        folded = grad.narrow(axis, front, size).clone(memory_format=CL)
        read = {}  # input index: the border indices that read it, in order
        for p in [*range(front), *range(front + size, front + size + back)]:
            read.setdefault(source_index(p, size, front, mode), []).append(p)
        for i, borders in read.items():
            plane = grad.narrow(axis, front + i, 1).to(sum_dtype, copy=True)
            for p in borders:
                plane += grad.narrow(axis, p, 1)
                if bias is not None:
                    plane -= bias.to(sum_dtype).view(1, -1, 1, 1, 1)
            folded.narrow(axis, i, 1).copy_(plane)
        grad = folded
    return grad


FOLDED_DIMENSIONS = [  # (mode: one, or one per dimension; input size; padding)
    ("replicate", (6, 10, 12), (2, 1, 1, 1, 1, 1)),  # HunyuanVideo's causal padding: three dimensions folded
    ("reflect,replicate,circular", (5, 6, 7), (2, 2, 1, 3, 3, 1)),
    ("replicate,zeros,replicate", (4, 5, 6), (2, 0, 1, 1, 1, 1)),
    ("circular", (3, 4, 5), (2, 1, 1, 2, 0, 0)),
    ("replicate", (1, 1, 3), (2, 2, 3, 3, 2, 2)),  # borders wider than the dimension: several onto a plane
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize(
    "dtype, into", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.float16, torch.float16)],
    ids=["float32_into_bfloat16", "float32", "float16"],
)  # fmt: skip
@pytest.mark.parametrize(
    "mode, size, padding", FOLDED_DIMENSIONS + FOLDS, ids=lambda v: v if isinstance(v, str) else None
)  # fmt: skip
def test_the_fold_in_one_launch(mode, size, padding, dtype, into, with_bias, device):
    """kernels.fold.fold_bordered (the kernels' path): every voxel's own value and the borders that read it summed in
    float32 in one launch and rounded once into `into`: within one rounding of float64's sum of the same values
    (float32: within 1e-6, as the torch ops' fold_padding, whose order of terms differs); every border's copy of a
    bias taken off but one. Wide borders (121 rows onto one) and corners (three dimensions folded) included."""
    from tconv3d.geometry import conv_geometry
    from tconv3d.kernels.fold import fold_bordered
    from tconv3d.kernels.tensors import fold_padding

    shape = (2, 8, *size)
    geom = conv_geometry(shape, (4, 8, 1, 1, 1), 1, padding, 1, padding_mode=mode)
    bordered = [n + geom.padding[2 * d] + geom.padding[2 * d + 1] if m != "zeros" else n
                for d, (n, m) in enumerate(zip(size, geom.dim_modes, strict=True))]  # fmt: skip
    grad = torch.randn(2, 8, *bordered, device=device).to(dtype).contiguous(memory_format=CL)
    bias = torch.randn(8, device=device).to(dtype) if with_bias else None
    exact = fold_padding(grad.double(), geom, None if bias is None else bias.double())
    folded = fold_bordered(grad, geom, bias, into)
    assert folded.dtype == into and folded.shape == shape and folded.is_contiguous(memory_format=CL)
    unit = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 1e-6}[into]
    assert rel_l2(folded, exact) <= unit
    if into == torch.float32:
        assert rel_l2(folded, fold_padding(grad.clone(memory_format=CL), geom, bias)) <= 1e-6


@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize(
    "dtype, into", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.bfloat16)],
    ids=["float32", "bfloat16", "float32_into_bfloat16"],
)  # fmt: skip
@pytest.mark.parametrize("mode, size, padding", FOLDED_DIMENSIONS, ids=lambda v: v if isinstance(v, str) else None)
def test_the_fold_writes_one_copy_of_the_gradient(mode, size, padding, dtype, into, with_bias):
    """fold_padding folds every dimension in place in the bordered buffer and copies the interior once: the same
    bits as folding each dimension into a new tensor, and the CPU allocator hands it the folded gradient and a
    float32 plane per voxel plane folded onto (none for a float32 buffer, summed in place), nothing of the
    gradient's size more (folding dimension by dimension, a gradient-sized tensor per dimension, fails it in every
    case here). Bias: every voxel of the bordered gradient carries it (a transposed conv's), each border's copy
    taken off once. `into`: the float32 buffer a 16-bit input gradient's kernels write (config.destination_dtype),
    rounded by the one copy."""
    from torch.profiler import ProfilerActivity, profile

    from tconv3d.geometry import conv_geometry
    from tconv3d.kernels.tensors import fold_padding, source_index

    shape = (2, 8, *size)
    geom = conv_geometry(shape, (4, 8, 1, 1, 1), 1, padding, 1, padding_mode=mode)
    bordered = [n + geom.padding[2 * d] + geom.padding[2 * d + 1] if m != "zeros" else n
                for d, (n, m) in enumerate(zip(size, geom.dim_modes, strict=True))]  # fmt: skip
    grad = torch.randn(2, 8, *bordered).to(dtype).contiguous(memory_format=CL)
    bias = torch.randn(8, dtype=dtype) if with_bias else None
    expected = fold_dimension_by_dimension(grad, geom, bias).to(into or dtype)
    mine = grad.clone(memory_format=CL)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        folded = fold_padding(mine, geom, bias, into)
    assert folded.is_contiguous(memory_format=CL) and folded.shape == shape and folded.dtype == (into or dtype)
    assert torch.equal(folded, expected)
    planes = 0  # float32 bytes of the planes summed, at the extent folded then
    extent = list(bordered)
    for d, (n, m) in enumerate(zip(size, geom.dim_modes, strict=True)):
        front, back = geom.padding[2 * d], geom.padding[2 * d + 1]
        if m == "zeros" or not (front or back):
            continue
        read = {source_index(p, n, front, m) for p in [*range(front), *range(front + n, front + n + back)]}
        # in 16 bits each sum and a float32 copy of each border it adds (what float32 += bfloat16 converts); a
        # float32 gradient's sums are made in place
        sums = len(read) + front + back if dtype != torch.float32 else 0
        planes += sums * 2 * 8 * 4 * (torch.Size(extent).numel() // extent[d])
        extent[d] = n
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    planes += 8 * 4 if with_bias else 0  # and the bias in float32
    assert allocated <= folded.numel() * folded.element_size() + planes


@pytest.mark.skipif(tconv3d.CPU_BACKEND != "triton", reason="CPU tensors run aten's conv3d here, which pads")
@pytest.mark.parametrize("mode", PADDING_MODES)
def test_forward_allocates_only_its_output(mode):
    """No padded copy: the CPU allocator, as the profiler sees it, hands the forward nothing but its output (a
    replicate-padded copy of this input would take 1.6x the input's bytes)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(1, 8, 6, 20, 20).contiguous(memory_format=CL)
    w = torch.randn(8, 8, 3, 3, 3).contiguous(memory_format=CL)
    run = lambda: tconv3d.conv3d(x, w, padding=(2, 0, 1, 1, 1, 1), padding_mode=mode)  # noqa: E731
    run()  # the config's choice and the kernel's first launch happen once, before measuring
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        y = run()
    allocated = sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)
    assert 0 < allocated <= y.numel() * y.element_size()
