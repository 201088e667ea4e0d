"""Tuning tables: where they live, how they are read and checked, and how entries are written.

A table is autotune_configs/<device name as torch reports it, spaces replaced by _>.json:
    {"device", "triton", "torch", "date", "variants", "entries": {"<tuning key>": {"config": {...}, "ms",
     "default_config", "default_ms", ...}}}
"variants" lists the kernel variants its tuning searched ("pointer", "tma", "gluon", "direct"); a table without
it predates the field and searched the pointer kernels alone (the H100 table of 2026-11-22).
Tables are read from the shipped folder, then TCONV3D_CONFIG_DIR, then the first-use tuning cache, later ones
overriding earlier ones. A table that is not valid JSON or comes from another triton major version is skipped
with one warning; entries naming an invalid config are skipped with one warning per table. Never a crash.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
import triton
from packaging.version import Version

from .. import settings
from ..kernels.config import KernelConfig
from .configs import TuningKey

_PACKAGE_DIR = Path(__file__).parents[1]  # tconv3d/
# Installed wheels carry the tables inside the package; a source checkout has them beside it.
SHIPPED_DIRS = (_PACKAGE_DIR / "autotune_configs", _PACKAGE_DIR.parent / "autotune_configs")


def table_file_name(device_name: str) -> str:
    return device_name.replace(" ", "_") + ".json"


def table_dirs() -> list[Path]:
    dirs = [d for d in SHIPPED_DIRS if d.is_dir()][:1]
    if settings.CONFIG_DIR is not None:
        dirs.append(settings.CONFIG_DIR)
    dirs.append(settings.CACHE_DIR)
    return dirs


# What a table without "variants" searched: tables tuned before the field, when the tuner had the pointer kernels.
LEGACY_VARIANTS = frozenset({"pointer"})


def table_metadata(device_name: str, variants=LEGACY_VARIANTS) -> dict:
    return {
        "device": device_name,
        "triton": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "variants": sorted(variants),
    }


def read_table(path: Path) -> dict[TuningKey, KernelConfig]:
    """The valid entries of one table file; {} with a warning if the file cannot be used at all."""
    return _read_table(path)[0]


def _read_table(path: Path) -> tuple[dict[TuningKey, KernelConfig], frozenset[str]]:
    """read_table's entries, and the kernel variants the tuning behind them searched (its "variants";
    LEGACY_VARIANTS where it does not say)."""
    try:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            raise ValueError("expected an object with an 'entries' object")
        made_with = Version(str(data.get("triton", "0")))
    except (OSError, ValueError) as error:
        warnings.warn(f"tconv3d: ignoring tuning table {path}: {error}", RuntimeWarning, stacklevel=3)
        return {}, LEGACY_VARIANTS
    if made_with.major != Version(triton.__version__).major:
        warnings.warn(
            f"tconv3d: ignoring tuning table {path}: made with triton {made_with}, this is triton "
            f"{triton.__version__} (another major version)",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}, LEGACY_VARIANTS
    table, rejected = {}, []
    for key_text, entry in data["entries"].items():
        try:
            table[TuningKey.parse(key_text)] = KernelConfig.from_dict(
                entry.get("config") if isinstance(entry, dict) else entry
            )
        except (TypeError, ValueError) as error:
            rejected.append(f"{key_text}: {error}")
    if rejected:
        warnings.warn(
            f"tconv3d: skipped {len(rejected)} invalid entr{'y' if len(rejected) == 1 else 'ies'} of tuning table "
            f"{path} (the heuristic or another entry stands in): " + "; ".join(rejected[:3]),
            RuntimeWarning,
            stacklevel=3,
        )
    variants = data.get("variants")
    return table, frozenset(variants) if isinstance(variants, list) else LEGACY_VARIANTS


def device_table(device: torch.device) -> dict[TuningKey, KernelConfig]:
    """Every tuned config known for this CUDA device's model."""
    return named_table(torch.cuda.get_device_name(device))


# Per GPU model, per key of named_table: the variants the tuning that chose its config searched (named_table
# fills it as it merges the tables).
_searched: dict[str, dict[TuningKey, frozenset[str]]] = {}


@functools.lru_cache(maxsize=16)
def named_table(device_name: str) -> dict[TuningKey, KernelConfig]:
    """Every tuned config known for the GPU model `device_name`, merged from all table folders. Read once per
    process (python -m tconv3d.inspect reads the tables of GPUs that are not there)."""
    name = table_file_name(device_name)
    merged: dict[TuningKey, KernelConfig] = {}
    searched: dict[TuningKey, frozenset[str]] = {}
    for directory in table_dirs():
        path = directory / name
        if path.is_file():
            entries, variants = _read_table(path)
            merged.update(entries)
            searched.update(dict.fromkeys(entries, variants))
    _searched[device_name] = searched
    return merged


def searched_variants(device_name: str) -> dict[TuningKey, frozenset[str]]:
    """Per key of named_table(device_name): the variants the tuning that chose its config searched (its table's
    "variants"; a later folder's table overrides an earlier one's, as for the configs). A key first tuned here
    after the tables were read (first-use tuning) is absent: it searched everything this device runs."""
    named_table(device_name)
    return _searched[device_name]


def read_entries(path: Path) -> dict:
    """The raw entries of a table being written (for resuming); {} if it does not exist yet."""
    if not Path(path).is_file():
        return {}
    return json.loads(Path(path).read_text()).get("entries", {})


def write_entry(path: Path, key: TuningKey, entry: dict, metadata: dict) -> None:
    """Add or replace one entry, rewriting the file atomically so an interrupted run never leaves it corrupt."""
    entries = read_entries(path)
    entries[str(key)] = entry
    _write_json(path, {**metadata, "entries": dict(sorted(entries.items()))})


def _write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        json.dump(data, tmp, indent=1)
        tmp.write("\n")
    os.replace(tmp.name, path)


def hung_file(table_path: Path) -> Path:
    """Beside a table being tuned, <device>.hung.json: the candidates whose first run never finished, per key (the
    tuner exits when one hangs; run again, it resumes without them). Not a table: nothing reads it as one."""
    table_path = Path(table_path)
    return table_path.with_name(table_path.stem + ".hung.json")


def read_hung(path: Path) -> dict[str, list[KernelConfig]]:
    if not Path(path).is_file():
        return {}
    return {key: [KernelConfig.from_dict(c) for c in found] for key, found in json.loads(path.read_text()).items()}


def record_hung(path: Path, key: TuningKey, config: KernelConfig) -> None:
    found = {k: [c.to_dict() for c in v] for k, v in read_hung(path).items()}
    found.setdefault(str(key), []).append(config.to_dict())
    _write_json(path, found)
