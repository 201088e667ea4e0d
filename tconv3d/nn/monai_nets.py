"""Adapters for MONAI's 3D networks, as video_vaes.py holds diffusers' (same contract: `classes`, `attributes`,
`reason`; monai is never imported here). MONAI's convolutions, transposed convolutions and norms are plain torch
modules that convert takes over as they are; what is left are the places where a network's own code turns a
channels_last_3d activation NCDHW."""

from __future__ import annotations


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


ADAPTERS = (_UNETR,)
