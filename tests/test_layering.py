"""Imports inside tconv3d run one way, floor by floor from the bottom, and the folders are the floors:

    settings, geometry, testing   the leaves every layer meets on (environment, argument checks, the reference)
    kernels/                      every @triton.jit family with its launcher, the config type, the aten fallback
    inspect/                      compiling the kernels for a GPU that is not there (compile.py)
    tune/                         configs as data, tables, shape sets, the tuner, the choice of variant and tiling
    plans, ops, functional        call plans, the torch.library ops and the functional entry
    nn/                           hooks, subpixel, modules, convert, audit, the VAE, MONAI, torchvision adapters
    tconv3d (__init__)            the public surface

A module may import its own floor and the floors below. `__main__` modules are entry points (`python -m
tconv3d`, `tconv3d.tune`, `tconv3d.inspect`): they may import any floor and nothing imports them. Every import
counts, those inside functions too, and the whole module graph has no circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tconv3d"

FLOORS = [
    ("tconv3d.settings", "tconv3d.geometry", "tconv3d.testing"),
    ("tconv3d.kernels",),
    ("tconv3d.inspect",),
    ("tconv3d.tune",),
    ("tconv3d.plans", "tconv3d.ops", "tconv3d.functional"),
    ("tconv3d.nn",),
    ("tconv3d",),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    matches = [
        (len(prefix), level)
        for level, prefixes in enumerate(FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is on no floor: add it to FLOORS in tests/test_layering.py"
    return max(matches)[1]


def is_entry_point(module: str) -> bool:
    return module.rsplit(".", 1)[-1] == "__main__"


def imports_of(module: str) -> set[str]:
    """The package modules `module` imports, resolved: `from .x import name` is module x.name where that is a
    module, else x."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            bases, names = [base], [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            if base != "tconv3d" and not base.startswith("tconv3d."):
                continue
            submodules = [f"{base}.{name}" for name in names if f"{base}.{name}" in MODULES]
            found.update(submodules or [base])
    return found - {module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)
    for targets in GRAPH.values():
        assert targets <= set(MODULES), f"imports of modules that do not exist: {targets - set(MODULES)}"


def test_imports_run_one_way():
    upward = {
        module: sorted(target for target in targets if floor_of(target) > floor_of(module))
        for module, targets in GRAPH.items()
        if not is_entry_point(module)
    }
    upward = {module: targets for module, targets in upward.items() if targets}
    assert not upward, f"modules importing above their floor: {upward}"


def test_nothing_imports_an_entry_point():
    importing = {module: sorted(filter(is_entry_point, targets)) for module, targets in GRAPH.items()}
    assert not {module: targets for module, targets in importing.items() if targets}


def test_no_circle():
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            circle = [*on_path[on_path.index(module) :], module]
            raise AssertionError(f"import circle: {' -> '.join(circle)}")
        if module in done:
            return
        on_path.append(module)
        for target in sorted(GRAPH[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(GRAPH):
        visit(module)


def test_the_checks_can_fail():
    """The graph is read right: known edges are there, and an upward or circular one would be seen."""
    assert "tconv3d.kernels.config" in GRAPH["tconv3d.kernels.conv_fwd"]
    assert "tconv3d.tune.choice" in GRAPH["tconv3d.ops"]
    assert "tconv3d.inspect.compile" in GRAPH["tconv3d.tune.tuner"]
    assert floor_of("tconv3d.testing") < floor_of("tconv3d.functional")  # the old circle went testing -> functional
    assert floor_of("tconv3d.tune.choice") > floor_of("tconv3d.kernels.conv_fwd")


def test_no_launcher_chooses_its_own_tiling():
    for path in sorted((PACKAGE / "kernels").glob("conv_*.py")):
        source = path.read_text()
        assert "pick_config" not in source and "choice" not in source, path.name
