"""Every bad input a user can pass gets a clear Python exception, before any kernel launches."""

import pytest
import torch

import tconv3d


def args(device, **overrides):
    call = dict(
        input=torch.randn(1, 4, 5, 6, 7, device=device),
        weight=torch.randn(8, 4, 3, 3, 3, device=device),
        bias=torch.randn(8, device=device),
        stride=1,
        padding=1,
        dilation=1,
        groups=1,
    )
    call.update(overrides)
    return call


BAD_INPUTS = [
    ("input_3d", lambda d: args(d, input=torch.randn(5, 6, 7, device=d)), ValueError, "input must be 5-D"),
    ("weight_4d", lambda d: args(d, weight=torch.randn(8, 4, 3, 3, device=d)), ValueError, "weight must be 5-D"),
    (
        "channel_mismatch",
        lambda d: args(d, weight=torch.randn(8, 5, 3, 3, 3, device=d)),
        ValueError,
        "channel mismatch",
    ),
    (
        "weight_dtype_mismatch",
        lambda d: args(d, weight=torch.randn(8, 4, 3, 3, 3, device=d, dtype=torch.float16)),
        TypeError,
        "weight dtype torch.float16 does not match input dtype torch.float32",
    ),
    (
        "bias_dtype_mismatch",
        lambda d: args(d, bias=torch.randn(8, device=d, dtype=torch.bfloat16)),
        TypeError,
        "bias dtype",
    ),
    ("bias_shape", lambda d: args(d, bias=torch.randn(7, device=d)), ValueError, "bias must have shape (8,)"),
    ("bias_2d", lambda d: args(d, bias=torch.randn(8, 1, device=d)), ValueError, "bias must have shape"),
    ("stride_zero", lambda d: args(d, stride=0), ValueError, "stride must be >= 1"),
    ("stride_negative", lambda d: args(d, stride=(1, -1, 1)), ValueError, "stride must be >= 1"),
    ("dilation_zero", lambda d: args(d, dilation=(1, 1, 0)), ValueError, "dilation must be >= 1"),
    ("padding_negative", lambda d: args(d, padding=(1, -1, 1)), ValueError, "padding must be non-negative"),
    ("padding_length_2", lambda d: args(d, padding=(1, 1)), ValueError, "padding must have 1, 3 or 6 values"),
    ("padding_length_4", lambda d: args(d, padding=(1, 1, 1, 1)), ValueError, "padding must have 1, 3 or 6 values"),
    ("padding_bad_string", lambda d: args(d, padding="full"), ValueError, "padding must be 'same', 'valid'"),
    ("same_with_stride", lambda d: args(d, padding="same", stride=2), ValueError, "not supported for strided"),
    ("stride_length_2", lambda d: args(d, stride=(1, 2)), ValueError, "stride must have 1 or 3 values"),
    ("stride_float", lambda d: args(d, stride=1.5), TypeError, "stride must be an int"),
    (
        "input_smaller_than_dilated_kernel",
        lambda d: args(d, input=torch.randn(1, 4, 5, 3, 7, device=d), padding=0, dilation=2),
        ValueError,
        "input is smaller than the dilated kernel in dimension H",
    ),
    (
        "input_empty_w_padded",  # torch refuses an empty D, H or W in a batch, whatever the padding adds
        lambda d: args(d, input=torch.randn(1, 4, 5, 6, 0, device=d)),
        ValueError,
        "has an empty W: as torch's convolutions, tconv3d takes an empty batch but not an empty D, H or W",
    ),
    ("input_not_tensor", lambda d: args(d, input=[[1.0]]), TypeError, "input must be a torch.Tensor, got list"),
    ("weight_not_tensor", lambda d: args(d, weight=3.0), TypeError, "weight must be a torch.Tensor, got float"),
    ("bias_not_tensor", lambda d: args(d, bias=[0.0] * 8), TypeError, "bias must be a torch.Tensor"),
    (
        "integer_dtype",
        lambda d: args(
            d,
            input=torch.randint(0, 5, (1, 4, 5, 6, 7), device=d),
            weight=torch.randint(0, 5, (8, 4, 3, 3, 3), device=d),
            bias=None,
        ),
        TypeError,
        "input has dtype torch.int64; tconv3d supports float16, bfloat16 and float32",
    ),
    (
        "float64",
        lambda d: args(d, input=torch.randn(1, 4, 5, 6, 7, dtype=torch.float64, device=d)),
        TypeError,
        "tconv3d supports float16, bfloat16 and float32",
    ),
    ("groups_not_dividing", lambda d: args(d, groups=3), ValueError, "groups=3 must divide both the 4 input"),
    ("groups_zero", lambda d: args(d, groups=0), ValueError, "groups must be a positive integer"),
    (
        "groups_weight_mismatch",
        lambda d: args(d, groups=2),
        ValueError,
        "input has 4 channels but weight (8, 4, 3, 3, 3) with groups=2 expects 8",
    ),
    (
        "different_devices",
        lambda d: args(d, weight=torch.randn(8, 4, 3, 3, 3, device="meta")),
        ValueError,
        "weight is on meta but input is on",
    ),
]


@pytest.mark.parametrize(("make_args", "error", "words"), [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_functional_rejects(make_args, error, words, device):
    with pytest.raises(error) as info:
        tconv3d.conv3d(**make_args(device))
    assert words in str(info.value)


OP_BAD_INPUTS = [b for b in BAD_INPUTS if b[0] not in {"padding_bad_string", "same_with_stride", "stride_float"}]
OP_BAD_INPUTS = [b for b in OP_BAD_INPUTS if not b[0].endswith("not_tensor")]  # the op schema rejects those itself


def _as_op_args(call):
    def as_list(v):
        return [v] if isinstance(v, int) else list(v)

    return (
        call["input"],
        call["weight"],
        call["bias"],
        as_list(call["stride"]),
        as_list(call["padding"]),
        as_list(call["dilation"]),
        call["groups"],
    )


@pytest.mark.parametrize(
    ("make_args", "error", "words"), [b[1:] for b in OP_BAD_INPUTS], ids=[b[0] for b in OP_BAD_INPUTS]
)
def test_op_rejects(make_args, error, words, device):
    """torch.ops.tconv3d.conv3d is a public entry too: it checks the same things."""
    with pytest.raises(error) as info:
        torch.ops.tconv3d.conv3d(*_as_op_args(make_args(device)))
    assert words in str(info.value)


def test_gradient_ops_reject_wrong_grad_output_shape(device):
    w = torch.randn(8, 4, 3, 3, 3, device=device)
    go = torch.randn(1, 8, 5, 6, 6, device=device)
    with pytest.raises(ValueError, match="grad_output has shape"):
        torch.ops.tconv3d.conv3d_input_grad(go, w, [1, 4, 5, 6, 7], [1, 1, 1], [1, 1, 1], [1, 1, 1])
    x = torch.randn(1, 4, 5, 6, 7, device=device)
    with pytest.raises(ValueError, match="grad_output has shape"):
        torch.ops.tconv3d.conv3d_weight_grad(go, x, [8, 4, 3, 3, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1])


def test_gradient_ops_reject_dtype_mismatch(device):
    w = torch.randn(8, 4, 3, 3, 3, device=device)
    go = torch.randn(1, 8, 5, 6, 7, device=device, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"weight dtype torch\.float32 does not match grad_output dtype"):
        torch.ops.tconv3d.conv3d_input_grad(go, w, [1, 4, 5, 6, 7], [1, 1, 1], [1, 1, 1], [1, 1, 1])


def test_empty_dimensions_are_refused_as_torch_refuses_them(device):
    """An empty D, H or W in a batch is refused by every entry, as torch refuses it, even where padding would make
    the convolution's input non-empty (tests/fuzz_args.py found tconv3d answering such calls: zeros, and a
    transposed conv's bias). An empty batch is still answered; and so is an empty input with frames before it,
    whose concatenation is not empty."""
    x = torch.randn(2, 3, 4, 0, 5, device=device)
    w = torch.randn(2, 3, 3, 1, 3, device=device)
    with pytest.raises(RuntimeError, match="Only zero batch or zero channel"):
        torch.nn.functional.conv3d(x, w, padding=1)
    with pytest.raises(ValueError, match="has an empty H"):
        tconv3d.conv3d(x, w, padding=1)
    with pytest.raises(ValueError, match="has an empty H"):
        tconv3d.conv_transpose3d(x, w.transpose(0, 1))
    with pytest.raises(ValueError, match="has an empty D"):
        torch.ops.tconv3d.conv3d_input_grad(
            torch.randn(1, 2, 0, 2, 4, device=device), w, [1, 3, 0, 2, 4], [1, 1, 1], [1, 1, 1], [1, 1, 1]
        )
    assert tconv3d.conv3d(x[:0], w, padding=1).shape == (0, 2, 4, 2, 5)
    assert torch.nn.functional.conv3d(x[:0], w, padding=1).shape == (0, 2, 4, 2, 5)
    frames = torch.randn(1, 3, 2, 4, 5, device=device)
    w = torch.randn(2, 3, 3, 3, 3, device=device)
    y = tconv3d.conv3d(torch.randn(1, 3, 0, 4, 5, device=device), w, padding=1, frames_before=frames)
    torch.testing.assert_close(y, torch.nn.functional.conv3d(frames, w, padding=1), atol=1e-4, rtol=1e-4)


def test_norms_refuse_one_value_a_group_as_torch_does(device):
    """torch's GroupNorm refuses an input whose groups hold one value in all (batch, channels a group and voxels:
    1), its InstanceNorm3d one voxel a channel; tconv3d.nn's answered the bias there (found by tests/fuzz_args.py).
    An RMS norm of one channel and one voxel is answered."""
    x = torch.randn(1, 2, 1, 1, 1, device=device)
    for make in (lambda nn: nn.GroupNorm(2, 2), lambda nn: nn.InstanceNorm3d(2)):
        with pytest.raises(ValueError, match="Expected more than 1"):
            make(torch.nn).to(device)(x)
        with pytest.raises(ValueError, match="expects more than 1"):
            make(tconv3d.nn).to(device)(x)
    with pytest.raises(ValueError, match="expects more than 1 value per group"):
        torch.ops.tconv3d.group_norm(x, None, None, 2, 1e-5)
    assert tconv3d.nn.GroupNorm(1, 2).to(device)(x).shape == x.shape  # two values a group
    y = tconv3d.nn.InstanceNorm3d(2).to(device)(torch.randn(2, 2, 1, 1, 2, device=device))
    assert y.shape == (2, 2, 1, 1, 2)
    # an RMS norm's values are a voxel's channels: one is its sign (the refusal above once reached it)
    one = torch.tensor([-3.0], device=device).view(1, 1, 1, 1, 1)
    assert torch.ops.tconv3d.rms_norm(one, None, None, 1e-6, "none", True).item() == -1.0


def test_upsample_linear_refuses_an_empty_dimension_as_interpolate_does(device):
    """F.interpolate refuses an empty D, H or W whatever the batch; torch.ops.tconv3d.upsample_linear answered an
    empty tensor (found by tests/fuzz_args.py)."""
    x = torch.randn(0, 2, 3, 0, 4, device=device)
    with pytest.raises(RuntimeError, match="sizes should be greater than 0"):
        torch.nn.functional.interpolate(x, scale_factor=2.0, mode="trilinear")
    with pytest.raises(ValueError, match="upsample_linear of an empty D, H or W"):
        torch.ops.tconv3d.upsample_linear(x, [2, 2, 2])
    with pytest.raises(ValueError, match="upsample_linear of an empty D, H or W"):
        torch.ops.tconv3d.upsample_linear_backward(torch.randn(0, 2, 6, 0, 8, device=device), [0, 2, 3, 0, 4], [2] * 3)
