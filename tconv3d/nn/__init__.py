"""tconv3d.nn: the modules (Conv3d, CausalConv3d, ConvTranspose3d, GroupNorm, InstanceNorm3d, BatchNorm3d, AvgPool3d,
Upsample), `convert` to swap tconv3d into a model, `shardable` to let FSDP2 shard a converted one,
`match_optimizer_state` for an optimizer whose state was made or saved before `convert`, and `audit` to see what
tconv3d runs."""

from .audit import Audit, LayerAudit, audit
from .convert import convert, match_optimizer_state, shardable
from .modules import (
    AvgPool3d,
    BatchNorm3d,
    CausalConv3d,
    Conv3d,
    ConvTranspose3d,
    GroupNorm,
    InstanceNorm3d,
    Upsample,
)

__all__ = [
    "Audit", "AvgPool3d", "BatchNorm3d", "CausalConv3d", "Conv3d", "ConvTranspose3d", "GroupNorm", "InstanceNorm3d",
    "LayerAudit", "Upsample", "audit", "convert", "match_optimizer_state", "shardable",
]  # fmt: skip
