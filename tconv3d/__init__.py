"""tconv3d: Triton implicit-GEMM Conv3d for PyTorch on channels_last_3d (NDHWC) tensors.

Importing the package registers torch.ops.tconv3d.conv3d, its gradient ops and tconv3d.group_norm.
"""

from . import nn, ops  # ops registers the torch.library ops
from .functional import conv3d, conv_transpose3d, explain
from .settings import CPU_BACKEND, CUDA_BACKEND, INTERPRET

__version__ = "0.1.0"

__all__ = [
    "CPU_BACKEND", "CUDA_BACKEND", "INTERPRET", "__version__", "conv3d", "conv_transpose3d", "explain", "nn", "ops",
]  # fmt: skip
