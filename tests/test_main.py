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
