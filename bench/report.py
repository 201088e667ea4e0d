"""Benchmark results: the derived figures (TFLOP/s, % of peak, speedups, geomeans) and the three files a run
writes: <device>.json, <device>.md and <device>.png under bench/results/. No GPU needed here."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tconv3d.tune.shapes import DIRECTION_FLOP_FACTOR, ConvShape

IMPLS = ("tconv3d", "cudnn_cl3d", "cudnn_ncdhw", "compile", "compile_max_autotune")
BASELINE = "cudnn_cl3d"
DIRECTIONS = tuple(DIRECTION_FLOP_FACTOR)


def device_file_stem(device_name: str) -> str:
    return device_name.replace(" ", "_")


def min_bytes(shape: ConvShape, direction: str, element_size: int) -> int:
    """The fewest bytes a direction must move: each tensor it reads read once, each it writes written once."""
    geom = shape.geometry()
    x = geom.batch * geom.in_channels * math.prod(geom.in_size)
    y = geom.batch * geom.out_channels * math.prod(geom.out_size)
    w = geom.out_channels * geom.in_channels * geom.taps
    forward = x + w + y
    backward = (y + w + x) + (y + x + w)  # input-grad: read dy and w, write dx; weight-grad: read dy and x, write dw
    elements = {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[direction]
    return elements * element_size


def pct_of_peak(tflops: float, peak_tflops: float | None) -> float | None:
    return round(100 * tflops / peak_tflops, 1) if peak_tflops else None


def impl_figures(ms: float, flops: int, peak_tflops: float, peak_mem_mb: float | None) -> dict:
    tflops = flops / ms * 1e-9
    return {
        "ms": round(ms, 5),
        "tflops": round(tflops, 2),
        "pct_of_peak": pct_of_peak(tflops, peak_tflops),
        "peak_mem_mb": None if peak_mem_mb is None else round(peak_mem_mb, 1),
    }


def speedup(case: dict, impl: str = "tconv3d", baseline: str = BASELINE) -> float | None:
    impls = case["impls"]
    if impl not in impls or baseline not in impls or not impls[impl].get("ms") or not impls[baseline].get("ms"):
        return None
    return impls[baseline]["ms"] / impls[impl]["ms"]


def _rounded(value, digits=3):
    return None if value is None else round(value, digits)


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def memory_ratio(case: dict, impl: str = "tconv3d", baseline: str = BASELINE) -> float | None:
    """tconv3d's peak memory over cuDNN channels_last_3d's for a case (what the call allocated beyond its inputs):
    below 1 means tconv3d is leaner."""
    ours, theirs = (case["impls"].get(name, {}).get("peak_mem_mb") for name in (impl, baseline))
    return ours / theirs if ours and theirs else None


def summary(results: dict) -> dict:
    """Per (direction, dtype): geomean speedup of tconv3d over cuDNN channels_last_3d and the worst case; where the
    cases measured peak memory, the geomean of tconv3d's over cuDNN's and the case most over it."""
    out = {}
    for direction in DIRECTIONS:
        for dtype in sorted({c["dtype"] for c in results["cases"]}):
            cases = [c for c in results["cases"] if c["direction"] == direction and c["dtype"] == dtype]
            ratios = [(speedup(c), c["name"]) for c in cases if speedup(c)]
            if ratios:
                worst = min(ratios)
                out[f"{direction}/{dtype}"] = {
                    "geomean_speedup": round(geomean(r for r, _ in ratios), 3),
                    "worst_speedup": round(worst[0], 3),
                    "worst_case": worst[1],
                    "cases": len(ratios),
                }
                memory = [(memory_ratio(c), c["name"]) for c in cases if memory_ratio(c)]
                if memory:
                    most = max(memory)
                    out[f"{direction}/{dtype}"].update(
                        geomean_memory_ratio=round(geomean(r for r, _ in memory), 3),
                        most_memory_ratio=round(most[0], 3),
                        most_memory_case=most[1],
                    )
    return out


def _cell(value, fmt="{:.3f}") -> str:
    if value is None:
        return "-"
    return fmt.format(value) if isinstance(value, (int, float)) else str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return ["| " + " | ".join(r) + " |" for r in [header, align, *rows]]


CASE_COLUMNS = ["case", "dtype", "dir", "tconv3d", "cuDNN CL", "speedup", "graph: tconv3d", "graph: cuDNN CL",
                "cuDNN NCDHW", "compile", "max-autotune", "TFLOP/s", "% peak", "rel. err", "peak MiB: tconv3d",
                "peak MiB: cuDNN CL", "memory ratio"]  # fmt: skip


def _case_table(results: dict) -> list[str]:
    """The cases' table; with a column naming the commit each was measured at where a merge put together cases of
    more than one run (the heading's commit is the newest run's)."""
    rows = [_case_row(c) for c in results["cases"]]
    if not _mixed_runs(results):
        return _table(CASE_COLUMNS, rows)
    measured = [f"{c['commit']}, {c['date']}" for c in _stamped(results)]
    return _table([*CASE_COLUMNS, "measured at"], [[*row, at] for row, at in zip(rows, measured, strict=True)])


def _mixed_runs(results: dict) -> bool:
    return len({c["commit"] for c in _stamped(results)}) > 1


def _case_row(case: dict) -> list[str]:
    impls = case["impls"]
    ours = impls.get("tconv3d", {})
    times = [_cell(impls.get(name, {}).get("ms")) for name in ("tconv3d", "cudnn_cl3d")]
    graphs = [_cell(impls.get(name, {}).get("graph_ms")) for name in ("tconv3d", "cudnn_cl3d")]
    others = [_cell(impls.get(name, {}).get("ms")) for name in ("cudnn_ncdhw", "compile", "compile_max_autotune")]
    return [
        case["name"], case["dtype"], case["direction"], *times, _cell(speedup(case), "{:.2f}x"), *graphs, *others,
        _cell(ours.get("tflops"), "{:.0f}"), _cell(ours.get("pct_of_peak"), "{:.0f}%"),
        _cell(ours.get("max_rel_err"), "{:.1e}"), _cell(ours.get("peak_mem_mb"), "{:.1f}"),
        _cell(impls.get("cudnn_cl3d", {}).get("peak_mem_mb"), "{:.1f}"), _cell(memory_ratio(case), "{:.2f}x"),
    ]  # fmt: skip


def markdown(results: dict) -> str:
    peak = results.get("peak", {})
    mm, copy = _cell(peak.get("bf16_mm_tflops"), "{:.0f}"), _cell(peak.get("copy_tbps"), "{:.2f}")
    tf32 = f", TF32 matmul {_cell(peak['tf32_mm_tflops'], '{:.0f}')} TFLOP/s" if peak.get("tf32_mm_tflops") else ""
    l2 = f", reads that hit L2 {peak['l2_read_tbps']:.2f} TB/s" if peak.get("l2_read_tbps") else ""
    newest = " (the newest run's; each case's below)" if _mixed_runs(results) else ""
    lines = [
        f"# tconv3d vs cuDNN on {results['device']}",
        "",
        f"torch {results['torch']}, triton {results['triton']}, cuDNN {results.get('cudnn')}, "
        f"commit {results.get('commit')}, {results.get('date')}{newest}.",
        f"Measured peaks: bf16 matmul {mm} TFLOP/s{tf32}, device copy {copy} TB/s{l2} (fp32 cases are quoted against "
        "TF32's). Times are medians of "
        "`triton.testing.do_bench` in ms; speedup = cuDNN channels_last_3d time / tconv3d time; graph: the same "
        "call replayed from a CUDA graph (no host time); peak MiB: what the call allocated beyond its inputs "
        "(torch.cuda.max_memory_allocated), memory ratio = tconv3d's / cuDNN channels_last_3d's (below 1: leaner).",
        "",
        *_case_table(results),
        "",
    ]
    summary_rows = [
        [name, f"{row['geomean_speedup']:.2f}x", f"{row['worst_speedup']:.2f}x", row["worst_case"],
         _cell(row.get("geomean_memory_ratio"), "{:.2f}x"),
         f"{row['most_memory_ratio']:.2f}x ({row['most_memory_case']})" if "most_memory_ratio" in row else "-"]
        for name, row in summary(results).items()
    ]  # fmt: skip
    header = ["direction/dtype", "geomean speedup", "worst", "worst case", "peak memory / cuDNN (geomean)", "most over"]
    lines += _table(header, summary_rows)
    if results.get("stack"):
        lines += ["", "3-layer stack: fwd+bwd step time and layout-conversion kernels in the profiler trace", ""]
        stack_rows = [
            [n, _cell(r.get("ms")), _cell(r.get("layout_conversion_kernels"), "{}")]
            for n, r in results["stack"].items()
        ]
        lines += _table(["implementation", "ms", "conversion kernels"], stack_rows)
    for section in ("conv2d_vs_conv3d", "causal", "skip", "subpixel", "norms"):
        rows = results.get(section) or []
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's columns (some rows have more)
            lines += ["", f"{section} (*_ms: ms, *_peak_mb: MiB)", "",
                      *_table(keys, [[_cell(row.get(k)) for k in keys] for row in rows])]  # fmt: skip
    if results.get("notes"):  # where the numbers come from, when a file was put together from several runs
        lines += ["", "Notes:", "", *(f"- {note}" for note in results["notes"])]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> bool:
    """Speedup of tconv3d over cuDNN channels_last_3d per case, fwd and bwd; False if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    directions = [d for d in ("fwd", "bwd") if any(c["direction"] == d for c in results["cases"])]
    fig, axes = plt.subplots(len(directions) or 1, 1, figsize=(12, 4 * max(len(directions), 1)), squeeze=False)
    for ax, direction in zip(axes[:, 0], directions, strict=False):
        cases = [c for c in results["cases"] if c["direction"] == direction and speedup(c)]
        labels = [f"{c['name']}\n{c['dtype']}" for c in cases]
        values = [speedup(c) for c in cases]
        ax.bar(range(len(values)), values, color=["tab:green" if v >= 1 else "tab:red" for v in values])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("speedup over cuDNN (CL)")
        ax.set_title(f"{direction}: tconv3d vs cuDNN channels_last_3d on {results['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _stamped(results: dict) -> list[dict]:
    """results' cases, each carrying the commit and date it was measured at: its own where a merge gave it one,
    else the run's."""
    return [{"commit": results.get("commit"), "date": results.get("date"), **case} for case in results.get("cases", [])]


def merge(old: dict, new: dict) -> dict:
    """`new` over `old`: cases replaced by (name, direction, dtype), scenarios replaced when present in `new`.
    Each case keeps the commit and date of the run that measured it (the file's own are the newest run's)."""

    def case_key(c):
        return c["name"], c["direction"], c["dtype"]

    cases = {case_key(c): c for c in _stamped(old)}
    cases.update({case_key(c): c for c in _stamped(new)})
    merged = {**old, **{k: v for k, v in new.items() if v not in (None, [], {})}}
    merged["cases"] = list(cases.values())
    return merged


def write_results(
    results: dict, out_dir: Path, merge_existing: bool = False, json_only: bool = False
) -> dict[str, Path]:
    """Write <device>.json, .md and .png into out_dir; with merge_existing, fold into the existing JSON first.
    json_only skips the Markdown and the plot (the benchmark saves its JSON after every case)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = device_file_stem(results["device"])
    json_path = out_dir / f"{stem}.json"
    if merge_existing and json_path.exists():
        results = merge(json.loads(json_path.read_text()), results)
    for case in results["cases"]:
        for name, figures in case["impls"].items():
            if "ms" in figures:
                figures["speedup_vs_cudnn_cl3d"] = _rounded(speedup(case, name))
    results = {**results, "summary": summary(results)}
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    if json_only:
        return {"json": json_path}
    paths = {"json": json_path, "md": out_dir / f"{stem}.md"}
    paths["md"].write_text(markdown(results))
    png = out_dir / f"{stem}.png"
    if plot(results, png):
        paths["png"] = png
    return paths


def main(argv=None) -> int:
    """python -m bench.report bench/results/<device>.json: rewrite its .md and .png beside it (a GPU call brings
    back only the JSON: the device tool returns few files)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.report", description=main.__doc__.split(":")[0])
    parser.add_argument("results", type=Path, help="a <device>.json that python -m bench wrote")
    args = parser.parse_args(argv)
    paths = write_results(json.loads(args.results.read_text()), args.results.parent)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
