"""Imports inside tconv3d run one way: configs (data and heuristics) at the bottom, the kernels above them, the
choosing, tuning and inspecting above the kernels, the ops on top. A module that imports upward makes a circle."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tconv3d"

KERNELS = {"conv_fwd", "conv_dgrad", "conv_wgrad", "conv_tma", "conv_depthwise", "group_norm"}
# What each module may import from the package (beyond the leaf helpers: geometry, settings, kernel_utils).
ALLOWED = {
    "configs": set(),
    "tables": {"configs"},
    "conv_tma": {"configs"},
    "conv_depthwise": {"configs"},
    "conv_fwd": {"configs", "conv_tma", "conv_depthwise"},
    "conv_dgrad": {"configs", "conv_tma", "conv_depthwise"},
    "conv_wgrad": {"configs", "conv_tma", "conv_depthwise"},
    "group_norm": set(),
    "static_compile": {"configs", *KERNELS},
    "tune": {"aten", "configs", "tables", "shapes", "testing", "static_compile", *KERNELS},
    "choice": {"configs", "tables", "tune"},
    "functional": {"ops"},  # the ops' eager callers (torch.ops.tconv3d.* wherever anything intercepts)
    "modules": {"functional", "ops"},
    "video_vaes": {"modules"},
    "convert": {"modules", "video_vaes"},
    "audit": {"convert", "video_vaes"},
    "nn": {"audit", "convert", "modules"},
}
LEAVES = {"geometry", "settings", "kernel_utils"}


def package_imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
    return found


def test_imports_run_one_way():
    upward = {
        module: sorted(package_imports(module) - allowed - LEAVES)
        for module, allowed in ALLOWED.items()
        if package_imports(module) - allowed - LEAVES
    }
    assert not upward, f"modules importing above their layer: {upward}"


def test_no_launcher_chooses_its_own_tiling():
    for module in ("conv_fwd", "conv_dgrad", "conv_wgrad", "conv_tma", "conv_depthwise"):
        source = (PACKAGE / f"{module}.py").read_text()
        assert "pick_config" not in source and "choice" not in source, module
