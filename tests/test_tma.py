"""The TMA variant of the three kernels (tensor-descriptor boxes with zero-filled borders feeding the MMA): every
correctness case with channel counts TMA can describe and at most 4 phase views (stride 2 in H and W), through
the TMA kernels against float64, gradients included;
problems it cannot run falling back to the pointer kernel under TCONV3D_KERNELS=tma; tconv3d.explain; the
config field. On CPU the interpreter runs the TMA kernel (triton 3.9's host descriptors zero-fill out-of-range
boxes, negative coordinates included)."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from helpers import CASES, DTYPES, Case, case_reference, conv_and_reference, dtype_id

import tconv3d
from tconv3d import settings
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_dgrad, conv_fwd, conv_gluon, conv_tma, conv_wgrad
from tconv3d.kernels.config import KernelConfig
from tconv3d.testing import rel_l2, tolerance
from tconv3d.tune import choice
from tconv3d.tune.configs import heuristic_config, tma_eligible, with_tma

CL = torch.channels_last_3d


def _round8(c: int) -> int:
    return -(-c // 8) * 8


def _phases(case: Case) -> int:
    _, s_h, s_w = (case.stride,) * 3 if isinstance(case.stride, int) else case.stride
    return s_h * s_w


# The cases of the suite with channels rounded up to whole 16-byte rows and at most 4 phase views: borders on
# every face, sizes no box divides, D = 1, dilation, asymmetric padding, batch 2, 1x1x1 and 7x2x5 kernels, strides
# 2 in D, H and W (odd and even sizes: phase views of unequal length); strides in one of H, W (two phase
# views) with dilation and asymmetric padding, so that taps of one phase shift by a whole row or column; and a
# stride above the kernel, whose input gradient has phases no tap reaches.
TMA_CASES = [
    dataclasses.replace(case, name=case.name + "_c8", cin=_round8(case.cin), cout=_round8(case.cout))
    for case in CASES
    if _phases(case) <= 4
] + [
    Case("depth_1", 2, 8, 16, (1, 6, 5), 3, padding=1),
    Case("wide_cout", 1, 16, 72, (3, 4, 19), 3, padding=1),
    Case("stride_w_dilated", 1, 8, 16, (3, 5, 13), (1, 3, 5), (1, 1, 2), (0, 0, 1, 1, 3, 2), (1, 1, 2)),
    Case("stride_dh_asym", 1, 16, 8, (6, 9, 6), (3, 3, 2), (2, 2, 1), (1, 0, 2, 1, 0, 1)),
    Case("stride_past_kernel", 1, 8, 8, (5, 7, 9), 1, (2, 2, 2)),  # 7 of 8 input-gradient phases: zeros
]


@pytest.fixture
def variant(request, monkeypatch):
    """Run with TCONV3D_KERNELS set to the parameter, and record the TMA launches ("fwd", "dgrad")."""
    monkeypatch.setattr(settings, "KERNELS", request.param)
    monkeypatch.setattr(choice, "_memo", {})
    launches = []
    for module, name, launcher in (
        (conv_fwd, "fwd", "conv3d_tma"), (conv_dgrad, "dgrad", "conv3d_tma"), (conv_wgrad, "wgrad", "conv3d_wgrad_tma")
    ):  # fmt: skip
        real = getattr(module, launcher)
        monkeypatch.setattr(
            module, launcher, lambda *a, real=real, name=name, **k: launches.append(name) or real(*a, **k)
        )
    return request.param, launches


# The pointer kernels run every case of the suite in tests/test_forward.py and tests/test_backward.py.
@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", TMA_CASES, ids=lambda c: c.name)
def test_forward_variants_match_float64(case, dtype, variant, device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    _, launches = variant
    ours, expected = conv_and_reference(case, dtype, device)
    for got, want in zip(ours, expected, strict=True):  # output, input, weight and bias gradients
        assert rel_l2(got, want) < tolerance(dtype)
    assert ours[0].is_contiguous(memory_format=CL) and ours[1].is_contiguous(memory_format=CL)
    assert launches == ["fwd", "dgrad", "wgrad"]


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
def test_fp32_with_tf32_through_tma(variant, device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    case = TMA_CASES[0]
    x, w = case.input(torch.float32, device), case.weight(torch.float32, device)
    y = tconv3d.conv3d(x, w, None, case.stride, case.padding)
    assert rel_l2(y, case_reference(x, w, None, case)) < tolerance(torch.float32)


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("stride", [1, (1, 2, 2)], ids=["stride1", "stride122"])
def test_transposed_convolution_bias_through_tma(stride, variant, device):
    """conv_transpose3d's bias in the TMA input gradient's epilogue (at a stride in H and W, phase by phase):
    every voxel of the output once, the phases no tap reaches included."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    _, launches = variant
    x = torch.randn(1, 16, 2, 3, 4, device=device).contiguous(memory_format=CL)
    w = (torch.randn(16, 8, 1, 3, 3, device=device) / 12).contiguous(memory_format=CL)
    b = torch.randn(8, device=device)
    extra = (0, 1, 1) if stride != 1 else 0
    y = tconv3d.conv_transpose3d(x, w, b, stride, (0, 1, 1), extra, dilation=(1, 1, 2))
    expected = torch.nn.functional.conv_transpose3d(x.double(), w.double(), b.double(), stride, (0, 1, 1), extra, 1,
                                                    (1, 1, 2))  # fmt: skip
    assert rel_l2(y, expected) < tolerance(torch.float32) and launches == ["dgrad"]


INELIGIBLE = [
    ("stride_3", dict(stride=(1, 3, 2), padding=1), 8),  # 6 phase views
    ("odd_channels", dict(padding=1), 5),
    # replicate in H and W at a stride there: no interior of stride-1 boxes (conv_fwd.interior_part)
    ("replicate_strided", dict(stride=(1, 2, 2), padding=1, padding_mode="replicate"), 8),
]


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize(("name", "kwargs", "channels"), INELIGIBLE, ids=[c[0] for c in INELIGIBLE])
def test_ineligible_problems_fall_back_to_pointer(name, kwargs, channels, variant, device):
    _, launches = variant
    x = torch.randn(1, channels, 3, 5, 6, device=device).contiguous(memory_format=CL)
    w = torch.randn(8, channels, 3, 3, 3, device=device)
    assert tconv3d.explain(x, w, **kwargs)["fwd"]["variant"] == "pointer"
    y = tconv3d.conv3d(x, w, **kwargs)
    mode = kwargs.get("padding_mode", "zeros")
    expected = torch.nn.functional.conv3d(
        torch.nn.functional.pad(x.double(), (1,) * 6, mode="constant" if mode == "zeros" else mode),
        w.double(), stride=kwargs.get("stride", 1),
    )  # fmt: skip
    assert rel_l2(y, expected) < tolerance(torch.float32) and "fwd" not in launches


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("stride", [1, (1, 2, 2)], ids=["stride1", "stride122"])
@pytest.mark.parametrize("mode", ["replicate", "zeros,reflect,circular"])
def test_input_gradient_of_padding_modes_and_cached_frames_through_tma(mode, stride, variant, device):
    """The input gradient of a padded or two-source forward is the input gradient of the padded (or
    concatenated) input: the TMA kernel computes it (at a stride, phase by phase), then the border is folded and
    the sources split."""
    _, launches = variant
    x = torch.randn(1, 8, 3, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_()
    before = torch.randn(1, 8, 2, 5, 6, device=device).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(16, 8, 3, 3, 3, device=device)
    y = tconv3d.conv3d(x, w, stride=stride, padding=(0, 0, 1, 1, 1, 1), padding_mode=mode, frames_before=before)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    x64, before64 = (t.detach().double().requires_grad_() for t in (x, before))
    padded = torch.cat([before64, x64], dim=2)
    modes = mode.split(",") if "," in mode else [mode] * 3
    for dim, dim_mode in ((2, modes[2]), (1, modes[1])):
        pads = [0] * 6
        pads[4 - 2 * dim : 6 - 2 * dim] = [1, 1]
        padded = torch.nn.functional.pad(padded, pads, mode="constant" if dim_mode == "zeros" else dim_mode)
    torch.nn.functional.conv3d(padded, w.double(), stride=stride).backward(grad_out.double())
    assert rel_l2(x.grad, x64.grad) < tolerance(torch.float32)
    assert rel_l2(before.grad, before64.grad) < tolerance(torch.float32)
    # The forward of another mode in H or W at stride 1 there: its interior on the TMA kernel (border strips on the
    # pointer kernel); at a stride there, and the weight gradient of another mode in H or W: the pointer kernels.
    assert launches == (["fwd", "dgrad"] if stride == 1 else ["dgrad"])


def test_pointer_tiles_of_box_configs():
    """config.pointer_tiles, what a box config runs on the pointer kernel (a bordered launch's ring or strips, a
    launch whose tensors TMA cannot describe): off the Gluon kernel's own fields (swapped operands; grouped taps'
    columns back to one tap's), at most 128 rows, 8 warps from 64 x 128 up (4 spilled 56-472 bytes on sm_90), the
    split kept; where the pointer kernel gathers the channels element by element (not 16-divisible), within what
    that holds (config.gathered_tiles), a forward's reduction steps kept (its ring shares the box launch's)."""
    from tconv3d.kernels.config import pointer_tiles

    plain = conv_geometry((2, 64, 8, 16, 16), (64, 64, 3, 3, 3), 1, 1, 1)
    swapped = KernelConfig(256, 128, 64, 8, 3, tma_box_w=16, gluon=2, swap_ab=1, split_k=2)
    assert pointer_tiles(swapped, "fwd", plain, 2) == KernelConfig(128, 128, 64, 8, 3, split_k=2)
    grouped = KernelConfig(128, 256, 64, 8, 4, tma_box_w=16, gluon=2, tap_group=4)
    assert pointer_tiles(grouped, "wgrad", plain, 2) == KernelConfig(128, 64, 64, 8, 4)
    assert pointer_tiles(KernelConfig(128, 64, 64, 4, 6, tma_box_w=16, gluon=2), "fwd", plain, 2).num_warps == 8
    one_group = KernelConfig(64, 128, 64, 4, 3, tma_box_w=16, gluon=2, split_k=3)
    assert pointer_tiles(one_group, "dgrad", plain, 2).num_warps == 8
    assert pointer_tiles(KernelConfig(64, 64, 64, 4, 3, tma_box_w=8), "fwd", plain, 2) == KernelConfig(64, 64, 64, 4, 3)
    # 216 -> 72 channels (multiples of 8, not of 16): the forward's reduction and the input gradient's columns
    unaligned = conv_geometry((2, 216, 8, 16, 16), (72, 216, 3, 3, 3), 1, 1, 1)
    box = KernelConfig(128, 128, 64, 8, 3, tma_box_w=16, gluon=2, split_k=2)
    for direction in ("fwd", "dgrad"):
        assert pointer_tiles(box, direction, unaligned, 2) == KernelConfig(64, 32, 64, 4, 3, split_k=2)
    assert pointer_tiles(box, "wgrad", unaligned, 2) == KernelConfig(128, 128, 32, 8, 3, split_k=2)
    fp32 = KernelConfig(64, 64, 32, 4, 2, tma_box_w=16)
    assert pointer_tiles(fp32, "wgrad", unaligned, 4) == KernelConfig(64, 64, 32, 4, 1)
    assert pointer_tiles(fp32, "wgrad", plain, 4) == KernelConfig(64, 64, 32, 4, 2)


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
def test_unaligned_tensor_falls_back_to_pointer(variant, device):
    """A view starting 2 elements into its storage cannot be a TMA descriptor's base: its tiles on the pointer
    kernel (config.pointer_tiles)."""
    _, launches = variant
    storage = torch.randn(1 * 8 * 3 * 4 * 5 + 2, device=device)
    x = storage[2:].view(1, 3, 4, 5, 8).permute(0, 4, 1, 2, 3)  # channels unit-stride, base 8 bytes off
    w = torch.randn(8, 8, 3, 3, 3, device=device)
    assert tconv3d.explain(x, w, padding=1)["fwd"]["variant"] == "pointer"
    y = tconv3d.conv3d(x, w, padding=1)
    expected = torch.nn.functional.conv3d(x.double(), w.double(), padding=1)
    assert rel_l2(y, expected) < tolerance(torch.float32) and not launches


@pytest.mark.parametrize("variant", ["auto", "pointer", "tma"], indirect=True)
def test_explain_reports_variant_config_and_source(variant, device):
    name, launches = variant
    x = torch.randn(1, 16, 3, 5, 6, device=device).contiguous(memory_format=CL)
    w = torch.randn(16, 16, 3, 3, 3, device=device)
    plan = tconv3d.explain(x, w, padding=1)
    assert set(plan) == {"fwd", "dgrad", "wgrad"}
    if name != "auto" or device == "cpu":  # on a GPU the heuristic picks each direction's variant on its own
        assert plan["dgrad"]["variant"] == plan["wgrad"]["variant"] == plan["fwd"]["variant"]
    assert {p["variant"] for p in plan.values()} <= {"pointer", "tma", "gluon"}
    if device == "cpu":
        assert plan["fwd"]["source"] == "interpreter"
        assert plan["fwd"]["variant"] == ("tma" if name == "tma" else "pointer")  # auto: the interpreter's pointer
    assert isinstance(plan["fwd"]["config"], KernelConfig)
    assert not launches  # explain launches nothing


def test_explain_on_the_aten_path(monkeypatch):
    monkeypatch.setattr(settings, "CPU_BACKEND", "aten")
    plan = tconv3d.explain(torch.randn(1, 4, 3, 5, 5), torch.randn(4, 4, 3, 3, 3), padding=1)
    assert all(p == {"variant": "aten", "config": None, "source": "aten"} for p in plan.values())


def test_tma_config_field_round_trips_and_is_checked():
    config = KernelConfig(128, 128, 64, 8, 3, tma_box_w=16)
    assert KernelConfig.from_dict(config.to_dict()) == config and config.variant == "tma"
    pointer = KernelConfig(128, 128, 64, 8, 3)
    assert "tma_box_w" not in pointer.to_dict() and pointer.variant == "pointer"
    for bad in (12, 256, -1):
        with pytest.raises(ValueError, match="tma_box_w"):
            KernelConfig.from_dict({**config.to_dict(), "tma_box_w": bad})


# A video VAE decoder's last conv (to 3 channels): its input and weight are whole 16-byte rows of Cin, its
# output's 3- or 5-channel rows are not. The TMA forward stores those from registers; the gradients, which read
# grad_out's rows as boxes, stay on the pointer kernels.
UNALIGNED_OUTPUT = [
    Case("cout3", 1, 16, 3, (3, 5, 19), 3, padding=1),
    Case("cout3_rows", 2, 16, 3, (2, 3, 16), 3, padding=1),
    Case("cout5_stride2", 1, 8, 5, (5, 7, 9), 3, stride=2, padding=1),
    Case("cout3_causal_dilated", 1, 8, 3, (6, 9, 13), 3, (1, 1, 2), (2, 0, 1, 1, 3, 2), (1, 1, 2)),
]


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("case", UNALIGNED_OUTPUT, ids=lambda c: c.name)
def test_forward_stores_unaligned_output_rows_from_registers(case, dtype, variant, device):
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    _, launches = variant
    ours, expected = conv_and_reference(case, dtype, device)
    for got, want in zip(ours, expected, strict=True):  # output, input, weight and bias gradients
        assert rel_l2(got, want) < tolerance(dtype)
    assert ours[0].is_contiguous(memory_format=CL) and launches == ["fwd"]


@pytest.mark.parametrize("split_k", [1, 3])
def test_unaligned_output_rows_with_split_k_and_row_boxes(split_k, device):
    """The split partials (fp32, 12-byte rows at 3 channels) are stored from registers too, and so is a one-row
    box's patch."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    from tconv3d.geometry import check_conv3d

    x = torch.randn(2, 16, 3, 4, 32, device=device).contiguous(memory_format=CL)
    w = torch.randn(3, 16, 3, 3, 3, device=device).contiguous(memory_format=CL)
    b = torch.randn(3, device=device)
    geom = check_conv3d(x, w, b, [1] * 3, [1] * 6, [1] * 3, 1)
    expected = torch.nn.functional.conv3d(x.double(), w.double(), b.double(), padding=1)
    for rows in (False, True):
        config = with_tma(KernelConfig(32, 16, 16, 4, 2, split_k=split_k), geom, "fwd", rows=rows)
        assert config.tma_box_w == (32 if rows else 16)
        y = conv_fwd.conv3d_fwd(x, w, b, None, geom, config)
        assert y.is_contiguous(memory_format=CL) and rel_l2(y, expected) < tolerance(torch.float32)


def test_eligibility_and_box_width(monkeypatch):
    from tconv3d.geometry import conv_geometry

    geom = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1)
    assert tma_eligible("fwd", geom, torch.bfloat16) and tma_eligible("dgrad", geom, torch.bfloat16)
    assert tma_eligible("wgrad", geom, torch.bfloat16)
    replicate = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1, "replicate")
    # replicate in H and W: the interior on the box kernels, the border strips on the pointer kernel
    assert all(tma_eligible(direction, replicate, torch.bfloat16) for direction in ("fwd", "dgrad", "wgrad"))
    strided = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 2, 1, 1)
    assert all(tma_eligible(direction, strided, torch.bfloat16) for direction in ("fwd", "dgrad", "wgrad"))
    for stride, size in (((1, 3, 2), (4, 8, 52)), ((2, 3, 3), (4, 8, 52)), ((1, 2, 2), (4, 8, 1))):
        odd = conv_geometry((1, 64, *size), (64, 64, 1, 1, 1), stride, 0, 1)  # 6, 9 phases; an empty phase view
        assert not any(tma_eligible(direction, odd, torch.bfloat16) for direction in ("fwd", "dgrad", "wgrad"))
    assert with_tma(KernelConfig(128, 128, 64, 8, 3), geom, "fwd").tma_box_w == 16
    narrow = conv_geometry((1, 64, 4, 8, 5), (64, 64, 3, 3, 3), 1, 1, 1)
    assert with_tma(KernelConfig(128, 128, 64, 8, 3), narrow, "fwd").tma_box_w == 8
    assert not tma_eligible("fwd", conv_geometry((1, 12, 4, 8, 8), (16, 12, 3, 3, 3), 1, 1, 1), torch.bfloat16)
    assert tma_eligible("fwd", conv_geometry((1, 12, 4, 8, 8), (16, 12, 3, 3, 3), 1, 1, 1), torch.float32)
    # Output rows of 3 channels: the forward stores them from registers; the gradients read them as boxes.
    to_rgb = conv_geometry((1, 96, 4, 8, 8), (3, 96, 3, 3, 3), 1, 1, 1)
    assert [tma_eligible(d, to_rgb, torch.bfloat16) for d in ("fwd", "dgrad", "wgrad")] == [True, False, False]
    # Along D a border mode and frames_before are a frame coordinate; in H and W only zeros borders are the TMA unit's.
    causal = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1, "replicate,zeros,zeros", 2)
    assert all(tma_eligible(direction, causal, torch.bfloat16) for direction in ("fwd", "dgrad", "wgrad"))
    # In H and W another mode leaves the forward's and the weight gradient's interior to the box kernels
    # (conv_fwd.interior_part) where one is left.
    spatial = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, 1, 1, "zeros,reflect,zeros")
    assert all(tma_eligible(d, spatial, torch.bfloat16) for d in ("fwd", "dgrad", "wgrad"))
    thin = conv_geometry((1, 64, 4, 2, 52), (64, 64, 3, 3, 3), 1, (1, 1, 1, 1, 1, 1), 1, "zeros,replicate,zeros")
    assert not any(tma_eligible(d, thin, torch.bfloat16) for d in ("fwd", "wgrad"))  # 2 rows, both border: no interior
    assert not tma_eligible("fwd", dataclasses.replace(spatial, stride=(1, 2, 1)), torch.bfloat16)
    strided_cached = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), (1, 2, 2), 1, 1, "zeros", 2)
    assert [tma_eligible(d, strided_cached, torch.bfloat16) for d in ("fwd", "dgrad", "wgrad")] == [False, True, False]
    # The heuristic on sm_90: a border mode along D keeps the box loops as they are; frames_before (a branch per step
    # in the box loops) and a border in H or W keep the weight gradient on the pointer kernel off the Gluon kernel
    # and with timed_only (on it, an untimed rule takes it there as the forward is). The box kernel is the
    # warp-specialized Gluon one where this Triton has it (timed on the H200), else the TMA one, but in the
    # forward: the Triton TMA forward lost to the pointer kernel wherever Gluon does not run it (H200, H100).
    replicate_d = conv_geometry((1, 64, 4, 8, 52), (64, 64, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1, "replicate,zeros,zeros")
    long_rows = conv_geometry((1, 64, 4, 64, 256), (64, 64, 3, 3, 3), 1, (2, 0, 1, 1, 1, 1), 1, "replicate,zeros,zeros")
    # (replicate_d's, causal's and spatial's forwards are split over their reduction to fill 132 SMs: on
    # one-warpgroup Gluon tiles where Gluon runs, causal's cached frames among the split steps; else, and for
    # spatial's, bordered in W (H200 run 5: LTX-2's such layers ran 1.5-3.4x faster so), the pointer kernel;
    # long_rows' is not split)
    assert heuristic_config("fwd", replicate_d, torch.bfloat16, 132, 90).split_k > 1
    for unavailable, box in ((None, "gluon"), ("a Triton without Gluon", "tma")):
        monkeypatch.setattr(conv_gluon, "UNAVAILABLE", unavailable)
        for problem, variants in (
            (replicate_d, ["gluon" if box == "gluon" else "pointer", box, box]),
            (causal, ["gluon" if box == "gluon" else "pointer", box, "gluon" if box == "gluon" else "pointer"]),
            (spatial, ["pointer", box, "gluon" if box == "gluon" else "pointer"]),
            (long_rows, ["pointer" if box == "tma" else box, box, box]),
        ):  # fmt: skip
            chosen = [heuristic_config(d, problem, torch.bfloat16, 132, 90) for d in ("fwd", "dgrad", "wgrad")]
            assert [c.variant for c in chosen] == variants
            assert all(c.gluon in (0, 2) for c in chosen)
            if problem in (causal, spatial):
                assert heuristic_config("wgrad", problem, torch.bfloat16, 132, 90, True).variant == "pointer"


def test_row_box_where_rows_fill_it():
    """The heuristic's box: one row of block_m voxels where the volume's rows fill 90% of their last box (the loop
    keeps both operands in shared memory), else the 16-wide patch; the tuner's space holds both."""
    from tconv3d.geometry import conv_geometry
    from tconv3d.tune import configs

    tiles = KernelConfig(128, 128, 64, 8, 3)
    full = conv_geometry((1, 64, 4, 8, 256), (64, 64, 3, 3, 3), 1, 1, 1)  # 256 = 2 rows of 128
    ragged = conv_geometry((1, 64, 4, 8, 104), (64, 64, 3, 3, 3), 1, 1, 1)  # 104 of 128: 81%
    assert with_tma(tiles, full, "fwd").tma_box_w == 128 and with_tma(tiles, full, "dgrad").tma_box_w == 128
    assert with_tma(tiles, full, "wgrad").tma_box_w == 64  # the weight gradient's box spans block_k
    assert with_tma(tiles, ragged, "fwd").tma_box_w == 16 and with_tma(tiles, ragged, "fwd", rows=True).tma_box_w == 128
    boxes = {c.tma_box_w for c in configs.candidates("fwd", ragged, torch.bfloat16, 227 * 1024, tma=True)}
    assert {0, 16, 128} <= boxes
    assert KernelConfig(128, 128, 64, 8, 3, tma_box_w=128).tma_box(128) == (1, 128)
    with pytest.raises(ValueError, match="does not divide"):
        KernelConfig(128, 128, 64, 8, 3, tma_box_w=128).tma_box(64)


ROW_BOX_CASES = [
    *(case for case in TMA_CASES if case.name == "causal_6pad_c8"),
    Case("two_boxes_a_row", 1, 8, 16, (2, 3, 19), 3, padding=1),
]


@pytest.mark.parametrize("case", ROW_BOX_CASES, ids=lambda c: c.name)
def test_row_boxes_match_float64(case, monkeypatch, device):
    """Boxes one row high (box_h = 1) in all three kernels: rows narrower than the box (W = 7, with asymmetric
    padding) and wider (W = 19: two boxes, the second mostly past the edge), against float64."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90+")
    rows = KernelConfig(16, 16, 16, 4, 2, tma_box_w=16)  # block_m = block_k = the box: one row of 16 voxels
    monkeypatch.setattr(choice, "_memo", {})
    monkeypatch.setattr(choice, "_select", lambda *args: rows)
    launched = []
    real = conv_tma.patch_descriptors
    monkeypatch.setattr(
        conv_tma, "patch_descriptors", lambda *a, **k: launched.append(a[4].tma_box(16)) or real(*a, **k)
    )
    ours, expected = conv_and_reference(case, torch.float32, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.float32)
    assert launched == [(1, 16), (1, 16)]  # the forward and the input gradient ran one-row boxes


@pytest.mark.parametrize(
    "shape, strides, box, swizzle, problem",
    [
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 1), (1, 1, 4, 8, 64), 3, None),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 60, 1), (1, 1, 4, 8, 64), 3, "stride 3 is 120 bytes"),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 2), (1, 1, 4, 8, 64), 3, "innermost dimension has stride 2"),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 1), (1, 1, 4, 512, 64), 3, "box dimension 3 is 512"),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 1), (1, 1, 4, 8, 4), 0, "inner dimension is 8 bytes"),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 1), (1, 1, 4, 8, 64), 2, "past the 64-byte swizzle"),
        ((1, 4, 8, 16, 64), (8192, 8192, 1024, 64, 1), (1, 1, 4, 8, 64), 7, "swizzle 7"),
        ((2**33, 64), (64, 1), (1, 64), 3, "2^32"),
        ((4, 8, 8, 8, 8, 64), (1,) * 6, (1,) * 6, 0, "rank 6"),
    ],
)
def test_tensor_map_problems_name_what_the_driver_refuses(shape, strides, box, swizzle, problem):
    """utils.tensor_map_problems holds a map to cuTensorMapEncodeTiled's documented requirements (bf16)."""
    from tconv3d.kernels.utils import tensor_map_problems

    problems, _ = tensor_map_problems(shape, strides, box, 2, swizzle)
    if problem is None:
        assert not problems
    else:
        assert any(problem in p for p in problems), problems


def test_tensor_map_risks_and_packed_size_one_strides():
    """The maps cuda.h allows and CCCL refuses are risks, not problems; ndhwc_descriptor gives a size-1
    dimension the packed stride, so a batch of one is not one of them."""
    from tconv3d.kernels.utils import ndhwc_descriptor, tensor_map_problems

    problems, risks = tensor_map_problems((3, 27, 96), (2592, 96, 1), (16, 1, 64), 2, 3)
    assert not problems and risks == ["box dimension 0 (16) is longer than the tensor's (3)"]
    problems, risks = tensor_map_problems((1, 4, 8, 16, 64), (8, 8192, 1024, 64, 1), (1, 1, 4, 8, 64), 2, 3)
    assert not problems and len(risks) == 1 and "stride 0 (8)" in risks[0]
    x = torch.randn(1, 64, 1, 16, 1, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)
    desc = ndhwc_descriptor(x, (1, 1, 8, 16, 64))
    assert desc.shape == [1, 1, 16, 1, 64] and desc.strides == [1024, 1024, 64, 64, 1]
    assert tensor_map_problems(desc.shape, desc.strides, [1, 1, 8, 1, 64], 2, 3) == ([], [])


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("maps", ["any", "strict"])
@pytest.mark.parametrize("risk", ["box", "stride"])
def test_risky_tensor_maps_under_tma_maps_strict(maps, risk, variant, monkeypatch, device):
    """TCONV3D_TMA_MAPS=strict: a launch with a tensor map CCCL would refuse (box: a 3-voxel-high volume under
    taller patches and 8 weight rows over Cout 3; stride: the stride-2 phase views of an odd H, whose D stride is
    shorter than their rows span) runs the pointer kernels on its tiles, from then on; any runs it on TMA.
    Both match float64."""
    from tconv3d.kernels import utils as kernel_utils

    _, launches = variant
    monkeypatch.setattr(settings, "TMA_MAPS", maps)
    monkeypatch.setattr(kernel_utils, "_descriptors", {})
    refused = []
    check = kernel_utils._check_strict

    def recording(*args):
        try:
            check(*args)
        except kernel_utils.RiskyTensorMap as error:
            refused.append(str(error))
            raise

    monkeypatch.setattr(kernel_utils, "_check_strict", recording)
    if risk == "box":
        x, w, stride = torch.randn(1, 16, 3, 3, 5, device=device), torch.randn(3, 16, 3, 3, 3, device=device), 1
    else:  # boxes within every extent: the phase views' stride is the only risk
        x, w, stride = torch.randn(1, 32, 2, 17, 16, device=device), torch.randn(16, 32, 3, 3, 3, device=device), 2
    x, w = x.contiguous(memory_format=CL), w.contiguous(memory_format=CL)
    expected = torch.nn.functional.conv3d(x.double(), w.double(), stride=stride, padding=1)
    for _ in range(2):
        assert rel_l2(tconv3d.conv3d(x, w, stride=stride, padding=1), expected) < tolerance(torch.float32)
    config = next(c for key, c in choice._memo.items() if key[0] == "fwd")
    if maps == "strict":  # the TMA launcher was entered once, refused a map and launched nothing
        assert launches == ["fwd"] and not config.tma_box_w
        assert len(refused) == 1 and ("box dimension" if risk == "box" else "is shorter than") in refused[0]
    else:
        assert launches == ["fwd", "fwd"] and config.tma_box_w and not refused


def test_refused_tensor_map_says_what_to_do(monkeypatch):
    """A tensor map the driver refuses (Triton's launcher raises) is an error naming the launch and the ways out."""
    config = KernelConfig(64, 64, 32, 4, 3, tma_box_w=8)
    monkeypatch.setattr(choice, "launch_config", lambda *a, **k: config)

    def refused(*args):
        raise RuntimeError("Triton Error [CUDA]: Failed to create tensor map descriptor: invalid argument")

    with pytest.raises(RuntimeError, match="TCONV3D_TMA_MAPS=strict") as error:
        geom = conv_geometry((1, 16, 2, 4, 4), (16, 16, 3, 3, 3), 1, 1, 1)  # any dense problem: no kernel runs
        choice.launch("fwd", refused, geom, torch.empty(1))
    assert "tensor map descriptor" in str(error.value.__cause__)


def conv_with_border_along_d(mode_d, stride, before, dtype, device, modes_hw=("zeros", "zeros"), channels=(8, 16)):
    """tconv3d's [y, dx, dw (, d frames_before)] of a conv of `channels` (in, out) with `mode_d` borders along D (and
    `modes_hw` in H and W: zeros, as the video VAEs' causal convs have, by default) and `before` frames_before, and
    float64's of the concatenated, padded input, under one random upstream gradient."""
    c_in, c_out = channels
    x = torch.randn(1, c_in, 3, 5, 6, device=device).to(dtype).contiguous(memory_format=CL).requires_grad_()
    frames = torch.randn(1, c_in, before, 5, 6, device=device).to(dtype).contiguous(memory_format=CL).requires_grad_()
    w = torch.randn(c_out, c_in, 3, 3, 3, device=device).to(dtype).requires_grad_()
    padding, mode = (2, 1, 1, 1, 1, 1), ",".join((mode_d, *modes_hw))
    y = tconv3d.conv3d(x, w, None, stride, padding, padding_mode=mode, frames_before=frames if before else None)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    x64, frames64, w64 = (t.detach().double().requires_grad_() for t in (x, frames, w))
    padded = torch.cat([frames64, x64], dim=2)
    for pads, dim_mode in (
        ((1, 1, 0, 0, 0, 0), modes_hw[1]),
        ((0, 0, 1, 1, 0, 0), modes_hw[0]),
        ((0,) * 4 + (2, 1), mode_d),
    ):
        padded = torch.nn.functional.pad(padded, pads, mode="constant" if dim_mode == "zeros" else dim_mode)
    want = torch.nn.functional.conv3d(padded, w64, stride=stride)
    want.backward(grad_out.double())
    ours, expected = [y, x.grad, w.grad], [want, x64.grad, w64.grad]
    if before:
        ours, expected = [*ours, frames.grad], [*expected, frames64.grad]
    return ours, expected


# A video VAE decoder's fine-tuning step, as conv_with_border_along_d's arguments: (channels, modes along D, H and
# W, frames_before, the sm_90 heuristic's weight gradient's tap_group where it computes it transposed, else 0).
DECODER_WEIGHT_GRADS = [
    ((16, 16), ("zeros", "zeros", "zeros"), 2, 4),  # Wan's cached frames: 4 taps of 16 on the wgmma's rows
    ((32, 48), ("replicate",) * 3, 0, 0),  # HunyuanVideo's and Mochi's borders: the interior, then the strips
    ((16, 32), ("replicate", "reflect", "reflect"), 2, 4),  # LTX-2's reflect borders, cached frames too
    ((32, 16), ("replicate",) * 3, 2, 4),  # 32 channels a tap, 8 warps
]
DECODER_WEIGHT_GRAD_IDS = ["cached", "replicate", "reflect_cached", "replicate_cached_32"]


def decoder_geometry(channels, modes, before):
    """conv_with_border_along_d's geometry."""
    c_in, c_out = channels
    return conv_geometry((1, c_in, 3, 5, 6), (c_out, c_in, 3, 3, 3), 1, (2, 1, 1, 1, 1, 1), 1, ",".join(modes), before)


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("before", [0, 2], ids=["one_source", "frames_before"])
@pytest.mark.parametrize("stride", [1, (2, 1, 1), (1, 2, 2)], ids=["stride1", "stride211", "stride122"])
@pytest.mark.parametrize("mode_d", ["zeros", "replicate", "reflect", "circular"])
def test_border_modes_and_cached_frames_along_d_through_tma(mode_d, stride, before, variant, device):
    """A border mode along D and frames_before in front of the input are a box's frame coordinate (conv_tma.
    source_frame): the forward and the weight gradient run on the TMA kernels too, as the video VAEs' causal convs
    (zeros in H and W) call them; frames_before at a stride in H or W has no phase views and runs on the pointer
    kernels. Against float64 of the concatenated, padded input."""
    _, launches = variant
    ours, expected = conv_with_border_along_d(mode_d, stride, before, torch.float32, device)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.float32)
    assert launches == (["dgrad"] if before and stride == (1, 2, 2) else ["fwd", "dgrad", "wgrad"])


BORDERS_HW = [("replicate", "replicate"), ("reflect", "reflect"), ("zeros", "circular"), ("replicate", "zeros")]


@pytest.mark.parametrize("variant", ["tma"], indirect=True)
@pytest.mark.parametrize("before", [0, 2], ids=["one_source", "frames_before"])
@pytest.mark.parametrize("mode_d", ["zeros", "replicate"])
@pytest.mark.parametrize("modes_hw", BORDERS_HW, ids=lambda m: "_".join(m))
def test_border_modes_in_h_and_w_through_tma_interior_and_pointer_strips(modes_hw, mode_d, before, variant, device):
    """A forward whose border in H or W reads input voxels (HunyuanVideo's and Mochi's replicate, LTX-2's
    decoder's reflect): its interior on the TMA kernel over a view of the output, its border ring on the pointer
    kernel with the modes (conv_fwd.interior_part, utils.ring_voxel); the weight gradient reduces over the same
    parts, each into partial sums of its own."""
    _, launches = variant
    ours, expected = conv_with_border_along_d(mode_d, 1, before, torch.float32, device, modes_hw)
    for got, want in zip(ours, expected, strict=True):
        assert rel_l2(got, want) < tolerance(torch.float32)
    assert launches == ["fwd", "dgrad", "wgrad"]


# Borders in H or W that read input voxels, as the forward cuts them into an interior and a ring (kernel, padding,
# modes): LTX-2's decoder's reflect; two rows on top and one below; a border in W alone (the ring is columns); in
# H alone (whole rows).
RING_BORDERS = [
    ((3, 3, 3), (1, 1, 1, 1, 1, 1), "zeros,reflect,reflect"),
    ((1, 5, 3), (0, 0, 2, 1, 1, 1), "zeros,replicate,circular"),
    ((3, 3, 5), (2, 0, 0, 0, 2, 2), "replicate,zeros,reflect"),
    ((3, 3, 1), (1, 1, 1, 1, 0, 0), "zeros,replicate,zeros"),
]


def bordered_forward(kernel, padding, modes, box_config, monkeypatch, dtype=torch.float32, device="cpu"):
    """conv_fwd.conv3d_fwd of a bordered problem at `box_config(geom)` (with its bias), float64's of the padded
    input, and the (kernel name, grid, RING) of its launches."""
    x = torch.randn(2, 16, 3, 6, 7, device=device).to(dtype).contiguous(memory_format=CL)
    w = torch.randn(24, 16, *kernel, device=device).to(dtype).contiguous(memory_format=CL)
    bias = torch.randn(24, device=device).to(dtype)
    geom = conv_geometry(x.shape, w.shape, 1, padding, 1, modes)
    launched = _recording_launches(monkeypatch, (conv_fwd, conv_tma, conv_gluon))
    y = conv_fwd.conv3d_fwd(x, w, bias, None, geom, box_config(geom))
    want = torch.nn.functional.conv3d(_padded(x.double(), padding, modes), w.double(), bias.double())
    assert y.is_contiguous(memory_format=CL)
    return y, want, launched


def bordered_weight_grad(
    kernel, padding, modes, box_config, monkeypatch, dtype=torch.float32, device="cpu", size=(3, 6, 7)
):
    """conv_wgrad.conv3d_wgrad of bordered_forward's problem (of `size`) at `box_config(geom)` under a random
    grad_out, float64's of the padded input, and the (kernel name, grid, RING) of its launches."""
    x = torch.randn(2, 16, *size, device=device).to(dtype).contiguous(memory_format=CL)
    geom = conv_geometry(x.shape, (24, 16, *kernel), 1, padding, 1, modes)
    grad_out = torch.randn(2, 24, *geom.out_size, device=device).to(dtype).contiguous(memory_format=CL)
    launched = _recording_launches(monkeypatch, (conv_wgrad, conv_tma, conv_gluon))
    got = conv_wgrad.conv3d_wgrad(grad_out, x, None, geom, box_config(geom))
    padded = _padded(x.double(), padding, modes)
    want = torch.nn.grad.conv3d_weight(padded, (24, 16, *kernel), grad_out.double())
    return got, want, launched


def _recording_launches(monkeypatch, modules) -> list:
    launched = []
    for module in modules:
        real = module.launch
        monkeypatch.setattr(module, "launch", lambda k, grid, *a, _real=real, **kw: [
            launched.append((k.__name__, grid, kw.get("RING"))), _real(k, grid, *a, **kw)][1])  # fmt: skip
    return launched


def _padded(x, padding, modes):
    """x padded by `padding` (front and back along D, H, W) with each dimension's mode of `modes`."""
    d_pads, h_pads, w_pads = (0,) * 4 + padding[:2], (0, 0, *padding[2:4], 0, 0), padding[4:] + (0,) * 4
    for pads, mode in zip((d_pads, h_pads, w_pads), modes.split(","), strict=True):
        x = torch.nn.functional.pad(x, pads, mode="constant" if mode == "zeros" else mode)
    return x


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize(("kernel", "padding", "modes"), RING_BORDERS)
def test_bordered_forward_splits_over_its_interior_and_one_ring_launch(
    kernel, padding, modes, split_k, monkeypatch, device
):
    """A forward whose border in H or W reads input voxels, on a box config: the interior on the TMA kernel, every
    border voxel in one pointer launch over the frames' rings (utils.ring_voxel), both in the config's splits of
    the reduction (small_grid_twin's on the Gluon kernel), against float64 of the padded input."""
    config = KernelConfig(16, 16, 16, 4, 2, split_k=split_k)
    y, want, launched = bordered_forward(
        kernel, padding, modes, lambda geom: with_tma(config, geom, "fwd"), monkeypatch, device=device
    )  # fmt: skip
    assert rel_l2(y, want) < tolerance(torch.float32)
    assert [(name, grid[-1] if ring else None, ring) for name, grid, ring in launched] == [
        ("_conv3d_tma_kernel", None, None),
        ("_conv3d_fwd_kernel", split_k, True),  # split_k splits of 27 x 1, 5 x 3 x 1 or 9 x 1 steps each
    ]


@pytest.mark.parametrize(("split_k", "size"), [(1, (3, 6, 7)), (4, (3, 6, 7)), (4, (4, 12, 14))])
@pytest.mark.parametrize(("kernel", "padding", "modes"), RING_BORDERS)
def test_bordered_weight_gradient_reduces_over_its_interior_and_one_ring_launch(
    kernel, padding, modes, split_k, size, monkeypatch, device
):
    """A weight gradient whose border in H or W reads input voxels, on a box config: its reduction over the
    interior's output voxels on the TMA kernel in the config's splits, over every border voxel in one pointer
    launch over the frames' rings (utils.ring_voxel) in as many splits as far as each keeps RING_SPLIT_STEPS steps
    (6-10 steps of 16 voxels: one; at 4 x 12 x 14, 14-30: 1-3), each into fp32 partial sums of its own; against
    float64 of the padded input."""
    config = KernelConfig(16, 16, 16, 4, 2, split_k=split_k)
    got, want, launched = bordered_weight_grad(
        kernel, padding, modes, lambda geom: with_tma(config, geom, "wgrad"), monkeypatch, device=device, size=size
    )  # fmt: skip
    assert rel_l2(got, want) < tolerance(torch.float32)
    geom = conv_geometry((2, 16, *size), (24, 16, *kernel), 1, padding, 1, modes)
    interior, _ = conv_fwd.interior_part(geom, torch.empty(2, 24, *geom.out_size))
    box_h, box_w = with_tma(config, geom, "wgrad").tma_box(16)
    _, d, h, w = 2, *interior.out_size
    patches = 2 * d * -(-h // box_h) * -(-w // box_w)
    interior_splits = -(-patches // -(-patches // split_k))
    ring_steps = -(-2 * d * conv_fwd.ring_voxels(geom) // 16)
    ring_splits = min(interior_splits, max(1, ring_steps // conv_wgrad.RING_SPLIT_STEPS))
    assert [(name, grid[1], ring) for name, grid, ring in launched] == [
        ("_conv3d_wgrad_tma_kernel", interior_splits, None),
        ("_conv3d_wgrad_kernel", ring_splits, True),
    ]


@pytest.mark.parametrize("wide", [False, True], ids=["int32_ring", "int64_ring"])
def test_weight_gradient_ring_indices_of_either_width(wide, monkeypatch, device):
    """The weight gradient's ring launch splits its voxels from their index every step (utils.ring_voxel): in int32
    (an int64 division is a subroutine call: 18-50 calls in the ring kernel, sm_90 and sm_80, none now) unless the
    ring's voxels near 2^31 (WIDE_ROWS, forced here by lowering the bound); against float64 either way."""
    from tconv3d.kernels import utils

    if wide:
        monkeypatch.setattr(utils, "INT32_ROWS", 64)
    flags, real = [], conv_wgrad.launch
    monkeypatch.setattr(conv_wgrad, "launch", lambda kernel, grid, *a, **kw: [
        flags.append((kw.get("RING"), kw.get("WIDE_ROWS"))), real(kernel, grid, *a, **kw)][1])  # fmt: skip
    kernel, padding, modes = RING_BORDERS[0]
    config = KernelConfig(16, 16, 16, 4, 2, split_k=3)
    got, want, _ = bordered_weight_grad(
        kernel, padding, modes, lambda geom: with_tma(config, geom, "wgrad"), monkeypatch, device=device
    )  # fmt: skip
    assert rel_l2(got, want) < tolerance(torch.float32)
    assert flags == [(True, wide)]


@triton.jit
def _store_row(row, values):
    for j in tl.static_range(len(values)):
        tl.store(row + j, values[j])


@triton.jit
def _walk_kernel(got_ptr, want_ptr, first, count, D, H, W, K_BLOCKS, BOX_H: tl.constexpr, BOX_W: tl.constexpr):
    """Row i: patch_origin(first + i) and step_of(first + i) walked with next_patch and next_step, as the Gluon
    kernels' load loops walk them (got), and computed directly (want)."""
    n, d, h, w = conv_tma.patch_origin(first, D, H, W, BOX_H, BOX_W)  # unpacked by name: the compiler (unlike the
    k_tap, k_block = conv_tma.step_of(first, K_BLOCKS)  # interpreter) takes no starred tuples
    for i in range(count):
        _store_row(got_ptr + i * 6, (n, d, h, w, k_tap, k_block))
        n2, d2, h2, w2 = conv_tma.patch_origin(first + i, D, H, W, BOX_H, BOX_W)
        tap2, block2 = conv_tma.step_of(first + i, K_BLOCKS)
        _store_row(want_ptr + i * 6, (n2, d2, h2, w2, tap2, block2))
        n, d, h, w = conv_tma.next_patch(n, d, h, w, D, H, W, BOX_H, BOX_W)
        k_tap, k_block = conv_tma.next_step(k_tap, k_block, K_BLOCKS)


@pytest.mark.parametrize(("first", "size", "box", "k_blocks"), [
    (0, (3, 5, 7), (2, 4), 1),  # boxes no size divides: every wrap (w, h, d, n), channel blocks of 1
    (17, (2, 4, 8), (4, 8), 3),  # a split starting mid-volume; one box a frame
    (5, (1, 1, 33), (1, 16), 6),  # D = H = 1: every wrap of w wraps d and n too
])  # fmt: skip
def test_carried_patches_and_steps_match_their_division(first, size, box, k_blocks, device):
    """next_patch and next_step (the Gluon kernels' load loops carry them instead of dividing every step) walk
    patch_origin's and step_of's order exactly, across every wrap (interpreted on CPU, compiled on a GPU)."""
    d, h, w = size
    count = 4 * d * -(-h // box[0]) * -(-w // box[1])  # four batch entries' patches
    got = torch.full((count, 6), -1, dtype=torch.int32, device=device)
    want = torch.full((count, 6), -2, dtype=torch.int32, device=device)
    _walk_kernel[(1,)](got, want, first, count, d, h, w, k_blocks, box[0], box[1])
    assert (got == want).all(), torch.cat([got, want], 1)[(got != want).any(1)][:4]
    assert len({tuple(row) for row in want[:, :4].tolist()}) == count  # every patch a different one
