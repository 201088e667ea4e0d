"""Adapters for torchvision's video models, as video_vaes.py holds diffusers' and monai_nets.py MONAI's (same
contract: `classes`, `attributes`, `reason`; torchvision is never imported here). Its video ResNets, R(2+1)D, S3D
and Swin3D need none: their convolutions are nn.Conv3d, or subclasses that add only a constructor, which convert
takes over as they are (convert.own_forward). MViT's attention pools write their tokens NCDHW in front of each
pooling convolution."""

from __future__ import annotations

import torch

from .modules import Conv3d


class _MViTPool:
    """MViT's attention pooling (v1 and v2): a head's tokens (B, heads, 1 + T*H*W, C), its class token first, pooled
    by a depthwise Conv3d over (B * heads, C, T, H, W). torchvision transposes the tokens and writes them NCDHW
    (`.contiguous()`), which a converted conv then copies channels_last_3d again: two copies of the tokens a pool,
    three pools (q, k, v) a block. The tokens less the class token are, in memory, that input in channels_last_3d's
    order (C innermost, then W, H, T): the conv reads their view in place, its strides as they come (a batch of
    one; a larger batch of q, k and v split from one projection, heads between batch entries, is one
    channels_last_3d copy), and its channels_last_3d output is the (B, heads, T'*H'*W', C) tokens view again. The
    class token's concatenation and the norm after it as torchvision's. A pool by another module (pool_skip's
    MaxPool3d) or normalized before pooling runs as torchvision's."""

    classes = ("torchvision.models.video.mvit.Pool",)
    attributes = ("pool", "norm_act", "norm_before_pool")

    def forward(self, x, thw):
        if not isinstance(self.pool, Conv3d) or self.norm_before_pool or x.dim() not in (3, 4):
            return super().forward(x, thw)
        tokens = x if x.dim() == 4 else x.unsqueeze(1)
        batch, heads, _, channels = tokens.shape
        grid = tokens[:, :, 1:].reshape(batch * heads, *thw, channels).permute(0, 4, 1, 2, 3)
        pooled = self.pool(grid)
        pooled_thw = tuple(pooled.shape[2:])
        pooled = pooled.reshape(batch, heads, channels, -1).transpose(2, 3)
        out = torch.cat((tokens[:, :, :1], pooled), dim=2)
        if self.norm_act is not None:
            out = self.norm_act(out)
        return (out if x.dim() == 4 else out.squeeze(1)), pooled_thw


ADAPTERS = (_MViTPool,)
