"""tests/fuzz.py in CI: seeded random problems through tconv3d.conv3d and conv_transpose3d against float64, and
the proof that the fuzzer fails where a direction's result is wrong."""

import dataclasses
import json

import fuzz
import pytest
import torch
from fuzz import DEVICE, KERNELS, MODES, SCALES, Problem, check, draw, halo_shaped

import tconv3d
from tconv3d.geometry import conv_geometry
from tconv3d.kernels import conv_gluon
from tconv3d.tune import choice, configs

KERNELS_HERE = KERNELS if conv_gluon.UNAVAILABLE is None else tuple(k for k in KERNELS if k != "gluon")
SCALE = SCALES["large" if DEVICE == "cuda" else "small"]
# Seeds 0-39 drew, on CPU, every variant forced in every direction, transposed and grouped problems, every padding
# mode and cached frames; a seed added here is one a fuzzing run found failing.
SEEDS = range(40)
# The interpreter's int32 overflow checks, off elsewhere for speed (tests/conftest.py), stay on for the random problems.
pytestmark = pytest.mark.overflow_checks


@pytest.mark.parametrize("seed", SEEDS)
def test_random_problem_matches_float64(seed):
    check(draw(seed, KERNELS_HERE, SCALE))


def test_draws_cover_what_the_suite_does_not_name():
    """The seeds above draw transposed, grouped, depthwise, cached-frame, channels-after, non-zeros-padded, strided,
    second-order, forward-mode (tangent), vmapped and empty-batch problems, and every variant; a change to draw()
    that lost one would leave it unfuzzed in CI."""
    problems = [draw(seed, KERNELS_HERE, SCALE) for seed in SEEDS]
    drawn = {
        "transpose": any(p.transpose for p in problems),
        "output_padding": any(p.transpose and any(p.output_padding) for p in problems),
        "grouped": any(1 < p.groups < p.cin for p in problems),
        "depthwise": any(p.groups == p.cin > 1 for p in problems),
        "frames": any(p.frames for p in problems),
        "channels_after": any(p.after for p in problems),
        "grouped_channels_after": any(p.after and p.groups > 1 for p in problems),
        "modes": {m for p in problems for m in p.modes} == {"zeros", "replicate", "reflect", "circular"},
        "strided": any(max(p.stride) > 1 for p in problems),
        "dilated": any(max(p.dilation) > 1 for p in problems),
        "unbatched": any(p.batch == 0 and not p.empty for p in problems),
        "empty_batch": any(p.empty for p in problems),
        "second_order": any(p.second_order for p in problems),
        "second_order_transpose": any(p.second_order and p.transpose for p in problems),
        "tangent": any(p.tangent and not p.transpose for p in problems),
        "tangent_transpose": any(p.tangent and p.transpose for p in problems),
        "vmapped": any(p.vmapped and not p.transpose and (p.frames or p.after) for p in problems),
        "vmapped_transpose": any(p.vmapped and p.transpose for p in problems),
        "view": any(p.layout == "view" for p in problems),
        "kernels": {p.kernels for p in problems} == set(KERNELS_HERE),
        "dtypes": {p.dtype for p in problems} == {"fp32", "bf16", "fp16"},
    }
    assert all(drawn.values()), {name: seen for name, seen in drawn.items() if not seen}
    for p in problems:
        assert min(p.out_size()) >= 1 and p.macs() <= SCALE.max_macs


# `--focus halo`'s first draws on CPU: halo tiles in both directions, unswapped and swapped (the tuner's own_twins,
# which the seeds above reach a few times in a thousand launches). A run of the focus found nothing (run 70); a halo
# step reading one frame for both of its tile's fails 41 of its first 57 draws.
HALO_SEEDS = {0: {("fwd", 0), ("dgrad", 0)}, 2: {("fwd", 1), ("dgrad", 0)}, 11: {("fwd", 0), ("dgrad", 1)}}


@pytest.mark.skipif(conv_gluon.UNAVAILABLE is not None, reason=f"Gluon: {conv_gluon.UNAVAILABLE}")
@pytest.mark.parametrize("seed", HALO_SEEDS)
def test_halo_draws_match_float64(seed):
    problem = draw(seed, KERNELS_HERE, SCALE, focus="halo")
    assert problem.halo and problem.kernels == "gluon" and halo_shaped(problem)
    launched = check(problem)["launched"]
    halo = {(direction, swap) for direction, variant, *_, halo_d, group, swap in launched if halo_d}
    assert halo, launched  # a halo-shaped problem's forward takes halo tiles wherever it runs Gluon
    if DEVICE == "cpu":  # the seeds' draws at the small scale: (direction, swapped), both directions, each swapped once
        assert halo == HALO_SEEDS[seed], launched


def test_halo_focus_draws_only_what_halo_tiles_take():
    """`--focus halo` draws Gluon problems of every kind the halo tiles take (transposed, second-order, both 16-bit
    dtypes, borders in H and W that read input voxels: the ring beside the halo tiles' interior, fuzz run 109's
    failure), none they do not; the plain draws offer halo tiles half the time, as before."""
    problems = [draw(seed, KERNELS_HERE, SCALE, focus="halo") for seed in range(60)]
    assert all(p.halo and p.kernels == "gluon" and halo_shaped(p) for p in problems)
    assert {p.dtype for p in problems} == {"bf16", "fp16"}
    assert any(p.transpose for p in problems) and any(p.second_order for p in problems)
    assert {m for p in problems for m in p.modes[1:]} == set(MODES)
    assert not any(draw(seed, KERNELS_HERE, SCALE).halo for seed in SEEDS)


def test_heuristic_draws_take_the_tuners_own_twins(monkeypatch):
    """A Gluon draw on the heuristic's tiles takes, half the time, one of the twins the tuner times beside them
    (configs.own_twins): over seeds, unet_64's forward reaches its halo tiles, deep and swapped, and a 96-channel
    weight gradient its taps of 32 channels (channel_taps_twin), none of which the hand-made steps draw."""
    monkeypatch.setattr(choice, "_gluon_runs", lambda device: True)  # as under the emulator, or on an H100
    unet_64 = conv_geometry((2, 64, 64, 64, 64), (64, 64, 3, 3, 3), 1, 1, 1)
    wan_96 = conv_geometry((1, 96, 5, 32, 32), (96, 96, 3, 3, 3), 1, 1, 1)
    found = {}
    for direction, geom in (("fwd", unet_64), ("wgrad", wan_96)):
        h100 = configs.heuristic_config(direction, geom, torch.bfloat16, 132, configs.GLUON_CAPABILITY)
        twins = configs.own_twins(direction, geom, h100, torch.bfloat16, 232448)
        chosen = set()
        for seed in range(40):
            problem = dataclasses.replace(draw(seed, ("gluon",), SCALE), tiling="heuristic", halo=False)
            chosen.add(fuzz._select(problem)(direction, geom, torch.bfloat16, torch.device(DEVICE), None))
        found[direction] = chosen & set(twins)
        assert len(found[direction]) >= len(twins) - 1, (direction, twins, chosen)
    halo = [c for c in found["fwd"] if c.halo_d]
    assert any(c.swap_ab for c in halo) and any(c.block_k == 32 for c in halo), halo
    assert any(c.tap_group and c.block_n < 256 for c in found["wgrad"]), found["wgrad"]


def test_replay_line_round_trips():
    """A failure's printed line gives the problem back; a line from before the transposed and second-order fields
    still loads."""
    problem = draw(7, KERNELS_HERE, SCALE)
    line = json.dumps({"failure": "wrong", "problem": json.loads(problem.to_json()), "error": "..."})
    assert Problem.from_json(line) == problem
    old = json.loads(problem.to_json())
    del old["transpose"], old["output_padding"], old["second_order"]
    assert Problem.from_json(json.dumps(old)).transpose is False


# Fuzz run 34's first kind of failure: a second-order problem of an empty batch. torch's float64 double backward
# leaves the weight unreached (its .grad None), tconv3d's gives it zeros: the check takes exact zeros as that None.
EMPTY_SECOND_ORDER = {
    "seed": 643,
    "dtype": "bf16",
    "batch": 0,
    "cin": 27,
    "cout": 12,
    "groups": 3,
    "size": [4, 1, 8],
    "frames": 0,
    "kernel": [2, 1, 2],
    "stride": [1, 2, 1],
    "dilation": [2, 1, 1],
    "padding": [3, 1, 0, 0, 1, 0],
    "modes": ["replicate", "replicate", "replicate"],
    "bias": True,
    "layout": "cl",
    "weight_cl": False,
    "tiling": "default",
    "kernels": "auto",
    "transpose": False,
    "output_padding": [0, 0, 0],
    "second_order": True,
    "after": 0,
    "empty": True,
}


def test_an_empty_batch_has_zero_second_order_gradients():
    result = check(Problem.from_json(json.dumps(EMPTY_SECOND_ORDER)))
    assert result["errors"]["grad2_weight"] == 0.0


@pytest.mark.parametrize(
    ("direction", "caught"),
    [("fwd", "output"), ("dgrad", "grad_input"), ("wgrad", "grad_weight")],
)
def test_a_wrong_direction_fails(direction, caught, monkeypatch):
    """The fuzzer must be able to fail: one direction's result nudged by 5% of its norm is reported, named."""
    launch = choice.launch

    def nudged(launched_direction, *args, **kwargs):
        result = launch(launched_direction, *args, **kwargs)
        if launched_direction == direction:
            result = result + 0.05 * result.norm() / result.numel() ** 0.5 * torch.randn_like(result)
        return result

    monkeypatch.setattr(choice, "launch", nudged)
    problems = (draw(seed, ("pointer",), SCALE) for seed in range(1000))
    problem = next(p for p in problems if not p.transpose and not p.second_order and p.dtype == "fp32")
    with pytest.raises(AssertionError, match=caught):
        check(problem)


def test_a_wrong_tangent_fails(monkeypatch):
    """A forward-mode problem's tangent is checked: with the convolution's jvp summing only its first term (the
    input side's tangent, the weight's dropped), the fuzzer reports the tangent, named."""
    monkeypatch.setattr(tconv3d.ops, "_summed", lambda terms: next(t for t in terms if t is not None))
    problems = (draw(seed, ("pointer",), SCALE) for seed in range(1000))
    problem = next(p for p in problems if p.tangent and not p.transpose and not p.empty and p.dtype == "fp32")
    with pytest.raises(AssertionError, match="tangent"):
        check(problem)


def test_a_wrong_vmap_fails(monkeypatch):
    """A vmapped problem's results under vmap are checked: with the vmap rule's samples split back in the wrong
    order, the fuzzer reports the vmapped output, named."""
    unfolded = tconv3d.ops._unfolded
    monkeypatch.setattr(tconv3d.ops, "_unfolded", lambda t, size: unfolded(t, size).flip(0))
    problems = (draw(seed, ("pointer",), SCALE) for seed in range(1000))
    problem = next(p for p in problems if p.vmapped and p.batch == 2 and not p.transpose and p.dtype == "fp32")
    with pytest.raises(AssertionError, match="vmap_output"):
        check(problem)


# Fuzz run 62's one failure: fp32, one output channel, 120 output voxels. The bias gradient sums the output gradient,
# and that sum came out 415 times smaller than its terms' sizes: tconv3d's fp32 sum (2.3e-6 off, within rounding
# of the terms) was 1.0e-5 off the sum, over fp32's bound. The fuzzer measures the bias gradient against its terms.
CANCELLING_BIAS_SUM = {
    "seed": 62222, "dtype": "fp32", "batch": 2, "cin": 7, "cout": 1, "groups": 1, "size": [2, 8, 9], "frames": 0,
    "kernel": [3, 3, 1], "stride": [2, 1, 2], "dilation": [1, 1, 1], "padding": [0, 1, 3, 3, 0, 0],
    "modes": ["zeros", "zeros", "zeros"], "bias": True, "layout": "view", "weight_cl": True, "tiling": "default",
    "kernels": "auto", "transpose": False, "output_padding": [0, 0, 0], "second_order": False, "after": 0,
    "empty": False, "tangent": False, "vmapped": False,
}  # fmt: skip


@pytest.mark.parametrize("wrong", [False, True], ids=["as_it_is", "a_voxel_left_out"])
def test_a_bias_gradient_is_measured_against_its_terms(wrong, monkeypatch):
    """Run 62's cancelling sum passes; the same sum with one voxel's gradient left out fails, named."""
    problem = Problem.from_json(json.dumps(CANCELLING_BIAS_SUM))
    if wrong:
        for name in ("_bias_grad", "_summed_bias_grad"):
            summed = getattr(tconv3d.ops, name)
            monkeypatch.setattr(
                tconv3d.ops, name, lambda g, dtype, summed=summed: summed(g, dtype) - g[0, :, 0, 0, 0].to(dtype)
            )
        with pytest.raises(AssertionError, match="grad_bias"):
            check(problem)
    else:
        assert check(problem)["errors"]["grad_bias"] < 1e-6


# Fuzz run 68's one failure: fp16, a circular border along D over 3 cached frames and one input frame, second order.
# The input's frame gets two terms of its second-order gradient, one through the wrap, that cancel tenfold: tconv3d's
# 2.45e-3 over fp16's bound of 2e-3, and stock torch's (torch.cat + F.pad + F.conv3d in fp16) the same 2.45e-3. The
# fuzzer counts it ill-conditioned, apart from failures.
CANCELLING_CIRCULAR_WRAP = {
    "seed": 68299, "dtype": "fp16", "batch": 1, "cin": 9, "cout": 1, "groups": 1, "size": [1, 1, 8], "frames": 3,
    "kernel": [1, 1, 4], "stride": [2, 2, 2], "dilation": [1, 1, 2], "padding": [1, 1, 0, 0, 0, 0],
    "modes": ["circular", "reflect", "circular"], "bias": False, "layout": "cl", "weight_cl": False,
    "tiling": "candidate", "kernels": "auto", "transpose": False, "output_padding": [0, 0, 0], "second_order": True,
    "after": 0, "empty": False, "tangent": False, "vmapped": False,
}  # fmt: skip


@pytest.mark.skipif(DEVICE != "cpu", reason="run 68's inputs and roundings are the CPU's")
@pytest.mark.parametrize("fold", ["rounded_first", "rounded_first_one_percent_off", "float32"])
def test_an_ill_conditioned_problem_is_held_to_stock_torch(fold, monkeypatch):
    """Run 68's problem with its bordered input gradient rounded to 16 bits before the fold (as the kernels wrote it
    until the fifty-sixth session: config.destination_dtype patched to the operands' dtype): over the bound as far as
    stock torch is, it counts ill-conditioned; that fold 1% off, over it farther than stock, fails, named. As the
    kernels fold it now (the bordered buffer in float32), it is within the bound (1.9e-4 of 2e-3)."""
    from tconv3d.kernels import conv_dgrad

    problem = Problem.from_json(json.dumps(CANCELLING_CIRCULAR_WRAP))
    if fold != "float32":
        monkeypatch.setattr(conv_dgrad, "destination_dtype", lambda direction, geom, dtype: dtype)
    if fold == "rounded_first_one_percent_off":
        folded = conv_dgrad.fold_bordered
        monkeypatch.setattr(conv_dgrad, "fold_bordered", lambda *a, **k: folded(*a, **k) * 1.01)
        with pytest.raises(AssertionError, match="grad2_input"):
            check(problem)
    elif fold == "rounded_first":
        ours, stock = check(problem)["ill_conditioned"]["grad2_input"]
        assert 2e-3 < ours <= 1.5 * stock
    else:
        result = check(problem)
        assert "ill_conditioned" not in result and result["errors"]["grad2_input"] < 2e-3, result
