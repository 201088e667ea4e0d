"""The GPU evidence scripts under tests/gpu/ run end to end; here on CPU, on small shapes, through torch's path."""

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tconv3d

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the aten path: fast on CPU
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_huge_tensor_script_logic(tmp_path):
    out = tmp_path / "huge.json"
    result = run_script("tests/gpu/huge_tensor.py", "--device", "cpu", "--shape", "1,4,6,10,12", "--chunk", "4",
                        "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["elements"] == 4 * 6 * 10 * 12 and data["max_rel_err_output"] < 1e-2


def test_training_script_logic(tmp_path):
    out = tmp_path / "train.json"
    result = run_script("tests/gpu/train_unet.py", "--device", "cpu", "--steps", "3", "--size", "8", "--width", "8",
                        "--batch", "1", "--out", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["tconv3d"]["conv_layers"] == data["tconv3d"]["tconv3d_layers"] == 8
    # Same seed, same weights, bf16 autocast: the first losses agree to bf16 rounding (convert swaps the
    # GroupNorms too, which under autocast return bf16 where torch's return fp32).
    first_stock, first_ours = data["stock"]["losses"][0], data["tconv3d"]["losses"][0]
    assert abs(first_stock - first_ours) <= 2**-8 * abs(first_stock)
    assert len(data["stock"]["losses"]) == 3


def test_resample_script_logic(tmp_path):
    """tests/gpu/resample.py on CPU: every op in both layouts (tconv3d's in channels_last_3d), forward and backward,
    its checks of tconv3d's replacements against torch's values passing."""
    out = tmp_path / "resample.json"
    result = run_script("tests/gpu/resample.py", "--device", "cpu", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["checks"]["nearest2x"] and data["checks"]["avgpool2_rel_l2"] < 1e-5
    assert data["checks"]["trilinear2x_rel_l2"] < 1e-5
    assert len(data["rows"]) == 2 * (3 * 2 + 3) and all(row["ms"] > 0 for row in data["rows"])
    ours = [row for row in data["rows"] if row["op"].endswith("tconv3d")]
    assert ours and all(row["out_channels_last"] for row in ours)


def test_sanitizer_cases_force_each_family():
    """tests/gpu/sanitize_cases.py (what memcheck.sh runs under compute-sanitizer) through the interpreter: every
    family it can run here passes against float64 on the kernels of that family (the TMA kernels, split-K, the
    direct depthwise kernels...), the Gluon ones saying they are not run off an sm_90 GPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "tests/gpu/sanitize_cases.py", "--device", "cpu", "--quick"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    for family in ("pointer", "tma", "split_k", "depthwise", "grouped", "padding_modes", "frames_before",
                   "conv_transpose", "channels_after", "group_norm", "rms_norm", "resample"):  # fmt: skip
        assert f"{family} 1/1 ok" in summary, summary
    assert "gluon not run on this device" in summary
    listed = subprocess.run([sys.executable, "tests/gpu/sanitize_cases.py", "--device", "cpu", "--family", "nope"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert listed.returncode == 2 and "unknown family" in listed.stderr


def test_sanitizer_gluon_family_runs_the_pipelined_kernel():
    """The gluon family's problems run the pipelined Gluon kernel: with Gluon forced, the heuristic gives the
    warp-specialized one on sm_90 nearly everywhere (H200 run 7: 3 of the family's 4 problems memchecked gluon = 2
    only), so the family takes the chosen tiles onto gluon = 1 (sanitize_cases.pipelined), a config the kernel
    compiles, in every direction of every problem."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import sanitize_cases

    from tconv3d.geometry import conv_geometry
    from tconv3d.tune import choice, configs

    specialized = 0
    for n, cin, cout, size, kernel, stride, padding, dilation in sanitize_cases.BOXED:
        geom = conv_geometry((n, cin, *size), (cout, cin, kernel, kernel, kernel), stride, padding, dilation)
        for direction in ("fwd", "dgrad", "wgrad"):
            config, _ = choice.choose(direction, geom, torch.bfloat16, "NVIDIA H100 80GB HBM3", 132, 90)
            config = choice.force_variant(direction, geom, torch.bfloat16, config, "gluon", True)
            specialized += config.gluon == 2
            adjusted = sanitize_cases.pipelined(direction, geom, config)
            assert adjusted.gluon == (1 if config.gluon else 0) and configs.gluon_takes(adjusted) == bool(config.gluon)
    assert specialized >= 6  # the heuristic's warp-specialized choices are what the family had to leave


def _stub_sanitizer(tmp_path):
    """A compute-sanitizer that logs its arguments, says 0 errors, and fails (or hangs) where its families' list
    names FAIL_FAMILY (SLOW_FAMILY)."""
    stub = tmp_path / "bin" / "compute-sanitizer"
    stub.parent.mkdir()
    stub.write_text(
        "#!/usr/bin/env bash\n"
        'echo "sanitizer $*"\n'
        'if [ -n "${SLOW_FAMILY:-}" ] && [[ "$*" == *"$SLOW_FAMILY"* ]]; then echo "started"; exec sleep 60; fi\n'
        'if [ -n "${FAIL_FAMILY:-}" ] && [[ "$*" == *"$FAIL_FAMILY"* ]]; then\n'
        '  echo "========= ERROR SUMMARY: 1 error"; exit 1; fi\n'
        'echo "========= ERROR SUMMARY: 0 errors"\n'
    )
    stub.chmod(0o755)
    path = f"{stub.parent}:{Path(sys.executable).parent}:{os.environ['PATH']}"  # python3: this one, with tconv3d
    return {**os.environ, "PATH": path, "OUT": str(tmp_path / "out")}


def test_memcheck_shares_the_families_out_and_keeps_every_log(tmp_path):
    """tests/gpu/memcheck.sh with a stub sanitizer: every family of sanitize_cases.FAMILIES memchecked once, pointer
    alone in the first of JOBS processes, one memcheck.log holding every process's ERROR SUMMARY; a failing family
    fails the script; stopped at a limit (gpu_session.sh's timeout), it still leaves what each process logged."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import sanitize_cases

    env = _stub_sanitizer(tmp_path)
    run = lambda extra, *prefix: subprocess.run(  # noqa: E731
        [*prefix, "bash", "tests/gpu/memcheck.sh"], cwd=ROOT, env={**env, "JOBS": "3", **extra},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    result = run({})
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "out" / "memcheck.log").read_text()
    groups = [line.split()[-1].split(",") for line in log.splitlines() if line.startswith("=== families")]
    assert groups[0] == ["pointer"] and len(groups) == 3, groups
    assert sorted(f for group in groups for f in group) == sorted(sanitize_cases.FAMILIES)
    assert log.count("ERROR SUMMARY: 0 errors") == 3 and "--tool memcheck" in log
    race = (tmp_path / "out" / "racecheck.log").read_text()
    assert "--tool racecheck" in race and "--quick --family tma,split_k,gluon,gluon_ws,halo" in race
    assert run({"FAIL_FAMILY": "depthwise"}).returncode == 1
    nothing = run({"FAMILIES": " "})  # no families to check: an error, not a pass
    assert nothing.returncode == 2 and "no families" in nothing.stderr
    # FAMILIES given: the script's own listing (a python3 importing sanitize_cases) took more than the 8 s on a
    # loaded 2-core CI machine, and the TERM came before its trap was set (the last run's memcheck.log then stood)
    families = {"FAMILIES": " ".join(sanitize_cases.FAMILIES)}
    stopped = run({"SLOW_FAMILY": "group_norm", **families}, "timeout", "-s", "TERM", "8")
    assert stopped.returncode == 124, stopped.stdout + stopped.stderr
    log = (tmp_path / "out" / "memcheck.log").read_text()
    assert log.count("=== families") == 3 and log.count("ERROR SUMMARY: 0 errors") == 2 and "started" in log


def test_tma_probe_script_logic(monkeypatch):
    """tests/gpu/tma_probe.py on the interpreter: every case's box loads as the torch reference cuts it (the
    interpreter takes any map), and a reference cut one voxel off is told apart."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import tma_probe

    for name in [*tma_probe.CASES, *tma_probe.STORES]:
        result = tma_probe.run_case(name, "cpu")
        assert result["verdict"] == "ok", result
        assert not result["problems"], result  # every case is one cuda.h allows
        assert bool(result["risks"]) == (name not in tma_probe.CONTROLS), result
    shifted = tma_probe.reference

    def off_by_one(t, shape, strides, box, coords):
        return shifted(t, shape, strides, box, (*coords[:-2], coords[-2] + 1, coords[-1]))

    monkeypatch.setattr(tma_probe, "reference", off_by_one)
    assert tma_probe.run_case("inside", "cpu")["verdict"] == "wrong"
    stored = tma_probe.stored_reference

    def row_lower(buffer, shape, strides, box, coords, values):  # as if the store landed one row off
        return stored(buffer, shape, strides, box, (*coords[:2], coords[2] + 1, *coords[3:]), values)

    monkeypatch.setattr(tma_probe, "stored_reference", row_lower)
    assert tma_probe.run_case("store_box_past_h", "cpu")["verdict"] == "wrong"


def test_layer_errors_script_rates_a_models_layers(tmp_path):
    """tests/gpu/layer_errors.py on CPU (torch's path): MONAI's UNet in bf16, each conv and norm rated for stock
    and converted against float64 of stock's module on the same input."""
    pytest.importorskip("monai")
    pytest.importorskip("diffusers")  # the script takes its models from test_integrations, which needs diffusers
    out = tmp_path / "layers.json"
    result = run_script("tests/gpu/layer_errors.py", "--model", "monai_unet", "--device", "cpu", "--size", "16",
                        "--json", str(out))  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [row for row in json.loads(out.read_text())["rows"] if "ratio" in row]
    kinds = {row["module"] for row in rows}
    assert {"Conv3d", "ConvTranspose3d", "InstanceNorm3d"} <= kinds, kinds
    assert all(1e-4 < row["stock"] < 1e-2 and 1e-4 < row["converted"] < 1e-2 for row in rows), rows


def test_layer_errors_name_the_layer_that_adds_error():
    """On the Triton kernels (the interpreter), a bf16 stack of convs and a GroupNorm fused with its SiLU: each
    layer as near float64 as stock's; a converted conv whose weight is 1% off stands out by its ratio, and only it."""
    spec = importlib.util.spec_from_file_location("layer_errors", ROOT / "tests" / "gpu" / "layer_errors.py")
    layer_errors = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layer_errors)
    torch.manual_seed(0)
    stock = torch.nn.Sequential(
        torch.nn.Conv3d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.SiLU(),
        torch.nn.Conv3d(16, 16, 3, padding=1), torch.nn.Conv3d(16, 8, 1),
    ).eval()  # fmt: skip
    x = torch.randn(1, 8, 4, 6, 6).bfloat16().contiguous(memory_format=torch.channels_last_3d)
    for wrong in (None, "3"):
        converted = tconv3d.nn.convert(copy.deepcopy(stock))
        if wrong:
            with torch.no_grad():
                converted.get_submodule(wrong).weight.mul_(1.01)
        rows = {row["name"]: row for row in layer_errors.layer_errors(stock, converted, lambda m: m(x), torch.bfloat16)}
        assert set(rows) == {"0", "1", "3", "4"}, rows  # the SiLU fused into the GroupNorm is not rated
        assert rows["1"]["module"] == "GroupNorm" and converted.get_submodule("1").activation == "silu"
        for name, row in rows.items():
            assert 5e-4 < row["stock"] < 1e-2, row
            if name == wrong:
                assert row["ratio"] > 2, row
            else:
                assert 0.5 < row["ratio"] < 1.5, row


def test_host_overhead_profiles_the_launchers_host_time(monkeypatch):
    """tests/gpu/host_overhead.py's profile of a launcher (H200 run 6: a Gluon launch cost 130-170 us of host time,
    40 us here): one line a function, by own time, each call's share."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def slow():
        return sorted(range(20000, 0, -1))

    lines = host_overhead.profiled(lambda: slow(), calls=20, top=3)
    assert len(lines) == 3 and "sorted" in lines[0], lines
    calls, own, cumulative = lines[0].split()[:3]
    assert int(calls) == 20 and 0 < float(own) <= float(cumulative)


def test_host_overhead_names_a_backwards_synchronisations_and_where_its_time_goes(monkeypatch):
    """tests/gpu/host_overhead.py's two looks at a slow backward (H200 run 9: a GroupNorm backward's host time 10x
    its stubbed launches'): each synchronisation torch's sync debug mode reports in one call, and the profiler's
    top entries by host and device time."""
    import warnings

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def reads_to_host():  # stands in for a call whose step reads device memory while the mode is "warn"
        if modes and modes[-1] == "warn":
            warnings.warn("called a synchronizing CUDA operation\nmore", stacklevel=2)
        return torch.ones(3).sum()

    assert host_overhead.synchronizing(reads_to_host) == ["called a synchronizing CUDA operation"]
    assert modes == ["warn", "default"]
    assert host_overhead.synchronizing(lambda: torch.ones(3).sum()) == []

    lines = host_overhead.traced(lambda: torch.ones(64, 64) @ torch.ones(64, 64), calls=3, top=2)
    assert lines[0] == "by host time:" and "by device time:" in lines
    assert any("aten::" in line for line in lines[1:3]), lines


def test_host_overhead_times_the_norm_scenarios_host_bound_rows(monkeypatch):
    """tests/gpu/host_overhead.py's norm modules (H200 run 12: the norms scenario's small rows lose, their backward
    about 0.6-1 ms whatever the size): the bench's rows by name, torch's and tconv3d's modules timed forward and
    forward+backward as bench.run times them, and tconv3d's step looked at; run here on small CPU inputs."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    from bench import run

    case = run.norm_case
    small = {name: (name, kind, 2, channels, (2, 3, 4)) for name, kind, _, channels, _ in run.NORM_LAYERS}
    monkeypatch.setattr(run, "NORM_LAYERS", list(small.values()))
    monkeypatch.setattr(run, "norm_case", lambda kind, b, c, size, device: case(kind, b, c, size, "cpu"))
    steps = []
    monkeypatch.setattr(host_overhead.triton.testing, "do_bench", lambda fn, **kw: steps.append(fn()) or 1.0)
    monkeypatch.setattr(host_overhead, "host_us", lambda fn: 2.0)
    monkeypatch.setattr(host_overhead, "synchronizing", lambda fn: fn() or [])
    monkeypatch.setattr(host_overhead, "traced", lambda fn: ["by host time:"])
    rows = host_overhead.measure_norm_modules()
    assert [r["name"] for r in rows] == list(host_overhead.NORM_MODULE_ROWS)
    for r in rows:
        assert set(r["ms"]) == {f"{i}_{d}" for i in ("torch", "tconv3d") for d in ("fwd", "fwd+bwd")}
        assert r["step_synchronizes"] == [] and r["step_trace"] == ["by host time:"]
    assert len(steps) == 4 * len(rows)


def test_host_overhead_captures_each_backward_by_three_recipes(monkeypatch):
    """tests/gpu/host_overhead.py's capture check (H200 runs 10 and 11: a process's first backward capture failed):
    cuDNN's backward first, then tconv3d's, each by three recipes, every one a backward whose gradients are right,
    and a failed capture recorded, not raised."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    from bench import run
    from tconv3d.tune.shapes import ConvShape

    tiny = ConvShape("tiny", 1, 4, 8, (3, 4, 5), (3, 3, 3), (1, 1, 1), (1, 1, 1, 1, 1, 1), (1, 1, 1), ("fp32",))
    monkeypatch.setattr(host_overhead, "CASES", (("tiny", "fp32"),))
    monkeypatch.setattr(host_overhead, "load_shape_set", lambda name: [tiny])
    captured = []

    def capture(fn):  # stands in for bench.run.capture: the gradients fn gives, and a failure in one recipe
        grads = fn()
        captured.append(grads)
        if len(captured) == 2:
            raise RuntimeError("operation failed due to a previous error during capture")

    monkeypatch.setattr(run, "capture", capture)
    sides = []  # the side-stream recipe's forwards, made through bench.run's helper
    monkeypatch.setattr(run, "on_side_stream", lambda make: sides.append(1) or make())
    errors = host_overhead.capture_errors(device="cpu")
    assert len(sides) == 2  # cuDNN's and tconv3d's
    assert list(errors) == [f"{impl} tiny fp32 {recipe}" for impl in ("cudnn", "tconv3d")
                            for recipe in host_overhead.CAPTURE_RECIPES]  # fmt: skip
    assert [key for key, error in errors.items() if error] == ["cudnn tiny fp32 side_stream"]
    assert "previous error" in errors["cudnn tiny fp32 side_stream"]
    assert len(captured) == 6
    for cudnn, ours in zip(captured[:3], captured[3:], strict=True):  # fresh inputs each: the shapes agree
        assert [g.shape for g in cudnn] == [g.shape for g in ours] == [(1, 4, 3, 4, 5), (8, 4, 3, 3, 3)]


def test_host_overhead_says_how_each_compiled_kernel_launches(monkeypatch):
    """tests/gpu/host_overhead.py's launcher states (H200 run 11: whether launches went past Triton's wrapper):
    one line per compiled kernel, naming the launcher, its scratch and whether _Past took it."""
    import types

    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    from tconv3d.kernels import launch

    def inner():  # stands in for the wrapper Triton puts around a kernel's C launch
        pass

    runner = types.SimpleNamespace(launch=inner, global_scratch_size=0, profile_scratch_size=0)
    taken = types.SimpleNamespace(name="taken", run=runner, _tconv3d_past=object())
    refused = types.SimpleNamespace(name="refused", run=types.SimpleNamespace(launch=print), _tconv3d_past=False)
    monkeypatch.setattr(launch, "_compiled", {1: (taken, ()), 2: (refused, ())})
    lines = host_overhead.launcher_states()
    assert lines[0].startswith("launch.WRAPPER: ") and len(lines) == 3
    assert "taken: past=object launcher=SimpleNamespace scratch=0/0 wrapped=inner" in lines[1]
    assert "refused: past=False" in lines[2] and "scratch=?/?" in lines[2] and "wrapped=C launch" in lines[2]


def test_host_overhead_sets_each_launch_against_the_same_launch_stopped_at_the_driver(monkeypatch, capsys):
    """tests/gpu/host_overhead.py's launch costs (issue 29: the H200's host times ran 3-10x this CPU's stubbed
    launches, no one knew whether by the CPU or by CUDA): bench.host_overhead's launches for real and stopped at the
    driver on one host, each layer's real host time beside its stubbed one at the device's own configs, the host's
    CPU speed; a part that fails is reported in its place and the rest still measured and printed."""
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    import host_overhead

    bench = host_overhead.host_bench
    asked = {}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(host_overhead.configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(host_overhead.configs, "compute_capability", lambda device: 90)
    speed = {"python": 9.0}
    monkeypatch.setattr(bench, "host_speed", lambda calls, device: asked.setdefault("speed", device) and speed)
    monkeypatch.setattr(bench, "triton_launch", lambda calls, device: {"fwd": {"run": 30.0, "direct": 12.0 if
                        device == "cuda" else 4.5, "arguments": 60}})  # fmt: skip

    def replay(calls, cases, device):
        asked["replay"] = cases, device
        raise RuntimeError("a stubbed plan failed")

    monkeypatch.setattr(bench, "plan_replay", replay)
    rows = [{"case": c, "dtype": d, "host_us": {"op_fwd": 70.0, "op_bwd": 200.0}} for c, d in host_overhead.CASES]
    found = host_overhead.launch_costs(rows)
    assert asked == {"speed": "cuda", "replay": (["unet_320", "down_s2"], ("NVIDIA H200", 132, 90))}
    assert found["host_speed_us"] == found["host_speed_after_us"] == speed
    assert found["launch_us"]["fwd"]["direct"] == 12.0 and found["launch_stubbed_us"]["fwd"]["direct"] == 4.5
    assert found["layers_stubbed_us"] == {"error": "RuntimeError: a stubbed plan failed"}
    assert found["layers_us"] == {"unet_320": {"fwd": 70.0, "bwd": 200.0}, "down_s2": {"fwd": 70.0, "bwd": 200.0}}
    capsys.readouterr()
    host_overhead.print_launch_costs(found)
    out = capsys.readouterr().out
    assert "fwd" in out and "30.0 /   12.0" in out and "+7.5" in out, out
    assert "unet_320 bf16 with call plans" in out and "a stubbed plan failed" in out
    assert "this host's CPU, us a step: python 9.00" in out and "this host's CPU after, us a step: python 9.00" in out
    found["layers_stubbed_us"] = {"unet_320": {"fwd": {"plans": 20.0, "no_plans": 40.0}, "bwd": {"plans": 50.0,
                                  "no_plans": 90.0}}}  # fmt: skip
    host_overhead.print_launch_costs(found)
    out = capsys.readouterr().out
    assert "fwd     70 launched,   20.0 stopped (  +50); bwd    200 launched,   50.0 stopped ( +150)" in out, out
