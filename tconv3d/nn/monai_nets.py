"""Adapters for MONAI's 3D networks, as video_vaes.py holds diffusers' (same contract: `classes`, `attributes`,
`reason`; monai is never imported here). MONAI's convolutions, transposed convolutions and norms are plain torch
modules that convert takes over as they are; what is left are the places where a network's own code turns a
channels_last_3d activation NCDHW (a `.contiguous()`, MONAI's convert_to_tensor, a view that flattens), the
decoder blocks' skip connections, each a `torch.cat` along C in front of a convolution (MONAI UNet's: of a
transposed convolution), which the adapters hand to the convolution as its `channels_after`, read in place, zero
padding made as a copy before a convolution (`fold_paddings`), and MAISI's own modules (its split convolutions and
group-by-group norms), which tconv3d runs whole."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels.tensors import channels_last, exporting_to_onnx, func_transformed, traced
from .hooks import hand, hooked, wrapper, wrapper_error
from .modules import (
    BatchNorm3d,
    Conv3d,
    ConvTranspose3d,
    GroupNorm,
    InstanceNorm3d,
    _laid_out_only,
    activation_of,
    add_into,
    add_repeated_,
    autograd_traced,
    format_strides,
    laid_out,
    layout_of,
    normalize,
    resize_nearest,
    upsample_linear,
)
from .subpixel import upsampled_conv_reason

_CL = torch.channels_last_3d

# MONAI's blocks that run their input through conv1 (and, UnetResBlock, conv3 on the residual path): the decoder
# blocks' convolutions of the concatenation.
_CONV_BLOCKS = ("UnetBasicBlock", "UnetResBlock")


class _UNETR:
    """MONAI's UNETR: `proj_feat` turns the ViT's (B, tokens, hidden)
    states into the decoder's (B, hidden, D, H, W) by a view, a permute and `.contiguous()`: an NCDHW copy of a
    tensor that the permute alone already lays out channels_last_3d. The adapter returns the permuted view (same
    values, no copy), so the four convolution paths it feeds read it without a layout copy."""

    classes = ("monai.networks.nets.unetr.UNETR",)
    attributes = ("proj_axes", "proj_view_shape")

    @staticmethod
    def reason(module) -> str | None:
        if tuple(module.proj_axes) != (0, 4, 1, 2, 3):
            return f"its proj_axes are {tuple(module.proj_axes)}, not a 3-D network's (0, 4, 1, 2, 3)"
        return None

    def proj_feat(self, x):
        return x.view([x.size(0), *self.proj_view_shape]).permute(self.proj_axes)


def _checkpointed(module: nn.Module) -> nn.Module | None:
    """The module inside MONAI's ActivationCheckpointWrapper (CheckpointUNet wraps each level's down path,
    subblock and up path in one), else None."""
    return module.module if type(module).__name__ == "ActivationCheckpointWrapper" else None


def conv_of_concatenation(layer: nn.Module, x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """layer(torch.cat([x, after], dim=1)) for a bare convolution, a MONAI `Convolution` (an nn.Sequential whose
    first module is its convolution or transposed convolution, then its norm, dropout and activation) or an
    nn.Sequential that starts with one (MONAI UNet's up path: a Convolution, then a ResidualUnit), each possibly
    in MONAI's ActivationCheckpointWrapper (checkpointed as the wrapper does, both inputs saved): a tconv3d
    convolution reads `after` in place as its channels_after; anything else (a layer convert left alone, a container
    with hooks) gets the concatenation."""
    if hooked(layer) and not isinstance(layer, (Conv3d, ConvTranspose3d)):
        return layer(torch.cat([x, after], dim=1))
    if (inner := _checkpointed(layer)) is not None:  # the wrapper's own call: checkpoint(module, input)
        return checkpoint(conv_of_concatenation, inner, x, after, use_reentrant=False)
    if isinstance(layer, (Conv3d, ConvTranspose3d)):
        return layer(x, channels_after=after)
    if not isinstance(layer, nn.Sequential) or not len(layer):
        return layer(torch.cat([x, after], dim=1))
    first, *rest = layer
    out = conv_of_concatenation(first, x, after)
    for module in rest:
        out = module(out)
    return out


def _block_of_concatenation(block: nn.Module, x: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """MONAI's UnetBasicBlock or UnetResBlock forward on torch.cat([x, after], dim=1), its convolutions of the input
    reading the two in place (the block called on the concatenation where it has hooks)."""
    if hooked(block):
        return block(torch.cat([x, after], dim=1))
    return _dynunet_block(block, x, after)


def _dynunet_block(block: nn.Module, x: torch.Tensor, after: torch.Tensor | None = None) -> torch.Tensor:
    """MONAI's UnetBasicBlock or UnetResBlock forward (dynunet_block.py), of torch.cat([x, after], dim=1) where
    `after` is given (its convolutions of the input read the two in place): each norm's LeakyReLU that follows it
    directly in its pass (norm_then; a UnetResBlock's second one comes after the residual's sum)."""
    first = block.conv1(x) if after is None else conv_of_concatenation(block.conv1, x, after)
    out = block.conv2(norm_then(block.norm1, block.lrelu, first))
    if type(block).__name__ != "UnetResBlock":
        return norm_then(block.norm2, block.lrelu, out)
    out = block.norm2(out)
    if hasattr(block, "conv3"):
        residual = block.conv3(x) if after is None else conv_of_concatenation(block.conv3, x, after)
    else:
        residual = x if after is None else torch.cat([x, after], dim=1)
    if hasattr(block, "norm3"):
        residual = block.norm3(residual)
    out += residual
    return block.lrelu(out)


def norm_then(norm: nn.Module, activation: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """activation(norm(x)), the activation in the norm's pass where it can be: a converted norm with no activation of
    its own, an activation module it takes (modules.FUSED_ACTIVATIONS), neither hooked (then both are called)."""
    fused = activation_of(activation)
    on_kernels = isinstance(norm, (GroupNorm, InstanceNorm3d, BatchNorm3d)) and norm.activation is None
    if fused is None or not on_kernels or hooked(norm) or hooked(activation):
        return activation(norm(x))
    return norm.normalized(x, fused)


class _SegResBlock:
    """MONAI's SegResNet and SegResNetDS residual blocks (segresnet_block.ResBlock, segresnet_ds.SegResBlock: norm,
    activation, conv, twice, then the input added, in code): each norm's activation (a ReLU by default) in the
    norm's pass (norm_then), where the block called it after the norm and wrote and read the activation again."""

    classes = ("monai.networks.blocks.segresnet_block.ResBlock", "monai.networks.nets.segresnet_ds.SegResBlock")
    attributes = ("norm1", "conv1", "norm2", "conv2")

    def forward(self, x):
        first, second = (self.act1, self.act2) if hasattr(self, "act1") else (self.act, self.act)
        out = self.conv2(norm_then(self.norm2, second, self.conv1(norm_then(self.norm1, first, x))))
        out += x
        return out


class _DynUNetBlock:
    """MONAI's DynUNet blocks (UnetBasicBlock, UnetResBlock: conv, norm, LeakyReLU, conv, norm, in code): each
    norm's LeakyReLU (or another activation a norm takes) in the norm's pass, where the block called it after the
    norm and wrote and read the activation again (_dynunet_block)."""

    classes = ("monai.networks.blocks.dynunet_block.UnetBasicBlock", "monai.networks.blocks.dynunet_block.UnetResBlock")
    attributes = ("conv1", "conv2", "norm1", "norm2", "lrelu")

    def forward(self, inp):
        return _dynunet_block(self, inp)


def _conv_block_reason(module) -> str | None:
    name = type(module.conv_block).__name__
    if name not in _CONV_BLOCKS:
        return f"its conv_block is a {name}, not one of MONAI's {_CONV_BLOCKS}"
    return None


class _UpBlock:
    """MONAI's decoder up blocks of DynUNet (UnetUpBlock) and of UNETR and SwinUNETR (UnetrUpBlock): the upsampled
    input concatenated with the skip connection along C, `torch.cat((out, skip), dim=1)`, feeds the conv block's
    first convolution (and, in a residual block, its 1x1x1 residual one). The adapter hands `skip` to those
    convolutions as channels_after: no concatenated copy."""

    classes = ("monai.networks.blocks.dynunet_block.UnetUpBlock", "monai.networks.blocks.unetr_block.UnetrUpBlock")
    attributes = ("transp_conv", "conv_block")
    reason = staticmethod(_conv_block_reason)

    def forward(self, inp, skip):
        return _block_of_concatenation(self.conv_block, self.transp_conv(inp), skip)


class _UpCat:
    """MONAI's BasicUNet up block: `self.convs(torch.cat([x_e, x_0], dim=1))`, the encoder's features then the
    upsampled ones into a TwoConv (two Convolutions). The adapter gives the first Convolution x_0 as channels_after.
    Where the encoder's size is odd, MONAI replicate-pads x_0 by one plane at the far side (F.pad: a copy of all of
    x_0 at the level's resolution): a lone transposed conv upsampling (MONAI's default, "deconv") writes that plane
    itself (its output_size, the plane its bias alone) and the plane before it is copied over it in place, one plane
    a padded dim; another upsampling keeps MONAI's pad. Where it pads nothing (even sizes), MONAI's F.pad copied x_0
    all the same, and here it is not called."""

    classes = ("monai.networks.nets.basic_unet.UpCat",)
    attributes = ("upsample", "convs", "is_pad")

    @staticmethod
    def reason(module) -> str | None:
        names = list(module.convs._modules) if isinstance(module.convs, nn.Sequential) else []
        if names != ["conv_0", "conv_1"]:
            return f"its convs are {type(module.convs).__name__} {names}, not MONAI's TwoConv (conv_0, conv_1)"
        return None

    def forward(self, x, x_e):
        if not isinstance(x_e, torch.Tensor):
            return self.convs(self.upsample(x))
        x_0 = self._upsampled(x, x_e.shape[2:]) if self.is_pad else self.upsample(x)
        if hooked(self.convs):
            return self.convs(torch.cat([x_e, x_0], dim=1))
        return self.convs.conv_1(conv_of_concatenation(self.convs.conv_0, x_e, x_0))

    def _upsampled(self, x, size):
        """self.upsample(x), replicate-padded by one plane at the far side of each dim where its size is not
        `size` (MONAI's: the 2x max pooling of odd edge lengths)."""
        deconv = getattr(self.upsample, "deconv", None)
        if isinstance(self.upsample, nn.Sequential) and len(self.upsample) == 1 and isinstance(deconv, ConvTranspose3d):
            natural = [(n - 1) * s - 2 * p + d * (k - 1) + o + 1 for n, s, p, d, k, o in zip(
                x.shape[2:], deconv.stride, deconv.padding, deconv.dilation, deconv.kernel_size,
                deconv.output_padding, strict=True)]  # fmt: skip
            padded = [i for i in range(3) if size[i] != natural[i]]
            if padded and all(size[i] == natural[i] + 1 and deconv.output_padding[i] + 1 < deconv.stride[i]
                              for i in padded):  # fmt: skip
                x_0 = deconv(x, output_size=hand(deconv, list(size)))  # each padded dim's last plane: the bias alone
                for i in reversed(padded):  # W first, as F.pad's replicate: corners from planes already copied
                    x_0.narrow(i + 2, -1, 1).copy_(x_0.narrow(i + 2, -2, 1))
                return x_0
        x_0 = self.upsample(x)
        pads = [0] * (2 * (x.dim() - 2))
        for i in range(x.dim() - 2):
            if size[-i - 1] != x_0.shape[-i - 1]:
                pads[2 * i + 1] = 1
        return F.pad(x_0, pads, "replicate") if any(pads) else x_0


class _AttentionLayer:
    """MONAI's AttentionUnet level: `self.merge(torch.cat((att, fromlower), dim=1))`, the attention-gated skip
    features then the upsampled ones into a Convolution. The adapter gives that Convolution `fromlower` as
    channels_after."""

    classes = ("monai.networks.nets.attentionunet.AttentionLayer",)
    attributes = ("upconv", "submodule", "attention", "merge")

    def forward(self, x):
        fromlower = self.upconv(self.submodule(x))
        att = self.attention(g=fromlower, x=x)
        return conv_of_concatenation(self.merge, att, fromlower)


class _VNetUp:
    """MONAI's VNet up level (UpTransition): `xcat = torch.cat((out, skipx), 1)` feeds its LUConvs' first
    convolution and is added back as the residual, `torch.add(self.ops(xcat), xcat)`. The adapter gives the first
    convolution `skipx` as channels_after and adds each source to its own channels of the last LUConv's output
    (`_plus_concatenation`): the concatenation is never made. Hooks on the LUConvs, or sources of two dtypes, run
    MONAI's forward."""

    classes = ("monai.networks.nets.vnet.UpTransition",)
    attributes = ("up_conv", "bn1", "dropout", "dropout2", "act_function1", "act_function2", "ops")

    @staticmethod
    def reason(module) -> str | None:
        ops = module.ops
        if not (isinstance(ops, nn.Sequential) and len(ops) and all(hasattr(m, "conv_block") for m in ops)):
            return "its ops are not an nn.Sequential of MONAI's LUConv"
        return None

    def forward(self, x, skipx):
        out = self.dropout(x) if self.dropout is not None else x
        skip = self.dropout2(skipx)
        out = self.act_function1(self.bn1(self.up_conv(out)))
        first = self.ops[0]
        if hooked(self.ops) or hooked(first) or out.dtype != skip.dtype:
            xcat = torch.cat((out, skip), 1)
            return self.act_function2(torch.add(self.ops(xcat), xcat))
        h = first.act_function(conv_of_concatenation(first.conv_block, out, skip))
        for layer in self.ops[1:]:
            h = layer(h)
        return self.act_function2(_plus_concatenation(h, out, skip))


class _PlusConcatenation(torch.autograd.Function):
    """h + torch.cat([a, b], dim=1) (all of one dtype and shape but C) without the concatenation: each source added
    to its own channels of h, into one tensor laid out as h; the gradient passes to h whole and to a and b as its
    channel slices (views, as a concatenation's backward gives)."""

    @staticmethod
    def forward(ctx, h, a, b):
        first = ctx.first = a.shape[1]
        out = torch.empty_like(h)
        torch.add(h.narrow(1, 0, first), a, out=out.narrow(1, 0, first))
        torch.add(h.narrow(1, first, b.shape[1]), b, out=out.narrow(1, first, b.shape[1]))
        return out

    @staticmethod
    def backward(ctx, grad):
        first = ctx.first
        return grad, grad.narrow(1, 0, first), grad.narrow(1, first, grad.shape[1] - first)


def _plus_concatenation(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """h + torch.cat([a, b], dim=1), the concatenation made only where the shapes or dtypes ask for torch's
    broadcasting or promotion, under torch.compile (Dynamo does not trace an `out=` slice; Inductor fuses the
    concatenation into the addition's one kernel) and under torch.func."""
    whole = (a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:])
    same = h.dtype == a.dtype == b.dtype and h.shape == whole and b.shape[2:] == a.shape[2:] and len(b) == len(a)
    if not same or autograd_traced():  # torch.func runs no ctx-style Function
        return h + torch.cat([a, b], dim=1)
    return _PlusConcatenation.apply(h, a, b)


def _is_connection(block: nn.Module) -> bool:
    """MONAI UNet's connection block: nn.Sequential(down path, SkipConnection(subblock), up path), the skip
    concatenating along C."""
    if not isinstance(block, nn.Sequential) or len(block) != 3 or type(block[1]).__name__ != "SkipConnection":
        return False
    return block[1].mode == "cat" and block[1].dim == 1


def _through_connections(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """block(x), each connection block's up path reading torch.cat([x, subblock(x)], dim=1) in place; a block in
    MONAI's ActivationCheckpointWrapper (CheckpointUNet's subblocks) checkpointed as the wrapper does."""
    if (inner := _checkpointed(block)) is not None and _is_connection(inner):
        return checkpoint(_through_connections, inner, x, use_reentrant=False)
    if not _is_connection(block) or hooked(block) or hooked(block[1]):  # hooks: the SkipConnection's cat runs
        return block(x)
    down, skip, up = block
    x = down(x)
    return conv_of_concatenation(up, x, _through_connections(skip.submodule, x))


class _MedNeXtUpBlock:
    """MONAI's MedNeXtUpBlock: the block's output (its depthwise transposed conv makes 2L - 1 voxels an axis)
    padded with a zero voxel in front of each axis by F.pad, and with the residual connection (MedNeXt's S, B, M
    and L variants build it) the 1x1x1 transposed conv of the input padded the same and added: two padded copies
    and a sum. Here the padded result is written once in the output's layout: its three front faces zeroed, the
    block's output and the residual summed into the rest."""

    classes = ("monai.networks.blocks.mednext_block.MedNeXtUpBlock",)
    attributes = ("dim", "resample_do_res")

    def forward(self, x):
        if self.dim != "3d" or x.dim() != 5:
            return super().forward(x)
        out = super(type(self).__bases__[1], self).forward(x)  # MedNeXtBlock's forward: the block, not padded
        return _front_padded(out, self.res_conv(x) if self.resample_do_res else None)


class _HighResBlock:
    """MONAI's HighResBlock: its conv path plus the input padded with zero channels up to the output's width
    (ChannelPad's F.pad: a copy of the output's size), summed. Here the input is added into its channels of the conv
    path's output in place: that output is its last conv's, which no backward reads."""

    classes = ("monai.networks.nets.highresnet.HighResBlock",)
    attributes = ("layers", "chn_pad")

    def forward(self, x):
        pad = getattr(self.chn_pad, "pad", None)
        last = self.layers[-1] if len(self.layers) else None
        conv = getattr(last, "conv", None)
        if pad is None or x.dim() != 5 or not isinstance(conv, nn.Conv3d) or list(last.children()) != [conv]:
            return super().forward(x)
        out = self.layers(x)
        out.narrow(1, pad[-4], x.shape[1]).add_(x)  # F.pad's (C front, C back) pair comes before the batch's
        return out


def _front_padded(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """F.pad(x, (1, 0, 1, 0, 1, 0)) (+ the residual padded the same) written once, in x's layout; under torch.func
    (vmap batches no write into a tensor made inside it) as stock pads."""
    if func_transformed():
        return F.pad(x if residual is None else x + residual, (1, 0, 1, 0, 1, 0))
    n, c, d, h, w = x.shape
    out = torch.empty((n, c, d + 1, h + 1, w + 1), dtype=x.dtype, device=x.device, memory_format=layout_of(x))
    for face in (out[:, :, 0], out[:, :, 1:, 0], out[:, :, 1:, 1:, 0]):
        face.zero_()
    inner = out[:, :, 1:, 1:, 1:]
    if residual is None:
        inner.copy_(x)
    else:
        add_into(inner, x, residual)
    return out


class _PSP:
    """AHNet's pyramid pooling module: its branches' outputs (a channel each, up from the pooled maps) concatenated
    by torch.cat, which answers NCDHW for tensors of one channel; AHNet concatenates that with its last dense
    block's features in front of its final block, so the final norm and convolution got all of those channels
    NCDHW (a layout copy at the network's full resolution). Here the pyramid's few channels are laid out
    channels_last_3d instead, and the concatenation after keeps that layout. A 2-D AHNet's runs as it is."""

    classes = ("monai.networks.nets.ahnet.PSP",)
    attributes = ("project_modules", "pool_modules")

    def forward(self, x):
        out = super().forward(x)
        return channels_last(out) if out.dim() == 5 else out


class _UNet:
    """MONAI's UNet: each level is nn.Sequential(down, SkipConnection(subblock), up), whose SkipConnection returns
    torch.cat([x, subblock(x)], dim=1) and whose up path starts with a transposed convolution (then its norm and
    activation, and a ResidualUnit). The adapter runs the same modules level by level and hands subblock(x) to
    that transposed convolution as channels_after, read in place. CheckpointUNet's levels (down path, subblock
    and up path each in an ActivationCheckpointWrapper) are checkpointed as MONAI checkpoints them. A level whose
    Sequential or SkipConnection has hooks runs as MONAI runs it (`hooked`), its concatenation made."""

    classes = ("monai.networks.nets.unet.UNet", "monai.networks.nets.unet.CheckpointUNet")
    attributes = ("model",)

    @staticmethod
    def reason(module) -> str | None:
        if not _is_connection(module.model):
            return "its model is not nn.Sequential(down, SkipConnection(subblock, mode='cat', dim=1), up)"
        return None

    def forward(self, x):
        return _through_connections(self.model, x)


class _VoxelMorphUNet:
    """MONAI's VoxelMorphUNet (VoxelMorph's backbone): MONAI UNet's levels, nn.Sequential(down, SkipConnection
    (subblock), up) with a convolution then nearest upsampling as the up path, and its final convolutions after
    them: each up path's convolution reads the skip connection in place, as `_UNet`'s transposed ones do."""

    classes = ("monai.networks.nets.voxelmorph.VoxelMorphUNet",)
    attributes = ("net",)

    @staticmethod
    def reason(module) -> str | None:
        net = module.net
        if not (isinstance(net, nn.Sequential) and len(net) == 2 and _is_connection(net[0])):
            return "its net is not nn.Sequential(nn.Sequential(down, SkipConnection(subblock), up), final convs)"
        return None

    def forward(self, concatenated_pairs):
        if hooked(self.net):
            return self.net(concatenated_pairs)
        levels, final = self.net
        return final(_through_connections(levels, concatenated_pairs))


def _kept_channels_last(x: torch.Tensor) -> torch.Tensor:
    """x.contiguous() where x is not a channels_last_3d 5-D tensor; a channels_last_3d one as it is."""
    if x.dim() == 5 and laid_out(x, _CL):
        return x
    return x.contiguous()


class _SwinTransformer:
    """MONAI's SwinTransformer (SwinUNETR's encoder) calls `.contiguous()` on each stage's input: an NCDHW copy of
    the patch embedding's channels_last_3d output and of each stage's output (its blocks work on (B, D, H, W, C),
    permuted back at the end: a channels_last_3d view), which the stage permutes to (B, D, H, W, C) again, then a
    strided view. Here a 5-D channels_last_3d input goes on as it is: no copy, contiguous (B, D, H, W, C) for the
    blocks, and SwinUNETR v2's residual conv blocks in front of each stage (layers1c ...) read it without a layout
    copy. Values as MONAI's."""

    classes = ("monai.networks.nets.swin_unetr.SwinTransformer",)
    attributes = ("patch_embed", "pos_drop", "use_v2", "layers1", "layers2", "layers3", "layers4")

    def forward(self, x, normalize=True):
        x = self.pos_drop(self.patch_embed(x))
        outputs = [self.proj_out(x, normalize)]
        for stage in range(1, 5):
            if self.use_v2:
                x = getattr(self, f"layers{stage}c")[0](_kept_channels_last(x))
            x = getattr(self, f"layers{stage}")[0](_kept_channels_last(x))
            outputs.append(self.proj_out(x, normalize))
        return outputs


def _ncdhw_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """A forward hook: the module's output NCDHW-contiguous (a copy where it is channels_last_3d)."""
    return output.contiguous()


class _FlattensByView:
    """MONAI networks whose own code flattens an activation with `.view(batch, -1)`: VarAutoEncoder's
    encode_forward (the output of `intermediate`) and SegResNetVAE's VAE loss in training (the output of
    `vae_down`). A view flattens C with the voxels only where the tensor is NCDHW-contiguous; converted, the
    activation is channels_last_3d and the view raises. A forward hook on the module that makes it returns it
    NCDHW (one copy of a bottleneck activation), the values stock's view reads, in its order."""

    classes = ("monai.networks.nets.varautoencoder.VarAutoEncoder", "monai.networks.nets.segresnet.SegResNetVAE")
    attributes = ()

    @staticmethod
    def _flattened(module) -> nn.Module | None:
        """The module whose output the network views flat."""
        name = "intermediate" if type(module).__name__ == "VarAutoEncoder" else "vae_down"
        return getattr(module, name, None)

    @classmethod
    def reason(cls, module) -> str | None:
        return None if isinstance(cls._flattened(module), nn.Module) else "not the MONAI layout this tconv3d knows"

    @classmethod
    def prepare(cls, module) -> None:
        cls._flattened(module).register_forward_hook(_ncdhw_output)


# MONAI's generative autoencoders: AutoencoderKL (monai.networks.nets) and MAISI's (monai.apps.generation.maisi).
_AEKL = "monai.networks.nets.autoencoderkl."
_MAISI = "monai.apps.generation.maisi.networks.autoencoderkl_maisi."


def _noise_in_stock_order(z: torch.Tensor) -> torch.Tensor:
    """torch.randn_like(z) as for z in NCDHW order, laid out as z: randn_like fills memory in order, so for a
    channels_last_3d z it gives each element another draw than for the NCDHW z of a stock model under the same
    seed. The same numbers, generated NCDHW and laid out as z (a copy of the latent, not of an activation)."""
    eps = torch.randn(z.shape, dtype=z.dtype, device=z.device)
    return eps.contiguous(memory_format=_CL) if z.dim() == 5 and _laid_out_only(z, _CL) else eps


class _Autoencoder:
    """MONAI's AutoencoderKL and MAISI's AutoencoderKlMaisi: `sampling` draws its noise with
    `torch.randn_like(z_sigma)`, which on the converted encoder's channels_last_3d latent gives other numbers than
    stock under the same seed (`_noise_in_stock_order`): converted, a seeded sample is stock's."""

    classes = (_AEKL + "AutoencoderKL", _MAISI + "AutoencoderKlMaisi")
    attributes = ("encoder", "decoder", "sampling")

    def sampling(self, z_mu, z_sigma):
        return z_mu + _noise_in_stock_order(z_sigma) * z_sigma


class _SPADEAutoencoder(_Autoencoder):
    """MONAI's SPADEAutoencoderKL: its sampling as `_Autoencoder`'s; its decoder's SPADE norms each interpolate the
    segmentation map (a user input, NCDHW as a rule) to their activation's size and convolve it: each such
    convolution took a layout copy. Converted, the map is laid out channels_last_3d once as it enters the decoder
    (a copy at the input's edge) and every interpolation of it stays so."""

    classes = ("monai.networks.nets.spade_autoencoderkl.SPADEAutoencoderKL",)

    def decode(self, z, seg):
        return super().decode(z, _channels_last_input(seg))


class _SPADEDiffusionUNet:
    """MONAI's SPADEDiffusionModelUNet: the segmentation map laid out channels_last_3d once as it enters (see
    `_SPADEAutoencoder`)."""

    classes = ("monai.networks.nets.spade_diffusion_model_unet.SPADEDiffusionModelUNet",)
    attributes = ("conv_in", "up_blocks")

    def forward(self, x, timesteps, seg, *args, **kwargs):
        return super().forward(x, timesteps, _channels_last_input(seg), *args, **kwargs)


def _channels_last_input(x: torch.Tensor) -> torch.Tensor:
    """A 5-D input that convolutions will read (after interpolations), laid out channels_last_3d (a copy if it is
    not)."""
    if isinstance(x, torch.Tensor) and x.dim() == 5:
        return channels_last(x)
    return x


class _SPADE:
    """MONAI's SPADE norm: `self.param_free_norm(x.contiguous())`, an NCDHW copy of the channels_last_3d activation
    into its norm (and the product after it NCDHW). Converted, the norm takes x as it is."""

    classes = ("monai.networks.blocks.spade_norm.SPADE",)
    attributes = ("param_free_norm", "mlp_shared", "mlp_gamma", "mlp_beta")

    def forward(self, x, segmap, channels_after=None):
        if channels_after is None:
            normalized = self.param_free_norm(_kept_channels_last(x))
        else:  # a converted SPADE res block's norm1 of a skip connection's concatenation
            normalized = _silu_after(self.param_free_norm, x, lambda h: h, channels_after)
        actv = self.mlp_shared(resize_nearest(segmap, x.size()[2:]))
        return normalized * (1 + self.mlp_gamma(actv)) + self.mlp_beta(actv)


def _conv_inside(module: nn.Module) -> nn.Module | None:
    """The convolution under a chain of `.conv` attributes that call it on their whole input (MONAI's
    Convolution, MAISI's MaisiConvolution once converted), else None."""
    while not isinstance(module, nn.Conv3d):
        whole = type(module).__name__ == "Convolution" or _is_maisi_convolution(module)
        if not whole:
            return None  # e.g. MAISI's split convolution left on torch: it would pad each slab
        module = module.conv
    return module


class _SpatialAttentionBlock:
    """MONAI's SpatialAttentionBlock (AutoencoderKL's and MAISI's attention) turns a channels_last_3d activation
    into (B, voxels, C) tokens and back by views, no copy; but at batch 1 the view back has the batch stride C,
    which torch does not recognise as channels_last_3d (`suggest_memory_format`): after the residual add, the
    decoder's upsampling (nearest interpolation) answered NCDHW and the convolution after it took a layout copy.
    The attention's output is viewed with channels_last_3d's own strides (the same memory) before the add."""

    classes = ("monai.networks.blocks.spatialattention.SpatialAttentionBlock",)
    attributes = ("norm", "attn")

    def forward(self, x):
        residual = x
        shape = x.shape
        h = self.norm(x).reshape(*shape[:2], -1).transpose(1, 2)
        return _channels_last_strides(self.attn(h).transpose(1, 2).reshape(shape)) + residual


def _channels_last_strides(x: torch.Tensor) -> torch.Tensor:
    """A 5-D tensor laid out channels_last_3d viewed with channels_last_3d's own strides (the same memory): a view
    back from (B, voxels, C) tokens at batch 1 has the batch stride C, and torch's kernels that follow an input's
    `suggest_memory_format` (interpolation, for one) then answer NCDHW. Not under torch.onnx.export
    (exporting_to_onnx)."""
    if x.dim() == 5 and laid_out(x, _CL) and not exporting_to_onnx():
        return x.as_strided(x.shape, format_strides(x.shape, _CL))
    return x


class _PaddedDownsample:
    """AutoencoderKL's AEKLDownsample and MAISI's MaisiDownsample: F.pad (0, 1) per dimension with zeros, a copy
    of the activation, then a stride-2 convolution with no padding. Converted, the convolution pads inside its op
    (`fold_paddings` gives it the padding) and the block calls it alone."""

    classes = (_AEKL + "AEKLDownsample", _MAISI + "MaisiDownsample")
    attributes = ("pad", "conv")
    pads_inside = False

    @staticmethod
    def reason(module) -> str | None:
        pad = tuple(getattr(module.pad, "pad", module.pad))
        if pad != (0, 1) * 3:
            return f"its padding is {pad}, not a 3-D network's (0, 1, 0, 1, 0, 1)"
        return None

    def forward(self, x):
        if not self.pads_inside:
            return super().forward(x)
        if _is_maisi_convolution(self.conv):
            return maisi_convolution(self.conv, x, padded=True)
        return self.conv(x)


class _ResBlock:
    """AutoencoderKL's AEKLResBlock: GroupNorm, F.silu, conv, twice, and the shortcut: each norm's SiLU in its
    pass (`fuse_res_block_norms` sets the converted norms' activation), where F.silu reads and writes the
    activation again."""

    classes = (_AEKL + "AEKLResBlock",)
    attributes = ("norm1", "conv1", "norm2", "conv2", "nin_shortcut")

    def forward(self, x):
        h = self.conv1(_silu_after(self.norm1, x))
        h = self.conv2(_silu_after(self.norm2, h))
        return self.nin_shortcut(x) + h


def _silu_after(norm: nn.Module, x: torch.Tensor, silu=F.silu, channels_after=None) -> torch.Tensor:
    """silu(norm(x)), the SiLU in the norm's pass where fused; of torch.cat([x, channels_after], dim=1), read in
    place by a tconv3d GroupNorm without hooks (concatenated for any other norm)."""
    if channels_after is None:
        h = norm(x)
    elif isinstance(norm, GroupNorm) and not hooked(norm):
        h = norm(x, channels_after=channels_after)
    else:
        h = norm(torch.cat([x, channels_after], dim=1))
    return h if getattr(norm, "activation", None) == "silu" else silu(h)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """What MAISI's blocks return through MONAI's convert_to_tensor, without its copy: a torch.Tensor (a MetaTensor
    unwrapped), in its own layout. convert_to_tensor also makes it contiguous: an NCDHW copy of every block's
    channels_last_3d output, and a layout copy into the next convolution. A fake or functional tensor (torch.export's
    trace: `traced`) stays as it is: as_subclass took it out of the trace, a fake tensor among the exported
    program's constants (torch.export, AOTInductor and torch.onnx.export of a converted MAISI raised)."""
    return x if type(x) is torch.Tensor or traced(x) else x.as_subclass(torch.Tensor)


class _MaisiResBlock(_ResBlock):
    """MAISI's MaisiResBlock: AutoencoderKL's block on MAISI's norms and split convolutions, emptying CUDA's cache
    after each step (save_mem) and returning through convert_to_tensor. Converted: the norms' SiLU fused, the
    convolutions one op each, no cache emptying inside the block (the encoder's and decoder's loops still empty it
    after each block) and no NCDHW copy of its output."""

    classes = (_MAISI + "MaisiResBlock",)

    def forward(self, x):
        return _plain(super().forward(x))


class _MaisiConvolution:
    """MAISI's MaisiConvolution splits its input into num_splits slabs along one dimension with 3 voxels of
    overlap, convolves each, trims and concatenates them (on the CPU when a dimension reaches 500): a way around
    cuDNN's workspace and 2**31-element limits that copies the activation twice. tconv3d's kernels take the whole
    tensor (64-bit offsets) into one op, input and output only, wherever the slabs' rows make up the convolution's
    output: `maisi_convolution`."""

    classes = (_MAISI + "MaisiConvolution",)
    attributes = ("conv", "num_splits", "dim_split", "stride")

    def forward(self, x):
        return maisi_convolution(self, x)


def _is_maisi_convolution(module: nn.Module) -> bool:
    """Whether `module` is MAISI's MaisiConvolution, converted."""
    return getattr(type(module), "tconv3d_adapter", None) is _MaisiConvolution


def maisi_convolution(module: nn.Module, x: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """What MAISI's MaisiConvolution `module` answers for x, or with `padded` for x padded by a zero after each
    spatial dimension (MaisiDownsample's F.pad, folded into its convolution's padding: fold_paddings): one op of
    the convolution where MAISI's slabs make it up (`_slabs_make_the_convolution`), else MAISI's own slabs, each
    convolved by tconv3d. They differ where num_splits does not divide the split dimension: the trim drops the last
    rows (33 rows in, 32 out of a 3x3x3 convolution padded by 1); and where a slab is shorter than the overlap,
    whose slicing wraps around."""
    conv = module.conv  # MONAI's Convolution, the convolution in it
    while not isinstance(conv, (nn.Conv3d, nn.ConvTranspose3d)):
        if wrapper(conv):  # a LoRA layer over it (peft's): MAISI's slabs, each through its call
            if padded and module.num_splits > 1:  # (each slab would be padded, where MAISI pads x)
                raise wrapper_error(module)
            return module.conv(x) if module.num_splits <= 1 else _maisi_slabs(module, x, module.conv)
        conv = conv.conv
    sizes = [size + padded for size in x.shape[2:]]
    if padded:  # MAISI pads x, then convolves without padding
        padding = [(0, 0)] * 3
    elif isinstance(conv, Conv3d):
        six = conv._op_padding()
        padding = list(zip(six[::2], six[1::2], strict=True))
    else:
        padding = [(p, p) for p in conv.padding]
    if module.num_splits <= 1 or _slabs_make_the_convolution(module, conv, sizes, padding):
        return module.conv(x)
    if padded:
        return _maisi_slabs(module, F.pad(x, (0, 1) * 3), lambda slab: conv.convolve(slab, (0,) * 6))
    return _maisi_slabs(module, x, module.conv)


def _maisi_slabs(module: nn.Module, x: torch.Tensor, convolve) -> torch.Tensor:
    """MaisiConvolution.forward with `convolve` for its convolution: x split into slabs, each convolved, trimmed
    and concatenated, by MAISI's own helpers."""
    split_size = x.size(module.dim_split + 2) // module.num_splits
    overlap = _maisi_overlap(module)
    slabs = module._split_tensor(x, split_size, overlap)
    outputs = [convolve(slab) for slab in slabs]
    other = module.dim_split + 1 if module.dim_split < 2 else 0
    kept, kept_from = _maisi_kept(split_size, overlap, slabs[0].size(other + 2), outputs[0].size(other + 2))
    return module._concatenate_tensors(outputs, kept, kept_from)


def _maisi_overlap(module: nn.Module) -> int:
    """The rows each slab but the first reads before its own (3, rounded up to a multiple of the stride)."""
    return 3 if 3 % module.stride == 0 else (3 // module.stride + 1) * module.stride


def _maisi_kept(split_size: int, overlap: int, size_in: int, size_out: int) -> tuple[int, int]:
    """The rows MAISI keeps of each slab's output, and from which row of it on (past the first slab): its slab's
    rows and overlap scaled as a dimension it does not split, of size_in in and size_out out, is scaled."""
    if size_out // size_in == 2:
        return 2 * split_size, 2 * overlap
    if size_in // size_out == 2:
        return split_size // 2, overlap // 2
    return split_size, overlap


def _slabs_make_the_convolution(module: nn.Module, conv: nn.Module, sizes: list[int], padding) -> bool:
    """Whether MAISI's slabs of an input of spatial `sizes`, convolved by `conv` with `padding` ((before, after) a
    dimension), trimmed and concatenated, are the convolution's output: each slab's kept rows are the output rows
    that follow the slab before's, every output row is kept, and each reads rows of its own slab (or the padding
    the input's ends have in both)."""
    splits, dim = module.num_splits, module.dim_split
    transposed = isinstance(conv, nn.ConvTranspose3d)

    def length_out(length: int, d: int) -> int:
        reach = conv.dilation[d] * (conv.kernel_size[d] - 1)
        if transposed:
            return (length - 1) * conv.stride[d] - sum(padding[d]) + reach + conv.output_padding[d] + 1
        return (length + sum(padding[d]) - reach - 1) // conv.stride[d] + 1

    length, stride, before = sizes[dim], conv.stride[dim], padding[dim][0]
    reach = conv.dilation[dim] * (conv.kernel_size[dim] - 1)
    split_size, overlap = length // splits, _maisi_overlap(module)
    if split_size < overlap:  # a slab's start wraps around (split_size 0: MAISI raises)
        return False
    other = dim + 1 if dim < 2 else 0
    kept, kept_from = _maisi_kept(split_size, overlap, sizes[other], length_out(sizes[other], other))
    if splits * kept != length_out(length, dim):
        return False
    for i in range(splits):
        start = 0 if i == 0 else i * split_size - overlap
        stop = min(length, (i + 1) * split_size + (overlap if i < splits - 1 else length % split_size))
        first = 0 if i == 0 else kept_from
        if length_out(stop - start, dim) < first + kept or (not transposed and start % stride):
            return False
        if (start * stride if transposed else start // stride) + first != i * kept:
            return False
        low, high = i * kept, (i + 1) * kept - 1  # the output rows kept, and the input rows they read
        reads = (-((reach - before - low) // stride), (high + before) // stride) if transposed else (
            low * stride - before, high * stride - before + reach)  # fmt: skip
        if (start > 0 and reads[0] < start) or (stop < length and reads[1] >= stop):
            return False
    return True


class _MaisiGroupNorm3D:
    """MAISI's MaisiGroupNorm3D normalizes one group at a time in float32 and concatenates the groups (on the CPU
    when a dimension reaches 500), then scales in place: tconv3d's GroupNorm kernels in one pass, float32
    statistics, channels_last_3d out, with the SiLU that follows in a converted MaisiResBlock. Its output is in
    the input's dtype (float16 with norm_float16, as MAISI's): MAISI answers float32 for a half input, which only
    autocast's next convolution reads, casting it back."""

    classes = (_MAISI + "MaisiGroupNorm3D",)
    attributes = ("norm_float16",)
    activation = None

    def forward(self, input):
        if input.dim() != 5:
            raise ValueError("Expected a 5D tensor")
        output = normalize(input, self.num_groups, self.weight, self.bias, self.eps, self.activation)
        return output.to(torch.float16) if self.norm_float16 else output


class _MaisiUpsample:
    """MAISI's MaisiUpsample: trilinear interpolation (or a transposed convolution), its convolution, emptying
    CUDA's cache between them; converted, without the cache emptying and the NCDHW copy of its output (see
    `_plain`), the interpolation tconv3d's (`upsample_linear`: channels_last_3d both ways)."""

    classes = (_MAISI + "MaisiUpsample",)
    attributes = ("conv", "use_convtranspose")

    def forward(self, x):
        if not self.use_convtranspose:
            x = upsample_linear(x, (2, 2, 2))
        return _plain(self.conv(x))


# MONAI's diffusion UNet (DiffusionModelUNet, ControlNet, and MAISI's DiffusionModelUNetMaisi, built of its blocks).
_DIFF = "monai.networks.nets.diffusion_model_unet."
_SPADE_DIFF = "monai.networks.nets.spade_diffusion_model_unet."


class _UpSample:
    """MONAI's UpSample (and the diffusion UNet's WrappedUpsample, which takes a timestep embedding and drops it) in
    its "nontrainable" mode: nearest interpolation by 2 in D, H and W, then its post_conv, in the decoders of
    AutoencoderKL and SPADEAutoencoderKL and the diffusion UNet's up blocks a 3 x 3 x 3 convolution padded by 1. The
    adapter calls that convolution on the input itself with `upsampled=(2, 2, 2)` (tconv3d.nn.Conv3d): one transposed
    conv of the input (the sub-pixel form, subpixel.upsampled_conv: 8 taps an output voxel where 27), the
    upsampled input (8 times the input) never written. Any other UpSample (trilinear, a pre_conv, a post_conv
    convert left alone or with norms after it, a size), or hooks on its parts, run as MONAI's."""

    classes = ("monai.networks.blocks.upsample.UpSample", _DIFF + "WrappedUpsample")
    attributes = ()

    def forward(self, x, *args):
        conv = _conv_after_nearest_2x(self)
        if conv is None or x.dim() != 5:
            return super().forward(x, *args)
        return conv(x, upsampled=(2, 2, 2))


def _conv_after_nearest_2x(module: nn.Sequential) -> Conv3d | None:
    """The tconv3d convolution that MONAI's UpSample `module` runs right after nearest 2x in D, H and W, else None
    (another mode, factor or size, more parts, a convolution left alone, a norm or activation after it, hooks)."""
    parts = dict(module.named_children())
    if list(parts) != ["upsample_non_trainable", "postconv"] or any(hooked(part) for part in parts.values()):
        return None
    return _plain_conv(parts["postconv"]) if _nearest_2x(parts["upsample_non_trainable"]) else None


def _nearest_2x(upsample: nn.Module) -> bool:
    """Whether `upsample` is an nn.Upsample by nearest 2x in D, H and W."""
    if not isinstance(upsample, nn.Upsample) or upsample.mode not in ("nearest", "nearest-exact"):
        return False
    scale = upsample.scale_factor if isinstance(upsample.scale_factor, tuple) else (upsample.scale_factor,) * 3
    return upsample.size is None and tuple(float(f) for f in scale) == (2.0, 2.0, 2.0)


def _plain_conv(conv: nn.Module) -> Conv3d | None:
    """The tconv3d convolution `conv` is (or MONAI's Convolution with conv_only=True holds alone), without hooks;
    else None."""
    if type(conv).__name__ == "Convolution" and list(dict(conv.named_children())) == ["conv"]:
        conv = conv.conv
        if hooked(conv):
            return None
    return conv if type(conv) is Conv3d else None


def _pointwise(module: nn.Module) -> bool:
    """Whether `module` maps each voxel on its own (nn.Identity, or a 1 x 1 x 1 convolution at unit stride, unpadded),
    without hooks: it commutes with nearest upsampling."""
    if hooked(module):
        return False
    if isinstance(module, nn.Identity):
        return True
    conv = _plain_conv(module)
    return conv is not None and conv.kernel_size == (1, 1, 1) and conv.stride == (1, 1, 1) and conv.padding == (0,) * 3


def _subpixel_conv1(block: nn.Module, h: torch.Tensor) -> Conv3d | None:
    """The tconv3d conv1 of a diffusion res block with up=True (resblock_updown) that runs on h, its normalized
    input, in the sub-pixel form (`upsampled=(2, 2, 2)`), else None: its upsample is nearest 2x in D, H and W alone,
    its conv1 takes the form (subpixel.upsampled_conv_reason), its skip connection is pointwise, and none of them
    has hooks (a hook sees the upsampled tensors in stock MONAI)."""
    upsample = block.upsample
    if upsample is None or hooked(upsample) or hooked(block.conv1) or not _pointwise(block.skip_connection):
        return None
    parts = dict(upsample.named_children())
    if list(parts) != ["upsample_non_trainable"] or hooked(parts["upsample_non_trainable"]):
        return None
    conv = _plain_conv(block.conv1) if _nearest_2x(parts["upsample_non_trainable"]) else None
    return conv if conv is not None and upsampled_conv_reason(conv, h, (2, 2, 2)) is None else None


class _DiffusionResnetBlock:
    """The diffusion UNet's DiffusionUNetResnetBlock: GroupNorm then its `nonlinearity` (SiLU), twice, with the
    timestep embedding added between: each norm's SiLU in its pass (`fuse_res_block_norms`). Called by a converted
    up block with the skip connection as `channels_after`, it runs on torch.cat([x, channels_after], dim=1)
    without making it: norm1 and the 1x1x1 skip_connection read both in place (see `_of_skip_connection`). With
    up=True (resblock_updown's upsamplers), where `_subpixel_conv1` allows, conv1 runs on the normalized input
    itself in the sub-pixel form and the skip connection on x itself, its output added into the block's by
    broadcasting (`add_repeated_`): neither upsampled tensor (8 times the input) is written, conv1 reads 8 taps an
    output voxel where 27. SPADE's UNet's SPADEDiffResBlock is the same block with SPADE norms, which take the
    segmentation map too."""

    classes = (_DIFF + "DiffusionUNetResnetBlock", _SPADE_DIFF + "SPADEDiffResBlock")
    attributes = ("norm1", "nonlinearity", "conv1", "upsample", "downsample", "time_emb_proj", "norm2", "conv2",
                  "skip_connection", "spatial_dims")  # fmt: skip

    def forward(self, x, emb, *seg, channels_after=None):
        if channels_after is not None and (self.upsample is not None or self.downsample is not None):
            x, channels_after = torch.cat([x, channels_after], dim=1), None
        h = _normalized(self.norm1, x, seg, self.nonlinearity, channels_after)
        conv1 = _subpixel_conv1(self, h) if self.upsample is not None else None
        if conv1 is not None:
            h = conv1(h, upsampled=(2, 2, 2))
        else:
            if self.upsample is not None:
                x, h = self.upsample(x), self.upsample(h)
            elif self.downsample is not None:
                x, h = self.downsample(x), self.downsample(h)
            h = self.conv1(h)
        temb = self.time_emb_proj(self.nonlinearity(emb))
        h = h + temb.view(*temb.shape, *(1,) * self.spatial_dims)
        h = self.conv2(_normalized(self.norm2, h, seg, self.nonlinearity))
        if conv1 is not None:  # skip(x repeated) = skip(x) repeated: a pointwise skip, on x itself
            return add_repeated_(h, self.skip_connection(x), (2, 2, 2))
        if channels_after is None:
            return self.skip_connection(x) + h
        return conv_of_concatenation(self.skip_connection, x, channels_after) + h


def _normalized(norm: nn.Module, x: torch.Tensor, seg: tuple, silu, channels_after=None) -> torch.Tensor:
    """silu(norm(x)) of a diffusion res block (`_silu_after`), or, with a segmentation map (`seg` holds it), of its
    SPADE norm: silu(norm(x, seg)), x with channels_after read in place by SPADE's converted norm."""
    if not seg:
        return _silu_after(norm, x, silu, channels_after)
    if channels_after is None:
        return silu(norm(x, *seg))
    if getattr(type(norm), "tconv3d_adapter", None) is _SPADE and not hooked(norm):
        return silu(norm.forward(x, *seg, channels_after=channels_after))
    return silu(norm(torch.cat([x, channels_after], dim=1), *seg))


def _of_skip_connection(resnet: nn.Module, x: torch.Tensor, skip: torch.Tensor, temb, *seg) -> torch.Tensor:
    """resnet(torch.cat([x, skip], dim=1), temb[, seg]) for a diffusion UNet decoder's res block: a converted one
    reads the two in place (a block with hooks, or one convert left alone, gets the concatenation)."""
    if getattr(type(resnet), "tconv3d_adapter", None) is not _DiffusionResnetBlock or hooked(resnet):
        return resnet(torch.cat([x, skip], dim=1), temb, *seg)
    return resnet.forward(x, temb, *seg, channels_after=skip)


def _attend(attention: nn.Module, x: torch.Tensor, context) -> torch.Tensor:
    """An attention of the diffusion UNet's blocks as they call it: SpatialTransformer with the context,
    SpatialAttentionBlock without (its blocks drop the context)."""
    return attention(x, context=context) if hasattr(attention, "transformer_blocks") else attention(x)


class _AttnDownBlock:
    """The diffusion UNet's AttnDownBlock and CrossAttnDownBlock make each attention's output `.contiguous()`:
    an NCDHW copy of the channels_last_3d activation, a layout copy into the next convolution (and norm)
    again. The same calls without it."""

    classes = (_DIFF + "AttnDownBlock", _DIFF + "CrossAttnDownBlock")
    attributes = ("resnets", "attentions", "downsampler")

    def forward(self, hidden_states, temb, context=None):
        output_states = []
        for resnet, attention in zip(self.resnets, self.attentions, strict=True):
            hidden_states = _attend(attention, resnet(hidden_states, temb), context)
            output_states.append(hidden_states)
        if self.downsampler is not None:
            hidden_states = self.downsampler(hidden_states, temb)
            output_states.append(hidden_states)
        return hidden_states, output_states


class _AttnMidBlock:
    """The diffusion UNet's AttnMidBlock: as `_AttnDownBlock`, its attention's output not made `.contiguous()`."""

    classes = (_DIFF + "AttnMidBlock",)
    attributes = ("resnet_1", "attention", "resnet_2")

    def forward(self, hidden_states, temb, context=None):
        return self.resnet_2(self.attention(self.resnet_1(hidden_states, temb)), temb)


class _UpBlocks:
    """The diffusion UNet's up blocks (UpBlock, AttnUpBlock, CrossAttnUpBlock, and SPADE's UNet's, which pass the
    segmentation map to their res blocks) concatenate each skip connection with the activation along C,
    `torch.cat([hidden_states, res_hidden_states], dim=1)`, for their res block's GroupNorm and 1x1x1 shortcut: the
    adapter hands the skip to the res block (`_of_skip_connection`), which reads it in place, and the attention
    blocks' outputs are not made `.contiguous()` (as `_AttnDownBlock`)."""

    classes = (_DIFF + "UpBlock", _DIFF + "AttnUpBlock", _DIFF + "CrossAttnUpBlock")
    attributes = ("resnets", "upsampler")

    def forward(self, hidden_states, res_hidden_states_list, temb, context=None):
        return _up_block(self, hidden_states, res_hidden_states_list, temb, context, ())


class _SPADEUpBlocks(_UpBlocks):
    """SPADE's UNet's up blocks: `_UpBlocks` with the segmentation map."""

    classes = (_SPADE_DIFF + "SPADEUpBlock", _SPADE_DIFF + "SPADEAttnUpBlock", _SPADE_DIFF + "SPADECrossAttnUpBlock")

    def forward(self, hidden_states, res_hidden_states_list, temb, seg=None, context=None):
        return _up_block(self, hidden_states, res_hidden_states_list, temb, context, (seg,))


def _up_block(block, hidden_states, res_hidden_states_list, temb, context, seg: tuple):
    attentions = getattr(block, "attentions", None) or [None] * len(block.resnets)
    for resnet, attention in zip(block.resnets, attentions, strict=True):
        res_hidden_states = res_hidden_states_list[-1]
        res_hidden_states_list = res_hidden_states_list[:-1]
        hidden_states = _of_skip_connection(resnet, hidden_states, res_hidden_states, temb, *seg)
        if attention is not None:
            hidden_states = _attend(attention, hidden_states, context)
    if block.upsampler is not None:
        hidden_states = block.upsampler(hidden_states, temb)
    return hidden_states


class _SpatialTransformer:
    """The diffusion UNet's SpatialTransformer (3-D): its tokens go back to the volume through
    `.permute(...).contiguous()`, an NCDHW copy that its 1x1x1 proj_out then takes a layout copy of: the permuted
    view is channels_last_3d already (`_channels_last_strides`)."""

    classes = (_DIFF + "SpatialTransformer",)
    attributes = ("norm", "proj_in", "transformer_blocks", "proj_out", "spatial_dims")

    @staticmethod
    def reason(module) -> str | None:
        return None if module.spatial_dims == 3 else "it is 2-D"

    def forward(self, x, context=None):
        batch, _, height, width, depth = x.shape
        residual = x
        x = self.proj_in(self.norm(x))
        inner_dim = x.shape[1]
        x = x.permute(0, 2, 3, 4, 1).reshape(batch, height * width * depth, inner_dim)
        for block in self.transformer_blocks:
            x = block(x, context=context)
        x = x.reshape(batch, height, width, depth, inner_dim).permute(0, 4, 1, 2, 3)
        return self.proj_out(_channels_last_strides(x)) + residual


def fuse_res_block_norms(model: nn.Module) -> None:
    """The SiLU after each norm of a converted AEKLResBlock, MaisiResBlock or DiffusionUNetResnetBlock, into the
    norm's pass (not SPADE's: its modulation comes between)."""
    for block in model.modules():
        if getattr(type(block), "tconv3d_adapter", None) not in (_ResBlock, _MaisiResBlock, _DiffusionResnetBlock):
            continue
        if type(getattr(block, "nonlinearity", nn.SiLU())) is not nn.SiLU:
            continue
        norms = (block.norm1, block.norm2)
        if all(
            isinstance(n, GroupNorm) or getattr(type(n), "tconv3d_adapter", None) is _MaisiGroupNorm3D for n in norms
        ):
            for norm in norms:
                norm.activation = "silu"


# MONAI's EfficientNet (and the encoders built from it: EfficientNetBN, EfficientNetBNFeatures, FlexibleUNet's
# EfficientNetEncoder) and its MBConvBlock: each conv `X` is called as `self.X(self.X_padding(x))`.
_SAME_PADDED = "monai.networks.nets.efficientnet"


def fold_paddings(model: nn.Module) -> None:
    """Zero padding that MONAI's code makes as a copy of the activation before a convolution, given to the
    convolution, once it is taken over, to pad inside its op:
    - EfficientNet's "same" padding (TensorFlow's) is a ConstantPad3d module in front of each convolution
      (`_conv_stem_padding` before `_conv_stem`, ...), fixed at construction for its image_size, asymmetric where
      the stride is 2 (17 in EfficientNet-B0): the convolution's padding becomes the padder's 6 values and the
      padder an nn.Identity;
    - AutoencoderKL's and MAISI's downsamplers pad (0, 1) per dimension before their stride-2 convolution.
    A padder with another value, or a convolution left on torch or padding itself, stays."""
    for block in model.modules():
        if getattr(type(block), "tconv3d_adapter", None) is _PaddedDownsample:
            conv = _conv_inside(block.conv)
            if _pads_nothing(conv):
                conv.padding = (0, 1) * 3
                block.pads_inside = True
        if type(block).__module__ != _SAME_PADDED:
            continue
        for name, padder in list(block._modules.items()):
            conv = block._modules.get(name.removesuffix("_padding"))
            zeros = name.endswith("_padding") and type(padder) is nn.ConstantPad3d and padder.value == 0
            if zeros and _pads_nothing(conv):
                w_left, w_right, h_top, h_bottom, d_front, d_back = padder.padding
                conv.padding = (d_front, d_back, h_top, h_bottom, w_left, w_right)
                block._modules[name] = nn.Identity()


def _pads_nothing(conv) -> bool:
    """A convolution taken over by tconv3d (not a subclass of another library) that pads nothing itself."""
    return type(conv) is Conv3d and conv.padding_mode == "zeros" and not any(conv.padding)


ADAPTERS = (
    _UNETR, _UpBlock, _UpCat, _UNet, _VoxelMorphUNet, _AttentionLayer, _VNetUp, _FlattensByView, _SwinTransformer,
    _SpatialAttentionBlock, _MedNeXtUpBlock, _HighResBlock, _DynUNetBlock, _SegResBlock, _PSP,
    _Autoencoder, _SPADEAutoencoder, _SPADEDiffusionUNet, _SPADE,
    _PaddedDownsample, _ResBlock, _MaisiResBlock, _MaisiConvolution, _MaisiGroupNorm3D, _MaisiUpsample, _UpSample,
    _DiffusionResnetBlock, _AttnDownBlock, _AttnMidBlock, _UpBlocks, _SPADEUpBlocks, _SpatialTransformer,
)  # fmt: skip
