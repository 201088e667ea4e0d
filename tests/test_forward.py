"""Forward convolution against a float64 reference, on CPU through the Triton interpreter or on CUDA."""

import subprocess
import sys

import pytest
import torch
from helpers import CASES, DTYPES, Case, case_reference, count_launches, dtype_id, poison_aten_convolution

import tconv3d
from tconv3d import settings
from tconv3d.geometry import triple
from tconv3d.testing import TF32_TOLERANCE, TOLERANCE, reference_conv3d, rel_l2, tolerance

CL = torch.channels_last_3d


def run_case(case: Case, dtype, device, bias: bool, memory_format=CL):
    x = case.input(dtype, device, memory_format)
    w = case.weight(dtype, device)
    b = case.bias(dtype, device) if bias else None
    y = tconv3d.conv3d(x, w, b, case.stride, case.padding, case.dilation)
    return y, case_reference(x, w, b, case)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_float64_reference(case, dtype, bias, device):
    y, ref = run_case(case, dtype, device, bias)
    assert y.shape == ref.shape
    assert y.dtype == dtype
    assert y.is_contiguous(memory_format=CL)
    assert rel_l2(y, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_ncdhw_input_gives_channels_last_output(dtype, device):
    y, ref = run_case(CASES[0], dtype, device, bias=True, memory_format=torch.contiguous_format)
    assert y.is_contiguous(memory_format=CL)
    assert rel_l2(y, ref) < TOLERANCE[dtype]


def test_non_contiguous_view_is_read_in_place(device):
    big = torch.randn(2, 6, 9, 10, 11, device=device).contiguous(memory_format=CL)
    x = big[:, 1:5, 1:8:2, ::2, 2:]  # channels stay unit-stride, everything else is strided
    assert not x.is_contiguous() and not x.is_contiguous(memory_format=CL)
    w = torch.randn(3, 4, 3, 3, 3, device=device).contiguous(memory_format=CL)
    y = tconv3d.conv3d(x, w, None, 1, 1)
    assert rel_l2(y, reference_conv3d(x, w, None, 1, 1, 1)) < TOLERANCE[torch.float32]


def test_weight_in_ncdhw_layout(device):
    case = CASES[1]
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device).contiguous()
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding)
    assert rel_l2(y, case_reference(x, w, None, case)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "kernel", [(1, 1, 1), (1, 1, 3), (1, 3, 3), (3, 1, 1), (3, 3, 1)], ids=lambda k: "x".join(map(str, k))
)
def test_unit_kernel_dims_read_whatever_their_strides(kernel, device):
    """A unit kernel dimension's stride may be anything (a contiguous 1x1x1 weight's are 1); the pointer kernels
    zero a pointwise weight's (conv_fwd, conv_dgrad) so that the compiler sees each weight row aligned. Forward and
    input gradient against float64 with strides 1 and 7 there; a wrong stride zeroed reads the wrong taps."""
    x = torch.randn(2, 16, 3, 5, 6, device=device).contiguous(memory_format=CL)
    dense = torch.randn(8, *kernel, 16, device=device)  # (Cout, kd, kh, kw, Cin) in memory
    grad_out = torch.randn(2, 8, 3, 5, 6, device=device).contiguous(memory_format=CL)
    padding = tuple(k // 2 for k in kernel)
    for unit_stride in (1, 7):
        taps = [unit_stride if k == 1 else s for k, s in zip(kernel, dense.stride()[1:4], strict=True)]
        w = dense.as_strided((8, 16, *kernel), (dense.stride(0), 1, *taps))
        x_ = x.clone().requires_grad_()
        y = tconv3d.conv3d(x_, w, None, 1, padding)
        (grad_in,) = torch.autograd.grad(y, x_, grad_out)
        x64 = x.double().requires_grad_()
        ref = torch.nn.functional.conv3d(x64, w.double(), None, 1, padding)
        (ref_grad,) = torch.autograd.grad(ref, x64, grad_out.double())
        assert rel_l2(y, ref) < TOLERANCE[torch.float32], (kernel, unit_stride)
        assert rel_l2(grad_in, ref_grad) < TOLERANCE[torch.float32], (kernel, unit_stride)


def test_empty_batch_returns_empty_channels_last(device):
    x = torch.randn(0, 3, 4, 5, 6, device=device)
    w = torch.randn(5, 3, 3, 3, 3, device=device)
    y = tconv3d.conv3d(x, w, padding=1)
    assert y.shape == (0, 5, 4, 5, 6)
    assert y.is_contiguous(memory_format=CL)


def test_same_padding_keeps_size(device):
    x = torch.randn(1, 2, 5, 6, 7, device=device)
    w = torch.randn(3, 2, 4, 3, 2, device=device)
    y = tconv3d.conv3d(x, w, padding="same")
    assert y.shape[2:] == x.shape[2:]
    expected = torch.nn.functional.conv3d(x.double(), w.double(), padding="same")
    assert rel_l2(y, expected) < TOLERANCE[torch.float32]


def test_fp32_uses_tf32_exactly_when_cudnn_allows_it(device):
    case = Case("tf32", 1, 32, 32, (4, 5, 6), 3, padding=1)
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    ref = case_reference(x, w, None, case)
    torch.backends.cudnn.allow_tf32 = True
    err_tf32 = rel_l2(tconv3d.conv3d(x, w, None, 1, 1), ref)
    torch.backends.cudnn.allow_tf32 = False
    err_ieee = rel_l2(tconv3d.conv3d(x, w, None, 1, 1), ref)
    assert err_ieee < TOLERANCE[torch.float32]
    assert err_tf32 < TF32_TOLERANCE
    if device == "cuda":  # the interpreter has no TF32; on a GPU it must show in the error
        assert err_tf32 > 10 * err_ieee


# torch's fp32 precisions, parents before children (setting a parent sets its children): what a test of them saves.
PRECISIONS = [("generic", "all"), ("cuda", "all"), ("mkldnn", "all")] + [
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("conv", "rnn", "matmul")
]
PRECISION_SETTINGS = {  # how a user asks, by either API -> whether cuDNN's convolutions may use TF32
    "conv_ieee": (lambda: setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"), False),
    "conv_ieee_from_torch_defaults": (  # cuDNN's conv and rnn at TF32, as in a new process; then conv exact
        lambda: (
            setattr(torch.backends.cudnn, "allow_tf32", True),
            setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee"),
        ),
        False,
    ),
    "cudnn_ieee": (lambda: setattr(torch.backends.cudnn, "fp32_precision", "ieee"), False),
    "everything_ieee": (lambda: setattr(torch.backends, "fp32_precision", "ieee"), False),
    "cudnn_tf32": (lambda: setattr(torch.backends.cudnn, "fp32_precision", "tf32"), True),
    "conv_inherits_tf32": (
        lambda: (
            setattr(torch.backends, "fp32_precision", "tf32"),
            setattr(torch.backends.cudnn.conv, "fp32_precision", "none"),
        ),
        True,
    ),
    "legacy_off": (lambda: setattr(torch.backends.cudnn, "allow_tf32", False), False),
    "legacy_on": (lambda: setattr(torch.backends.cudnn, "allow_tf32", True), True),
}


@pytest.mark.parametrize("setting", PRECISION_SETTINGS)
def test_fp32_follows_the_precision_set_by_either_api(setting, device):
    """torch 2.9 on keeps fp32 precision per backend and operator (torch.backends.cudnn.conv.fp32_precision, ...),
    and its legacy view torch.backends.cudnn.allow_tf32 raises once the new API set cuDNN's conv to "ieee": tconv3d
    follows whichever API set it, as cuDNN does, and an fp32 conv (the forward, the gradients, the tolerance it is
    judged by) never reads the view that raises."""
    getter, setter = torch._C._get_fp32_precision_getter, torch._C._set_fp32_precision_setter
    saved = [(backend, op, getter(backend, op)) for backend, op in PRECISIONS]
    apply, allowed = PRECISION_SETTINGS[setting]
    try:
        apply()
        assert settings.tf32_allowed() == allowed
        case = Case("precision", 1, 16, 16, (3, 4, 5), 3, padding=1)
        x = case.input(torch.float32, device).requires_grad_()
        w = case.weight(torch.float32, device).requires_grad_()
        y = tconv3d.conv3d(x, w, None, 1, 1)
        y.backward(torch.randn_like(y))
        assert rel_l2(y, case_reference(x.detach(), w.detach(), None, case)) < tolerance(torch.float32)
        assert x.grad is not None and w.grad is not None
    finally:
        for backend, op, value in saved:
            setter(backend, op, value)


def test_tf32_by_default_as_in_cudnn():
    """In a new process, at torch's defaults (cuDNN's convolutions may use TF32), tconv3d's fp32 kernels may too:
    the precision chain read as torch sets it by default, not only as the tests set it."""
    code = "import torch; from tconv3d import settings; print(settings.tf32_allowed(), torch.backends.cudnn.allow_tf32)"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert found == ["True", "True"]


def test_triton_kernel_ran_not_aten(monkeypatch, device):
    case = CASES[0]
    x, w, b = case.input(torch.float32, device), case.weight(torch.float32, device), case.bias(torch.float32, device)
    ref = case_reference(x, w, b, case)
    poison_aten_convolution(monkeypatch)
    launches = count_launches(monkeypatch, "conv3d_fwd")
    y = tconv3d.conv3d(x, w, b, case.stride, case.padding)
    assert launches == ["conv3d_fwd"]
    assert rel_l2(y, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_many_tiles(small_tiles, dtype, device):
    case = Case("many_tiles", 1, 33, 40, (3, 6, 7), (2, 1, 3), stride=(1, 2, 1), padding=(1, 0, 1, 1, 2, 0))
    y, ref = run_case(case, dtype, device, bias=True)
    assert rel_l2(y, ref) < TOLERANCE[dtype]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's inf - inf, in the interpreter
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_nan_and_inf_reach_the_same_outputs_as_torch(poison, dtype, device):
    """Non-finite inputs must mark exactly the outputs they mark in exact arithmetic: torch's convolution of the
    same values in float64. (Not torch's bf16 convolution: on this CPU its oneDNN path turns a single inf
    contribution into NaN, which no direct sum of products does.)"""
    case = CASES[-1]  # strides, dilation and asymmetric padding: receptive fields of every shape
    x, w = case.input(dtype, device), case.weight(dtype, device)
    positions = torch.randperm(x.numel(), device=device)[:5]
    x.permute(0, 2, 3, 4, 1).view(-1)[positions] = poison  # the NDHWC storage, in place
    x[0, 0, 0, 0, 0] = poison  # a corner voxel
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding, case.dilation)
    geom = tconv3d.geometry.check_conv3d(x, w, None, case.stride, case.padding, case.dilation, 1)
    expected = tconv3d.kernels.aten.conv3d_fwd(x.double(), w.double(), None, None, geom)
    assert expected.isnan().any() or expected.isinf().any()
    assert torch.equal(y.isnan(), expected.isnan())
    assert torch.equal(y.isinf(), expected.isinf())


def test_strided_bias_view(device):
    case = CASES[1]
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    bias = torch.randn(2 * case.cout, device=device)[::2]  # a view with stride 2
    y = tconv3d.conv3d(x, w, bias, case.stride, case.padding)
    assert rel_l2(y, case_reference(x, w, bias, case)) < TOLERANCE[torch.float32]


ROW_CASES = [
    Case("s1_cout20", 2, 24, 20, (3, 5, 6), 3, padding=1),
    Case("s2_cout20", 1, 20, 24, (5, 6, 7), 3, stride=2, padding=1),
]


@pytest.mark.parametrize("wide", [False, True], ids=["int32_rows", "int64_rows"])
@pytest.mark.parametrize("case", ROW_CASES, ids=lambda c: c.name)
def test_row_indices_of_either_width_match_float64(case, wide, gpu_heuristic_tiles, device, monkeypatch):
    """The forward's and input gradient's pointer kernels split their rows into coordinates in int32 unless a
    launch's row indices near 2^31 (utils.wide_rows: WIDE_ROWS, forced here by lowering the bound), and store a
    flat output's rows at m * stride_w (the forward's FLAT_Y where y's strides are not 16-divisible: 20 and 24
    output channels here; the input gradient's FLAT_GI at unit stride, over stride phases it finds them from the
    coordinates), against float64. Each launch is checked to have taken the flags asked for."""
    from tconv3d.kernels import conv_dgrad, conv_fwd, utils

    if wide:
        monkeypatch.setattr(utils, "INT32_ROWS", 64)
    taken = []
    for module in (conv_fwd, conv_dgrad):

        def spy(kernel, grid, *args, _launch=module.launch, **kwargs):
            taken.append((kernel.__name__, kwargs.get("WIDE_ROWS"), kwargs.get("FLAT_Y", kwargs.get("FLAT_GI"))))
            return _launch(kernel, grid, *args, **kwargs)

        monkeypatch.setattr(module, "launch", spy)
    dtype = torch.float32
    x, w = case.input(dtype, device, CL), case.weight(dtype, device)
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding)
    ref = case_reference(x, w, None, case)
    assert rel_l2(y, ref) < TOLERANCE[dtype]
    grad_out = torch.randn_like(y)
    stride, padding = triple(case.stride, "stride"), triple(case.padding, "padding")
    expected = torch.nn.grad.conv3d_input(x.shape, w.double(), grad_out.double(), stride, padding)
    grad_in = torch.ops.tconv3d.conv3d_input_grad(grad_out, w, list(x.shape), stride, padding, (1, 1, 1))
    assert rel_l2(grad_in, expected) < TOLERANCE[dtype]
    unit = stride == (1, 1, 1)
    assert taken == [("_conv3d_fwd_kernel", wide, True), ("_conv3d_dgrad_kernel", wide, unit)]


def test_flat_rows():
    """utils.flat_rows: voxels one W stride apart in (n, d, h, w) order, whatever the channels' stride."""
    from tconv3d.kernels.utils import flat_rows

    whole = torch.empty(2, 12, 3, 4, 5).contiguous(memory_format=CL)
    assert flat_rows(whole) and flat_rows(whole[:, 3:7])  # dense, a channel slice
    assert not flat_rows(whole[:, :, 1:]) and not flat_rows(whole[:, :, :, :, 1:4])  # frames or columns sliced off
    assert not flat_rows(whole.permute(0, 1, 2, 4, 3))  # H and W swapped
    assert not flat_rows(torch.empty(2, 12, 3, 4, 5))  # NCDHW: the second batch past every channel of the first
    assert flat_rows(whole[:1, :, 1:2])  # size-1 dims: any stride
    assert flat_rows(torch.empty(1, 12, 1, 1, 5).as_strided((1, 12, 1, 1, 5), (7, 1, 999, 3, 12)))
