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
