"""The main job, `python -m tconv3d`, runs and passes its own check (interpreter self-check on a CPU machine)."""

import os
import subprocess
import sys
from pathlib import Path


def test_main_job_passes():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-m", "tconv3d"], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "relative L2 error" in result.stdout
    assert "FAIL" not in result.stdout


def test_launch_paths_names_each_path_and_why_not():
    """The line python -m tconv3d prints on a GPU: the direct path, the call past Triton's launcher Python and the
    Gluon kernels, each with why not where it is off (this process runs the interpreter: the direct path is off)."""
    from tconv3d.__main__ import launch_paths
    from tconv3d.kernels import launch

    line = launch_paths()
    assert line.startswith("triton ") and "direct launches off (the interpreter runs kernels itself)" in line
    assert f"past the launcher's Python no ({launch.WRAPPER})" in line and "; Gluon " in line


ROCM_TORCH = """
import types
import torch
if {hip!r}:
    torch.version.hip = {hip!r}  # what a ROCm build of torch reports; its AMD GPUs answer as cuda devices
from tconv3d import settings
from tconv3d.__main__ import launch_paths
gpu, cpu = types.SimpleNamespace(is_cuda=True, is_cpu=False), types.SimpleNamespace(is_cuda=False, is_cpu=True)
print(settings.CUDA_BACKEND, settings.runs_triton(gpu), settings.runs_triton(cpu), launch_paths())
"""


def test_a_rocm_torch_runs_torchs_own_ops_on_its_gpus():
    """Under a ROCm build of torch (torch.version.hip set), tconv3d's kernels, variants and tuning, written and
    checked for NVIDIA GPUs alone, do not run on its GPUs (an MI300X's capability 9.4 would take the Hopper
    variants): the ops run torch's own there, and python -m tconv3d says so. CPU tensors are as elsewhere."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}
    found = {}
    for hip in ("6.4.43484", None):
        result = subprocess.run(
            [sys.executable, "-c", ROCM_TORCH.format(hip=hip)], cwd=root, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        found[hip] = result.stdout.strip().splitlines()[-1]
    backend, on_gpu, on_cpu, line = found["6.4.43484"].split(" ", 3)
    assert (backend, on_gpu, on_cpu) == ("aten", "False", "True")
    assert line.startswith("a ROCm build of torch (HIP 6.4.43484): tconv3d's ops run torch's own"), line
    assert found[None].startswith("triton True True triton "), found[None]
