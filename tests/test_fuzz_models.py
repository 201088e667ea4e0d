"""tests/fuzz_models.py in CI: a few drawn cases of whole converted models against stock (inputs the real-model
tests' fixed shapes never take), and the proof that the fuzzer fails where a converted model is wrong."""

import random

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("monai")

from fuzz_models import Models, check, draw

CASES = [  # sizes that halve to odd, clips that are not whole chunks, a tiled decode, a training step
    {"model": "wan", "shape": [1, 3, 6, 24, 40], "mode": "eval", "tiling": False},
    {"model": "cogvideox", "shape": [2, 3, 5, 16, 24], "mode": "eval", "tiling": True},
    {"model": "ltx_video", "shape": [2, 3, 9, 24, 16], "mode": "train", "tiling": False},
    {"model": "monai_basic_unet", "shape": [1, 1, 18, 25, 33], "mode": "train", "tiling": False},
]


@pytest.fixture(scope="module")
def models():
    return Models()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case["model"])
def test_drawn_models_match_stock(case, models, aten_path):
    assert check(case, models, seed=0) is None  # not "skipped": stock takes each of these


def test_draws_are_seeded_and_cover_both_modes():
    names = ["wan", "monai_unet"]
    draws = [draw(random.Random(seed), names) for seed in range(40)]
    assert draws == [draw(random.Random(seed), names) for seed in range(40)]
    assert {d["mode"] for d in draws} == {"eval", "train"} and {d["model"] for d in draws} == set(names)
    assert any(d["tiling"] for d in draws if d["model"] == "wan")


def test_a_wrong_model_fails(models, aten_path):
    """A converted UNet whose first block answers 1e-3 off fails, and fails again on other inputs."""
    case = {"model": "monai_unet", "shape": [1, 1, 16, 12, 20], "mode": "eval", "tiling": False}
    _, converted = models("monai_unet")
    handle = converted.model[0].register_forward_hook(lambda module, args, out: out * (1 + 1e-3))
    try:
        problem = check(case, models, seed=0)
    finally:
        handle.remove()
    assert problem is not None and not problem.startswith("once") and problem.startswith("output")
    assert check(case, models, seed=0) is None
