"""torch's own conv3d for tensors tconv3d has no kernel for (CPU without the interpreter, other devices).

Same contract as the Triton launchers: checked geometry in, channels_last_3d result out. Asymmetric padding,
which aten cannot express, the padding modes other than zeros and a second source along D become an explicit
F.pad or torch.cat on this path only (channels_after a torch.cat along C).
"""

import math

import torch
import torch.nn.functional as F

from ..geometry import ConvGeometry
from .config import destination_dtype
from .tensors import (
    as_allocated,
    batched,
    cat_channels,
    channels_last,
    exporting_to_onnx,
    fold_padding,
    parameter_grad_dtype,
    traced,
)  # fmt: skip


def _out(t: torch.Tensor, clone: bool = False) -> torch.Tensor:
    """An op's result: channels_last_3d (channels_last), with the strides the op's fake answers (as_allocated).
    As it is in torch.onnx.export's TorchScript exporter's trace, which has no memory formats."""
    if _exporting_by_torchscript():
        return t
    return as_allocated(channels_last(t, clone))


def _exporting_by_torchscript() -> bool:
    """Whether torch.onnx.export's TorchScript exporter traces this (dynamo=False), which knows no memory formats
    and no sizes of an as_strided view."""
    return torch._C._get_tracing_state() is not None and exporting_to_onnx()


def _pad_input(x: torch.Tensor, frames_before, geom: ConvGeometry) -> torch.Tensor:
    if frames_before is not None:
        x = torch.cat([frames_before, x], dim=2)
    # F.pad takes (w, h, d) pairs; dimensions are padded one mode at a time (each mode maps indices per
    # dimension, so the order does not matter).
    for mode in dict.fromkeys(geom.dim_modes):
        pads = [0] * 6
        for dim in range(3):
            if geom.dim_modes[dim] == mode:
                pads[4 - 2 * dim : 6 - 2 * dim] = geom.padding[2 * dim : 2 * dim + 2]
        x = F.pad(x, pads, mode="constant" if mode == "zeros" else mode)
    return x


def _plain(t: torch.Tensor) -> torch.Tensor:
    """t, viewed with a contiguous tensor's strides where it is one whose size-1 dimensions' strides are others (a
    one-channel tensor laid out channels_last_3d, as tconv3d keeps a weight of one input channel, has a channel
    stride of 1). torch's CPU convolutions (2.13, oneDNN) answer garbage for such an input or weight at some
    geometries (W strided by 2 onto one output column: relative errors ~1, values up to 1e33). The same memory."""
    if not t.is_contiguous() or _exporting_by_torchscript():
        return t
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    strides.reverse()
    return t if list(t.stride()) == strides else t.as_strided(t.shape, strides)


def _single_output_strides(geom: ConvGeometry) -> tuple[list[int], list[int]] | None:
    """(strides, reaches) where an output dimension of one voxel is strided (None where none is): that dimension's
    stride made 1 and the padded extent its one output reads (dilation * (kernel - 1) + 1), else the geometry's
    stride and None. At one output voxel the stride changes nothing that is computed, but torch's CPU
    convolutions (2.13, oneDNN, bf16) answer garbage for a grouped conv of one input channel a group and a channel
    multiplier, one frame, strided onto one output column (values up to 1e37, all three directions;
    docs/upstream.md), as they do for a one-channel input (`_plain`). This path then convolves the padded input
    narrowed to those extents at stride 1."""
    if not any(o == 1 and s > 1 for o, s in zip(geom.out_size, geom.stride, strict=True)):
        return None
    strides, reaches = [], []
    for o, s, d, k in zip(geom.out_size, geom.stride, geom.dilation, geom.kernel, strict=True):
        single = o == 1 and s > 1
        strides.append(1 if single else s)
        reaches.append(d * (k - 1) + 1 if single else None)
    return strides, reaches


def _at_single_outputs(padded: torch.Tensor, geom: ConvGeometry) -> tuple[torch.Tensor, list[int]]:
    """(the padded input, the stride) a convolution of `geom` over it runs with: narrowed to its reach and at stride
    1 along each strided dimension of one output voxel (_single_output_strides), else as they are."""
    single = _single_output_strides(geom)
    if single is None:
        return padded, geom.stride
    strides, reaches = single
    for dim, reach in enumerate(reaches):
        if reach is not None:
            padded = padded.narrow(2 + dim, 0, reach)
    return padded, strides


def _dilation(geom: ConvGeometry) -> list[int]:
    """The geometry's dilation, 1 along a dimension of kernel 1, where it changes nothing that is computed. torch's
    CPU conv3d (2.13, oneDNN, bf16) crashes the process (a segmentation fault) for a channels_last_3d input one voxel
    wide along W, padded by 1 and strided by 2 there, its kernel of 1 along W dilated (docs/upstream.md); the same
    conv undilated is right."""
    return [1 if k == 1 else d for k, d in zip(geom.kernel, geom.dilation, strict=True)]


def _weight(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The weight torch's convolution takes: `_plain`, and NCDHW under a torch.func transform that batches x (under
    torch.compile, any transform). torch 2.13's compiled vmap of grad over channels_last_3d convolutions fails at
    run time with a view error (docs/upstream.md: stock AttentionUnet and SegResNetDS made channels_last_3d), and a
    converted SegResNetDS's bf16 graph answered an input gradient 0.29 off, silently; NCDHW weights mend both."""
    return _plain(weight.contiguous() if batched(x) else weight)


def conv3d_fwd(x, weight, bias, frames_before, geom: ConvGeometry, channels_after=None) -> torch.Tensor:
    x = cat_channels(x, channels_after)
    weight = _weight(weight, x)
    plain = geom.is_symmetric and geom.padding_mode == "zeros" and frames_before is None
    if plain and _single_output_strides(geom) is None:
        y = F.conv3d(_plain(x), weight, bias, geom.stride, geom.front_padding, _dilation(geom), geom.groups)
    else:
        padded, stride = _at_single_outputs(_pad_input(x, frames_before, geom), geom)
        y = F.conv3d(_plain(padded), weight, bias, stride, 0, _dilation(geom), geom.groups)
    return _out(y)


def conv3d_dgrad(grad_out, weight, geom: ConvGeometry, channels_after=None, bias=None) -> torch.Tensor:
    grad_out = _plain(cat_channels(grad_out, channels_after))
    weight = _weight(weight, grad_out)
    dtype = grad_out.dtype
    if bias is not None:
        # A transposed convolution's bias, summed with the gradient in float32 and rounded once: aten's 16-bit CPU
        # transposed conv rounds its sum before it adds the bias on some CPUs (an AVX2-only VM), not on the one
        # this was first checked on (a sum within half a rounding of -bias then lands on exactly 0, and a norm over
        # one channel behind it, Wan's test config's, took a gradient of 1e12 there).
        grad_out, weight, bias = grad_out.float(), weight.float(), bias.float()
    elif destination_dtype("dgrad", geom, dtype) != dtype:
        # The bordered gradient in float32, as the kernels write it: the fold then rounds each voxel's sum once.
        grad_out, weight = grad_out.float(), weight.float()
    reach = [(o - 1) * s - 2 * p + d * (k - 1) + 1 for o, s, p, d, k in
             zip(geom.out_size, geom.stride, geom.front_padding, geom.dilation, geom.kernel, strict=True)]  # fmt: skip
    extra = [size - r for size, r in zip(geom.in_size, reach, strict=True)]  # output_padding
    fits = all(0 <= e < s for e, s in zip(extra, geom.stride, strict=True))
    single = _single_output_strides(geom)
    if geom.is_symmetric and geom.padding_mode == "zeros" and fits and single is None:
        # aten's transposed conv pads itself (no padded gradient, no narrowed copy), the bias inside
        grad = F.conv_transpose3d(grad_out, weight, bias, geom.stride, geom.front_padding, extra, geom.groups,
                                  _dilation(geom))  # fmt: skip
        return _out(grad).to(dtype)
    df, db, ht, hb, wl, wr = geom.padding
    d, h, w = geom.in_size
    padded = (geom.batch, geom.in_channels, d + df + db, h + ht + hb, w + wl + wr)
    if single is None:
        grad = _input_gradient(padded, weight, grad_out, geom.stride, geom)
    else:  # the extents the one output voxel read, then zeros past them (see _single_output_strides)
        stride, reaches = single
        read = [r if r is not None else n for r, n in zip(reaches, padded[2:], strict=True)]
        grad = _input_gradient(padded[:2] + tuple(read), weight, grad_out, stride, geom)
        grad = F.pad(grad, [side for n, r in reversed(list(zip(padded[2:], read, strict=True))) for side in (0, n - r)])
    if bias is not None:  # at every voxel, borders too: the fold takes the borders' copies off
        grad = grad + bias.view(1, -1, 1, 1, 1) if traced(grad) else grad.add_(bias.view(1, -1, 1, 1, 1))
    narrowed = "zeros" in geom.dim_modes
    for dim, mode in enumerate(geom.dim_modes):  # a zeros border read nothing: drop its gradient
        if mode == "zeros":
            grad = grad.narrow(2 + dim, geom.padding[2 * dim], geom.in_size[dim])
    if geom.reads_border:
        grad = _out(fold_padding(grad, geom, bias, dtype))  # rounded once, in its one copy
    elif narrowed:
        # A narrow that leaves the gradient contiguous (no border, or one along D with a batch of one) is still a
        # view, which an op must not return: autograd forbids modifying it in place (an in-place SiLU after it).
        grad = _out(grad, clone=True)
    else:
        grad = _out(grad)
    return grad.to(dtype)


def _input_gradient(size, weight, grad_out, stride, geom: ConvGeometry) -> torch.Tensor:
    """The gradient of an unpadded convolution's input of `size`: torch.nn.grad.conv3d_input, or where `traced`
    the transposed convolution it is (aten's convolution_backward, which conv3d_input runs, has no ONNX function,
    nor a record in the TorchScript exporter's trace)."""
    if not traced(grad_out) and not _exporting_by_torchscript():
        return torch.nn.grad.conv3d_input(size, weight, grad_out, stride, 0, _dilation(geom), geom.groups)
    reach = [(o - 1) * s + d * (k - 1) + 1 for o, s, d, k in
             zip(grad_out.shape[2:], stride, geom.dilation, geom.kernel, strict=True)]  # fmt: skip
    extra = [n - r for n, r in zip(size[2:], reach, strict=True)]
    return F.conv_transpose3d(grad_out, weight, None, stride, 0, extra, geom.groups, _dilation(geom))


def conv3d_wgrad(grad_out, x, frames_before, geom: ConvGeometry, channels_after=None) -> torch.Tensor:
    padded, stride = _at_single_outputs(_pad_input(cat_channels(x, channels_after), frames_before, geom), geom)
    grad = torch.nn.grad.conv3d_weight(
        _plain(padded), geom.weight_shape(), _plain(grad_out), stride, 0, _dilation(geom), geom.groups
    )
    return _out(grad)


def scale_shift(mean, rstd, weight, bias, channels: int):
    """Per (n, channel) center, a, b with normalised-and-affine x = (x - center) * a + b (fp32 [N, C], [N, C, 1, 1,
    1]-viewable), as group_norm's kernels take them: x centered before it is scaled (see its module docstring)."""
    per_group = channels // mean.shape[1]
    center = mean.repeat_interleave(per_group, dim=1)
    a = rstd.repeat_interleave(per_group, dim=1)
    if weight is not None:
        a = a * weight.float()
    b = bias.float().expand_as(a) if bias is not None else torch.zeros_like(a)
    return center.contiguous(), a.contiguous(), b.contiguous()


def backward_coefficients(sums, voxels: int, rstd, weight, groups: int):
    """From per (n, channel) sums of dy' and dy' * (x - mean): the coefficients of dx = dy' * k1 + (x - mean) * k2
    + k3 (fp32 [N, C] each; with one channel a group, k3 = -mean(dy') and dx = (dy' + k3) * k1 + (x - mean) * k2)
    and the weight and bias gradients (fp32 [C]), as group_norm._fold_kernel's FOLD_BACKWARD."""
    n, _, c = sums.shape
    per_group = c // groups
    expand = lambda t: t.repeat_interleave(per_group, dim=1)  # noqa: E731  [N, groups] -> [N, C]
    gamma = weight.float()[None, :] if weight is not None else torch.ones(1, c, device=sums.device)
    dy_sum, dyx_sum = sums[:, 0], sums[:, 1]
    dy_xhat = expand(rstd) * dyx_sum  # sum over voxels of dy' * xhat, [N, C]
    grad_bias = dy_sum.sum(dim=0)
    grad_weight = dy_xhat.sum(dim=0)
    group_a = (gamma * dy_sum).view(n, groups, per_group).sum(dim=2)  # sum over the group of gamma * dy'
    group_b = (gamma * dy_xhat).view(n, groups, per_group).sum(dim=2)  # ... of gamma * dy' * xhat
    total = voxels * per_group
    k1 = expand(rstd) * gamma
    k2 = expand(-rstd.square() * group_b / total)
    k3 = expand(-rstd * group_a / total) if per_group > 1 else -dy_sum / total
    if total == 1:  # a group of one value normalizes to 0 whatever it is: dx is 0 (the fold kernel's `single`),
        # NaN where rstd is not finite (eps <= 0, the output NaN too), as torch's
        k1, k2, k3 = (expand(rstd) * 0.0 for _ in range(3))
    return k1.contiguous(), k2.contiguous(), k3.contiguous(), grad_weight, grad_bias


def group_norm_fwd(x, weight, bias, groups: int, eps: float, activation: str, slope=0.01):
    """The kernels' forward in torch ops, fp32: one statistics pass, then y = act((x - mean) * a + b) with the
    same per-(batch, channel) coefficients (`slope` a leaky ReLU's, or a PReLU's weight). Returns (y
    channels_last_3d, mean, rstd fp32 [N, groups])."""
    if x.numel() == 0:  # an empty batch or clip: the kernels' empty answer, NaN statistics
        stats = torch.full((x.shape[0], groups), float("nan"), device=x.device)
        return _out(torch.empty_like(x)), stats, stats.clone()
    xf = x.float()
    var, mean = torch.var_mean(xf.reshape(x.shape[0], groups, -1), dim=2, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    center, a, b = (t[:, :, None, None, None] for t in scale_shift(mean, rstd, weight, bias, x.shape[1]))
    y = activated((xf - center) * a + b, activation, slope)
    return _out(y.to(x.dtype)), mean, rstd


def group_norm_bwd(grad_out, x, mean, rstd, weight, bias, groups: int, activation: str, slope=0.01):
    """The kernels' backward in torch ops: the same sums, coefficients and formula, the parameter gradients in
    parameter_grad_dtype(weight) as the kernels write them, and the PReLU weight's (`slope` a tensor: prelu_grad)."""
    c = x.shape[1]
    # An empty batch or clip: the kernels' answer, an empty gradient and zero parameter gradients (the sums below
    # would give NaN ones for an empty clip of a batch, the NaN statistics times empty sums, as torch's GroupNorm)
    if x.numel() == 0:
        zeros = torch.zeros(c, device=x.device, dtype=parameter_grad_dtype(weight))
        return _out(torch.empty_like(x)), zeros, zeros.clone(), prelu_grad(slope, None, None)
    dy = grad_out.float()
    center, a, b = (t[:, :, None, None, None] for t in scale_shift(mean, rstd, weight, bias, c))
    centered = x.float() - center
    z = centered * a + b if activation != "none" else None
    slope_grad = prelu_grad(slope, dy, z)
    if activation != "none":
        dy = _activation_backward(dy, z, activation, slope)
    sums = torch.stack([dy.sum(dim=(2, 3, 4)), (dy * centered).sum(dim=(2, 3, 4))], dim=1)
    k1, k2, k3, grad_weight, grad_bias = backward_coefficients(sums, math.prod(x.shape[2:]), rstd, weight, groups)
    per_channel = lambda t: t[:, :, None, None, None]  # noqa: E731
    if groups == c:  # one channel a group: dy' centered first, as the affine kernel does
        grad_in = (dy + per_channel(k3)) * per_channel(k1) + centered * per_channel(k2)
    else:
        grad_in = dy * per_channel(k1) + centered * per_channel(k2) + per_channel(k3)
    dtype = parameter_grad_dtype(weight)
    return _out(grad_in.to(x.dtype)), grad_weight.to(dtype), grad_bias.to(dtype), slope_grad


def prelu_grad(slope, dy, z) -> torch.Tensor | None:
    """The gradient of a PReLU's weight `slope` (one, or one a channel) from dy and its input z (fp32; None: an
    empty tensor, no voxels): the sum of dy * z where z <= 0 over each channel (over all of them for one weight),
    in the weight's dtype; None where `slope` is a number (no PReLU: group_norm_backward's fourth output)."""
    if not isinstance(slope, torch.Tensor):
        return None
    if dy is None:
        return torch.zeros_like(slope)
    sums = torch.where(z > 0, 0.0, dy * z).sum(dim=(0, 2, 3, 4))
    return (sums.sum().reshape(1) if slope.numel() == 1 else sums).to(slope.dtype)


def rms_norm_fwd(x, weight, bias, eps: float, activation: str, clamp: bool = False) -> torch.Tensor:
    """The rms_norm kernel's forward in torch ops, fp32: act(x / divisor(x) * weight + bias)."""
    xf = x.float()
    y = activated(_channel_affine(xf / _rms_divisor(xf, eps, clamp), weight, bias), activation)
    return _out(y.to(x.dtype))


def rms_norm_bwd(grad_out, x, weight, bias, eps: float, activation: str, clamp: bool = False):
    """The kernel's backward in torch ops: its formula, fp32, the parameter gradients in parameter_grad_dtype(weight)
    as the kernels write them."""
    xf, dz = x.float(), grad_out.float()
    divisor = _rms_divisor(xf, eps, clamp)
    normalized = xf / divisor
    if activation != "none":
        dz = _activation_backward(dz, _channel_affine(normalized, weight, bias), activation)
    per_channel = lambda t: t.float().view(1, -1, 1, 1, 1)  # noqa: E731
    g = dz * per_channel(weight) if weight is not None else dz
    along = (g * normalized).mean(dim=1, keepdim=True)
    if clamp:  # a clamped divisor is a constant: nothing flows through it
        along = torch.where(divisor > eps, along, 0.0)
    grad_in = (g - normalized * along) * (1.0 / divisor)
    reduce = (0, 2, 3, 4)
    dtype = parameter_grad_dtype(weight)
    return _out(grad_in.to(x.dtype)), (dz * normalized).sum(dim=reduce).to(dtype), dz.sum(dim=reduce).to(dtype)


def _rms_divisor(xf, eps: float, clamp: bool):
    """Each voxel's divisor: sqrt(mean(x^2) + eps), or max(sqrt(mean(x^2)), eps) with `clamp`. x is divided by it
    (one rounding; the kernels multiply rows of more than one channel by its inverse, a rounding apart): a
    one-channel voxel normalizes to +-1 exactly and its gradient is exactly 0 (rms_norm.py's _normalized)."""
    mean_square = xf.square().mean(dim=1, keepdim=True)
    return mean_square.sqrt().clamp_min(eps) if clamp else (mean_square + eps).sqrt()


def _channel_affine(normalized, weight, bias):
    if weight is not None:
        normalized = normalized * weight.float().view(1, -1, 1, 1, 1)
    if bias is not None:
        normalized = normalized + bias.float().view(1, -1, 1, 1, 1)
    return normalized


def activated(z, activation: str | None, slope=0.01):
    """act(z) in torch ops of a norm's fused `activation` (geometry.NORM_ACTIVATIONS, or None as the modules name
    "none"; `slope` a leaky ReLU's number or a PReLU's weight, one or one a channel): the aten path's, and the
    modules' after a norm torch's ops computed."""
    if activation == "silu":
        return F.silu(z)
    if activation == "relu":
        return F.relu(z)
    if activation == "leaky_relu":
        return F.leaky_relu(z, slope)
    return torch.where(z > 0, z, z * _per_channel(slope, z)) if activation == "prelu" else z


def _per_channel(slope, like):
    """A PReLU's weight (one, or one a channel) as a factor of `like` (N, C, D, H, W), in its dtype."""
    return slope.to(like.dtype).view(1, -1, 1, 1, 1)


def _activation_backward(dy, z, activation: str, slope=0.01):
    """dy * act'(z), as the kernels' utils.activation_backward: SiLU's derivative, or ReLU's, leaky ReLU's or
    PReLU's select."""
    if activation == "relu":
        return torch.where(z > 0, dy, 0.0)
    if activation in ("leaky_relu", "prelu"):
        return torch.where(z > 0, dy, dy * (_per_channel(slope, dy) if activation == "prelu" else slope))
    sig = torch.sigmoid(z)
    return dy * (sig * (1 + z * (1 - sig)))


# Forward-mode derivatives (tangents) of the norms, in torch ops, fp32, on every device: the kernels compute
# primals only. Each takes the primals and their tangents (zeros where an input has none; t_weight, t_bias None)
# and returns the output's tangent in the input's dtype, in whatever layout torch's ops give (under vmap, as
# jacfwd runs them, a batched tensor takes no channels_last_3d copy): the op lays it out.


def group_norm_jvp(
    x, t_x, weight, bias, t_weight, t_bias, groups: int, eps: float, activation: str, slope=0.01, t_slope=None
):  # fmt: skip
    """The tangents of group_norm_fwd's (y, mean, rstd) along (t_x, t_weight, t_bias): with x's groups centered
    (c = x - mean) and r = rstd, d mean = mean(t_x), d r = -r^3 mean(c t_x), d (c r) = (t_x - d mean) r + c d r."""
    xf, t_xf = x.float(), t_x.float()
    n = x.shape[0]
    per_group = x.shape[1] // groups * math.prod(x.shape[2:])  # not -1: ambiguous in an empty batch
    grouped, t_grouped = xf.reshape(n, groups, per_group), t_xf.reshape(n, groups, per_group)
    var, mean = torch.var_mean(grouped, dim=2, unbiased=False)
    rstd = torch.rsqrt(var + eps)
    centered = grouped - mean[..., None]
    t_mean = t_grouped.mean(dim=2)
    t_rstd = -rstd.pow(3) * (centered * t_grouped).mean(dim=2)
    normalized = (centered * rstd[..., None]).reshape(x.shape)
    t_normalized = ((t_grouped - t_mean[..., None]) * rstd[..., None] + centered * t_rstd[..., None]).reshape(x.shape)
    t_y = _affine_tangent(normalized, t_normalized, weight, bias, t_weight, t_bias, activation, slope, t_slope)
    return t_y.to(x.dtype), t_mean, t_rstd


def rms_norm_jvp(x, t_x, weight, bias, t_weight, t_bias, eps: float, activation: str, clamp: bool = False):
    """The tangent of rms_norm_fwd along (t_x, t_weight, t_bias): with d the divisor and x^ = x / d, that of x^ is
    (t_x - x^ mean(x^ t_x)) / d over the channels (t_x / d where `clamp` holds the divisor at eps: a constant)."""
    xf, t_xf = x.float(), t_x.float()
    divisor = _rms_divisor(xf, eps, clamp)
    normalized = xf / divisor
    along = (normalized * t_xf).mean(dim=1, keepdim=True)
    if clamp:
        along = torch.where(divisor > eps, along, 0.0)
    t_normalized = (t_xf - normalized * along) / divisor
    t_y = _affine_tangent(normalized, t_normalized, weight, bias, t_weight, t_bias, activation)
    return t_y.to(x.dtype)


def _affine_tangent(
    normalized, t_normalized, weight, bias, t_weight, t_bias, activation: str, slope=0.01, t_slope=None
):  # fmt: skip
    """The tangent of act(normalized * weight + bias) (per-channel weight and bias, either None; a PReLU's weight
    `slope` and its tangent t_slope, None for none)."""
    t_z = _channel_affine(t_normalized, weight, None)
    if t_weight is not None:
        t_z = t_z + _channel_affine(normalized, t_weight, None)
    if t_bias is not None:
        t_z = t_z + t_bias.float().view(1, -1, 1, 1, 1)
    if activation != "none":
        z = _channel_affine(normalized, weight, bias)
        t_z = _activation_backward(t_z, z, activation, slope)
        if t_slope is not None:  # PReLU's: z * t_slope where z <= 0
            t_z = t_z + torch.where(z > 0, 0.0, z * _per_channel(t_slope, z))
    return t_z


def upsample_linear_fwd(x, factors) -> torch.Tensor:
    """F.interpolate(x, scale_factor=factors, mode="trilinear"), channels_last_3d (resample.py's contract)."""
    return _out(F.interpolate(x, scale_factor=[float(f) for f in factors], mode="trilinear"))


def upsample_linear_bwd(grad_out, input_size, factors) -> torch.Tensor:
    """Its input gradient, channels_last_3d."""
    scales = [float(f) for f in factors]
    grad = torch.ops.aten.upsample_trilinear3d_backward(grad_out, list(grad_out.shape[2:]), list(input_size), False,
                                                        *scales)  # fmt: skip
    return _out(grad)
