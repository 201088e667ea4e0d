"""The README and docs/ say only what is there: every path they name exists, every `python -m` module and every
`tconv3d.*` name resolves (or names a registered op), every relative link lands, and the README stays a front
page."""

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import tconv3d

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP_DIRS = ("tconv3d/", "tests/", "bench/", "autotune_configs/", "docs/", ".ci/")


def code_spans(page: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", page.read_text())


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_paths_exist(page):
    named = {
        word.rstrip(".,:;)")
        for span in code_spans(page)
        for word in span.split()
        if word.startswith(TOP_DIRS) and "<" not in word and "*" not in word
    }
    missing = sorted(path for path in named if not names_something(path))
    assert not missing, f"{page_id(page)} names paths that do not exist: {missing}"


def names_something(path: str) -> bool:
    """A path that exists, or a test file's `path::test_name` whose test is defined there."""
    path, _, test = path.partition("::")
    if not (ROOT / path).exists():
        return False
    return not test or re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(), flags=re.M) is not None


def defined_tests() -> set[str]:
    """The names of the tests under tests/ (functions, methods) and of the test modules."""
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names |= {path.stem, *re.findall(r"^\s*def (test_\w+)\(", path.read_text(), flags=re.M)}
    return names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_tests_exist(page):
    """A test the docs name by itself, `test_...`, is defined under tests/ (a mend once deleted one a page named)."""
    named = {name for span in code_spans(page) for name in re.findall(r"(?<![\w/.:])test_\w+(?![\w.])", span)}
    missing = sorted(named - defined_tests())
    assert not missing, f"{page_id(page)} names tests that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_m_modules_exist(page):
    modules = set(re.findall(r"python3? -m ((?:tconv3d|bench)[\w.]*)", page.read_text()))
    missing = sorted(module for module in modules if importlib.util.find_spec(module) is None)
    assert not missing, f"{page_id(page)} runs modules that do not exist: {missing}"


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for name in parts[split:]:
                obj = getattr(obj, name)
        except AttributeError:
            break
        return True
    op = parts[1] if len(parts) > 1 else ""
    return hasattr(torch.ops.tconv3d, op)  # an op as graphs and the profiler name it: tconv3d.conv3d_input_grad


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_named_python_objects_exist(page):
    names = {
        match
        for span in code_spans(page)
        for match in re.findall(r"(?<![\w.])tconv3d(?:\.\w+)+", span)
        if not match.endswith(".default")
    }
    missing = sorted(name for name in names if not resolves(name))
    assert not missing, f"{page_id(page)} names objects that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_land(page):
    text = re.sub(r"`[^`\n]*`", "", page.read_text())  # code, such as kernel[grid](...), holds no links
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page_id(page)} links to missing files: {missing}"


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines; move reference material to docs/"
    linked = set(re.findall(r"\]\(docs/([\w.]+)\)", "\n".join(lines)))
    assert linked == {page.name for page in PAGES[1:]}, "every docs/ page is linked from the README"


def test_the_checks_can_fail():
    assert not resolves("tconv3d.no_such_thing") and not resolves("tconv3d.nn.NoSuchModule")
    assert "test_static_compile" in defined_tests() and "test_no_such_test" not in defined_tests()
    assert resolves("tconv3d.tune.choice.pick_config") and resolves("tconv3d.conv3d_input_grad")
    assert importlib.util.find_spec("tconv3d.no_such_module") is None
    assert tconv3d.nn.convert is not None
