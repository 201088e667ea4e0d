"""The main job, `python -m tconv3d`, runs and passes its own check (interpreter self-check on a CPU machine)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


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


WITHOUT_TRITON = """
import runpy, sys, types
sys.modules["triton"] = None  # as where Triton is not installed: importing it fails, find_spec answers None
import torch
import torch.nn.functional as F
import tconv3d
from tconv3d import settings
from tconv3d.__main__ import launch_paths
from tconv3d.testing import TOLERANCE, float64_errors, rel_l2

assert [m for m, module in sys.modules.items() if m.split(".")[0] == "triton" and module is not None] == []
gpu = types.SimpleNamespace(is_cuda=True, is_cpu=False)
assert (settings.CPU_BACKEND, settings.CUDA_BACKEND, settings.runs_triton(gpu)) == ("aten", "aten", False)
print(launch_paths())
torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 8, 4, 6, 5).to(dtype).contiguous(memory_format=torch.channels_last_3d)
    w, b = torch.randn(8, 4, 3, 3, 3).to(dtype), torch.randn(8).to(dtype)
    skip = torch.randn(2, 4, 4, 6, 5).to(dtype)
    for args in ((1, 1, 1, 2), ((1, 2, 1), (2, 0, 1, 1, 1, 1), (1, 1, 2), 2)):
        for name, err in float64_errors(tconv3d.conv3d, x, w, b, *args).items():
            assert err < TOLERANCE[dtype], (dtype, args, name, err)
    ours = tconv3d.conv3d(x, w, b, 1, 1, 1, 2, "reflect,zeros,circular")
    padded = F.pad(F.pad(x.double(), (1, 1, 0, 0, 0, 0), mode="circular"), (0, 0, 0, 0, 1, 1), mode="reflect")
    assert rel_l2(ours, F.conv3d(F.pad(padded, (0, 0, 1, 1)), w.double(), b.double(), groups=2)) < TOLERANCE[dtype]
    ours = tconv3d.conv3d(x[:, :4], w.repeat(1, 2, 1, 1, 1), b, 1, 1, channels_after=skip)
    assert ours.is_contiguous(memory_format=torch.channels_last_3d)
    expected = F.conv3d(torch.cat([x[:, :4], skip], 1).double(), w.repeat(1, 2, 1, 1, 1).double(), b.double(), 1, 1)
    assert rel_l2(ours, expected) < TOLERANCE[dtype]
plan = tconv3d.explain(x, w, padding=1, groups=2)
assert all(plan[d] == {"variant": "aten", "config": None, "source": "aten"} for d in ("fwd", "dgrad", "wgrad")), plan
try:
    tconv3d.explain(x, w, padding=1)  # 8 input channels, a weight of 4: the checks still run
except ValueError as error:
    print("refused:", error)
else:
    raise AssertionError("explain took a weight of the wrong channels")

from monai.networks.nets import UNet

for norm in ("batch", "instance"):
    torch.manual_seed(1)
    stock = UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1, norm=norm)
    converted = tconv3d.nn.convert(UNet(3, 1, 2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1, norm=norm))
    converted.load_state_dict(stock.state_dict())
    x = torch.randn(2, 1, 8, 12, 8)
    outputs = [model(x) for model in (stock, converted)]
    for model, out in zip((stock, converted), outputs):
        (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    assert rel_l2(outputs[1], outputs[0]) < 1e-5
    assert outputs[1].is_contiguous(memory_format=torch.channels_last_3d)
    # all parameters' gradients as one vector: a conv bias before a norm has a gradient of rounding alone
    grads = [torch.cat([p.grad.flatten() for p in model.parameters()]) for model in (stock, converted)]
    assert rel_l2(grads[1], grads[0]) < 1e-5, (norm, rel_l2(grads[1], grads[0]))
    for (name, theirs), ours in zip(stock.named_buffers(), converted.buffers()):
        assert torch.allclose(ours.float(), theirs.float(), rtol=1e-5, atol=1e-6), (norm, name)
    report = tconv3d.nn.audit(converted, x, verbose=False)
    assert report.totals["tconv3d_calls"] > 0 and report.totals["aten_conv3d_calls"] == 0, report.table()
    compiled = torch.compile(converted, fullgraph=True, backend="aot_eager")
    assert rel_l2(compiled(x), converted(x)) < 1e-6
print("ok")
torch.cuda.is_available = lambda: True  # a GPU without Triton: torch's ops there, nothing of tconv3d's to time
sys.argv = ["tconv3d"]
runpy.run_module("tconv3d", run_name="__main__")
"""


def test_tconv3d_runs_torchs_ops_without_triton():
    """Where Triton is not installed (it has wheels for Linux alone; the package asks for it there alone), tconv3d
    imports without it, imports nothing of it, and runs torch's own ops on every device: the convolutions with
    padding modes, strides, groups and a skip connection read as concatenated against float64; a converted MONAI
    UNet with BatchNorm and with InstanceNorm as stock (outputs, parameter gradients, running statistics), its convs
    counted on tconv3d's ops, compiled too; explain says "aten" after the checks; python -m tconv3d checks those ops
    and passes, a GPU there too (cuDNN's ops: nothing to time). Any kernel module imported at tconv3d's import
    fails it."""
    pytest.importorskip("monai")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "1"}  # no interpreter without Triton
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRITON], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"Triton is not installed (Python on {sys.platform}): tconv3d's ops run torch's own on this GPU"
    assert lines[1].startswith("refused: ") and "ok" in lines
    assert "Triton is not installed" in result.stdout.split("ok\n", 1)[1] and "FAIL" not in result.stdout
