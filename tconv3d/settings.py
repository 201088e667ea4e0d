"""Every setting tconv3d reads from the environment, read once at import, in one place.

TRITON_INTERPRET=1     run the Triton kernels through Triton's interpreter (CPU tensors; where Triton is
                       installed); set before import.
TCONV3D_AUTOTUNE=1     tune a problem that no table covers on its first use (CUDA), and cache the result.
TCONV3D_CACHE_DIR      where first-use tuning results are kept (default $XDG_CACHE_HOME/tconv3d or ~/.cache/tconv3d).
TCONV3D_CONFIG_DIR     a folder of extra tuning tables (<device name>.json), taking precedence over shipped ones.
TCONV3D_KERNELS        auto | pointer | tma | gluon: the kernel variant where the TMA one is eligible (stride 1,
                       16-byte channel rows; the forward and weight gradient also zeros padding and one source).
                       auto: TMA on sm_90+ unless a tuning table chose pointer or gluon; tma: TMA wherever
                       eligible, also through the interpreter on CPU; pointer: never; gluon: the Gluon kernel
                       (fp16/bf16, and in fp32 as TF32 the forward and input gradient; sm_90, triton 3.6 to 3.9)
                       where it runs, else TMA.
TCONV3D_TMA_MAPS       any (default) | strict: strict runs a TMA or Gluon launch on the pointer kernels where one of
                       its tensor maps is one that cuda.h allows but CCCL refuses (a box past the tensor's extent, a
                       stride shorter than the dimensions inside it span: utils.tensor_map_problems' risks), for a
                       driver that refuses them (tests/gpu/tma_probe.py shows what a GPU's driver does).
TCONV3D_DIRECT_LAUNCH  1 (default) | 0: after a kernel's first launch with an argument signature, call its
                       compiled launcher directly instead of Triton's run (kernels/launch.py), and replay a conv
                       op's launches from the plan of its arguments (plans.py); 0 always uses run, no plans.
TCONV3D_INDUCTOR_KERNELS  0 (default) | 1: under torch.compile, the conv and norm ops of a CUDA graph hand Inductor
                       their Triton launches (torch.library.wrap_triton), so its generated code launches them itself
                       with no per-call op in Python; 0 leaves each op one opaque call (ops.py). With 1, Inductor's
                       cache keys include tconv3d's settings and tables (ops.keep_choices_in_cache_keys).

One torch setting is read live instead, at every fp32 launch, as cuDNN reads it: whether fp32 convolutions may use
TF32 (tf32_allowed)."""

import importlib.util
import os
import sys
from pathlib import Path

import torch

# Why tconv3d's Triton kernels cannot run in this process, or None where they can. Triton has wheels for Linux
# alone, and torch brings it only there: on macOS and Windows (or wherever it is not installed) tconv3d still
# imports, and every op runs torch's own on every device, with the same results. Nothing imports Triton then
# (tests/test_main.py's test_tconv3d_runs_torchs_ops_without_triton).
TRITON_MISSING = None if importlib.util.find_spec("triton") else f"Triton is not installed (Python on {sys.platform})"

# Triton decides at decoration time whether @triton.jit kernels are compiled or interpreted, so this must be
# set before `import tconv3d`. When it is, CPU tensors run the Triton kernels through Triton's interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1" and TRITON_MISSING is None

# What CPU tensors run: "triton" (the kernels, through the interpreter) or "aten" (torch's own conv3d, so code
# written against tconv3d still runs on a machine without a GPU).
CPU_BACKEND = "triton" if INTERPRET else "aten"

# What CUDA tensors run: "triton" (tconv3d's kernels), or "aten" without Triton, and under a ROCm build of torch,
# whose AMD GPUs answer as cuda devices: tconv3d's kernels, their variants and tuning are written and checked for
# NVIDIA GPUs alone (an MI300X's capability reads 9.4, which would take the Hopper variants), so there its ops run
# torch's own.
CUDA_BACKEND = "aten" if torch.version.hip or TRITON_MISSING else "triton"

AUTOTUNE = os.environ.get("TCONV3D_AUTOTUNE", "0") == "1"
CACHE_DIR = Path(
    os.environ.get("TCONV3D_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tconv3d"
)
CONFIG_DIR = Path(os.environ["TCONV3D_CONFIG_DIR"]) if os.environ.get("TCONV3D_CONFIG_DIR") else None

KERNEL_VARIANTS = ("auto", "pointer", "tma", "gluon")
KERNELS = os.environ.get("TCONV3D_KERNELS", "auto")
if KERNELS not in KERNEL_VARIANTS:
    raise ValueError(f"TCONV3D_KERNELS must be one of {KERNEL_VARIANTS}, got {KERNELS!r}")

TMA_MAPS = os.environ.get("TCONV3D_TMA_MAPS", "any")
if TMA_MAPS not in ("any", "strict"):
    raise ValueError(f"TCONV3D_TMA_MAPS must be any or strict, got {TMA_MAPS!r}")

DIRECT_LAUNCH = os.environ.get("TCONV3D_DIRECT_LAUNCH", "1")
if DIRECT_LAUNCH not in ("0", "1"):
    raise ValueError(f"TCONV3D_DIRECT_LAUNCH must be 0 or 1, got {DIRECT_LAUNCH!r}")
DIRECT_LAUNCH = DIRECT_LAUNCH == "1"

INDUCTOR_KERNELS = os.environ.get("TCONV3D_INDUCTOR_KERNELS", "0")
if INDUCTOR_KERNELS not in ("0", "1"):
    raise ValueError(f"TCONV3D_INDUCTOR_KERNELS must be 0 or 1, got {INDUCTOR_KERNELS!r}")
INDUCTOR_KERNELS = INDUCTOR_KERNELS == "1"


def runs_triton(t: torch.Tensor) -> bool:
    """Whether the ops run tconv3d's Triton kernels on `t`'s device (an NVIDIA GPU; the CPU under the interpreter)
    or torch's own ops."""
    return (t.is_cuda and CUDA_BACKEND == "triton") or (t.is_cpu and CPU_BACKEND == "triton")


# torch (2.9 on) keeps fp32 precision per backend and operator: "tf32", "ieee", or "none" (its parent's). Its
# legacy view, torch.backends.cudnn.allow_tf32, raises once conv and rnn differ or either is "ieee" by the new API
# (torch.backends.cudnn.conv.fp32_precision = "ieee", torch.backends.fp32_precision = "ieee").
_CONV_PRECISION_CHAIN = (("cuda", "conv"), ("cuda", "all"), ("generic", "all"))


def tf32_allowed() -> bool:
    """Whether cuDNN's convolutions may multiply fp32 as TF32 now, and so tconv3d's fp32 kernels: cuDNN's conv
    precision (torch.backends.cudnn.conv.fp32_precision), where that is "none" its parents' (cuDNN's, then every
    backend's); "none" throughout is exact. Set by either API (allow_tf32 = False leaves "none" throughout)."""
    for backend, op in _CONV_PRECISION_CHAIN:
        precision = torch._C._get_fp32_precision_getter(backend, op)
        if precision != "none":
            return precision == "tf32"
    return False
