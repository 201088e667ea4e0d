"""docs/upstream.md's repros run as written, each in a fresh interpreter (the Triton one needs TRITON_INTERPRET
before triton is imported, and none of conftest's patches), and each says whether its fault still reproduces.
They do not have to reproduce: a fault fixed upstream prints `reproduces: False`, which the test turns into a
warning in pytest's summary (its workaround in tconv3d may go)."""

import importlib.util
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[1] / "docs" / "upstream.md"
PROJECTS = ("torch", "Triton", "diffusers")  # diffusers' repros need the integrations extra (absent under triton 3.6)


def repros() -> dict[str, str]:
    text = PAGE.read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    found = {}
    for section in sections:
        title = section.splitlines()[0]
        blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
        assert len(blocks) == 1, f"{title!r} has {len(blocks)} python blocks, not one repro"
        found[title] = blocks[0]
    return found


def test_every_report_names_its_project_and_has_one_repro():
    titles = list(repros())
    assert len(titles) >= 2 and all(title.split(":")[0] in PROJECTS for title in titles), titles


@pytest.mark.parametrize("name", sorted(repros()))
def test_the_repro_runs_and_gives_a_verdict(name):
    if name.startswith("diffusers") and importlib.util.find_spec("diffusers") is None:
        pytest.skip("diffusers is not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", repros()[name]], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = re.findall(r"^reproduces: (True|False)$", done.stdout, flags=re.M)
    assert len(verdict) == 1, done.stdout
    if verdict[0] == "False":
        warnings.warn(f"docs/upstream.md, {name!r}: no longer reproduces; its workaround may go", stacklevel=1)
