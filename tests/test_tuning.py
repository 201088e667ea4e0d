"""Tuning keys, the table lookup order, bad tables, the generator's writing and resuming, the memoised choice.

No GPU needed: devices are named, tables are files in tmp_path, and timings come from a stand-in function.
"""

import dataclasses
import itertools
import json
import time
import warnings

import pytest
import torch
import triton

import tconv3d
from tconv3d import settings
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_gluon
from tconv3d.kernels.config import DIRECTIONS, KernelConfig, packs_taps, split_rows
from tconv3d.kernels.conv_tma import wgrad_tma_patches
from tconv3d.kernels.tensors import cdiv, next_power_of_2
from tconv3d.testing import rel_l2, tolerance
from tconv3d.tune import choice, configs, tables, tuner
from tconv3d.tune.configs import TuningKey, candidates, keep, tuning_key
from tconv3d.tune.shapes import DTYPES_BY_NAME, ConvShape, load_shape_set

H100 = "NVIDIA H100 80GB HBM3"
CUDA = torch.device("cuda", 0)
CONFIG_A = KernelConfig(128, 128, 64, 8, 4, group_m=8)
CONFIG_B = KernelConfig(64, 64, 32, 4, 3, group_m=8)


def geometry(cin=64, cout=64, size=(8, 16, 16), kernel=3, stride=1, batch=1):
    k = (kernel,) * 3 if isinstance(kernel, int) else kernel
    return conv_geometry((batch, cin, *size), (cout, cin, *k), stride, [kk // 2 for kk in k], 1)


# ---------------------------------------------------------------------------------------------------------------
# keys


def test_the_hosts_integer_helpers_answer_as_tritons():
    # cdiv and next_power_of_2 stand in for Triton's constexpr functions on the host (a few us a call there)
    sizes = [*range(1, 4100), 2**20 - 1, 2**20, 2**20 + 1, 2**31 + 5]
    assert [next_power_of_2(n) for n in sizes] == [triton.next_power_of_2(n) for n in sizes]
    assert [cdiv(n, d) for n in sizes for d in (1, 3, 16, 127)] == [
        triton.cdiv(n, d) for n in sizes for d in (1, 3, 16, 127)
    ]


def test_key_fields_and_round_trip():
    key = tuning_key("wgrad", geometry(cin=32, cout=48, size=(5, 9, 13), kernel=(1, 3, 3)), torch.bfloat16)
    assert (key.direction, key.dtype, key.cin, key.cout) == ("wgrad", "bf16", 32, 48)
    assert key.kernel == (1, 3, 3) and key.stride == (1, 1, 1) and key.dilation == (1, 1, 1)
    assert key.log2_voxels == 9  # 5 * 9 * 13 = 585 output voxels: 2^9 <= 585 < 2^10
    assert str(key) == "wgrad/bf16/cin=32/cout=48/k=1x3x3/s=1x1x1/d=1x1x1/m=2^9"
    assert TuningKey.parse(str(key)) == key


def test_sizes_share_a_key_within_a_power_of_two_bucket():
    small = tuning_key("fwd", geometry(size=(8, 16, 16)), torch.float16)  # 2048 voxels
    larger = tuning_key("fwd", geometry(size=(8, 16, 31)), torch.float16)  # 3968 voxels
    doubled = tuning_key("fwd", geometry(size=(8, 16, 32)), torch.float16)  # 4096 voxels
    assert small == larger != doubled
    assert tuning_key("dgrad", geometry(), torch.float16) != small  # direction is part of the key


@pytest.mark.parametrize("text", ["", "fwd/bf16", "fwd/bf16/cin=a/cout=1/k=3x3x3/s=1x1x1/d=1x1x1/m=2^3",
                                  "up/bf16/cin=1/cout=1/k=3x3x3/s=1x1x1/d=1x1x1/m=2^3",
                                  "fwd/bf16/cin=1/cout=1/k=3x3/s=1x1x1/d=1x1x1/m=2^3"])  # fmt: skip
def test_malformed_keys_are_rejected(text):
    with pytest.raises(ValueError, match="malformed tuning key"):
        TuningKey.parse(text)


# ---------------------------------------------------------------------------------------------------------------
# search space


def test_candidates_are_pruned_to_the_problem_and_the_device():
    geom = geometry(cin=3, cout=32, size=(4, 8, 8), kernel=1)
    smem = 100 * 1024
    found = candidates("fwd", geom, torch.bfloat16, smem)
    assert found and all(keep("fwd", c, geom, torch.bfloat16, smem) for c in found)
    assert all(c.block_k == 16 and c.block_n <= 32 and c.block_m <= 256 for c in found)
    # 3 channels under a 3x3x3 kernel reduce over 81 (tap, channel) pairs: steps up to 128 wide.
    packed = candidates("fwd", geometry(cin=3, cout=32, size=(4, 8, 8)), torch.bfloat16, smem)
    assert {c.block_k for c in packed} == {16, 32, 64, 128}
    assert all(configs.ring_bytes(c, 2) <= smem for c in found)
    wgrad = candidates("wgrad", geometry(cin=64, cout=64, size=(2, 4, 4)), torch.float32, smem)
    assert wgrad and all(c.split_k <= triton.cdiv(32, c.block_k) for c in wgrad)
    assert len({c.split_k for c in candidates("wgrad", geometry(size=(16, 64, 64)), torch.bfloat16, smem)}) > 4


# ---------------------------------------------------------------------------------------------------------------
# lookup order: exact, else nearest, else heuristic


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A named CUDA device with an empty cache and config folder, no shipped tables, and 132 SMs."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(configs, "multiprocessor_count", lambda device: 132)
    monkeypatch.setattr(configs, "compute_capability", lambda device: 80)  # the pointer variant's heuristic
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tables, "SHIPPED_DIRS", (tmp_path / "shipped",))
    monkeypatch.setattr(settings, "CONFIG_DIR", tmp_path / "configs")
    monkeypatch.setattr(settings, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(settings, "AUTOTUNE", False)
    monkeypatch.setattr(choice, "_memo", {})
    tables.named_table.cache_clear()
    yield tmp_path
    tables.named_table.cache_clear()


def write_table(folder, entries, triton_version=triton.__version__, name=H100):
    folder.mkdir(parents=True, exist_ok=True)
    data = {"device": name, "triton": triton_version, "torch": torch.__version__, "date": "2026-11-22"}
    data["entries"] = {str(k): {"config": c.to_dict() if isinstance(c, KernelConfig) else c} for k, c in entries}
    path = folder / tables.table_file_name(name)
    path.write_text(json.dumps(data))
    return path


def test_exact_key_wins(fake_gpu):
    geom = geometry()
    key = tuning_key("fwd", geom, torch.bfloat16)
    write_table(fake_gpu / "shipped", [(key, CONFIG_A)])
    assert choice.pick_config("fwd", geom, torch.bfloat16, CUDA) == CONFIG_A


def test_nearest_key_in_the_same_family(fake_gpu):
    near = tuning_key("fwd", geometry(cin=64, cout=64, size=(8, 16, 32)), torch.bfloat16)
    far = tuning_key("fwd", geometry(cin=512, cout=512, size=(8, 16, 16)), torch.bfloat16)
    other_kernel = tuning_key("fwd", geometry(cin=64, cout=64, kernel=(1, 3, 3)), torch.bfloat16)
    # CONFIG_B's 64 columns fit the 64 output channels (CONFIG_A's 128 would be half empty: the heuristic's then)
    write_table(fake_gpu / "shipped", [(near, CONFIG_B), (far, CONFIG_A), (other_kernel, CONFIG_A)])
    assert choice.pick_config("fwd", geometry(cin=64, cout=64), torch.bfloat16, CUDA) == CONFIG_B


def test_heuristic_when_the_family_is_too_far(fake_gpu):
    """A tuned 384-channel key does not lend its tiles to a 32-channel problem, nor one 16x smaller in voxels."""
    wide = tuning_key("fwd", geometry(cin=256, cout=256), torch.bfloat16)
    small = tuning_key("fwd", geometry(cin=32, cout=32, size=(2, 4, 4)), torch.bfloat16)
    write_table(fake_gpu / "shipped", [(wide, CONFIG_A), (small, CONFIG_B)])
    geom = geometry(cin=32, cout=32)
    assert choice.pick_config("fwd", geom, torch.bfloat16, CUDA) == configs.heuristic_config(
        "fwd", geom, torch.bfloat16, 132
    )


def test_a_nearest_keys_tiles_too_wide_for_the_problem_give_way_to_the_heuristic(fake_gpu):
    """A nearest key's entry whose tiles fill less than NEAR_FILL_RATIO of what the heuristic's fill of the problem's
    MMA gives way to the heuristic (H200 run 8: unet_32's weight gradient on stack_64's 64 x 64 tiles, half their
    rows and half their columns empty, 0.42x cuDNN; here 128 x 64 tiles over 32 channels, a quarter of the
    heuristic's fill on this fake sm_80 device); where the same entry's tiles fit the problem, it is lent; an
    exact key's entry always stands."""
    wide = KernelConfig(128, 64, 64, 4, 3, group_m=1, split_k=4)
    tuned = tuning_key("wgrad", geometry(cin=64, cout=64), torch.bfloat16)
    write_table(fake_gpu / "shipped", [(tuned, wide)])
    narrow = geometry(cin=32, cout=32)
    heuristic = configs.heuristic_config("wgrad", narrow, torch.bfloat16, 132, 80)
    assert configs.nearest_key(tuning_key("wgrad", narrow, torch.bfloat16), [tuned]) == tuned  # within the bounds
    assert configs.mma_fill("wgrad", narrow, wide) < configs.NEAR_FILL_RATIO * configs.mma_fill(
        "wgrad", narrow, heuristic
    )
    assert choice.pick_config("wgrad", narrow, torch.bfloat16, CUDA) == heuristic
    assert choice.pick_config("wgrad", geometry(cin=128, cout=128), torch.bfloat16, CUDA) == wide  # fits: lent
    write_table(fake_gpu / "shipped", [(tuned, wide), (tuning_key("wgrad", narrow, torch.bfloat16), wide)])
    tables.named_table.cache_clear()
    choice._memo.clear()
    assert choice.pick_config("wgrad", narrow, torch.bfloat16, CUDA) == wide  # timed on this problem: it stands


def test_a_nearest_keys_tiles_half_as_full_as_the_heuristics_stand(fake_gpu):
    """Tiles of a nearest key that fill half of what the heuristic's do are lent (H200 run 10: unet_32's forward on
    stack_64's 128 x 64 halo tiles, fill 0.50 against 1.00, ran 1.087 ms against the heuristic's 1.241; here
    128 x 64 x 32 tiles, 64 columns over 32 output channels); a quarter gives way (the test above)."""
    lent = KernelConfig(128, 64, 32, 4, 3, group_m=8)
    tuned = tuning_key("fwd", geometry(cin=64, cout=64), torch.bfloat16)
    write_table(fake_gpu / "shipped", [(tuned, lent)])
    narrow = geometry(cin=32, cout=32)
    heuristic = configs.heuristic_config("fwd", narrow, torch.bfloat16, 132, 80)
    ours, theirs = configs.mma_fill("fwd", narrow, lent), configs.mma_fill("fwd", narrow, heuristic)
    assert ours == 0.5 * theirs, (ours, theirs)
    assert choice.pick_config("fwd", narrow, torch.bfloat16, CUDA) == lent


def test_heuristic_when_no_key_of_the_family(fake_gpu):
    write_table(fake_gpu / "shipped", [(tuning_key("fwd", geometry(), torch.float16), CONFIG_A)])
    geom = geometry()
    expected = configs.heuristic_config("fwd", geom, torch.bfloat16, 132)
    assert choice.pick_config("fwd", geom, torch.bfloat16, CUDA) == expected


def test_config_dir_overrides_shipped_and_cache_overrides_both(fake_gpu):
    geom = geometry()
    key = tuning_key("dgrad", geom, torch.bfloat16)
    write_table(fake_gpu / "shipped", [(key, CONFIG_A)])
    write_table(fake_gpu / "configs", [(key, CONFIG_B)])
    assert choice.pick_config("dgrad", geom, torch.bfloat16, CUDA) == CONFIG_B
    choice._memo.clear()
    tables.named_table.cache_clear()
    cached = KernelConfig(64, 128, 64, 8, 3)
    write_table(fake_gpu / "cache", [(key, cached)])
    assert choice.pick_config("dgrad", geom, torch.bfloat16, CUDA) == cached


def test_a_table_that_never_searched_the_box_kernels_gives_way_to_them(fake_gpu, monkeypatch):
    """On sm_90, where the heuristic runs a Gluon (or TMA) kernel, an entry from a tuning that searched the pointer
    kernels alone (a table without "variants", as the H100 table of 2026-11-22, or one listing only pointer) gives
    way to it, exact or nearest; an entry from a tuning that searched Gluon stands, as does a legacy entry where the
    heuristic runs the pointer kernel too (a strided forward)."""
    monkeypatch.setattr(configs, "compute_capability", lambda device: 90)
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)  # an sm_90 GPU, not the interpreter
    geom, strided = geometry(cin=128, cout=128, size=(8, 64, 64)), geometry(cin=128, cout=128, stride=2)
    key, near, strided_key = (
        tuning_key("fwd", geom, torch.bfloat16),
        tuning_key("fwd", geometry(cin=128, cout=128, size=(8, 64, 32)), torch.bfloat16),
        tuning_key("fwd", strided, torch.bfloat16),
    )
    heuristic = configs.heuristic_config("fwd", geom, torch.bfloat16, 132, 90)
    assert heuristic.variant == "gluon"

    def chosen(problem, variants=None, entries=((key, CONFIG_A), (strided_key, CONFIG_B))):
        path = write_table(fake_gpu / "shipped", list(entries))
        if variants is not None:
            path.write_text(json.dumps({**json.loads(path.read_text()), "variants": variants}))
        tables.named_table.cache_clear()
        choice._memo.clear()
        return choice.pick_config("fwd", problem, torch.bfloat16, CUDA)

    assert chosen(geom) == heuristic  # legacy: no "variants"
    assert chosen(geom, ["pointer"]) == heuristic
    assert chosen(geom, ["pointer"], entries=[(near, CONFIG_A)]) == heuristic  # the nearest key's entry too
    assert chosen(geom, ["direct", "gluon", "pointer", "tma"]) == CONFIG_A
    assert chosen(strided) == CONFIG_B  # the heuristic's strided forward is a pointer kernel: the table decides
    assert tables.table_metadata(H100)["variants"] == ["pointer"]
    monkeypatch.setattr(tuner, "_has_gluon", lambda device: True)  # what the tuner writes on an sm_90 GPU
    assert tables.table_metadata(H100, tuner.searched_variants(CUDA))["variants"] == [
        "direct",
        "gluon",
        "pointer",
        "tma",
    ]


# ---------------------------------------------------------------------------------------------------------------
# bad tables: one warning, then the fallback


def test_corrupt_table_warns_and_falls_back(fake_gpu):
    folder = fake_gpu / "shipped"
    folder.mkdir()
    (folder / tables.table_file_name(H100)).write_text('{"entries": {')
    geom = geometry()
    with pytest.warns(RuntimeWarning, match="ignoring tuning table"):
        chosen = choice.pick_config("fwd", geom, torch.bfloat16, CUDA)
    assert chosen == configs.heuristic_config("fwd", geom, torch.bfloat16, 132)


def test_table_from_another_triton_major_is_ignored(fake_gpu):
    geom = geometry()
    major = int(triton.__version__.split(".")[0])
    write_table(fake_gpu / "shipped", [(tuning_key("fwd", geom, torch.bfloat16), CONFIG_A)], f"{major + 1}.0.0")
    with pytest.warns(RuntimeWarning, match="another major version"):
        chosen = choice.pick_config("fwd", geom, torch.bfloat16, CUDA)
    assert chosen == configs.heuristic_config("fwd", geom, torch.bfloat16, 132)


def test_invalid_entries_are_skipped_with_one_warning(fake_gpu):
    geom = geometry()
    good = tuning_key("fwd", geometry(size=(8, 16, 32)), torch.bfloat16)
    bad_block = tuning_key("fwd", geom, torch.bfloat16)
    bad_field = tuning_key("dgrad", geom, torch.bfloat16)
    entries = [(good, CONFIG_B), (bad_block, dict(CONFIG_A.to_dict(), block_m=96)), (bad_field, {"block_q": 1})]
    path = write_table(fake_gpu / "shipped", entries)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = tables.read_table(path)
    assert len(caught) == 1 and "skipped 2 invalid entries" in str(caught[0].message)
    assert table == {good: CONFIG_B}
    # The exact key's entry was invalid: the nearest valid one stands in, never the broken config.
    choice._memo.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert choice.pick_config("fwd", geom, torch.bfloat16, CUDA) == CONFIG_B


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"block_m": 0, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}, "positive int"),
        ({"block_m": 64, "block_n": 48, "block_k": 32, "num_warps": 4, "num_stages": 3}, "power of two"),
        ({"block_m": 8, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 3}, "at least 16"),
        ({"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4}, "missing"),
        ({"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": "3"}, "positive int"),
        ([64, 64, 32, 4, 3], "must be an object"),
    ],
)
def test_invalid_configs_are_named(config, words):
    with pytest.raises((ValueError, TypeError), match=words):
        KernelConfig.from_dict(config)


# ---------------------------------------------------------------------------------------------------------------
# memoised choice


def test_choice_is_memoised_and_costs_microseconds(fake_gpu, monkeypatch):
    calls = []
    real_select = choice._select
    monkeypatch.setattr(choice, "_select", lambda *args: calls.append(1) or real_select(*args))
    geom = geometry()
    first = choice.pick_config("wgrad", geom, torch.bfloat16, CUDA)
    start = time.perf_counter()
    for _ in range(10_000):
        assert choice.pick_config("wgrad", geom, torch.bfloat16, CUDA) is first
    per_call_us = (time.perf_counter() - start) / 10_000 * 1e6
    assert len(calls) == 1
    assert per_call_us < 50, f"{per_call_us:.1f} us per lookup"


# ---------------------------------------------------------------------------------------------------------------
# first-use tuning and the generator, with a stand-in for timing


def stand_in_cost(config: KernelConfig) -> float:
    """A made-up but deterministic time: bigger tiles and more stages are faster, 256-wide tiles fail."""
    if config.block_m == 256:
        return None
    return 10.0 / (config.block_m * config.block_n * config.block_k) ** 0.5 + 0.01 / config.num_stages


def test_first_use_tuning_writes_the_cache(fake_gpu, monkeypatch):
    monkeypatch.setattr(settings, "AUTOTUNE", True)
    monkeypatch.setattr(tuner, "_timed_if_correct", lambda run, reference, tolerance, **filters: stand_in_cost)
    monkeypatch.setattr(tuner, "smem_limit", lambda device: 228 * 1024)
    geom = geometry()
    runs = []
    chosen = choice.pick_config("fwd", geom, torch.bfloat16, CUDA, run=lambda c: runs.append(c) or torch.ones(3))
    default = configs.heuristic_config("fwd", geom, torch.bfloat16, 132)
    assert runs == [default]  # the reference run
    space = candidates("fwd", geom, torch.bfloat16, 228 * 1024)
    near = tuner.nearest_candidates(space, default, tuner.CANDIDATES_PER_KEY)
    expected = min((c for c in [default, *near] if stand_in_cost(c)), key=stand_in_cost)
    assert chosen == expected
    key = tuning_key("fwd", geom, torch.bfloat16)
    cached = tables.read_table(fake_gpu / "cache" / tables.table_file_name(H100))
    assert cached == {key: expected}
    assert tables.device_table(CUDA)[key] == expected


def bench_jobs():
    return tuner.plan_jobs(load_shape_set("bench"), dtypes={"bf16"})


def stand_in_prepare(job):
    geom = job.shape.geometry()
    default = configs.heuristic_config(job.direction, geom, job.dtype, 132)
    some = candidates(job.direction, geom, job.dtype, 228 * 1024)[:12]
    return stand_in_cost, default, some


def test_plan_covers_the_suite_once_per_key():
    jobs = bench_jobs()
    keys = [job.key for job in jobs]
    assert len(keys) == len(set(keys))
    # Every (case, direction) of the suite in bf16 maps to a planned key: the problem its kernels run (a grouped
    # case of few channels a group, its coarse groups: kernels/grouped.py).
    for shape in load_shape_set("bench"):
        for direction in configs.DIRECTIONS:
            assert tuning_key(direction, shape.launched_geometry(), torch.bfloat16) in keys
    # wan_dec_384b and wan_dec_192 differ in channels, so they do not share keys.
    assert len(keys) >= 3 * 10


def test_generator_writes_table_and_resumes(tmp_path):
    jobs = bench_jobs()[:6]
    path = tmp_path / tables.table_file_name(H100)
    meta = tables.table_metadata(H100)
    lines = []
    outcomes = tuner.tune_jobs(jobs, path, meta, stand_in_prepare, budget_s=60, out=lines.append)
    assert len(outcomes) == 6
    data = json.loads(path.read_text())
    assert data["device"] == H100 and data["triton"] == triton.__version__ and data["torch"] == torch.__version__
    assert set(data["entries"]) == {str(job.key) for job in jobs}
    for job in jobs:
        entry = data["entries"][str(job.key)]
        assert entry["ms"] <= entry["default_ms"]
        assert KernelConfig.from_dict(entry["config"]) == min(
            stand_in_prepare(job)[2] + [stand_in_prepare(job)[1]], key=lambda c: stand_in_cost(c) or 1e9
        )
        assert entry["shape"] == job.shape.name
    assert "6 to tune" in lines[0] and sum(line.startswith("[") for line in lines) == 6
    # every config timed, a line each under its key's, the default marked
    candidates = [line for line in lines if line.startswith("    ")]
    assert sum(line.endswith(" ms") or line.endswith("did not compile") for line in candidates) == len(candidates)
    assert sum("(default)" in line for line in candidates) == 6
    default_line = f"    {tuner.config_text(stand_in_prepare(jobs[0])[1])} (default):"
    assert any(line.startswith(default_line) for line in candidates), default_line

    def must_not_run(job):
        raise AssertionError("a key already in the table was tuned again")

    again = tuner.tune_jobs(jobs, path, meta, must_not_run, budget_s=60, out=lines.append)
    assert again == [] and "6 already in" in lines[-1]
    assert tables.read_table(path).keys() == {job.key for job in jobs}


def test_generator_resumes_after_an_interruption(tmp_path):
    jobs = bench_jobs()[:4]
    path = tmp_path / tables.table_file_name(H100)
    meta = tables.table_metadata(H100)
    prepared = []

    def interrupted_after_two(job):
        if len(prepared) == 2:
            raise KeyboardInterrupt
        prepared.append(job)
        return stand_in_prepare(job)

    with pytest.raises(KeyboardInterrupt):
        tuner.tune_jobs(jobs, path, meta, interrupted_after_two, budget_s=60, out=lambda line: None)
    assert set(json.loads(path.read_text())["entries"]) == {str(j.key) for j in jobs[:2]}  # a valid, partial table
    resumed = tuner.tune_jobs(jobs, path, meta, stand_in_prepare, budget_s=60, out=lambda line: None)
    assert [o for o in resumed] and len(resumed) == 2
    assert set(json.loads(path.read_text())["entries"]) == {str(j.key) for j in jobs}


def test_search_respects_its_time_bound():
    clock_values = iter(range(1000))
    seen = []

    def measure(config):
        seen.append(config)
        return stand_in_cost(config)

    configs_to_try = [KernelConfig(32, 32, 32, 4, s) for s in range(1, 8)]
    outcome = tuner.search(configs_to_try, CONFIG_B, measure, budget_s=3, clock=lambda: next(clock_values))
    assert len(seen) == 4  # the default, then candidates while the (stand-in) clock stays within 3 s
    assert outcome.tried == 4 and outcome.default_config == CONFIG_B


def test_search_takes_the_leaner_of_candidates_as_fast():
    """Of the candidates within LEANER_WITHIN of the fastest, the one with the least split-K workspace wins (the
    faster of equals); one slower than that does not, however lean. The workspace is the fp32 partials' bytes."""
    geom = geometry(cin=512, cout=512, size=(5, 32, 32))  # hunyuan_512's
    split = lambda k: dataclasses.replace(CONFIG_A, split_k=k)  # noqa: E731
    times = {split(1): 1.015, split(3): 1.0, split(4): 0.999, split(2): 1.01}
    workspace = lambda config: configs.split_workspace_bytes("wgrad", geom, config)  # noqa: E731
    assert [workspace(split(k)) for k in (1, 3)] == [0, 3 * 512 * 27 * 512 * 4]
    outcome = tuner.search(list(times), split(3), times.get, budget_s=60, workspace=workspace)
    assert outcome.config == split(1) and outcome.ms == 1.015 and outcome.default_ms == 1.0
    assert tuner.search(list(times), split(3), times.get, budget_s=60).config == split(4)  # no workspace: fastest
    times[split(1)] = 1.03  # past 2%: the fastest of those within it, the leanest (split 2)
    assert tuner.search(list(times), split(3), times.get, budget_s=60, workspace=workspace).config == split(2)
    assert tuner.search([], split(3), lambda config: None, budget_s=60, workspace=workspace) is None


def test_summary_reports_median_and_worst():
    outcome = lambda ms, default_ms: tuner.Outcome(CONFIG_A, ms, CONFIG_B, default_ms, 3)  # noqa: E731
    text = tuner.summarize([outcome(1.0, 2.0), outcome(1.0, 1.0), outcome(1.0, 1.5)])
    assert "keys tuned: 3" in text and "median 1.50x" in text and "worst 1.00x" in text


def test_tune_command_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the command would tune for real")
    assert tuner.main(["--shapes", "bench"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_wgrad_candidates_bound_their_workspace():
    geom = geometry(cin=512, cout=512, size=(16, 64, 64))
    found = candidates("wgrad", geom, torch.bfloat16, 228 * 1024)
    assert found
    assert all(c.split_k * 512 * 512 * 27 * 4 <= configs.WGRAD_WORKSPACE_BYTES for c in found if c.split_k > 1)
    assert max(c.split_k for c in found) < 128


def test_candidates_that_do_not_compile_cleanly_are_never_run():
    """The tuner's static-compile filter (spills, shared memory) rejects a candidate before any launch."""
    runs = []
    measure = tuner._timed_if_correct(
        lambda config: runs.append(config), torch.ones(3), 1e-2, compiles_cleanly=lambda config: False
    )
    assert measure(CONFIG_A) is None
    assert runs == []


def test_candidates_nearest_the_default_come_first():
    default = KernelConfig(128, 128, 64, 8, 3)
    assert tuner.config_steps(default, default) == 0
    assert tuner.config_steps(default, KernelConfig(64, 128, 64, 8, 4)) == 2  # one halving, one stage
    assert tuner.config_steps(default, KernelConfig(32, 128, 64, 8, 3, split_k=4)) == 4
    geom = geometry(cin=384, cout=384, size=(8, 32, 32))
    space = candidates("fwd", geom, torch.bfloat16, 228 * 1024)
    nearest = tuner.nearest_candidates(space, default, 12)
    assert len(nearest) == 12 and default not in nearest
    same_tile = lambda c: tuner._tile(c) == tuner._tile(default)  # noqa: E731
    forms = [c for c in nearest if same_tile(c)]
    assert forms == [c for c in nearest[: len(forms)]]  # the default's own tile in other forms comes first
    steps = [tuner.config_steps(c, default) for c in nearest[len(forms) :]]
    assert steps == sorted(steps) and steps[0] == 1
    # Nothing left out is nearer than the farthest kept: the bounded list is the neighbourhood, not a prefix.
    left_out = [c for c in space if c not in nearest and c != default and not same_tile(c)]
    assert min(tuner.config_steps(c, default) for c in left_out) >= steps[-1]
    assert len(space) > 100  # the whole space would not fit a per-key budget


def test_nearest_candidates_time_every_form_of_the_default_tile(monkeypatch):
    """A row box (16 -> 128 wide: three doublings) or the unsplit twin of a 6-way split is far from the default by
    steps, yet it is the comparison the GPU run must make: the default's tile in every other form comes first."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    smem = 227 * 1024
    wide = geometry(cin=384, cout=384, size=(6, 60, 208))  # rows of 208: the heuristic keeps the 16-wide patch
    default = configs.heuristic_config("dgrad", wide, torch.bfloat16, 132, 90)
    near = tuner.nearest_candidates(candidates("dgrad", wide, torch.bfloat16, smem, tma=True, gluon=True), default, 24)
    assert default.tma_box_w == 16
    mine = [c for c in near if tuner._tile(c) == tuner._tile(default)]
    assert default.gluon == 2  # the heuristic's sm_90 bf16 choice: the warp-specialized Gluon kernel
    assert {c.tma_box_w for c in mine} >= {0, default.block_m} and {c.gluon for c in mine} >= {0, 1}
    small = geometry(cin=320, cout=320, size=(8, 8, 8), batch=2)  # unet_320: the timed heuristic splits 6 ways
    default = configs.heuristic_config("fwd", small, torch.bfloat16, 132, 90, timed_only=True)
    near = tuner.nearest_candidates(candidates("fwd", small, torch.bfloat16, smem, tma=True), default, 24)
    assert default.split_k == 6
    assert 1 in {c.split_k for c in near if tuner._tile(c) == tuner._tile(default)}


def test_grouped_keys_carry_groups_and_depthwise_searches_the_direct_kernels():
    grouped = conv_geometry((1, 64, 8, 16, 16), (64, 2, 3, 3, 3), 1, 1, 1, groups=32)
    key = tuning_key("fwd", grouped, torch.bfloat16)
    assert (key.cin, key.cout, key.groups) == (2, 2, 32) and str(key).endswith("/g=32")
    assert TuningKey.parse(str(key)) == key
    assert not key.same_family(tuning_key("fwd", geometry(cin=2, cout=2), torch.bfloat16))
    depthwise = conv_geometry((1, 64, 8, 16, 16), (128, 1, 3, 3, 3), 1, 1, 1, groups=64)
    for direction in ("fwd", "dgrad", "wgrad"):
        found = candidates(direction, depthwise, torch.bfloat16, 227 * 1024)
        assert found and all(c.direct and c.block_n <= 128 for c in found), direction
        assert configs.heuristic_config(direction, depthwise, torch.bfloat16, 132, 90).direct
        assert KernelConfig.from_dict(found[0].to_dict()) == found[0]
    assert {c.split_k for c in candidates("wgrad", depthwise, torch.bfloat16, 227 * 1024)} > {1}
    assert not configs.heuristic_config("fwd", grouped, torch.bfloat16, 132, 90).direct


@pytest.mark.parametrize("direction", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("in_place", [True, False], ids=["blocks_in_place", "block_diagonal"])
def test_the_tuner_times_a_grouped_problem_as_choice_launches_it(direction, in_place, monkeypatch):
    """A grouped job of few channels a group is timed on its coarse geometry (its key's) handed the problem's own
    weight, as choice.launch runs it: the pointer kernels' blocks in place, or the box kernels' block-diagonal
    copy; the weight gradient is the problem's own. Both match float64 under the interpreter."""
    if settings.CPU_BACKEND != "triton":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set by conftest without CUDA)")
    monkeypatch.setattr(tuner.grouped, "in_place", lambda *args: in_place)
    shape = ConvShape("grouped", 1, 16, 24, (3, 4, 5), (3, 3, 3), (1, 1, 1), (1,) * 6, (1, 1, 1), ("fp32",), groups=8)
    coarse = shape.launched_geometry()
    assert coarse.groups < shape.groups  # the test's premise: its groups run several at a time
    job = tuner.Job(tuning_key(direction, coarse, torch.float32), shape, direction, torch.float32)
    run, reference = tuner.job_problem(job, torch.device("cpu"))
    config = configs.heuristic_config(direction, coarse, torch.float32, 132, 80)
    result = run(config)
    expected = shape.geometry().weight_shape() if direction == "wgrad" else reference.shape
    assert result.shape == reference.shape == expected
    assert rel_l2(result.double(), reference.double()) < tolerance(torch.float32)


def test_first_use_tuning_refuses_a_capture(fake_gpu, monkeypatch):
    """Inside a CUDA-graph capture nothing can be timed: a key no table holds raises, naming the way out, and
    nothing is launched (tests/test_gpu.py does the same under a real capture)."""
    monkeypatch.setattr(settings, "AUTOTUNE", True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    runs = []
    with pytest.raises(RuntimeError, match=r"CUDA-graph capture.*python -m tconv3d\.tune"):
        choice.pick_config("fwd", geometry(), torch.bfloat16, CUDA, run=lambda c: runs.append(c))
    assert not runs


# ---------------------------------------------------------------------------------------------------------------
# a candidate that hangs the GPU

HANGING_CHECK = """
import json, sys, time, torch
import tconv3d.testing
from tconv3d.kernels.config import KernelConfig, packs_taps
from tconv3d.tune import tables, tuner
from tconv3d.tune.configs import TuningKey
tconv3d.testing.HANG_S = 0.5
torch.cuda.synchronize = lambda: time.sleep(3600)  # a kernel that never finishes: the check's wait never returns
key, path, config = TuningKey.parse(sys.argv[1]), sys.argv[2], KernelConfig.from_dict(json.loads(sys.argv[3]))
measure = tuner._timed_if_correct(
    lambda config: torch.ones(3), torch.ones(3), 1e-2, on_hang=lambda config: tables.record_hung(path, key, config)
)
measure(config)
print("measured")  # never reached
"""


def test_a_hanging_candidate_is_recorded_and_the_run_exits_to_be_resumed(tmp_path, monkeypatch):
    """The tuner's check waits on the GPU under testing.hang_guard: a candidate whose kernel never finishes is
    written beside the table and the process exits with HUNG_EXIT; run again, the job's candidates leave it out."""
    import subprocess
    import sys

    from tconv3d.testing import HUNG_EXIT

    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    monkeypatch.setattr(tuner, "smem_limit", lambda device: 228 * 1024)
    monkeypatch.setattr(tuner, "_has_tma", lambda device: True)
    monkeypatch.setattr(tuner, "_has_gluon", lambda device: True)
    monkeypatch.setattr(tuner, "default_config", lambda *a: KernelConfig(128, 128, 64, 8, 3))
    shape = next(s for s in load_shape_set("bench") if s.name == "wan_dec_384b")
    key = tuning_key("fwd", shape.geometry(), torch.bfloat16)
    job = tuner.Job(key, shape, "fwd", torch.bfloat16)
    _, every = tuner.job_configs(job, CUDA)
    hanging = next(c for c in every if c.gluon == 2)  # the persistent warp-specialized twin, say
    hung = tables.hung_file(tmp_path / tables.table_file_name(H100))
    assert hung.name == "NVIDIA_H100_80GB_HBM3.hung.json"
    started = time.monotonic()
    args = [str(key), str(hung), json.dumps(hanging.to_dict())]
    run = subprocess.run([sys.executable, "-c", HANGING_CHECK, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == HUNG_EXIT, run.stderr
    assert "measured" not in run.stdout and "hung" in run.stderr
    assert time.monotonic() - started < 60
    assert tables.read_hung(hung) == {str(key): [hanging]}
    # The next run's candidates for that key leave the hung one out (the next nearest takes its place).
    _, without = tuner.job_configs(job, CUDA, tables.read_hung(hung)[str(key)])
    assert hanging not in without and len(without) == len(every)
    assert [c for c in every if c != hanging] == without[: len(every) - 1]


def test_a_small_grid_takes_the_split_gluon_tiles_over_a_pointer_only_entry(monkeypatch):
    """hunyuan_512's 64-row tiles are not the Gluon kernel's at 8 warps, and its 160 tiles of 128 rows fill 1.2
    rounds: its forward and input gradient take the split one-warpgroup Gluon tiles (small_grid_twin), over the
    shipped H100 table's pointer-only entry. With timed_only, as before: the forward on the pointer kernel, where
    the table's entry stands (the Triton TMA forward ran it 1.32x slower on the H100), the input gradient on the TMA
    kernel."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    geom = {shape.name: shape for shape in load_shape_set("bench")}["hunyuan_512"].geometry()
    fwd, dgrad = (configs.heuristic_config(d, geom, torch.bfloat16, 132, 90) for d in ("fwd", "dgrad"))
    for direction, config in (("fwd", fwd), ("dgrad", dgrad)):
        small = configs.small_grid_twin(direction, geom, configs.heuristic_config(
            direction, geom, torch.bfloat16, 132, 90, timed_only=True), 132, 2)  # fmt: skip
        assert config == small and (config.gluon, config.block_m, config.num_warps, config.split_k) == (2, 64, 4, 2)
    timed = [configs.heuristic_config(d, geom, torch.bfloat16, 132, 90, timed_only=True) for d in ("fwd", "dgrad")]
    assert [c.variant for c in timed] == ["pointer", "tma"]
    name = "NVIDIA H100 80GB HBM3"
    key = tuning_key("fwd", geom, torch.bfloat16)
    assert key in tables.named_table(name) and tables.named_table(name)[key].variant == "pointer"
    assert choice.choose("fwd", geom, torch.bfloat16, name, 132, 90) == (fwd, "heuristic")
    assert choice.choose("dgrad", geom, torch.bfloat16, name, 132, 90) == (dgrad, "heuristic")
    # timed_only: the choice before, the table's entry where it stood (bench.variants' timed_only row)
    before = choice.choose("fwd", geom, torch.bfloat16, name, 132, 90, timed_only=True)
    assert before == (tables.named_table(name)[key], "table")


# GPUs with 99 KB of shared memory a block (cudaDevAttrMaxSharedMemoryPerBlockOptin: 101,376 bytes): sm_86 (A10,
# RTX 3090), sm_89 (L4, L40S, RTX 4090), sm_120 (RTX 5090, RTX PRO 6000 Blackwell). No table holds them, so the
# heuristic chooses for them; sm_120's capability takes the box kernels' tiles as sm_90's does, off Gluon.
SMALL_SHARED_MEMORY = {"NVIDIA A10": (86, 72), "NVIDIA L4": (89, 58), "NVIDIA GeForce RTX 5090": (120, 170)}


@pytest.mark.parametrize("device_name", sorted(SMALL_SHARED_MEMORY))
def test_the_heuristics_rings_fit_gpus_of_99_kb_a_block(device_name):
    """Every launch of the shape sets the heuristic chooses for such a GPU keeps its operand ring (stages x (rows +
    columns) x depth) within the 99 KB a block: a ring past it fails at launch (Triton's OutOfResources), on GPUs
    no tuning table covers. Compiled for sm_89 and sm_120 (2026-12-05), the largest launch took 64 KB."""
    capability, sm_count = SMALL_SHARED_MEMORY[device_name]
    assert not tables.named_table(device_name)  # no tuning table: the heuristic chooses
    largest = (0, None)
    for name in ("bench", "decoders", "unets", "stack", "awkward"):
        for shape in load_shape_set(name):
            geom = shape.geometry()
            for dtype_name, direction in itertools.product(shape.dtypes, DIRECTIONS):
                dtype = DTYPES_BY_NAME[dtype_name]
                config, source = choice.choose(direction, geom, dtype, device_name, sm_count, capability)
                config = choice.force_variant(direction, geom, dtype, config, "auto", gluon_runs=False)
                assert source == "heuristic" and not config.gluon, (shape.name, direction, config, source)
                ring = configs.ring_bytes(config, dtype.itemsize)
                largest = max(largest, (ring, f"{shape.name} {dtype_name} {direction} {config}"))
    assert largest[0] <= 101_376, largest


def test_sm90_heuristic_takes_the_tiles_the_h100_timed_faster(monkeypatch):
    """The persistent Gluon forward and input gradient: 256x128 swapped where its rounds of tiles end sooner than
    128x128's at WIDE_TILE_GAIN (wan_dec_384b), 128x128 where half as many tiles would fill fewer SMs; 128x64 on
    one warpgroup at two programs an SM (unet_64); the weight gradient's tiles as they were."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape for shape in load_shape_set("bench")}
    # 132 x 3 tiles of 128x128 in 3 rounds; 66 x 3 of 256x128 in 2, 3.4 rounds' time at their gain
    few = conv_geometry((1, 384, 4, 64, 66), (384, 384, 3, 3, 3), 1, 1, 1)
    for direction in ("fwd", "dgrad"):
        for name in ("wan_dec_384b", "wan_dec_384a"):  # 27 rounds against 14; 7 against 4 (6.8 at the gain)
            wide = configs.heuristic_config(direction, shapes[name].geometry(), torch.bfloat16, 132, 90)
            assert (wide.block_m, wide.block_n, wide.num_warps, wide.swap_ab, wide.gluon) == (256, 128, 8, 1, 2)
        kept = configs.heuristic_config(direction, few, torch.bfloat16, 132, 90)
        assert (kept.block_m, kept.block_n, kept.swap_ab, kept.gluon) == (128, 128, 0, 2)
        geom = shapes["unet_64"].geometry()
        narrow = configs.heuristic_config(direction, geom, torch.bfloat16, 132, 90, timed_only=True)
        assert (narrow.block_m, narrow.block_n, narrow.num_warps, narrow.gluon) == (128, 64, 4, 2)
        assert conv_gluon.programs_an_sm(narrow, 2, weight_grad=False) == 2
        # as halo tiles on one program an SM, 32 deep (H200 run 5: stack_64's forward 1.38x, input gradient 1.45x)
        halo = configs.heuristic_config(direction, geom, torch.bfloat16, 132, 90)
        assert halo == configs.halo_twin(direction, geom, narrow, 2, programs=1) and halo.halo_d == 2
        assert (halo.block_k, halo.num_stages, conv_gluon.programs_an_sm(halo, 2, weight_grad=False)) == (32, 4, 1)
    weight = configs.heuristic_config("wgrad", shapes["wan_dec_384b"].geometry(), torch.bfloat16, 132, 90)
    assert (weight.block_m, weight.block_n, weight.num_warps, weight.swap_ab) == (128, 128, 8, 0)


def test_sm90_heuristic_takes_what_the_h100_timed_faster(monkeypatch):
    """H100 runs 15, 17 and 18 (bench.variants): the decoders' forwards (cached frames, replicate borders) on the
    persistent Gluon kernel, their weight gradients too but with timed_only (an untimed rule); the deepest ring for
    one-warpgroup forward and input-gradient tiles at two programs an SM and for 8-warp weight-gradient tiles at one,
    not for one-warpgroup weight gradients; the forward's and input gradient's 96 channels a tap in whole 32-deep
    steps; a forward (input gradient) reducing over fewer than 16 input (output) channels a tap on the pointer
    kernel's packed pairs, 16 deep on 8 warps (run 18: 1.08x over 32 on 4)."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape for name in ("bench", "decoders", "stack") for shape in load_shape_set(name)}

    def h100(direction, name, timed_only=False):
        return configs.heuristic_config(
            direction, shapes[name].launched_geometry(), torch.bfloat16, 132, 90, timed_only
        )

    for name in ("wan_dec_384_cached", "wan_dec_96_cached", "hunyuan_dec_128_replicate", "mochi_dec_256_replicate"):
        assert h100("fwd", name).gluon == 2 and h100("fwd", name, timed_only=True).gluon == 2, name
        assert h100("wgrad", name).gluon == 2 and h100("wgrad", name, timed_only=True).variant == "pointer", name
    assert (h100("fwd", "wan_dec_96_cached").block_k, h100("fwd", "wan_dec_384_cached").block_k) == (32, 64)
    for direction in ("fwd", "dgrad"):
        ring = h100(direction, "unet_64", timed_only=True)  # (the heuristic's are its halo tiles: _halo_tiles)
        assert (ring.num_warps, ring.num_stages) == (4, 4) and ring == configs.deepest_ring(ring, 2, direction)
        assert conv_gluon.programs_an_sm(ring, 2, weight_grad=False) == 2
    assert h100("wgrad", "wan_dec_384b").num_stages == 7 and h100("wgrad", "unet_64").num_stages == 3
    assert conv_gluon.programs_an_sm(h100("wgrad", "wan_dec_384b"), 2, weight_grad=True) == 1
    assert (h100("fwd", "wan_dec_384b").num_stages, h100("dgrad", "wan_dec_96").block_k) == (3, 32)
    assert h100("dgrad", "wan_dec_384b").block_k == 64  # 384 channels fill 64-deep steps
    for direction, name in (("fwd", "stack_in8"), ("dgrad", "stack_out8")):
        packed = h100(direction, name)
        assert packed.variant == "pointer" and packs_taps(direction, shapes[name].geometry()), (direction, name)
        assert (packed.block_k, packed.num_warps) == (16, 8), (direction, name, packed)


def test_unaligned_channels_take_plain_tiles_on_the_box_kernels(monkeypatch):
    """Channels not 16-divisible (216 -> 160 in bf16): the pointer kernels gather them element by element on small
    tiles (64 x 32 x 32; config.gathered_tiles), which timed_only's box launches inherit; the sm_90 heuristic gives
    its box launches a plain layer's tiles instead (224 -> 160 channels' rows and columns), its steps 32 deep where
    64 would leave more of a tap's slots empty (7 x 32 = 224 of 216, not 4 x 64 = 256) on a ring twice as deep; not
    where that would move it down the order pointer, Triton TMA, Gluon (a 24-channel input gradient of few voxels:
    64 x 128 on 8 warps, which the Gluon kernel does not take, keeps the Gluon kernel's 64 x 32); its pointer
    launches (sm_80, TCONV3D_KERNELS=pointer) keep the small tiles."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    bf16 = torch.bfloat16
    odd = conv_geometry((2, 216, 8, 48, 48), (160, 216, 3, 3, 3), 1, 1, 1)
    plain = conv_geometry((2, 224, 8, 48, 48), (160, 224, 3, 3, 3), 1, 1, 1)
    for direction in ("fwd", "dgrad"):
        chosen = configs.heuristic_config(direction, odd, bf16, 132, 90)
        twin = configs.heuristic_config(direction, plain, bf16, 132, 90)
        assert chosen.gluon == 2 and (chosen.block_m, chosen.block_n) == (twin.block_m, twin.block_n) == (128, 128)
        before = configs.heuristic_config(direction, odd, bf16, 132, 90, timed_only=True)
        assert (before.gluon, before.block_m, before.block_n, before.block_k) == (2, 64, 32, 32), direction
        pointer = choice.force_variant(direction, odd, bf16, chosen, "pointer")
        assert (pointer.variant, pointer.block_m, pointer.block_n, pointer.num_warps) == ("pointer", 64, 32, 4)
        sm_80 = configs.heuristic_config(direction, odd, bf16, 108, 80)
        assert (sm_80.variant, sm_80.block_m, sm_80.block_n) == ("pointer", 64, 32), direction
    forward = configs.heuristic_config("fwd", odd, bf16, 132, 90)
    assert (forward.block_k, forward.num_stages) == (32, 6)  # 216 channels a tap in 7 steps, 3 stages' bytes
    weight = configs.heuristic_config("wgrad", odd, bf16, 132, 90)
    assert weight.gluon == 2 and weight.block_k == 64  # 64 voxels deep, where the gathers take 32
    assert configs.heuristic_config("wgrad", odd, bf16, 132, 90, timed_only=True).block_k == 32
    few = conv_geometry((1, 128, 4, 16, 20), (24, 128, 1, 3, 3), 1, (0, 1, 1), 1)  # the input gradient reduces 24
    kept = configs.heuristic_config("dgrad", few, bf16, 132, 90)
    assert kept == configs.heuristic_config("dgrad", few, bf16, 132, 90, timed_only=True)
    assert (kept.gluon, kept.block_m, kept.block_n) == (2, 64, 32)


def test_few_voxel_layers_take_128_row_gluon_tiles_where_their_tiles_fill_the_sms(monkeypatch):
    """configs._gluon_rows: a forward or input gradient of fewer voxels than 128 for each SM (the heuristic's 64-row
    tiles, which the Gluon kernel does not take on 8 warps) runs 128-row tiles on the persistent Gluon kernel where
    those tiles, row blocks times column blocks, keep their last round over the SMs at least two-thirds busy: Wan's
    384-channel cached layer at 2 x 64 x 64 (192 tiles of 128 x 128: 96 of 256 x 128 swapped) and a 96-tile layer
    (unswapped: half as many tiles would fill fewer SMs), not hunyuan_512 (160 tiles: the second round 21% busy) nor
    unet_320 (24), nor off sm_90, nor with timed_only (bench.variants' timed_only row: the pointer kernel, the
    Triton TMA one for the input gradient). Those two, and layers of few tiles reading cached frames, take the
    split one-warpgroup Gluon tiles (small_grid_twin); LTX-2's reflect-bordered ones the pointer kernel."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape for name in ("bench", "decoders") for shape in load_shape_set(name)}
    bf16 = torch.bfloat16

    def h100(direction, geom, **options):
        return configs.heuristic_config(direction, geom, bf16, 132, 90, **options)

    for name in ("wan_dec_384_cached_64", "mochi_dec_768_replicate"):
        geom = shapes[name].launched_geometry()
        rows = configs.gemm_view("fwd", geom).rows
        assert rows < 128 * 132 and rows // 128 * 3 >= 96, name  # few voxels, 384 or 768 columns
        wide = h100("fwd", geom)
        assert (wide.gluon, wide.block_m, wide.block_n, wide.swap_ab, wide.split_k) == (2, 256, 128, 1, 1), name
        before = h100("fwd", geom, timed_only=True)
        assert (before.variant, before.block_m) == ("pointer", 64), name
    plain = conv_geometry((1, 384, 2, 64, 64), (384, 384, 3, 3, 3), 1, 1, 1)
    for direction, before_variant in (("fwd", "pointer"), ("dgrad", "tma")):
        assert h100(direction, plain).gluon == 2
        assert h100(direction, plain, timed_only=True).variant == before_variant
        assert configs.heuristic_config(direction, plain, bf16, 132, 80).block_m == 64  # no Gluon kernel on sm_80
    assert h100("fwd", plain, timed_only=True).block_m == 64
    few = conv_geometry((1, 512, 3, 32, 32), (512, 512, 3, 3, 3), 1, 1, 1)  # 24 x 4 = 96 tiles: 0.73 of a round
    assert (h100("fwd", few).gluon, h100("fwd", few).block_m, h100("fwd", few).split_k) == (2, 128, 1)
    for name in ("hunyuan_512", "unet_320"):  # 160 tiles (1.21 rounds), 24: the split one-warpgroup tiles
        geom = shapes[name].geometry()
        for direction in ("fwd", "dgrad"):
            timed = h100(direction, geom, timed_only=True)
            assert timed.block_m == 64 and not timed.gluon, (name, direction)
            assert h100(direction, geom) == configs.small_grid_twin(direction, geom, timed, 132, 2), (name, direction)
    for name in ("ltx2_dec_256_reflect", "ltx2_dec_512_reflect"):
        # bordered in H and W: the pointer kernel, as before the rules (H200 run 5: the split Gluon interior beside
        # its border ring ran 1.5x and 3.4x slower)
        geom = shapes[name].launched_geometry()
        timed = h100("fwd", geom, timed_only=True)
        assert (timed.variant, timed.block_m) == ("pointer", 64), name
        assert h100("fwd", geom) == timed, name
        assert configs.small_grid_twin("fwd", geom, timed, 132, 2) is not None, name  # which it would take
        # unbordered, reading cached frames (a second source): the split one-warpgroup Gluon tiles
        cached = dataclasses.replace(geom, prefix_frames=2, padding=(0, 0, 1, 1, 1, 1), padding_mode="zeros")
        timed = h100("fwd", cached, timed_only=True)
        assert h100("fwd", cached) == configs.small_grid_twin("fwd", cached, timed, 132, 2), name
        assert h100("fwd", cached).split_k > 1 and h100("fwd", cached).gluon == 2, name
    # the weight gradient's tiles as before (its split refitted to the persistent programs: persistent_wgrad_split)
    refitted = h100("wgrad", plain)
    assert refitted == dataclasses.replace(h100("wgrad", plain, timed_only=True), split_k=refitted.split_k)


def test_a_transposed_conv_of_a_concatenation_takes_the_gluon_input_gradient(monkeypatch):
    """MONAI UNet's up convs (a transposed conv of [upsampled, skip]: the input gradient of a stride-2 conv reading
    the skip in place after grad_out's channels) take the persistent Gluon kernel as a plain input gradient does,
    32 + 32 channels a tap in two full 32-deep steps, not two half-empty 64-deep ones (whole_steps_twin), a deep one
    of few tiles split on one warpgroup; not with timed_only (bench's skip scenario times both), not on sm_80."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    bf16 = torch.bfloat16

    def h100(geom, **options):
        return configs.heuristic_config("dgrad", geom, bf16, 132, 90, **options)

    up = dataclasses.replace(conv_geometry((1, 16, 64, 64, 64), (64, 16, 3, 3, 3), 2, 1, 1), out_after_channels=32)
    plain = conv_geometry((1, 16, 64, 64, 64), (64, 16, 3, 3, 3), 2, 1, 1)
    chosen = h100(up)
    assert (chosen.gluon, chosen.block_k, chosen.split_k) == (2, 32, 1)
    assert configs.mma_fill("dgrad", up, chosen) == 1.0
    assert configs.mma_fill("dgrad", up, dataclasses.replace(chosen, block_k=64)) == 0.5
    assert h100(plain).gluon == 2 and h100(plain).block_k == 64  # one source of 64: whole 64-deep steps
    assert h100(up, timed_only=True).variant == "pointer"
    assert configs.heuristic_config("dgrad", up, bf16, 132, 80).variant == "pointer"
    # a deep one of few tiles: split on one warpgroup (small_grid_twin), as a plain one
    few = dataclasses.replace(conv_geometry((1, 64, 16, 16, 16), (384, 64, 3, 3, 3), 2, 1, 1), out_after_channels=192)
    small = configs.small_grid_twin("dgrad", few, h100(few, timed_only=True), 132, 2)
    assert h100(few) == small and (small.gluon, small.num_warps) == (2, 4) and small.split_k > 1
    assert h100(few, timed_only=True).variant == "pointer"


def test_a_skip_connection_read_in_place_takes_the_gluon_forward(monkeypatch):
    """A UNet decoder's convolution of [upsampled, skip] reading the skip in place (channels_after): its forward on
    the persistent Gluon kernel as a plain one's (MONAI's BasicUNet and DynUNet ran 25-39% of their FLOPs in these
    on the pointer kernel), each source's channels in whole steps (whole_steps_twin), not with timed_only (bench's
    skip scenario times both), not where a border mode in H or W parts it into interior and ring; its weight
    gradient on the Gluon kernel as a plain one of one source's channels (not with timed_only: the pointer kernel),
    its input gradient reads no second source."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    bf16 = torch.bfloat16
    skip = conv_geometry((1, 32, 128, 128, 128), (32, 64, 3, 3, 3), 1, 1, 1, after_channels=32)
    plain = conv_geometry((1, 64, 128, 128, 128), (32, 64, 3, 3, 3), 1, 1, 1)

    def h100(direction, geom, **options):
        return configs.heuristic_config(direction, geom, bf16, 132, 90, **options)

    # as the plain one's, but each source's 32 channels in a whole 32-deep step, not half of a 64-deep one
    chosen = h100("fwd", skip)
    assert dataclasses.replace(h100("fwd", plain), block_k=32, num_stages=chosen.num_stages) == chosen
    assert (chosen.gluon, h100("fwd", plain).block_k) == (2, 64)
    assert conv_gluon.programs_an_sm(chosen, 2, weight_grad=False) == 2
    assert configs.mma_fill("fwd", skip, h100("fwd", skip)) == 1.0
    assert h100("fwd", skip, timed_only=True).variant == "pointer"
    assert h100("wgrad", skip, timed_only=True).variant == "pointer" and h100("wgrad", plain).gluon == 2
    assert h100("wgrad", skip) == h100("wgrad", conv_geometry((1, 32, 128, 128, 128), (32, 32, 3, 3, 3), 1, 1, 1))
    bordered = conv_geometry((1, 32, 128, 128, 128), (32, 64, 3, 3, 3), 1, 1, 1, "zeros,replicate,replicate", 0, 1, 32)
    assert configs.tma_eligible("fwd", bordered, bf16) and h100("fwd", bordered).variant == "pointer"
    assert configs.heuristic_config("fwd", skip, bf16, 132, 80).variant == "pointer"  # no Gluon kernel on sm_80


def test_small_grid_twin_fills_the_sms_with_split_one_warpgroup_tiles(monkeypatch):
    """configs.small_grid_twin (bench.variants' gluon_ws_small_grid row): a forward or input gradient of few tiles on
    64-row one-warpgroup Gluon tiles, two programs an SM, its reduction split until the last round of (tile, split)
    units is at least 3/4 busy at one or two programs an SM; none where the tiles fill the SMs unsplit, nor for the
    weight gradient."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape.geometry() for shape in load_shape_set("bench")}
    expected = {"unet_320": 5, "hunyuan_512": 2}  # 48 tiles of 64 x 128 (5 x 48 = 240 units); 320 (640 units)
    for name, split in expected.items():
        geom = shapes[name]
        for direction in ("fwd", "dgrad"):
            base = configs.heuristic_config(direction, geom, torch.bfloat16, 132, 90)
            twin = configs.small_grid_twin(direction, geom, base, 132, 2)
            assert (twin.block_m, twin.block_n, twin.block_k, twin.num_warps, twin.gluon) == (64, 128, 64, 4, 2)
            assert twin.split_k == split and twin.tma_box_w and configs.gluon_takes(twin), twin
            assert conv_gluon.programs_an_sm(twin, 2, weight_grad=False) == 2
            view = configs.gemm_view(direction, geom)
            units = -(-view.rows // 64) * -(-view.cols // 128) * twin.split_k
            for per_sm in (1, 2):
                rounds = units / (per_sm * 132)
                assert rounds / -(-rounds // 1) >= 0.75, (name, per_sm, rounds)
        assert configs.small_grid_twin("wgrad", geom, base, 132, 2) is None
    fp32 = configs.heuristic_config("fwd", shapes["unet_320"], torch.float32, 132, 90)
    assert configs.small_grid_twin("fwd", shapes["unet_320"], fp32, 132, 4).block_k == 32  # 128-byte rows a step
    wide = shapes["wan_dec_384b"]  # 7,020 tiles of 64 x 128: the SMs are full unsplit
    assert (
        configs.small_grid_twin("fwd", wide, configs.heuristic_config("fwd", wide, torch.bfloat16, 132, 90), 132, 2)
        is None
    )


def test_whole_steps_twin_reads_96_channels_in_three_full_steps(monkeypatch):
    """configs.whole_steps_twin (bench.variants' gluon_ws_whole_steps row): Wan's 96-channel layer's persistent Gluon
    forward and input gradient in 32-deep steps on a ring twice as deep, the programs an SM unchanged, its MMA work
    1.33x less; none where the channels fill 64-deep steps, for the weight gradient or off the persistent kernel."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape.geometry() for shape in load_shape_set("bench")}
    geom = shapes["wan_dec_96"]
    for direction in ("fwd", "dgrad"):
        chosen = configs.heuristic_config(direction, geom, torch.bfloat16, 132, 90)
        # the heuristic takes the twin (H100: forward 1.36x, run 15; input gradient 1.44x, run 17); the tiles it
        # came from
        assert (chosen.block_k, chosen.num_stages) == (32, 6), (direction, chosen)
        chosen = dataclasses.replace(chosen, block_k=64, num_stages=3)
        twin = configs.whole_steps_twin(direction, geom, chosen, 2)
        assert (twin.block_k, twin.num_stages) == (chosen.block_k // 2, 2 * chosen.num_stages) == (32, 6), twin
        assert dataclasses.replace(twin, block_k=64, num_stages=3) == chosen
        same = conv_gluon.programs_an_sm(twin, 2, weight_grad=False) == conv_gluon.programs_an_sm(chosen, 2, False)
        assert same and configs.mma_fill(direction, geom, chosen) / configs.mma_fill(direction, geom, twin) == 0.75
        assert configs.whole_steps_twin(direction, geom, dataclasses.replace(chosen, gluon=0), 2) is None
        wide = shapes["wan_dec_384b"]  # 384 channels: whole 64-deep steps
        assert (
            configs.whole_steps_twin(
                direction, wide, configs.heuristic_config(direction, wide, torch.bfloat16, 132, 90), 2
            )
            is None
        )
    weight = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
    assert weight.gluon == 2 and configs.whole_steps_twin("wgrad", geom, weight, 2) is None


def test_the_persistent_weight_gradient_splits_by_what_a_split_buys(monkeypatch):
    """sm_90's Gluon weight gradient takes the split its model times best, or the fewest within
    WGRAD_LEANER_WITHIN of it (configs.persistent_wgrad_split; not with timed_only, which keeps the split that leaves
    the last round three quarters busy at up to 3 programs an SM): unsplit where a split does not shorten the rounds
    enough to pay for its fp32 partials (hunyuan_512: 432 tiles, 81 MB of partials for 3 splits; Wan's 384-channel
    layers: 2 rounds at any split up to 6), fewer splits where the narrow layers' few tiles fill one round of
    units at fewer (down_s2 34 -> 9: 28.7 -> 7.6 MB of partials), as many as fill the rounds where the reduction is
    long. With the partials' traffic and the fixed costs free, the model splits wan_dec_384b to shorten its rounds:
    the rounds count."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {s.name: s.geometry() for name in ("bench", "decoders") for s in load_shape_set(name)}

    def h100(name, **options):
        return configs.heuristic_config("wgrad", shapes[name], torch.bfloat16, 132, 90, **options)

    def partial_mb(name, config):
        geom = shapes[name]
        splits = config.split_k if config.split_k > 1 else 0
        return splits * geom.out_channels * geom.taps * geom.in_channels * 4 / 2**20

    for name in ("hunyuan_512", "wan_dec_384a", "wan_dec_384b"):
        chosen, before = h100(name), h100(name, timed_only=True)
        assert chosen.gluon == 2 and chosen.split_k == 1 and before.split_k > 1, (name, before.split_k)
        assert chosen == dataclasses.replace(before, split_k=1), name  # the tiles as before
    for name in ("wan_dec_384_cached", "ltx2_dec_512_reflect"):  # a decoder's fine-tuning step (an untimed rule)
        assert (h100(name).gluon, h100(name).split_k) == (2, 1), name
    assert partial_mb("hunyuan_512", h100("hunyuan_512", timed_only=True)) == 81
    for name in ("down_s2", "unet_64", "wan_dec_96", "hunyuan_128", "stack_64"):
        chosen, before = h100(name), h100(name, timed_only=True)
        per_sm = conv_gluon.programs_an_sm(chosen, 2, weight_grad=True)
        patches = wgrad_tma_patches(shapes[name], chosen)
        units = 27 * cdiv(patches, split_rows(patches, chosen.split_k, 1))  # 27 tiles: one a tap
        rounds = units / (per_sm * 132)
        assert 1 < chosen.split_k < before.split_k and rounds / -(-units // (per_sm * 132)) >= 0.9, (name, rounds)
        assert partial_mb(name, chosen) < partial_mb(name, before), name
    assert h100("down_s2").split_k == 9
    for name in ("cogvideo_256", "wan_dec_192"):  # 108 tiles: 1 round at 82%, 5 rounds of sixths at 98%
        assert h100(name).split_k == h100(name, timed_only=True).split_k == 6, name
    empty = conv_geometry((0, 384, 6, 60, 104), (384, 384, 3, 3, 3), 1, 1, 1)  # no patches: one split
    assert configs.heuristic_config("wgrad", empty, torch.bfloat16, 132, 90).split_k == 1
    geom, wide = shapes["wan_dec_384b"], h100("wan_dec_384b")
    for constant, free in (("WGRAD_DRAM_BYTES", 1e30), ("WGRAD_UNIT_SECONDS", 0), ("WGRAD_SUM_SECONDS", 0),
                           ("WGRAD_LEANER_WITHIN", 1.0)):  # fmt: skip
        monkeypatch.setattr(configs, constant, free)
    split = configs.persistent_wgrad_split(geom, wide, 132, 2)
    assert split > 1 and -(-243 * split // 132) / split < 2, split  # fewer tile-times than the 2 rounds unsplit


@pytest.mark.parametrize(
    ("input_shape", "cout", "stride", "groups"),
    [((0, 384, 6, 60, 104), 384, 1, 1), ((0, 384, 6, 60, 104), 16, 1, 1), ((0, 320, 8, 8, 8), 320, 1, 1),
     ((0, 64, 8, 8, 8), 128, 2, 1), ((0, 3, 8, 16, 16), 8, 1, 1), ((0, 96, 4, 8, 8), 3, 1, 1),
     ((0, 8, 4, 8, 8), 64, 1, 1), ((0, 256, 8, 28, 28), 256, 1, 32), ((0, 192, 16, 56, 56), 192, 1, 192)],
    ids=["wide", "few_out", "small_grid", "strided", "packed_in", "few_out_3", "packed_out", "grouped", "depthwise"],
)  # fmt: skip
def test_the_heuristic_takes_an_empty_batch(input_shape, cout, stride, groups, monkeypatch):
    """A batch of 0 has no tiles: every direction's heuristic config, on sm_80 and sm_90, timed rules or all, is a
    valid one (a split of at least 1), with no division by its zero tiles (small_grid_split, _gluon_rows,
    _wave_filling_split and persistent_wgrad_split divided by them: a CUDA call on an empty batch raised
    ZeroDivisionError before its launcher's early return), whatever variant is forced."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    geom = conv_geometry(input_shape, (cout, input_shape[1] // groups, 3, 3, 3), stride, 1, 1, groups=groups)
    for direction, dtype, capability in itertools.product(DIRECTIONS, configs.DTYPE_NAMES, (80, 90)):
        for timed_only in (False, True):
            config = configs.heuristic_config(direction, geom, dtype, 132, capability, timed_only)
            assert config.split_k >= 1, (direction, dtype, capability, config)
            for kernels in ("pointer", "tma", "gluon"):
                assert choice.force_variant(direction, geom, dtype, config, kernels, True).split_k >= 1


def test_an_empty_batch_runs_through_the_h100_choices(monkeypatch):
    """The layers of test_the_heuristic_takes_an_empty_batch as a model calls them, forward and backward with a bias,
    at the H100's choices (CPU tensors standing in for CUDA ones): empty outputs and input gradients, zero weight and
    bias gradients. At 8d49751 seven of these eight raised ZeroDivisionError in the heuristic."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    monkeypatch.setattr(settings, "CPU_BACKEND", "triton")
    monkeypatch.setattr(choice, "_memo", {})

    def h100(direction, geom, dtype, device, run):
        config, _ = choice.choose(direction, geom, dtype, H100, 132, 90)
        return choice.force_variant(direction, geom, dtype, config, settings.KERNELS, True), "h100"

    monkeypatch.setattr(choice, "_select_with_source", h100)
    layers = [((0, 512, 5, 32, 32), 512, 1, 1), ((0, 320, 8, 8, 8), 320, 1, 1), ((0, 64, 16, 16, 16), 128, 1, 2),
              ((0, 256, 8, 28, 28), 256, 32, 1), ((0, 192, 16, 56, 56), 192, 192, 1), ((0, 3, 17, 64, 64), 128, 1, 1),
              ((0, 96, 17, 64, 64), 3, 1, 1), ((0, 32, 8, 32, 32), 32, 1, 1)]  # fmt: skip
    cl = {"dtype": torch.bfloat16, "memory_format": torch.channels_last_3d}
    for shape, cout, groups, stride in layers:
        x = torch.randn(*shape).to(**cl).requires_grad_()
        w = torch.randn(cout, shape[1] // groups, 3, 3, 3).to(**cl).requires_grad_()
        b = torch.randn(cout, dtype=torch.bfloat16, requires_grad=True)
        y = tconv3d.conv3d(x, w, b, stride=stride, padding=1, groups=groups)
        gx, gw, gb = torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
        assert y.shape[0] == 0 and gx.shape == x.shape and gw.shape == w.shape, shape
        assert not gw.any() and not gb.any(), shape


def test_swapped_wgrad_twin_fills_the_rows_with_taps(monkeypatch):
    """configs.swapped_wgrad_twin (bench.variants' gluon_ws_swapped_wgrad row, a tuning candidate): a weight gradient
    of at most 32 output channels transposed, Cout on the wgmma's columns, taps of 32 input channels side by side on
    its rows: 4 on 8 warps for 27 taps (28 slots), 2 on 4 warps for 9 (10 slots, where 4 would take 12); its split,
    box and ring the chosen tile's (the timed rules' choice: the heuristic now takes the twin, swapped_wgrad_tiles).
    None for 33+ output channels or off the persistent kernel."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {shape.name: shape.geometry() for shape in load_shape_set("bench")}
    for name, (warps, group, fill) in {"unet_32": (8, 4, 27 / 28), "unet_aniso": (4, 2, 9 / 10)}.items():
        geom = shapes[name]
        chosen = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90, timed_only=True)
        twin = configs.swapped_wgrad_twin(chosen, geom)
        assert (twin.mma_tile, twin.num_warps, twin.tap_group, twin.swap_ab) == ((16 * warps, 32), warps, group, 1)
        kept = ("split_k", "block_k", "num_stages", "tma_box_w")
        assert [getattr(twin, f) for f in kept] == [getattr(chosen, f) for f in kept]
        assert configs.mma_fill("wgrad", geom, chosen) == 0.5
        assert configs.mma_fill("wgrad", geom, twin) == pytest.approx(fill)
        assert configs.swapped_wgrad_twin(dataclasses.replace(chosen, gluon=1), geom) is None
    wide = shapes["wan_dec_96"]
    assert configs.swapped_wgrad_twin(configs.heuristic_config("wgrad", wide, torch.bfloat16, 132, 90), wide) is None
    space = configs.candidates("wgrad", shapes["unet_32"], torch.bfloat16, 227 * 1024, tma=True, gluon=True)
    assert any(c.swap_ab for c in space)
    # 7 doublings from the default, where the 24 nearest stop: the tuner times the default's own twins first
    default = configs.heuristic_config("wgrad", shapes["unet_32"], torch.bfloat16, 132, 90, timed_only=True)
    twins = configs.own_twins("wgrad", shapes["unet_32"], default, torch.bfloat16, 227 * 1024)
    assert twins == [configs.swapped_wgrad_twin(default, shapes["unet_32"])]
    assert twins[0] not in tuner.nearest_candidates(space, default, tuner.CANDIDATES_PER_KEY)
    timed = tuner.nearest_candidates(space, default, tuner.CANDIDATES_PER_KEY, twins)
    assert timed[0] == twins[0] and len(timed) == tuner.CANDIDATES_PER_KEY


def test_heuristic_transposes_weight_gradients_of_few_output_channels(monkeypatch):
    """sm_90's heuristic computes a Gluon weight gradient of at most 32 output channels transposed
    (configs.swapped_wgrad_tiles; not with timed_only): MONAI UNet's 16-channel layers 4 taps of 16 input channels
    on one warpgroup's rows (fill 16/64 -> 27/28), unet_32's 4 of 32 on two; the split refitted to the tap groups,
    one round of units over the SMs (configs.persistent_wgrad_split; the twin's kept split, sized for one tap's
    tiles, leaves unet_32 3.5 rounds). 33+ output channels, and a transposed config's grouped twin: untouched."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)
    shapes = {s.name: s.geometry() for name in ("bench", "unets") for s in load_shape_set(name)}
    for name, (per_tap, warps) in {"unet_16": (16, 4), "unet_down_16": (16, 4), "unet_32": (32, 8)}.items():
        geom = shapes[name]
        plain = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90, timed_only=True)
        chosen = configs.heuristic_config("wgrad", geom, torch.bfloat16, 132, 90)
        assert (plain.swap_ab, chosen.swap_ab, chosen.gluon) == (0, 1, 2), name
        assert (chosen.block_n, chosen.tap_group, chosen.num_warps) == (4 * per_tap, 4, warps), name
        assert configs.mma_fill("wgrad", geom, plain) <= 0.5
        assert configs.mma_fill("wgrad", geom, chosen) == pytest.approx(27 / 28)
        per_sm = conv_gluon.programs_an_sm(chosen, 2, weight_grad=True)
        patches = wgrad_tma_patches(geom, chosen)
        units = 7 * cdiv(patches, split_rows(patches, chosen.split_k, 1))  # 7 tap groups, one channel block each
        assert units <= per_sm * 132, (name, units)  # one round of units, each a larger share of its tile
        kept = configs.swapped_wgrad_twin(plain, geom)
        kept_rounds = 7 * cdiv(patches, split_rows(patches, kept.split_k, 1)) / (per_sm * 132)
        assert kept_rounds > 2, name  # what the refit is for: 2 to 3.5 rounds of units a seventh as long
        assert configs.grouped_taps_twin(chosen, "wgrad") is None
        # the tuner times its unswapped one-tap tile first (configs.own_twins): 7 doublings from it otherwise
        unswapped = configs.own_twins("wgrad", geom, chosen, torch.bfloat16, 227 * 1024)
        assert [(c.block_m, c.block_n, c.swap_ab, c.tap_group, c.gluon) for c in unswapped] == [(64, per_tap, 0, 0, 2)]
        # off the Gluon kernel (TCONV3D_KERNELS=tma, a Triton without it): one tap's columns on 64 rows, one warpgroup
        tma = choice.force_variant("wgrad", geom, torch.bfloat16, chosen, "tma")
        assert (tma.block_m, tma.block_n, tma.num_warps, tma.swap_ab, tma.tap_group, tma.gluon) == (
            64, per_tap, 4, 0, 0, 0
        ), name  # fmt: skip
        assert configs.gluon_takes(tma) and tma.tma_box_w
    wide = shapes["unet_64"]
    assert configs.heuristic_config("wgrad", wide, torch.bfloat16, 132, 90).swap_ab == 0
    # a weight gradient reading channels_after (BasicUNet's decoder conv of [upsampled, skip], 32 + 32 -> 32): the
    # tiles of a plain one of its wider source, one launch a source; the timed rules kept the pointer kernel
    skip = conv_geometry((1, 32, 64, 64, 64), (32, 64, 3, 3, 3), 1, 1, 1, after_channels=32)
    source = conv_geometry((1, 32, 64, 64, 64), (32, 32, 3, 3, 3), 1, 1, 1)
    assert configs.heuristic_config("wgrad", skip, torch.bfloat16, 132, 90) == (
        configs.heuristic_config("wgrad", source, torch.bfloat16, 132, 90)
    )  # fmt: skip
    assert configs.heuristic_config("wgrad", skip, torch.bfloat16, 132, 90).swap_ab == 1
    assert configs.heuristic_config("wgrad", skip, torch.bfloat16, 132, 90, timed_only=True).variant == "pointer"


def test_channel_taps_twin_fills_the_columns_with_whole_channel_blocks():
    """Wan's 96 input channels in 128 columns: the twin makes them 4 taps of 32 (tap_group 4), fill 0.5625 -> 0.72
    (96/128 rows x 27/28 tap slots); none where the channels divide the columns (384), a half tile takes the last
    block (192), the tile is no warp-specialized Gluon one, or the channels' blocks would be narrower than 32."""
    tiles = KernelConfig(128, 128, 64, 8, 7, split_k=22, tma_box_w=16, gluon=2)
    wan_96 = geometry(cin=96, cout=96)
    twin = configs.channel_taps_twin(tiles, wan_96, "wgrad")
    assert twin == dataclasses.replace(tiles, tap_group=4) and configs.gluon_takes(twin)
    assert configs.mma_fill("wgrad", wan_96, tiles) == 0.5625
    assert configs.mma_fill("wgrad", wan_96, twin) == pytest.approx(0.75 * 27 / 28)
    assert configs.channel_taps_twin(dataclasses.replace(tiles, block_n=64), geometry(cin=96), "wgrad") == (
        dataclasses.replace(tiles, block_n=64, tap_group=2)
    )
    for geom, config, direction in (
        (geometry(cin=384, cout=384), tiles, "wgrad"),
        (geometry(cin=192, cout=192), tiles, "wgrad"),
        (wan_96, dataclasses.replace(tiles, gluon=1), "wgrad"),
        (wan_96, tiles, "fwd"),
        (geometry(cin=48), tiles, "wgrad"),
    ):
        assert configs.channel_taps_twin(config, geom, direction) is None, (geom.in_channels, config, direction)
    assert twin in configs.own_twins("wgrad", wan_96, tiles, torch.bfloat16, 227 * 1024)


def test_mma_fill_counts_the_tiles_work_over_the_real_work():
    """The share of a launch's MMA work that is the convolution's (configs.mma_fill), against hand counts: tiles that
    divide the problem; 8 output channels in 16 columns; a box kernel's 4 x 16 patches over a 6 x 20 output; an
    8-channel weight gradient packed ((tap, channel) pairs: 216 of 256 columns) and on the TMA kernel (8 of 128
    columns a tap: the launch the sm_90 heuristic used to pick); 24 channels in 16-deep steps; grouped taps, 27 in 14
    pairs; a direct kernel, None. A forward of 8 output channels with its W taps as columns: 24 of 32 columns, rows
    past a tile's outputs."""
    assert configs.mma_fill("fwd", geometry(), KernelConfig(128, 64, 64, 4, 3)) == 1.0
    assert configs.mma_fill("fwd", geometry(cout=8, kernel=(3, 3, 1)), KernelConfig(128, 16, 64, 4, 3)) == 0.5
    # with 3 W taps, the columns are (output channel, W tap) pairs, 24 of 32, over rows of 16 + 2: 19 tiles of 128
    # rows write 126 each, 2048 outputs in all
    w_taps = KernelConfig(128, 32, 64, 4, 3)
    assert configs.mma_fill("fwd", geometry(cout=8), w_taps) == pytest.approx(2048 / (19 * 128) * 24 / 32)
    patch = KernelConfig(64, 64, 64, 4, 3, tma_box_w=16)
    assert configs.mma_fill("fwd", geometry(size=(2, 6, 20)), patch) == pytest.approx(6 / 8 * 20 / 32)
    stack_in8 = geometry(cin=8, size=(8, 32, 32))
    packed = KernelConfig(64, 128, 16, 8, 3, split_k=4)
    assert configs.mma_fill("wgrad", stack_in8, packed) == pytest.approx(216 / 256)
    assert configs.mma_fill("wgrad", stack_in8, dataclasses.replace(packed, tma_box_w=16)) == pytest.approx(8 / 128)
    assert configs.mma_fill("dgrad", geometry(cout=24), KernelConfig(128, 64, 16, 4, 3)) == pytest.approx(24 / 32)
    grouped = KernelConfig(128, 256, 64, 8, 3, split_k=4, tma_box_w=16, gluon=2, tap_group=2)
    assert configs.mma_fill("wgrad", geometry(cin=128, cout=128), grouped) == pytest.approx(27 / 28)
    assert configs.mma_fill("fwd", geometry(), KernelConfig(64, 64, 1, 4, 1, direct=1)) is None
    # 192 channels in 128-column blocks: 128 + 128 on the pointer kernel, 128 + 64 on the Gluon kernel's half tail
    # (16 x 16 patches over a 16 x 16 output); 96 in 64-column blocks: not at 16 bits, where 32 columns are narrower
    # than a 128-byte swizzle row, nor swapped (32 rows are no warpgroup's); unswapped in fp32, whose 32 are 128 bytes
    wide = geometry(cin=192, cout=192)
    gluon = KernelConfig(256, 128, 64, 8, 3, tma_box_w=16, gluon=2, swap_ab=1)
    for direction in ("fwd", "dgrad"):
        assert configs.mma_fill(direction, wide, dataclasses.replace(gluon, gluon=0, swap_ab=0)) == 0.75
        assert configs.mma_fill(direction, wide, gluon) == 1.0
    assert configs.mma_fill("fwd", geometry(cout=96), dataclasses.replace(gluon, block_n=64)) == 0.75
    assert configs.mma_fill("fwd", geometry(cout=96), dataclasses.replace(gluon, block_n=64, swap_ab=0), 4) == 1.0
    # the weight gradient's 128 x 128 tiles over 192 x 192: rows and columns both 128 + 64 (wgrad_half_tails), not
    # 128 + 128 each (0.75 x 0.75), on the warp-specialized kernel only
    tiles = KernelConfig(128, 128, 64, 8, 3, split_k=2, tma_box_w=16, gluon=2)
    assert configs.mma_fill("wgrad", wide, tiles) == 1.0
    assert configs.mma_fill("wgrad", wide, dataclasses.replace(tiles, gluon=1)) == 0.5625
    assert configs.mma_fill("wgrad", geometry(cin=192, cout=96), tiles) == pytest.approx(0.75)  # 96 rows: no half


def test_operand_intensity_counts_each_tiles_rows_and_columns():
    """FLOPs a byte of the operands the tiles read (the L2 model of bench/NOTES.md, "What 64 columns cost"), against
    hand counts: a tile of R rows and C columns reads (R + C) elements a reduction row for 2RC FLOPs; a narrow
    layer's 16-column tile reads all 64 input channels of a row for 8 outputs; the weight gradient's grouped taps
    read grad_output once for two taps; a stride-2 input gradient's fewer live taps shorten both sides alike; a forward
    with its W taps as columns reads its rows once for the three."""
    tile = KernelConfig(128, 64, 64, 4, 3)
    assert configs.operand_intensity("fwd", geometry(), tile, 2) == pytest.approx(2 * 128 * 64 / (2 * (128 + 64)))
    assert configs.operand_intensity("fwd", geometry(), tile, 4) == pytest.approx(128 * 64 / (2 * (128 + 64)))
    strided = geometry(size=(8, 16, 16), stride=2)
    assert configs.operand_intensity("dgrad", strided, tile, 2) == pytest.approx(42.667, rel=1e-3)
    narrow = KernelConfig(128, 16, 64, 4, 3)
    # 8 output channels: every row tile reads its 128 rows and the 8 columns, for 2 x 128 x 8 FLOPs a reduction row
    one_w_tap = geometry(cout=8, kernel=(3, 3, 1))
    assert configs.operand_intensity("fwd", one_w_tap, narrow, 2) == pytest.approx(2 * 128 * 8 / (2 * 136))
    # with 3 W taps as columns: 19 tiles of 128 rows (126 outputs each) and the 24 (channel, W tap) columns, for
    # 2 x 2048 x 24 FLOPs a (kd, kh, input channel)
    w_taps = KernelConfig(128, 32, 64, 4, 3)
    expected = 2 * 2048 * 24 / (2 * (19 * 128 + 24 * 19))
    assert configs.operand_intensity("fwd", geometry(cout=8), w_taps, 2) == pytest.approx(expected)
    wide = geometry(cin=128, cout=128)
    plain = KernelConfig(128, 128, 64, 8, 3, split_k=4, tma_box_w=16, gluon=2)
    grouped = KernelConfig(128, 256, 64, 8, 3, split_k=4, tma_box_w=16, gluon=2, tap_group=2)
    assert configs.operand_intensity("wgrad", wide, plain, 2) == pytest.approx(64.0)
    # 27 taps in 14 groups: grad_output's 128 rows read 14 times, the input's 128 columns 27 times
    assert configs.operand_intensity("wgrad", wide, grouped, 2) == pytest.approx(128 * 27 / (14 + 27))
    assert configs.operand_intensity("fwd", geometry(), KernelConfig(64, 64, 1, 4, 1, direct=1), 2) is None


def test_the_grouped_taps_twin_of_a_deep_ring_takes_the_stages_that_fit():
    """The weight gradient's 128 x 128 tiles at 7 stages (the heuristic's for wan_dec_192 on the H200) grouped to
    256 columns: twice the operand bytes a stage, so as deep as fits an sm_90 block (4), where the twin at 7 was
    too large, dropped by the tuner and failing plan2's precompile in bench.variants' row; never deeper than the
    tiles'."""
    from tconv3d.inspect.compile import ARCHS

    smem = ARCHS[90].smem_per_block
    deep = KernelConfig(128, 128, 64, 8, 7, group_m=8, split_k=6, tma_box_w=16, gluon=2)
    assert conv_gluon.persistent_shared_bytes(configs.grouped_taps_twin(deep, "wgrad"), 2, True) > smem
    twin = configs.grouped_taps_twin(deep, "wgrad", 2, smem)
    assert (twin.block_n, twin.tap_group, twin.num_stages, twin.split_k) == (256, 2, 4, 6)
    assert conv_gluon.persistent_shared_bytes(twin, 2, True) <= smem
    assert conv_gluon.persistent_shared_bytes(dataclasses.replace(twin, num_stages=5), 2, True) > smem
    shallow = dataclasses.replace(deep, num_stages=3)
    assert configs.grouped_taps_twin(shallow, "wgrad", 2, smem).num_stages == 3
    geom = geometry(cin=192, cout=192)
    assert twin in configs.own_twins("wgrad", geom, deep, torch.bfloat16, smem)


def test_a_bordered_input_gradient_fits_its_float32_epilogue(monkeypatch):
    """A 16-bit input gradient of a layer bordered by replicate is written in float32 before its fold
    (config.destination_dtype), so the persistent Gluon kernel's epilogue tile is twice as wide: the choice
    (configs.fit_destination) shortens its ring to fit the SM (HunyuanVideo's 128-channel decoder layer: the
    heuristic's 256 x 128 three-stage tile needs 273 KB with it, 2 stages 225 KB of the 228), keeps the programs an SM
    a one-warpgroup tile had where a shorter ring allows, else runs one program on the deepest ring that fits, and
    offers the tuner only twins that fit. The zeros-padded layer and fp32 keep their tiles."""
    monkeypatch.setattr(conv_gluon, "UNAVAILABLE", None)  # the rules as on triton 3.6, whatever runs here
    smem = conv_gluon.SM_SHARED_BYTES
    shape, weight = (1, 128, 17, 256, 256), (128, 128, 3, 3, 3)
    bordered = conv_geometry(shape, weight, 1, (2, 0, 1, 1, 1, 1), 1, padding_mode="replicate")
    plain = conv_geometry(shape, weight, 1, (2, 0, 1, 1, 1, 1), 1)
    heuristic = configs.heuristic_config("dgrad", bordered, torch.bfloat16, 132, 90)
    assert heuristic.gluon == 2 and conv_gluon.persistent_shared_bytes(heuristic, 2, False, 4) > smem
    for device_name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        chosen, _ = choice.choose("dgrad", bordered, torch.bfloat16, device_name, 132, 90)
        assert chosen.gluon == 2 and conv_gluon.persistent_shared_bytes(chosen, 2, False, 4) <= smem
        assert dataclasses.replace(chosen, num_stages=heuristic.num_stages) == heuristic
        forced = choice.force_variant("dgrad", bordered, torch.bfloat16, heuristic, "gluon", True)
        assert conv_gluon.persistent_shared_bytes(forced, 2, False, 4) <= smem
    assert configs.fit_destination("dgrad", plain, torch.bfloat16, heuristic) == heuristic
    assert configs.fit_destination("fwd", bordered, torch.bfloat16, heuristic) == heuristic
    wide = configs.heuristic_config("dgrad", bordered, torch.float32, 132, 90)
    assert configs.fit_destination("dgrad", bordered, torch.float32, wide) == wide
    # one warpgroup, two programs an SM: 128 x 64 at 4 stages fills the SM with two bf16 tiles; with float32 ones
    # two programs still fit at 3 stages
    kept = configs.with_gluon(KernelConfig(128, 64, 64, 4, 4), bordered, "dgrad", specialized=True)
    assert conv_gluon.resident_programs(kept, 2, False) == 2 and conv_gluon.resident_programs(kept, 2, False, 4) == 1
    shorter = configs.fit_destination("dgrad", bordered, torch.bfloat16, kept)
    assert (shorter.num_stages, conv_gluon.resident_programs(shorter, 2, False, 4)) == (3, 2)
    # 128 x 128 at 2 stages, two bf16 tiles: a float32 tile leaves room for one program, on a ring of 5
    pair = configs.with_gluon(KernelConfig(128, 128, 64, 4, 2), bordered, "dgrad", specialized=True)
    assert conv_gluon.resident_programs(pair, 2, False) == 2
    fitted = configs.fit_destination("dgrad", bordered, torch.bfloat16, pair)
    assert (fitted.num_stages, conv_gluon.resident_programs(fitted, 2, False, 4)) == (5, 1)
    # a tile no ring fits (256 x 256 x 64: a 256 KB float32 tile): the TMA kernel on its tiles
    huge = configs.with_gluon(KernelConfig(256, 256, 64, 8, 2), bordered, "dgrad", specialized=True)
    assert configs.fit_destination("dgrad", bordered, torch.bfloat16, huge).variant == "tma"
    found = candidates("dgrad", bordered, torch.bfloat16, smem, tma=True, gluon=True)
    persistent = [c for c in found if c.gluon == 2]
    assert persistent and all(conv_gluon.persistent_shared_bytes(c, 2, False, 4) <= smem for c in persistent)
    assert len(persistent) < len(
        [c for c in candidates("dgrad", plain, torch.bfloat16, smem, True, True) if c.gluon == 2]
    )


def test_a_split_tile_counts_its_float32_partials_whatever_the_destination():
    """persistent_shared_bytes: split-K writes fp32 partial sums, so a split tile's epilogue counts 4 bytes an
    element even where the destination is given as 16-bit (candidates pass destination_dtype's size for every
    twin); an unsplit one counts the destination's."""
    tile = KernelConfig(128, 128, 64, 4, 3, gluon=2, tma_box_w=16)
    split = dataclasses.replace(tile, split_k=2)
    ring = 3 * 256 * 64 * 2 + 1024
    assert conv_gluon.persistent_shared_bytes(split, 2, False, 2) == ring + 128 * 128 * 4
    assert conv_gluon.persistent_shared_bytes(tile, 2, False, 2) == ring + 128 * 128 * 2
    assert conv_gluon.persistent_shared_bytes(tile, 2, False, 4) == ring + 128 * 128 * 4
    assert conv_gluon.persistent_shared_bytes(tile, 2, False) == ring + 128 * 128 * 2
