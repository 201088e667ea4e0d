"""tests/fuzz_args.py in CI: seeded calls of the public entries, good and bad, held to torch's own, and the proof
that the fuzzer fails each way it says it does."""

import fuzz_args
import pytest
import torch
from fuzz_args import ENTRIES, FAILURES, check, draw

# 400 seeds in four workers' shares (~2-6 s each here); a seed added to FOUND is one a fuzzing run found failing.
SEEDS = range(400)
# An empty W in a batch, padded: tconv3d answered zeros (4804) and a transposed conv's bias (3272). The grouped
# skip connection the fuzzer found (seed 12272 of its first draws) is test_groups' grouped_convs_of_a_skip_connection.
FOUND = (3272, 4804)


@pytest.mark.parametrize("share", range(4))
def test_seeded_calls_answer_as_torch_does(share):
    failures = []
    for seed in [s for s in SEEDS if s % 4 == share] + ([*FOUND] if share == 0 else []):
        outcome, detail = check(draw(seed))
        if outcome in FAILURES:
            failures.append((seed, outcome, detail))
    assert not failures, failures


def test_draws_reach_every_entry_and_most_mutations():
    """The seeds above call every entry, valid calls among them, with most kinds of mutation: a change to draw()
    that lost them would leave the arguments unfuzzed in CI."""
    calls = [draw(seed) for seed in SEEDS]
    assert {c["entry"] for c in calls} == set(ENTRIES)
    assert sum(not c["mutations"] for c in calls) >= 20
    kinds = {name for c in calls for name in c["mutations"]}
    every = set().union(*(fuzz_args._mutations(c) for c in calls if not c["mutations"]))
    assert len(kinds) >= 0.8 * len(every), sorted(every - kinds)


def _first(predicate, seeds=range(2000)):
    return next(call for call in map(draw, seeds) if predicate(call))


def test_a_wrong_answer_fails(monkeypatch):
    """The fuzzer must be able to fail: an output nudged by 5% of its norm is 'wrong'."""
    ours = fuzz_args.ours

    def nudged(call, t):
        out = ours(call, t)
        return out + 0.05 * out.norm() / out.numel() ** 0.5 * torch.randn_like(out)

    monkeypatch.setattr(fuzz_args, "ours", nudged)
    call = _first(lambda c: not c["mutations"] and c["dtype"] == "float32")
    outcome, detail = check(call)
    assert outcome == "wrong" and "output" in detail


def test_an_accepted_bad_call_fails(monkeypatch):
    """A call torch refuses and tconv3d answers is 'accepted': here a stride of 0 answered as stride 1."""
    ours = fuzz_args.ours

    def lenient(call, t):
        return ours({**call, "stride": 1}, t)

    monkeypatch.setattr(fuzz_args, "ours", lenient)
    call = _first(lambda c: c["mutations"] == ["stride_0"] and c["entry"] == "conv3d")
    assert check(call)[0] == "accepted"


def test_an_internal_error_fails(monkeypatch):
    """An exception other than a plain refusal is 'unclear', and so is a refusal with no message; a refusal of a
    call torch answers is a finding, not a failure."""
    call = _first(lambda c: not c["mutations"])

    def raising(error):
        def ours(call, t):
            raise error

        return ours

    monkeypatch.setattr(fuzz_args, "ours", raising(IndexError("tuple index out of range")))
    assert check(call)[0] == "unclear"
    monkeypatch.setattr(fuzz_args, "ours", raising(ValueError("")))
    assert check(call)[0] == "unclear"
    monkeypatch.setattr(fuzz_args, "ours", raising(ValueError("a refusal")))
    assert check(call)[0] == "refused" and "refused" not in FAILURES
