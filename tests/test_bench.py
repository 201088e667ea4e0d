"""The parts of the benchmarks that need no GPU: the suite, FLOP and byte counts, the plan, result writing."""

import collections
import dataclasses
import importlib.util
import itertools
import json

import pytest
import torch

from bench import report, run
from tconv3d.tune.shapes import load_shape_set

# The suite as the benchmark issue lists it: (N, Cin, Cout, T, H, W, kernel, stride).
SUITE = {
    "wan_dec_384a": (1, 384, 384, 6, 60, 104, (3, 3, 3), 1),
    "wan_dec_384b": (1, 384, 384, 6, 120, 208, (3, 3, 3), 1),
    "wan_dec_192": (1, 192, 192, 6, 240, 416, (3, 3, 3), 1),
    "wan_dec_96": (1, 96, 96, 6, 480, 832, (3, 3, 3), 1),
    "hunyuan_512": (1, 512, 512, 5, 32, 32, (3, 3, 3), 1),
    "hunyuan_128": (1, 128, 128, 17, 256, 256, (3, 3, 3), 1),
    "cogvideo_256": (1, 256, 256, 7, 120, 180, (3, 3, 3), 1),
    "unet_32": (2, 32, 32, 128, 128, 128, (3, 3, 3), 1),
    "unet_64": (2, 64, 64, 64, 64, 64, (3, 3, 3), 1),
    "unet_320": (2, 320, 320, 8, 8, 8, (3, 3, 3), 1),
    "unet_aniso": (2, 32, 32, 40, 192, 160, (1, 3, 3), 1),
    "down_s2": (2, 64, 128, 64, 64, 64, (3, 3, 3), 2),
    "first_cin3": (1, 3, 128, 17, 256, 256, (3, 3, 3), 1),
    "last_cout3": (1, 96, 3, 17, 256, 256, (3, 3, 3), 1),  # a video VAE decoder's conv_out, at full resolution
    "stack_64": (4, 64, 64, 64, 256, 256, (3, 3, 3), 1),
    # the grouped-convolution issue's cases (groups below)
    "x3d_depthwise_192": (1, 192, 192, 16, 56, 56, (3, 3, 3), 1),
    "depthwise_mult2_96": (1, 96, 192, 16, 56, 56, (3, 3, 3), 1),
    "resnext3d_g32_256": (1, 256, 256, 8, 28, 28, (3, 3, 3), 1),
}
SUITE_GROUPS = {"x3d_depthwise_192": 192, "depthwise_mult2_96": 96, "resnext3d_g32_256": 32}


def test_suite_is_the_issue_list():
    shapes = {s.name: s for s in load_shape_set("bench")}
    assert list(shapes) == list(SUITE)
    for name, (n, cin, cout, t, h, w, kernel, stride) in SUITE.items():
        s = shapes[name]
        assert (s.batch, s.cin, s.cout, s.size, s.kernel, s.stride) == (n, cin, cout, (t, h, w), kernel, (stride,) * 3)
        assert s.padding == tuple(k // 2 for k in kernel for _ in range(2))  # "same"-size padding
        assert "bf16" in s.dtypes
        assert s.groups == SUITE_GROUPS.get(name, 1)


def test_flop_counts():
    shapes = {s.name: s for s in load_shape_set("bench")}
    wan = shapes["wan_dec_384a"]
    one_direction = 2 * (1 * 6 * 60 * 104) * 384 * (384 * 27)
    assert wan.flops("fwd") == one_direction
    assert wan.flops("bwd") == 2 * one_direction
    assert wan.flops("fwd+bwd") == 3 * one_direction
    down = shapes["down_s2"]  # stride 2: 32^3 output voxels per item
    assert down.flops("fwd") == 2 * (2 * 32**3) * 128 * (64 * 27)


def test_min_bytes():
    shape = {s.name: s for s in load_shape_set("bench")}["unet_320"]
    x = y = 2 * 320 * 8**3
    w = 320 * 320 * 27
    assert report.min_bytes(shape, "fwd", 2) == 2 * (x + w + y)
    assert report.min_bytes(shape, "bwd", 2) == 2 * 2 * (x + w + y)


def test_user_shape_file(tmp_path):
    path = tmp_path / "mine.json"
    case = {"name": "causal", "batch": 1, "cin": 8, "cout": 8, "size": [5, 6, 7], "kernel": 3,
            "padding": [2, 0, 1, 1, 1, 1], "dtypes": ["fp16"]}  # fmt: skip
    path.write_text(json.dumps({"name": "mine", "cases": [case]}))
    (shape,) = load_shape_set(path)
    assert shape.padding == (2, 0, 1, 1, 1, 1) and shape.kernel == (3, 3, 3) and shape.dtypes == ("fp16",)
    assert shape.geometry().out_size == (5, 6, 7)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{", "not valid JSON"),
        ('{"cases": []}', "non-empty 'cases'"),
        ('{"cases": [{"name": "a", "batch": 1, "cin": 2, "cout": 2, "size": [4, 4, 4]}]}', "lacks the field 'kernel'"),
        ('{"cases": [{"name": "a", "batch": 1, "cin": 2, "cout": 2, "size": [4, 4], "kernel": 3}]}', "size must be"),
        ('{"cases": [{"name": "a", "batch": 1, "cin": 2, "cout": 2, "size": [2, 4, 4], "kernel": 5, "padding": 0}]}',
         "smaller than the dilated kernel"),
        ('{"cases": [{"name": "a", "batch": 1, "cin": 2, "cout": 2, "size": [4, 4, 4], "kernel": 3, '
         '"dtypes": ["fp8"]}]}',
         "unknown dtype"),
    ],
)  # fmt: skip
def test_bad_shape_files_name_the_problem(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words):
        load_shape_set(path)


def test_unknown_shape_set():
    with pytest.raises(FileNotFoundError, match="no shape set 'nope'"):
        load_shape_set("nope")


def test_plan_runs_bf16_everywhere_and_other_dtypes_on_the_subset():
    shapes = load_shape_set("bench")
    plan = run.plan_cases(shapes, "all", ("fwd", "bwd"))
    bf16 = {(s.name, d) for s, dt, d in plan if dt == "bf16"}
    assert len(bf16) == 2 * len(shapes)
    subset = {s.name for s, dt, _ in plan if dt == "fp32"}
    assert subset == {"wan_dec_384a", "hunyuan_512", "unet_64", "unet_aniso"}
    assert run.plan_cases(shapes, "bf16", ("fwd",), {"unet_64"}) == [(shapes[8], "bf16", "fwd")]


def synthetic_results():
    def case(name, direction, ours, cudnn):
        flops = 10**12
        return {
            "name": name, "direction": direction, "dtype": "bf16", "shape": {}, "flops": flops, "min_bytes": 1,
            "impls": {"tconv3d": {**report.impl_figures(ours, flops, 800.0, 12.0), "max_rel_err": 3e-3},
                      "cudnn_cl3d": report.impl_figures(cudnn, flops, 800.0, 10.0),
                      "compile": {"error": "RuntimeError: no"}},
        }  # fmt: skip

    return {
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "cudnn": 91000,
        "commit": "abc", "date": "2026-11-22", "peak": {"bf16_mm_tflops": 800.0, "copy_tbps": 3.0},
        "cases": [case("a", "fwd", 2.0, 4.0), case("b", "fwd", 4.0, 2.0), case("a", "bwd", 1.0, 3.0)],
        "stack": {"cudnn_eager": {"ms": 9.0, "layout_conversion_kernels": 0},
                  "compile": {"ms": 12.0, "layout_conversion_kernels": 6}},
        "conv2d_vs_conv3d": [
            {"name": "c2_bf16_fwd", "cudnn_conv3d_ms": 1.0, "cudnn_conv2d_ms": 0.5, "tconv3d_ms": 0.4}
        ],
        "causal": [],
    }  # fmt: skip


def test_figures_and_summary():
    results = synthetic_results()
    fig = results["cases"][0]["impls"]["tconv3d"]
    assert fig["tflops"] == 500.0 and fig["pct_of_peak"] == 62.5 and fig["peak_mem_mb"] == 12.0
    assert report.speedup(results["cases"][0]) == 2.0
    summary = report.summary(results)
    speed = {"geomean_speedup": 1.0, "worst_speedup": 0.5, "worst_case": "b", "cases": 2}
    memory = {"geomean_memory_ratio": 1.2, "most_memory_ratio": 1.2, "most_memory_case": "b"}
    assert summary["fwd/bf16"] == {**speed, **memory}
    assert summary["bwd/bf16"]["geomean_speedup"] == 3.0
    # peak memory over cuDNN's: a geomean, and the case most over it (tconv3d's 12 MiB against 10 and 40)
    results["cases"][0]["impls"]["cudnn_cl3d"]["peak_mem_mb"] = 40.0
    summary = report.summary(results)["fwd/bf16"]
    assert (summary["geomean_memory_ratio"], summary["most_memory_case"]) == (round((0.3 * 1.2) ** 0.5, 3), "b")
    assert report.memory_ratio(results["cases"][0]) == 0.3
    del results["cases"][0]["impls"]["cudnn_cl3d"]["peak_mem_mb"]  # a run that measured none: no memory ratio
    assert report.memory_ratio(results["cases"][0]) is None and report.summary(results)["fwd/bf16"]["cases"] == 2


def test_results_files(tmp_path):
    results = synthetic_results()
    impls = results["cases"][0]["impls"]
    impls["tconv3d"]["graph_ms"], impls["cudnn_cl3d"]["graph_ms"] = 1.5, 3.75  # replayed from a CUDA graph
    paths = report.write_results(results, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert paths["json"].name == "NVIDIA_H100_80GB_HBM3.json"
    for key in ("device", "torch", "triton", "cudnn", "commit", "date", "peak", "cases", "stack", "summary"):
        assert key in data
    assert set(data["cases"][0]["impls"]["tconv3d"]) >= {"ms", "tflops", "peak_mem_mb", "max_rel_err"}
    assert data["cases"][0]["impls"]["tconv3d"]["speedup_vs_cudnn_cl3d"] == 2.0
    text = paths["md"].read_text()
    assert "| a | bf16 | fwd | 2.000 | 4.000 | 2.00x | 1.500 | 3.750 |" in text
    assert "| b | bf16 | fwd | 4.000 | 2.000 | 0.50x | - | - |" in text
    assert "| fwd/bf16 | 1.00x | 0.50x | b | 1.20x | 1.20x (b) |" in text
    assert "| 12.0 | 10.0 | 1.20x |" in text  # each case's peak memory, tconv3d's and cuDNN's
    assert "| compile | 12.000 | 6 |" in text
    if "png" in paths:
        assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_remakes_the_markdown_from_the_json_alone(tmp_path):
    """A GPU call brings back only <device>.json; python -m bench.report writes its .md beside it here."""
    json_path = report.write_results(synthetic_results(), tmp_path, json_only=True)["json"]
    assert not (tmp_path / "NVIDIA_H100_80GB_HBM3.md").exists()
    assert report.main([str(json_path)]) == 0
    text = (tmp_path / "NVIDIA_H100_80GB_HBM3.md").read_text()
    assert "| b | bf16 | fwd | 4.000 | 2.000 | 0.50x |" in text
    assert "L2" not in text.split("Measured peaks")[1].split("\n")[0]  # a run that measured no L2 bandwidth
    measured = synthetic_results()
    measured["peak"]["l2_read_tbps"] = 7.25
    assert "reads that hit L2 7.25 TB/s" in report.markdown(measured)


def test_merge_replaces_cases_by_name_direction_dtype(tmp_path):
    report.write_results(synthetic_results(), tmp_path)
    update = synthetic_results()
    update["cases"] = [update["cases"][1]]
    update["cases"][0]["impls"]["tconv3d"]["ms"] = 1.0
    update["stack"] = {}
    paths = report.write_results(update, tmp_path, merge_existing=True)
    data = json.loads(paths["json"].read_text())
    assert len(data["cases"]) == 3
    assert next(c for c in data["cases"] if c["name"] == "b")["impls"]["tconv3d"]["ms"] == 1.0
    assert data["stack"]["compile"]["layout_conversion_kernels"] == 6  # kept: the update measured no stack


def test_merged_cases_keep_the_commit_they_were_measured_at(tmp_path):
    """A file put together from two runs says which run measured each case: the file's commit is the newest run's,
    and a case the newer run did not measure keeps the older one's, in the JSON and as a column of the table."""
    older = synthetic_results()
    older["commit"], older["date"] = "aaaaaaa", "2026-11-01"
    report.write_results(older, tmp_path)
    assert "measured at" not in (tmp_path / "NVIDIA_H100_80GB_HBM3.md").read_text()  # one run: no column
    newer = synthetic_results()
    newer["commit"], newer["date"] = "bbbbbbb", "2026-11-02"
    newer["cases"] = [newer["cases"][1]]
    paths = report.write_results(newer, tmp_path, merge_existing=True)
    data = json.loads(paths["json"].read_text())
    assert data["commit"] == "bbbbbbb"
    measured = {(c["name"], c["direction"]): (c["commit"], c["date"]) for c in data["cases"]}
    older_run, newer_run = ("aaaaaaa", "2026-11-01"), ("bbbbbbb", "2026-11-02")
    assert measured == {("a", "fwd"): older_run, ("b", "fwd"): newer_run, ("a", "bwd"): older_run}
    text = paths["md"].read_text()
    assert "commit bbbbbbb, 2026-11-02 (the newest run's; each case's below)" in text
    assert "| b | bf16 | fwd | 4.000 | 2.000 | 0.50x |" in text and "| bbbbbbb, 2026-11-02 |" in text
    assert text.count("| aaaaaaa, 2026-11-01 |") == 2
    again = report.write_results(synthetic_results() | {"cases": []}, tmp_path, merge_existing=True)  # no cases
    assert {c["commit"] for c in json.loads(again["json"].read_text())["cases"]} == {"aaaaaaa", "bbbbbbb"}


def test_bench_command_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the command would benchmark for real")
    assert run.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_host_overhead_benchmark_runs_on_cpu(tmp_path, capsys):
    from bench import host_overhead

    out = tmp_path / "host.json"
    assert host_overhead.main(["--device", "cpu", "--calls", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    names = {"nn.Conv3d", "tconv3d.nn.Conv3d", "tconv3d.conv3d", "torch.ops.tconv3d.conv3d"}
    for mode in ("no_grad", "autograd"):
        assert set(data["us_per_call"][mode]) == names
        assert all(us > 0 for us in data["us_per_call"][mode].values())
    assert set(data["us_per_call"]["backward"]) == {"nn.Conv3d", "tconv3d.nn.Conv3d"}
    # the CPU's own speed at a few steps, which sets one host's stubbed figures against another's
    assert set(data["host_speed_us"]) == {"python, 100 steps", "Tensor.view", "Tensor.stride", "torch.empty cpu"}
    assert all(us > 0 for us in data["host_speed_us"].values())
    out = capsys.readouterr().out
    assert "tconv3d.nn.Conv3d backward" in out and "this host's CPU, us a step: python, 100 steps" in out
    assert set(data["launch_us"]) == {"fwd", "dgrad", "wgrad"}
    assert all(set(times) == {"pointer", "tma"} for times in data["launch_us"].values())
    assert "launcher_past_us" in data  # under the interpreter {"off": why}: test_launch times it compiled
    norms = data["norm_replay_us"]
    if "off" not in norms:
        assert set(norms) == {name for name, *_ in run.norm_layers_at_hand(host_overhead.NORM_CASES)}, norms
        assert all("refused" not in times for times in norms.values()), norms  # every norm call replays its plan
        assert all(t[d][p] > 0 for t in norms.values() for d in ("fwd", "step") for p in ("plans", "no_plans"))
    assert data["commit"] and data["triton"]


def test_variants_table_and_cpu_refusal():
    """bench.variants needs a GPU to time; its table shows a failed variant as a result, not a crash."""
    from bench import variants

    if not torch.cuda.is_available():
        assert variants.main([]) == 2
    rows = [
        {"case": "c", "dtype": "bf16", "direction": "fwd", "impl": "cudnn_cl3d", "ms": 2.0, "tflops": 300.0,
         "pct_peak": 40.0, "speedup_vs_cudnn": 1.0},
        {"case": "c", "dtype": "bf16", "direction": "fwd", "impl": "gluon", "variant": "gluon",
         "failed": "relative L2 error 1.0e+00 above 1e-02"},
    ]  # fmt: skip
    text = variants.table(rows)
    assert "FAILED: relative L2 error" in text and "300.0" in text and "1.00x" in text
    narrow = {**rows[0], "impl": "chosen", "variant": "gluon", "fill": 0.5, "l2_bound_tflops": 82.5}
    assert variants.table([narrow], header=False).endswith("1.00x   50%       82")
    no_peak = {**rows[0], "dtype": "fp32", "pct_peak": None}  # resumed from a run that measured no TF32 peak
    assert " - " in variants.table([no_peak], header=False)


def test_fp32_cases_are_quoted_against_the_tf32_peak():
    """fp32 convolutions multiply as TF32 where allowed (the default, in cuDNN and tconv3d): their share of the
    peak is TF32's, about half of bf16's; a run that measured none quotes no share."""
    from bench.run import peak_for

    peaks = {"bf16_mm_tflops": 700.0, "tf32_mm_tflops": 360.0}
    assert [peak_for(peaks, d) for d in ("bf16", "fp16", "fp32")] == [700.0, 700.0, 360.0]
    assert peak_for({"bf16_mm_tflops": 700.0}, "fp32") is None


def test_the_bf16_peak_is_the_best_reading_of_the_run(monkeypatch):
    """One matmul shape read 716 and 789 TFLOP/s in two invocations of one H200 session: the peak is the best of
    the run's readings, before and after its cases, and the run's 16-bit cases are quoted against it (fp32's
    against TF32's, as measured)."""
    from bench import run

    monkeypatch.setattr(run, "bf16_matmul_tflops", lambda: [750.0, 790.0])
    bf16 = {"dtype": "bf16", "impls": {"tconv3d": {"tflops": 632.0, "pct_of_peak": 88.3}, "cudnn_cl3d": {}}}
    fp32 = {"dtype": "fp32", "impls": {"tconv3d": {"tflops": 300.0, "pct_of_peak": 75.0}}}
    results = {"peak": {"bf16_mm_tflops": 716.0, "bf16_mm_readings": [716.0, 702.5], "tf32_mm_tflops": 400.0},
               "cases": [bf16, fp32]}  # fmt: skip
    run.reread_bf16_peak(results)
    assert results["peak"]["bf16_mm_readings"] == [716.0, 702.5, 750.0, 790.0]
    assert results["peak"]["bf16_mm_tflops"] == 790.0
    assert bf16["impls"]["tconv3d"]["pct_of_peak"] == 80.0 and "pct_of_peak" not in bf16["impls"]["cudnn_cl3d"]
    assert fp32["impls"]["tconv3d"]["pct_of_peak"] == 75.0
    monkeypatch.setattr(run, "bf16_matmul_tflops", lambda: [600.0])  # a lower reading changes nothing
    run.reread_bf16_peak(results)
    assert results["peak"]["bf16_mm_tflops"] == 790.0 and bf16["impls"]["tconv3d"]["pct_of_peak"] == 80.0


def test_variants_offer_both_boxes_and_split_k(monkeypatch):
    """On an H100 (capability and SM count stubbed) bench.variants times the TMA kernel with both boxes, and
    split-K against none where the grid leaves SMs idle (unet_320) but not on a large layer."""
    from bench import variants
    from tconv3d.tune import choice, configs
    from tconv3d.tune.shapes import load_shape_set

    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(
        choice, "pick_config", lambda d, geom, dtype, device: configs._heuristic_tiles(d, geom, dtype, 132)
    )
    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    cuda = torch.device("cuda")
    small = variants.variant_configs("fwd", shapes["unet_320"].geometry(), torch.bfloat16, cuda)
    assert small["chosen"].split_k == 6 and small["unsplit"].split_k == 1
    assert small["tma_patch"].tma_box_w == 8 and small["tma_rows"].tma_box_w == 64
    large = variants.variant_configs("dgrad", shapes["hunyuan_128"].geometry(), torch.bfloat16, cuda)
    assert not {"split_k", "unsplit"} & set(large)
    assert large["tma_rows"].tma_box_w == 128 and large["tma_patch"].tma_box_w == 16


def test_variants_resume_after_a_hang(tmp_path, monkeypatch):
    """A variant that hung ends the run (exit 75) with its row written as hung; --resume keeps the rows and the
    peak of the run before and measures, per case and direction, only the variants it lacks."""
    from bench import variants

    out = tmp_path / "variants.json"
    before = [
        {"case": "wan_dec_384b", "dtype": "bf16", "direction": "fwd", "impl": "cudnn_cl3d", "ms": 2.0},
        {"case": "wan_dec_384b", "dtype": "bf16", "direction": "fwd", "impl": "gluon_ws", "failed": "hung: ..."},
    ]
    out.write_text(json.dumps({"peaks": {"bf16_mm_tflops": 700.0}, "rows": before}))
    calls = []

    def stand_in(shape, dtype_name, direction, peak, emit, done, compiled, impls, l2_read_tbps):
        calls.append((shape.name, direction, peak, sorted(done)))
        emit({"case": shape.name, "dtype": dtype_name, "direction": direction, "impl": "pointer", "failed": "x"})

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "stand-in")
    monkeypatch.setattr(variants, "measure_peaks", lambda: pytest.fail("a resumed run keeps its peak"))
    monkeypatch.setattr(variants, "measure_case", stand_in)
    args = ["--cases", "unet_320,wan_dec_384b", "--directions", "fwd,dgrad", "--out", str(out), "--resume"]
    args += ["--compile-workers", "1"]
    assert variants.main(args) == 0
    assert calls == [  # in the order asked, not the suite's
        ("unet_320", "fwd", 700.0, []), ("unet_320", "dgrad", 700.0, []),
        ("wan_dec_384b", "fwd", 700.0, ["cudnn_cl3d", "gluon_ws"]), ("wan_dec_384b", "dgrad", 700.0, []),
    ]  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert rows[:2] == before and len(rows) == 6
    for wrong in (["--resume"], ["--cases", "wan_dec_385b"]):  # nothing to resume from; no such case
        with pytest.raises(SystemExit):
            variants.main(wrong)


def test_variants_launch_only_for_a_profiler(monkeypatch, capsys):
    """--launch-only --impls: each named variant of each case and direction launched once, nothing checked, timed or
    measured besides (no cuDNN call, no matmul peak), each launch printed in order so that a profiler's report can
    be matched to its rows; a name a case does not have (the weight gradient's swap) is skipped."""
    from bench import variants
    from tconv3d.tune import choice, configs

    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    monkeypatch.setattr(
        choice, "pick_config", lambda d, geom, dtype, device: configs._heuristic_tiles(d, geom, dtype, 132)
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(variants, "measure_peaks", lambda: pytest.fail("nothing is measured"))
    launched = []

    def stand_in(shape, dtype, direction, device):
        geom = shape.geometry()
        return geom, lambda config: launched.append((shape.name, direction, config)), pytest.fail, pytest.fail

    monkeypatch.setattr(variants, "problem", stand_in)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    args = ["--cases", "wan_dec_384b", "--directions", "fwd,wgrad", "--launch-only", "--impls"]
    assert variants.main([*args, f"gluon_ws,{variants.SWAPPED}"]) == 0
    assert [(case, d, c.swap_ab) for case, d, c in launched] == [
        ("wan_dec_384b", "fwd", 0), ("wan_dec_384b", "fwd", 1), ("wan_dec_384b", "wgrad", 0),
    ]  # fmt: skip
    printed = [line.split()[:5] for line in capsys.readouterr().out.splitlines()]
    assert printed == [["launched", "wan_dec_384b", "bf16", d, name] for d, name in
                       (("fwd", "gluon_ws"), ("fwd", variants.SWAPPED), ("wgrad", "gluon_ws"))]  # fmt: skip


def test_variants_time_the_second_persistent_program(monkeypatch):
    """Where the persistent Gluon kernel runs two programs an SM (one-warpgroup tiles that fit twice: down_s2's),
    bench.variants also times the same tiles at one program an SM, and only there (not wan_dec_384b's forward,
    two warpgroups a tile); that row launches under conv_gluon.programs_per_sm_at_most(1). The forward and input
    gradient also get the swapped 256x128 tile, and where their tiles are few (hunyuan_512) one-warpgroup tiles with
    a split reduction."""
    from bench import variants
    from tconv3d.kernels import conv_gluon
    from tconv3d.tune import choice, configs, tables
    from tconv3d.tune.shapes import load_shape_set

    if conv_gluon.UNAVAILABLE is not None:
        pytest.skip(conv_gluon.UNAVAILABLE)
    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    table = tables.named_table("NVIDIA H100 80GB HBM3")
    h100 = lambda d, geom, dtype, device: table[configs.tuning_key(d, geom, dtype)]  # noqa: E731
    monkeypatch.setattr(choice, "pick_config", h100)  # the shipped table's tiles (4-warp ones for down_s2)
    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    cuda = torch.device("cuda")
    for direction in ("fwd", "dgrad", "wgrad"):
        found = variants.variant_configs(direction, shapes["down_s2"].geometry(), torch.bfloat16, cuda)
        assert found[variants.ONE_PROGRAM_PER_SM] == found["gluon_ws"], direction
        assert found["gluon_ws"].num_warps == 4 and found["gluon_ws"].gluon == 2
        assert (variants.SWAPPED in found) == (direction != "wgrad")  # the weight gradient does not swap
        assert (variants.GROUPED_TAPS in found) == (direction == "wgrad")  # and only it groups taps
    large = variants.variant_configs("fwd", shapes["wan_dec_384b"].geometry(), torch.bfloat16, cuda)
    assert "gluon_ws" in large and variants.ONE_PROGRAM_PER_SM not in large
    # a layer of few tiles (hunyuan_512's 320 of 64 x 128) also on one warpgroup with its reduction split
    for direction in ("fwd", "dgrad", "wgrad"):
        few = variants.variant_configs(direction, shapes["hunyuan_512"].geometry(), torch.bfloat16, cuda)
        assert (variants.SMALL_GRID in few) == (direction != "wgrad"), direction
        assert direction == "wgrad" or (few[variants.SMALL_GRID].split_k, few[variants.SMALL_GRID].num_warps) == (2, 4)
    assert variants.SMALL_GRID not in large and variants.WHOLE_STEPS not in large  # 384 channels: whole steps
    grouped = variants.variant_configs("wgrad", shapes["wan_dec_384b"].geometry(), torch.bfloat16, cuda)
    grouped = grouped[variants.GROUPED_TAPS]  # two taps of 128 input channels: m64n256
    assert (grouped.block_n, grouped.tap_group, grouped.gluon) == (256, 2, 2)
    swapped = large[variants.SWAPPED]  # m64n256 at 128 columns
    assert (swapped.block_m, swapped.block_n, swapped.num_warps, swapped.gluon, swapped.swap_ab) == (256, 128, 8, 2, 1)
    # the persistent tiles on the deepest ring: the heuristic's 128x128x64 at 6 stages beside its 32 KB epilogue tile
    # (7 would not fit 227 KB); this table's 128x128x128 has no deeper ring than its 3 stages, so no such row;
    # down_s2's 4-warp tiles keep their two programs an SM
    heuristic = configs.KernelConfig(128, 128, 64, 8, 3, tma_box_w=16, gluon=2)
    assert configs.deepest_ring(heuristic, 2, "fwd") == dataclasses.replace(heuristic, num_stages=6)
    assert large["gluon_ws"].block_k == 128 and variants.DEEP_RING not in large
    for direction in ("fwd", "dgrad", "wgrad"):
        found = variants.variant_configs(direction, shapes["down_s2"].geometry(), torch.bfloat16, cuda)
        if variants.DEEP_RING in found:
            ring = found[variants.DEEP_RING]
            shared = conv_gluon.persistent_shared_bytes(ring, 2, direction == "wgrad")
            assert conv_gluon.persistent_programs_per_sm(ring, shared) == 2 and 2 * (shared + 1024) <= 233472
    config = large["gluon_ws"].__class__(128, 64, 64, 4, 3, tma_box_w=16, gluon=2)
    seen = []
    programs = lambda c: seen.append(conv_gluon.persistent_programs_per_sm(c, 90 * 1024))  # noqa: E731
    programs(config)
    variants._one_program_per_sm(programs, config)
    programs(config)
    assert seen == [2, 1, 2]
    monkeypatch.setattr(
        choice, "pick_config", lambda d, geom, dtype, device: configs.heuristic_config(d, geom, dtype, 132, 90)
    )
    for direction in ("fwd", "dgrad", "wgrad"):  # 96 channels a tap: three 32-deep steps, not two 64-deep
        wan_96 = variants.variant_configs(direction, shapes["wan_dec_96"].geometry(), torch.bfloat16, cuda)
        assert (wan_96.get(variants.WHOLE_STEPS, wan_96["gluon_ws"]).block_k == 32) == (direction != "wgrad")
        # 32 output channels: the weight gradient transposed, 4 taps of 32 input channels on the wgmma's 128 rows
        unet_32 = variants.variant_configs(direction, shapes["unet_32"].geometry(), torch.bfloat16, cuda)
        assert (variants.SWAPPED_WGRAD in unet_32) == (direction == "wgrad")
        assert variants.SWAPPED_WGRAD not in wan_96  # 96 output channels fill their rows
    transposed = unet_32[variants.SWAPPED_WGRAD]
    assert transposed.mma_tile == (128, 32)
    assert (transposed.tap_group, transposed.swap_ab, transposed.gluon) == (4, 1, 2)


def test_vae_decode_counts_the_kernels_the_convolutions_launch(monkeypatch, device):
    """bench.vae_decode's `kernels`: the variant each conv launch ran, as tconv3d chose it (here TCONV3D_KERNELS=tma,
    on the interpreter or a GPU): a causal conv with cached frames and replicate along D on the TMA kernel, one with
    replicate in H and W at stride 2 there on the pointer kernel."""
    import tconv3d
    from bench.vae_decode import kernel_variants
    from tconv3d import settings
    from tconv3d.tune import choice

    monkeypatch.setattr(settings, "KERNELS", "tma")
    monkeypatch.setattr(choice, "_memo", {})
    cl = torch.channels_last_3d
    x, before = (torch.randn(1, 8, d, 5, 6, device=device).contiguous(memory_format=cl) for d in (3, 2))
    w = torch.randn(8, 8, 3, 3, 3, device=device)

    def causal_convs():
        tconv3d.conv3d(x, w, None, 1, (2, 0, 1, 1, 1, 1), padding_mode="replicate,zeros,zeros", frames_before=before)
        tconv3d.conv3d(x, w, None, (1, 2, 2), (2, 0, 1, 1, 1, 1), padding_mode="replicate")

    assert kernel_variants(causal_convs) == {"fwd/pointer": 1, "fwd/tma": 1}
    assert kernel_variants(lambda: None) == {}


@pytest.mark.parametrize("variant", ["stock", "converted"])
def test_vae_decode_measures_a_latent_upscaler_as_a_decode(variant, aten_path):
    """`python -m bench.vae_decode --model kandinsky6_upscaler`: Kandinsky 6 SR's 4x latent upscaler measured as a
    decode whose output is the latent 4x in space, stock and converted (every conv on tconv3d in the breakdown)."""
    pytest.importorskip("diffusers")
    from bench.vae_decode import measure

    row = measure("kandinsky6_upscaler", variant, "cpu", torch.float32, 1, [1, 64, 2, 4, 4])
    assert row["output"] == [1, 64, 2, 16, 16] and row["ms"] > 0
    assert row["breakdown_ms"]["conv"] > 0


def test_vae_decode_measures_kvae(monkeypatch, aten_path):
    """`python -m bench.vae_decode --model kvae`: Kandinsky 5's KVAE (built apart from the real-model tests' VAES),
    converted, in both upsampler forms: the same decoded shape, every conv on tconv3d in the breakdown."""
    pytest.importorskip("diffusers")
    from bench.vae_decode import measure
    from tconv3d.nn import subpixel

    monkeypatch.setattr(subpixel, "SUBPIXEL", True)  # restored after the test: converted_upsample_first turns it off

    for variant in ("converted", "converted_upsample_first"):
        row = measure("kvae", variant, "cpu", torch.float32, 1, [1, 16, 2, 4, 4])
        assert row["output"] == [1, 3, 5, 32, 32] and row["ms"] > 0 and row["breakdown_ms"]["conv"] > 0, variant


def test_vae_decode_times_a_decoders_training_step(aten_path):
    """`python -m bench.vae_decode --training`: a decoder fine-tuning step (decode, then the backward of one fixed
    random output gradient into every parameter), stock and converted: the same output, and the same parameter
    gradients (their norm, in fp32 on the aten path, agrees to 1e-6: the output gradient is the same values
    whatever the output's layout, where one drawn in each layout's memory order differed by 18% at a 2 x 8 x 8
    latent)."""
    pytest.importorskip("diffusers")
    from bench.vae_decode import measure

    rows = [measure("wan", variant, "cpu", torch.float32, 1, [1, 16, 2, 4, 4], training=True)
            for variant in ("stock", "converted")]  # fmt: skip
    stock, converted = rows
    assert stock["training"] and converted["training"] and stock["ms"] > 0 and converted["ms"] > 0
    assert stock["output"] == converted["output"] == [1, 3, 5, 32, 32]
    norm = stock["parameter_gradient_norm"]
    assert norm > 0 and abs(converted["parameter_gradient_norm"] - norm) <= 1e-6 * norm
    with pytest.raises(SystemExit, match="decodes only"):
        measure("wan", "converted_graph", "cpu", torch.float32, 1, [1, 16, 1, 4, 4], training=True)


def test_variants_time_one_warpgroup_tiles_at_two_programs_an_sm(monkeypatch):
    """Where a chosen persistent tile takes two warpgroups and one program an SM (a table's 128x64, as the heuristic
    chose for unet_64's forward and input gradient until the H100 timed the one-warpgroup form 1.18-1.20x faster),
    bench.variants also times it on one warpgroup at two programs an SM (TWO_PER_SM: one program's epilogue under
    the other's wgmmas); where the chosen tile runs two programs an SM (the heuristic's now), the same tiles at one
    (ONE_PROGRAM_PER_SM); neither where one warpgroup would not fit twice (wan_dec_384b's 256x128)."""
    from bench import variants
    from tconv3d.kernels import conv_gluon
    from tconv3d.tune import choice, configs
    from tconv3d.tune.shapes import load_shape_set

    if conv_gluon.UNAVAILABLE is not None:
        pytest.skip(conv_gluon.UNAVAILABLE)
    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    # the heuristic's tiles before its halo ones (configs._halo_tiles), which timed_only leaves out
    heuristic = lambda d, geom, dtype, device: configs.heuristic_config(d, geom, dtype, 132, 90, True)  # noqa: E731
    two_warpgroups = lambda d, geom, dtype, device: dataclasses.replace(heuristic(d, geom, dtype, device), num_warps=8)  # noqa: E731
    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    cuda = torch.device("cuda")
    for direction in ("fwd", "dgrad"):
        monkeypatch.setattr(choice, "pick_config", heuristic)
        found = variants.variant_configs(direction, shapes["unet_64"].geometry(), torch.bfloat16, cuda)
        chosen = found["chosen"]
        assert (chosen.gluon, chosen.block_m, chosen.block_n, chosen.num_warps) == (2, 128, 64, 4), chosen
        assert found[variants.ONE_PROGRAM_PER_SM] == chosen and variants.TWO_PER_SM not in found
        monkeypatch.setattr(choice, "pick_config", two_warpgroups)  # a table's two-warpgroup entry
        found = variants.variant_configs(direction, shapes["unet_64"].geometry(), torch.bfloat16, cuda)
        assert found[variants.TWO_PER_SM] == chosen and variants.ONE_PROGRAM_PER_SM not in found
    monkeypatch.setattr(choice, "pick_config", heuristic)
    weight = variants.variant_configs("wgrad", shapes["unet_64"].geometry(), torch.bfloat16, cuda)
    assert variants.TWO_PER_SM not in weight and variants.ONE_PROGRAM_PER_SM in weight
    large = variants.variant_configs("fwd", shapes["wan_dec_384b"].geometry(), torch.bfloat16, cuda)
    assert large["chosen"].num_warps == 8 and variants.TWO_PER_SM not in large
    # a narrow layer's forward and input gradient also swapped: the chosen 128x64 (m64n128) and 256x64 (m64n256),
    # one warpgroup each; not a wide layer's, nor a weight gradient's
    for direction in ("fwd", "dgrad"):
        found = variants.variant_configs(direction, shapes["unet_64"].geometry(), torch.bfloat16, cuda)
        narrow, tall = found[variants.NARROW_SWAPPED], found[variants.NARROW_TALL_SWAPPED]
        assert narrow == dataclasses.replace(found["chosen"], swap_ab=1) and narrow.mma_tile == (64, 128)
        assert (tall.block_m, tall.block_n, tall.num_warps, tall.swap_ab, tall.mma_tile) == (256, 64, 4, 1, (64, 256))
    assert variants.NARROW_SWAPPED not in large and variants.NARROW_TALL_SWAPPED not in large
    assert variants.NARROW_SWAPPED not in weight and variants.NARROW_TALL_SWAPPED not in weight
    # --impls: `row` asks for every case's row, `case:row` for that case's alone
    assert variants.wanted(None, "unet_64", "chosen") and variants.wanted({"chosen"}, "unet_64", "chosen")
    asked = {"wan_dec_384b:gluon_ws", f"unet_64:{variants.TWO_PER_SM}"}
    assert variants.wanted(asked, "unet_64", variants.TWO_PER_SM) and variants.wanted(asked, "wan_dec_384b", "gluon_ws")
    assert not variants.wanted(asked, "wan_dec_384b", variants.TWO_PER_SM) and not variants.wanted(
        asked, "unet_64", "gluon_ws"
    )


def test_variants_time_the_wide_tile_that_wastes_no_columns(monkeypatch):
    """bench.variants' wide Hopper tile: 128x256 where the GEMM's columns fill 256-wide tiles (512 channels), else
    256x128 (384: a 256-wide second tile would be half empty, as on the H200), the weight gradient at the chosen
    split of its reduction."""
    from bench import variants
    from tconv3d.kernels import conv_gluon
    from tconv3d.tune import choice, configs
    from tconv3d.tune.shapes import load_shape_set

    if conv_gluon.UNAVAILABLE is not None:
        pytest.skip(conv_gluon.UNAVAILABLE)
    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    monkeypatch.setattr(
        choice, "pick_config", lambda d, geom, dtype, device: configs.heuristic_config(d, geom, dtype, 132, 90)
    )
    shapes = {shape.name: shape.geometry() for shape in load_shape_set("bench")}
    cuda = torch.device("cuda")
    for case, direction, tile in (
        ("wan_dec_384b", "fwd", (256, 128)), ("wan_dec_384b", "wgrad", (256, 128)), ("hunyuan_512", "fwd", (128, 256))
    ):  # fmt: skip
        found = variants.variant_configs(direction, shapes[case], torch.bfloat16, cuda)
        name = "{}x{}".format(*tile)
        pipelined, specialized = found[f"gluon_{name}"], found[f"gluon_ws_{name}"]
        assert (pipelined.block_m, pipelined.block_n, pipelined.gluon, specialized.gluon) == (*tile, 1, 2)
        assert pipelined.split_k == (found["chosen"].split_k if direction == "wgrad" else 1)


def test_l2_read_sums_the_chunks_it_reads(device):
    """The L2-bandwidth kernel reads what its count of bytes says: program p's sums are x's chunks (p + 7r) mod
    CHUNKS over its repeats r (a kernel that read less, or one chunk again, would time more bandwidth than there is).
    """
    from bench.run import L2_READ_BLOCK, l2_read

    chunks, programs, repeats = 5, 3, 4
    x = torch.randint(-1000, 1000, (chunks * L2_READ_BLOCK,), dtype=torch.int32, device=device)
    blocks = x.view(chunks, L2_READ_BLOCK).long()
    expected = torch.stack([sum(blocks[(p + 7 * r) % chunks] for r in range(repeats)) for p in range(programs)])
    assert torch.equal(l2_read(x, programs, repeats).long().cpu(), expected.cpu())
    with pytest.raises(ValueError, match="whole 4096-element int32 blocks"):
        l2_read(x[:100], programs, repeats)


def test_variants_take_the_stack_layers():
    """bench.variants times the stack's 8-channel layers (no suite holds them) beside the bench suite's cases, in
    the order asked, each in the run's dtypes or its own, and names the sets it looked in for a case it does not
    know."""
    from bench import variants

    shapes = variants.case_shapes(["stack_out8", "unet_320", "stack_in8", "stack_64"])
    assert [s.name for s in shapes] == ["stack_out8", "unet_320", "stack_in8", "stack_64"]
    assert (shapes[0].cin, shapes[0].cout, shapes[2].cin, shapes[2].cout) == (64, 8, 8, 64)
    with pytest.raises(ValueError, match=r"unknown case.*'nope'.*stack_in8"):
        variants.case_shapes(["nope"])
    # each case in every --dtype, or in its own (name@dtype: one layer in fp32 beside a bf16 run)
    pairs = variants.case_dtypes(["unet_320", "unet_64@fp32", "stack_in8"], "bf16,fp16")
    assert [(s.name, d) for s, d in pairs] == [
        ("unet_320", "bf16"), ("unet_320", "fp16"), ("unet_64", "fp32"), ("stack_in8", "bf16"), ("stack_in8", "fp16")
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown dtype 'fp8' for case 'unet_64'"):
        variants.case_dtypes(["unet_64@fp8"], "bf16")


def test_variants_time_the_decoders_layers(device):
    """bench.variants' `decoders` cases (video VAE decoders' layers as converted decodes and training steps call
    them), forward and weight gradient: reading 2 cached frames (tconv3d in place, cuDNN and the reference on them
    concatenated in front) or bordered by replicate (tconv3d in place, cuDNN and the reference on F.pad's copy). Tiny
    such cases through the pointer kernel match the reference, and so does cuDNN's call; an input gradient is
    refused, and so are the suite's and the tuner's plans, which would time them without the cache or the border."""
    from bench import variants
    from tconv3d.kernels.config import KernelConfig
    from tconv3d.testing import rel_l2, tolerance
    from tconv3d.tune import tuner
    from tconv3d.tune.shapes import ConvShape

    shapes = variants.case_shapes(["wan_dec_384_cached", "hunyuan_dec_128_replicate"])
    assert (shapes[0].frames_before, shapes[0].padding[:2], shapes[1].padding_mode) == (2, (0, 0), "replicate")
    assert [variants.case_directions(s, "fwd,dgrad,wgrad") for s in shapes] == [["fwd", "wgrad"], ["fwd", "wgrad"]]
    assert variants.case_directions(variants.case_shapes(["unet_64"])[0], "fwd,wgrad") == ["fwd", "wgrad"]
    cached = ConvShape(
        "tiny_cached", 1, 8, 16, (2, 5, 6), (3, 3, 3), (1, 1, 1), (0, 0, 1, 1, 1, 1), (1, 1, 1), ("fp32",),
        frames_before=2,
    )  # fmt: skip
    bordered = dataclasses.replace(cached, name="tiny_replicate", frames_before=0, padding=(2, 0, 1, 1, 2, 1),
                                   padding_mode="replicate")  # fmt: skip
    # CogVideoX's: replicate along D, zeros in H and W (cuDNN: F.pad along D, the conv's own zeros in H and W)
    mixed = dataclasses.replace(bordered, name="tiny_mixed", padding=(2, 0, 1, 1, 1, 1),
                                padding_mode="replicate,zeros,zeros")  # fmt: skip
    tinies = ((cached, (4, 5, 6)), (bordered, (2, 5, 6)), (mixed, (2, 5, 6)))
    for (tiny, size), direction in itertools.product(tinies, ("fwd", "wgrad")):
        geom, launch, cudnn, exact = variants.problem(tiny, torch.float32, direction, torch.device(device))
        assert (geom.prefix_frames, geom.padding_mode, geom.in_size) == (tiny.frames_before, tiny.padding_mode, size)
        ours, reference = launch(KernelConfig(16, 16, 16, 4, 1)), exact()
        assert ours.shape == reference.shape == cudnn().shape
        assert rel_l2(ours, reference) < tolerance(torch.float32), (tiny.name, direction)
        assert rel_l2(cudnn(), reference) < tolerance(torch.float32), (tiny.name, direction)
        with pytest.raises(ValueError, match="a decoder's layer"):
            variants.problem(tiny, torch.float32, "dgrad", torch.device(device))
        with pytest.raises(ValueError, match="a decoder's layer"):
            run.plan_cases([tiny], "fp32", ("fwd",))
        with pytest.raises(ValueError, match="a decoder's layer"):
            tuner.plan_jobs([tiny])
    # a causal conv's zeros, 2 frames in front and none behind: cuDNN reads F.pad's constant copy
    causal = dataclasses.replace(mixed, name="tiny_causal", padding_mode="zeros")
    for direction in ("fwd", "wgrad"):
        geom, launch, cudnn, exact = variants.problem(causal, torch.float32, direction, torch.device(device))
        ours, reference = launch(KernelConfig(16, 16, 16, 4, 1)), exact()
        assert ours.shape == reference.shape == cudnn().shape and geom.padding == causal.padding
        assert rel_l2(ours, reference) < tolerance(torch.float32), direction


def test_variants_offer_the_decoders_layers_on_the_gluon_kernel(monkeypatch):
    """plan2's rows for the decoders' layers exist on an H100 (capability, SM count and Gluon stubbed): as chosen
    (the persistent Gluon kernel, as timed on the H100's run 15: the cache read in place; but LTX-2's reflect layers of
    few tiles, on the pointer kernel since H200 run 5 timed their split Gluon interior beside the border ring 1.5-3.4x
    slower) and forced to the pointer kernels, which ran them before."""
    from bench import variants
    from tconv3d.kernels import conv_gluon
    from tconv3d.tune import choice, configs

    if conv_gluon.UNAVAILABLE is not None:
        pytest.skip(conv_gluon.UNAVAILABLE)
    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)
    h100 = lambda d, geom, dtype, device: choice.choose(d, geom, dtype, "NVIDIA H100 80GB HBM3", 132, 90)[0]  # noqa: E731
    monkeypatch.setattr(choice, "pick_config", h100)
    for shape in load_shape_set("decoders"):
        found = variants.variant_configs("fwd", shape.launched_geometry(), torch.bfloat16, torch.device("cuda"))
        ltx2 = shape.name.startswith("ltx2_")
        assert found["chosen"].gluon == (0 if ltx2 else 2) and found["pointer"].variant == "pointer", shape.name
        # the few-voxel layers (configs._gluon_rows) beside the 64-row pointer tiles the heuristic gave them before
        few = shape.name in ("wan_dec_384_cached_64", "mochi_dec_768_replicate")
        assert (variants.TIMED_ONLY in found) == few, shape.name
        assert found["chosen"].split_k == 1 or ltx2, shape.name
        if few or ltx2:
            before = found[variants.TIMED_ONLY] if few else found["chosen"]
            assert (before.variant, before.block_m) == ("pointer", 64), shape.name


def test_variants_offer_the_packed_loops_at_the_other_depth_and_a_deep_ring(monkeypatch):
    """The stack's 8-channel layers on an H100 (capability and SM count stubbed): the packed forward and input
    gradient as chosen (16 deep on 8 warps, timed 1.08x faster on run 18) beside 32 deep on 4, the packed weight
    gradient as chosen (32 voxels on 4 warps, 1.08x faster) beside 16 on 8; each row the same tile otherwise. The
    forwards and input gradients (packed, or W taps as columns) beside their deepest ring in half an SM's shared
    memory; not the weight gradient's, not fp32's."""
    from bench import variants
    from tconv3d.tune import choice, configs

    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: False)
    h100 = lambda d, geom, dtype, device: choice.choose(d, geom, dtype, "NVIDIA H100 80GB HBM3", 132, 90)[0]  # noqa: E731
    monkeypatch.setattr(choice, "pick_config", h100)
    shapes = {s.name: s.launched_geometry() for s in load_shape_set("stack")}
    for case, direction, other, depth, warps in (
        ("stack_in8", "fwd", "packed_32deep", 32, 4),
        ("stack_out8", "dgrad", "packed_32deep", 32, 4),
        ("stack_in8", "wgrad", "packed_16deep", 16, 8),
    ):
        found = variants.variant_configs(direction, shapes[case], torch.bfloat16, torch.device("cuda"))
        chosen = found["chosen"]
        assert chosen.variant == "pointer" and (chosen.block_k, chosen.num_warps) != (depth, warps), (case, chosen)
        assert found[other] == dataclasses.replace(chosen, block_k=depth, num_warps=warps), (case, found)
        assert not {"packed_16deep", "packed_32deep"} - {other} & found.keys(), case
    # the latency-bound small-channel forwards and input gradients on the deepest ring within half an SM's shared
    # memory: 6 KB a stage of 128 x 64 x 16 (8 stages at most), 20 KB of 128 x 32 x 64 (W taps as columns)
    rings = {}
    for case, direction in (
        ("stack_in8", "fwd"),
        ("stack_out8", "dgrad"),
        ("stack_in8", "dgrad"),
        ("stack_out8", "fwd"),
    ):
        found = variants.variant_configs(direction, shapes[case], torch.bfloat16, torch.device("cuda"))
        deep = found[variants.POINTER_DEEP_RING]
        assert deep == dataclasses.replace(found["pointer"], num_stages=deep.num_stages), (case, direction, deep)
        assert configs.ring_bytes(deep, 2) <= variants.HALF_SM_SHARED_MEMORY - 1024, (case, direction, deep)
        rings[case, direction] = deep.num_stages
    assert rings == {("stack_in8", "fwd"): 8, ("stack_out8", "dgrad"): 8, ("stack_in8", "dgrad"): 5,
                     ("stack_out8", "fwd"): 5}  # fmt: skip
    for case, direction, dtype in (("stack_in8", "wgrad", torch.bfloat16), ("stack_in8", "fwd", torch.float32)):
        found = variants.variant_configs(direction, shapes[case], dtype, torch.device("cuda"))
        assert variants.POINTER_DEEP_RING not in found, (case, direction, dtype)


def test_census_sees_every_convolution_of_a_decode():
    """bench.census on the test-size Wan VAE: the dispatch mode records one geometry per tconv3d conv call (as many
    as the converted conv modules' forwards and the resamplers' frame convs), the chunks after the first read cached
    frames, each row names the kernel the H100's choice runs for its geometry; the rows' FLOP shares add up to the
    decode's."""
    pytest.importorskip("diffusers")
    from bench import census
    from bench.vaes import build_vae
    from tconv3d.nn import Conv3d, convert
    from tconv3d.nn.video_vaes import FRAME_CONV_BLOCKS, class_name
    from tconv3d.tune import choice

    converted = convert(build_vae("wan", scale=1))
    calls = []
    for module in converted.modules():
        frame_conv = class_name(type(module)) in FRAME_CONV_BLOCKS and module.mode != "none"
        if isinstance(module, Conv3d) or frame_conv:  # a resampler runs its frame conv as one tconv3d conv a call
            module.register_forward_hook(lambda *_: calls.append(1))
    counts = census.model_geometries(converted, census.decoded, (1, 16, 3, 8, 8), torch.bfloat16)
    assert sum(counts.values()) == len(calls) > 0
    assert any(g.prefix_frames for _, g in counts) and any(not g.prefix_frames for _, g in counts)
    # the upsamplers' frame convs run as sub-pixel transposed convs (upsampled_frame_conv): the input-gradient op
    assert {direction for direction, _ in counts} == {"fwd", "dgrad"}
    assert all((g.kernel, g.stride) == ((1, 4, 4), (1, 2, 2)) for d, g in counts if d == "dgrad")
    rows, by_variant = census.census(counts, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)
    assert sum(row[-1] for row in rows) == pytest.approx(1.0) and sum(by_variant.values()) == pytest.approx(1.0)
    h100 = lambda d, geom: choice.choose(d, geom, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)[0]  # noqa: E731
    assert all(config == h100(direction, geom) for _, direction, geom, config, *_ in rows)


def test_census_sees_a_unets_transposed_convs_and_skip_connections():
    """bench.census --unet: a converted MONAI UNet's forward on the meta device, its convs ("fwd", the decoder's
    reading the skip connection in place: channels_after) and its transposed convs (the input-gradient op, "dgrad",
    reading the concatenation's second half from grad_output's channels_after), one geometry per call."""
    nets = pytest.importorskip("monai.networks.nets")
    from bench import census
    from tconv3d.nn import convert
    from tconv3d.tune import choice

    counts = census.model_geometries(
        convert(census.UNETS["unet"](nets)), census.forward, (1, 1, 32, 32, 32), torch.bfloat16
    )
    assert {direction for direction, _ in counts} == {"fwd", "dgrad"}
    assert any(g.out_after_channels for d, g in counts if d == "dgrad")
    counts = census.model_geometries(
        convert(census.UNETS["basic_unet"](nets)), census.forward, (1, 1, 32, 32, 32), torch.bfloat16
    )
    assert any(g.after_channels for d, g in counts if d == "fwd")
    rows, _ = census.census(counts, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)
    assert sum(row[-1] for row in rows) == pytest.approx(1.0)
    before, _ = census.census(counts, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90, timed_only=True)
    h100 = lambda d, geom: choice.choose(d, geom, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90, True)[0]  # noqa: E731
    assert all(config == h100(direction, geom) for _, direction, geom, config, *_ in before)


def test_census_of_a_vae_decoders_training_step():
    """bench.census --vae NAME --training: a decoder's fine-tuning step (its latent from a frozen encoder takes no
    gradient) records each conv's weight gradient, cached frames included (Wan's chunks after the first), and an
    input gradient for every conv but the first, none of them reading frames_before (x's gradient alone). The
    upsamplers' sub-pixel transposed convs swap the two: their forward is the input-gradient op ("dgrad"), their
    input gradient a "fwd"; so both sides of each count gain as many."""
    pytest.importorskip("diffusers")
    from bench import census
    from bench.vaes import build_vae
    from tconv3d.nn import convert

    model = convert(build_vae("wan", scale=1))
    counts = census.model_geometries(model, census.decoded, (1, 16, 3, 8, 8), torch.bfloat16, training=True)
    calls = collections.Counter()
    for (direction, geom), n in counts.items():
        calls[direction, bool(geom.prefix_frames)] += n
    assert calls["wgrad", True] == calls["fwd", True] > 0 and calls["wgrad", False] == calls["fwd", False] > 0
    assert calls["dgrad", False] == calls["fwd", True] + calls["fwd", False] - 1 and not calls["dgrad", True]
    inference = census.model_geometries(model, census.decoded, (1, 16, 3, 8, 8), torch.bfloat16)
    assert {direction for direction, _ in inference} == {"fwd", "dgrad"}  # dgrad: the upsamplers' transposed convs


def test_census_of_a_training_step_and_its_timing(monkeypatch):
    """bench.census --training: a MONAI UNet's training step on the meta device records its backward's input and
    weight gradients beside the forward (the input takes no gradient: the first conv has none); --time's rows are
    bench cases that rebuild each row's geometry exactly (a decode's cached frames, causal zeros and per-dimension
    border modes included), the rows it cannot say (a transposed conv's skip) left untimed, and its totals are the
    calls times each row's time (bench.variants.measure_case stubbed: it needs a GPU)."""
    nets = pytest.importorskip("monai.networks.nets")
    pytest.importorskip("diffusers")
    from bench import census, variants
    from bench.vaes import build_vae
    from tconv3d.nn import convert

    model = convert(census.UNETS["unet"](nets))
    counts = census.model_geometries(model, census.forward, (1, 1, 32, 32, 32), torch.bfloat16, training=True)
    assert {direction for direction, _ in counts} == {"fwd", "dgrad", "wgrad"}
    forward = census.model_geometries(model, census.forward, (1, 1, 32, 32, 32), torch.bfloat16)
    convs = sum(calls for (direction, geom), calls in forward.items() if direction == "fwd")
    assert sum(calls for (direction, _), calls in counts.items() if direction == "wgrad") >= convs + sum(
        calls for (direction, _), calls in forward.items() if direction == "dgrad"
    )  # every conv and transposed conv has a weight gradient (a transposed conv of a concatenation one a source)
    rows, _ = census.census(counts, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)
    timeable = dict(census.timeable_rows(rows, "bf16"))
    assert 0 < len(timeable) < len(rows)
    assert all(rows[i][2].out_after_channels for i in range(len(rows)) if i not in timeable)
    decode = census.model_geometries(
        convert(build_vae("cogvideox", scale=1)), census.decoded, (1, 4, 3, 8, 8), torch.bfloat16
    )
    decode += census.model_geometries(
        convert(build_vae("wan", scale=1)), census.decoded, (1, 16, 3, 8, 8), torch.bfloat16
    )
    decoded, _ = census.census(decode, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)
    assert any(len(set(g.dim_modes)) > 1 for _, _, g, *_ in decoded) and any(g.prefix_frames for _, _, g, *_ in decoded)
    for table in (rows, decoded):
        for index, shape in census.timeable_rows(table, "bf16"):
            assert shape.geometry() == table[index][2], shape
    assert len(census.timeable_rows(decoded, "bf16")) == len(decoded)

    def measured(shape, dtype_name, direction, peak, emit, impls):
        assert impls == {"chosen"} and dtype_name == "bf16"
        emit({"impl": "cudnn_cl3d", "ms": 2.0})
        emit({"impl": "chosen", "ms": 1.0})

    monkeypatch.setattr(variants, "measure_case", measured)
    timed = census.time_rows(rows, "bf16", log=lambda line: None)
    totals = census.timed_totals(timed)
    calls = sum(rows[i][0] for i in timeable)
    assert (totals["tconv3d_ms"], totals["cudnn_ms"], totals["rows_timed"]) == (calls, 2 * calls, len(timeable))
    assert totals["flops_share_timed"] == pytest.approx(sum(rows[i][-1] for i in timeable))
    assert all(row["ms"] is None for i, row in enumerate(timed) if i not in timeable)


def test_subpixel_scenario_plans_the_geometries_its_launches_check():
    """bench's subpixel scenario: subpixel_geometries are the geometries the launches of both tconv3d forms of an
    upsampler check, its forward and its backward (the sub-pixel transposed conv: the input-gradient op, then a
    forward and a weight gradient; upsampled first: a forward over the upsampled size, then both gradients), which
    bench.precompile compiles ahead."""
    from torch import nn

    from bench import census
    from tconv3d.nn.modules import repeat_nearest
    from tconv3d.nn.video_vaes import frame_conv, upsampled_frame_conv

    forms = run.subpixel_geometries(1, 6, 2, 3, 5, 4)
    conv = nn.Conv2d(6, 4, 3, padding=1, device="meta")
    forwards = {"subpixel": lambda x, conv: upsampled_frame_conv(conv, x),
                "upsample_first": lambda x, conv: frame_conv(conv, repeat_nearest(x, (1, 2, 2)))}  # fmt: skip
    for form, forward in forwards.items():
        x = torch.empty(1, 6, 2, 3, 5, device="meta").contiguous(memory_format=torch.channels_last_3d)
        x.requires_grad_()
        with census._ConvGeometries() as seen:
            y = forward(x, conv)
            y.backward(torch.empty_like(y))
        assert set(seen.counts) == set(forms[form].items()), (form, list(seen.counts))


def test_skip_scenario_plans_the_geometries_its_launches_check():
    """bench's skip scenario: skip_geometries are the geometries the op's three launches check (the forward and the
    weight gradient reading the skip in place, the input gradient the concatenation's; a transposed up conv's
    forward), which bench.precompile compiles ahead; kernels_forced chooses as TCONV3D_KERNELS would from a memo of
    its own and puts the process's setting and memo back."""
    from tconv3d import settings
    from tconv3d.geometry import check_conv3d, check_input_grad, check_weight_grad
    from tconv3d.tune import choice

    cl = torch.channels_last_3d
    x, skip = (torch.randn(1, 4, 3, 4, 5).contiguous(memory_format=cl) for _ in range(2))
    w, grad = torch.randn(6, 8, 3, 3, 3), torch.randn(1, 6, 3, 4, 5).contiguous(memory_format=cl)
    geoms = run.skip_geometries(1, 4, (3, 4, 5), 6)
    assert geoms["fwd"] == check_conv3d(x, w, None, 1, 1, 1, 1, channels_after=skip) and geoms["fwd"].after_channels
    assert geoms["dgrad"] == check_input_grad(grad, w, [1, 8, 3, 4, 5], [1] * 3, [1] * 6, [1] * 3)
    assert geoms["wgrad"] == check_weight_grad(grad, x, w.shape, [1] * 3, [1] * 6, [1] * 3, channels_after=skip)
    # the transposed up conv's forward: the input gradient of the conv it transposes, the skip after x's channels
    import tconv3d
    from bench import census

    x, skip = (torch.empty(1, 4, 3, 4, 5, device="meta").contiguous(memory_format=cl) for _ in range(2))
    with census._ConvGeometries() as seen:
        tconv3d.conv_transpose3d(
            x, torch.empty(8, 6, 3, 3, 3, device="meta"), stride=2, padding=1, output_padding=1, channels_after=skip
        )  # fmt: skip
    transposed = run.skip_geometries(1, 4, (3, 4, 5), 6, transposed=True)
    assert list(seen.counts) == [("dgrad", transposed["dgrad"])] and transposed["dgrad"].out_after_channels == 4
    kernels, memo = settings.KERNELS, choice._memo
    with run.kernels_forced("pointer"):
        assert settings.KERNELS == "pointer" and choice._memo is not memo
    assert (settings.KERNELS, choice._memo) == (kernels, memo) and choice._memo is memo


@pytest.mark.parametrize("kind", sorted({layer[1] for layer in run.NORM_LAYERS}))
def test_norms_scenario_times_what_convert_makes_of_torchs_norms(kind, device):
    """bench_norms' pair of each kind computes the same normalization: torch's modules, and what tconv3d.nn.convert
    makes of them (tconv3d's norm on the kernels, a GroupNorm's SiLU fused into it; Wan's RMS norm adapted), in
    training mode; their results and input gradients agree on a channels_last_3d input as the scenario hands them
    one."""
    if kind == "rms":
        pytest.importorskip("diffusers")
    from tconv3d.nn.convert import is_converted

    torch.manual_seed(0)
    modules = run.norm_modules(kind, 64, device)
    norm = modules["tconv3d"][0]
    assert is_converted(norm) and norm.training
    if kind in ("group_silu", "batch_relu"):  # the activation fused into the norm
        assert norm.activation == kind.split("_")[1] and type(modules["tconv3d"][1]) is torch.nn.Identity
    if kind == "instance_prelu":  # across the dropout, the PReLU's module left holding its weight
        assert norm.activation == "prelu" and norm.fused_prelu is modules["tconv3d"][2]
    x = torch.randn(2, 64, 3, 4, 5, device=device).contiguous(memory_format=torch.channels_last_3d)
    grad = torch.randn_like(x)
    answers = []
    for module in modules.values():
        leaf = x.clone().requires_grad_()
        y = module(leaf)
        answers.append((y, *torch.autograd.grad(y, leaf, grad)))
    for ours, theirs in zip(answers[1], answers[0], strict=True):
        assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-5


@pytest.mark.parametrize("kind", sorted({layer[1] for layer in run.NORM_LAYERS}))
def test_norms_scenario_runs_a_bf16_models_norms(kind, device):
    """bench_norms' input and modules are a bf16 model's, parameters and all: torch's CUDA GroupNorm refuses fp32
    parameters on a bf16 input (H200 run 8's norms scenario died on it; torch's CPU one takes them). Both modules
    answer a forward and backward of that input in bf16 (tconv3d's channels_last_3d)."""
    if kind == "rms":
        pytest.importorskip("diffusers")
    torch.manual_seed(0)
    x, modules = run.norm_case(kind, 2, 64, (3, 4, 5), device)
    assert x.dtype == torch.bfloat16 and x.is_contiguous(memory_format=torch.channels_last_3d) and x.requires_grad
    for impl, module in modules.items():
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}, module
        y = module(x)
        assert y.dtype == torch.bfloat16, module
        assert impl == "torch" or y.is_contiguous(memory_format=torch.channels_last_3d)
        (grad,) = torch.autograd.grad(y, x, torch.randn_like(y))
        assert grad.dtype == torch.bfloat16


def test_norms_scenario_leaves_out_what_needs_a_missing_package(monkeypatch):
    """Wan's RMS norm row needs diffusers: without it bench_norms and bench.host_overhead time the other rows (a
    bench without the integrations' packages does not die on an ImportError)."""
    assert any(kind == "rms" for _, kind, *_ in run.NORM_LAYERS)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "diffusers" else find_spec(name, *a)
    )
    kept = run.norm_layers_at_hand(run.NORM_LAYERS)
    assert kept == [row for row in run.NORM_LAYERS if row[1] != "rms"] and kept


def test_norms_scenario_is_in_the_report(tmp_path):
    results = synthetic_results()
    results["norms"] = [{"name": "unet_batch_64_fwd", "torch_ms": 0.5, "tconv3d_ms": 0.25, "speedup": 2.0}]
    text = report.write_results(results, tmp_path, json_only=False)["md"].read_text()
    assert "| unet_batch_64_fwd | 0.500 | 0.250 | 2.000 |" in text


def test_bench_cases_draw_from_a_generator_of_their_own(monkeypatch):
    """A case's inputs and upstream gradient come from the bench's generator, never torch's default one, which H200
    run 8's graph captures left in capture mode (every torch.randn on it raised after): the default generator's
    state is untouched, and the same generator seed gives the same data."""
    from tconv3d.testing import float64_errors, random_conv_inputs

    torch.manual_seed(0)
    before = torch.get_rng_state()
    x, w = random_conv_inputs(
        (1, 4, 3, 4, 5), (6, 4, 3, 3, 3), torch.float32, "cpu", generator=torch.Generator().manual_seed(1)
    )
    again = random_conv_inputs(
        (1, 4, 3, 4, 5), (6, 4, 3, 3, 3), torch.float32, "cpu", generator=torch.Generator().manual_seed(1)
    )
    assert torch.equal(x, again[0]) and torch.equal(w, again[1]) and x.std() > 0.5
    assert x.is_contiguous(memory_format=torch.channels_last_3d)
    generator = torch.Generator().manual_seed(2)
    monkeypatch.setattr(run, "_cuda_generator", lambda: generator)
    step = run._direction_fn(lambda x, w: torch.nn.functional.conv3d(x, w), x, w, "bwd")
    assert all(g.abs().sum() > 0 for g in step())
    errors = float64_errors(torch.nn.functional.conv3d, x, w, generator=generator)  # tconv3d_error's, as it is called
    assert max(errors.values()) < 1e-5
    assert torch.equal(torch.get_rng_state(), before)


def test_the_graph_column_makes_a_backwards_forward_again_on_a_side_stream(monkeypatch):
    """The graph column of a backward alone captures a backward whose forward was made on a side stream (PyTorch's
    capture recipe: an autograd node keeps the stream it was made on; H200 runs 10 and 12 lost hunyuan_512's
    backward capture); the eager timing's callable and the other directions' are captured as they are."""
    import contextlib

    class Stream:
        def wait_stream(self, other):
            pass

    current, side_streams = Stream(), []

    @contextlib.contextmanager
    def stream(s):
        side_streams.append(s)
        try:
            yield
        finally:
            side_streams.pop()

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(run, "_cuda_generator", lambda: torch.Generator().manual_seed(0))
    made_on = []

    def forward(x, w):
        made_on.append(side_streams[-1] if side_streams else current)
        return torch.nn.functional.conv3d(x, w, None, 1, 1)

    x, w = torch.randn(1, 2, 3, 4, 4), torch.randn(3, 2, 3, 3, 3)
    fn = run._direction_fn(forward, x, w, "bwd")
    assert made_on == [current]
    for direction in ("fwd", "fwd+bwd"):
        assert run._captured_fn(forward, x, w, direction, fn) is fn
    captured = run._captured_fn(forward, x, w, "bwd", fn)
    assert captured is not fn and len(made_on) == 2 and made_on[1] is not current
    assert isinstance(made_on[1], Stream)
    assert [g.shape for g in captured()] == [x.shape, w.shape]
