"""The tests of test_gluon_emulated.py that CI runs under Triton 3.6, 3.7 and 3.8 (TCONV3D_EMULATED_SUBSET=1;
conftest deselects the rest there): together they run every line of the Gluon kernels (conv_gluon.py) and of the
emulator that the whole file runs, and each test function's cheapest case.

Those sections check that the kernels and the emulator work with that Triton's Gluon, its operations' names and
signatures, which a run through any line calling an operation shows. What the whole file checks beyond that, the
kernels' results over every case, the emulator computes in torch whatever the Triton: the main suite (the newest
Triton, the README's command) runs all of it. On 2026-12-07 the 50 tests missed none of the file's 1,144 lines
under 3.6.0, 3.7.1, 3.8.0 and 3.9.0 and took 9% of its time (17-19 of 173-208 s, traced; bench/NOTES.md's
seventy-fifth section).

Check it, under the Triton to check (numpy < 2.4 for 3.6's interpreter; `pip install coverage`; ~4 minutes):

    python tests/emulated_subset.py            # the lines the whole file runs that SUBSET misses; exit 1 if any
    python tests/emulated_subset.py --suggest  # and a SUBSET that covers them, to paste below

A suggestion is a cover weighted by each test's time (the most new lines a second first), plus each test
function's cheapest case.
"""

import argparse
import collections
import sys
import time
from pathlib import Path

import pytest

SUBSET = (
    "test_emulated_gluon_border_modes_and_cached_frames_along_d[reflect-stride1-one_source-pipelined]",
    "test_emulated_gluon_border_modes_and_cached_frames_along_d[replicate-stride211-one_source-pipelined]",
    "test_emulated_gluon_channels_after[residual_1x1-warp_specialized]",
    "test_emulated_gluon_channels_after_weight_gradient_as_chosen[skip_32_16-32]",
    "test_emulated_gluon_decoder_weight_gradients_as_chosen[cached]",
    "test_emulated_gluon_forward_interior_with_border_modes_in_h_and_w[reflect_zeros-one_source-pipelined]",
    "test_emulated_gluon_forward_splits_its_interior_beside_the_border_ring[kernel0-padding0-zeros,reflect,reflect-warp_specialized]",
    "test_emulated_gluon_forward_splits_its_interior_beside_the_border_ring[kernel3-padding3-zeros,replicate,zeros-warp_specialized]",
    "test_emulated_gluon_forward_stores_unaligned_rows[cout5_stride2-pipelined-as_is]",
    "test_emulated_gluon_forward_stores_unaligned_rows[cout5_stride2-warp_specialized-swapped]",
    "test_emulated_gluon_fp32_as_tf32[cout3-pipelined-swapped]",
    "test_emulated_gluon_grouped_taps_match_float64[kernel_1x1x1_c8-4]",
    "test_emulated_gluon_half_tail[dgrad_128x128-warp_specialized]",
    "test_emulated_gluon_half_tail[dgrad_256x128_swapped-pipelined]",
    "test_emulated_gluon_half_tail[fwd_128x128_w4_swapped-pipelined]",
    "test_emulated_gluon_half_tail[wgrad_128x128_w4-pipelined]",
    "test_emulated_gluon_half_tail_in_tf32[swapped-dgrad]",
    "test_emulated_gluon_halo_input_gradient_reads_grad_outs_second_source",
    "test_emulated_gluon_halo_input_gradients_match_float64[d5_back]",
    "test_emulated_gluon_halo_tiles_match_float64[d4]",
    "test_emulated_gluon_kernels_in_fp16[stride2_c8-pipelined]",
    "test_emulated_gluon_kernels_match_float64[depth_1-warp_specialized]",
    "test_emulated_gluon_kernels_match_float64[kernel_1x1x1_c8-pipelined]",
    "test_emulated_gluon_kernels_match_float64[kernel_1x3x3_c8-pipelined]",
    "test_emulated_gluon_large_tiles[256x128x64-pipelined]",
    "test_emulated_gluon_split_k[3-dgrad-warp_specialized-swapped]",
    "test_emulated_gluon_split_reads_a_second_source[frames_before-3-pipelined]",
    "test_emulated_gluon_swapped_halo_tiles_match_float64[dgrad-1]",
    "test_emulated_gluon_swapped_halo_tiles_match_float64[fwd-1]",
    "test_emulated_gluon_swapped_operands_match_float64[kernel_1x1x1_c8-pipelined]",
    "test_emulated_gluon_swapped_operands_match_float64[kernel_1x1x1_c8-warp_specialized]",
    "test_emulated_gluon_swapped_operands_match_float64[kernel_3x1x1_c8-pipelined]",
    "test_emulated_gluon_swapped_operands_match_float64[stride_past_kernel-pipelined]",
    "test_emulated_gluon_swapped_weight_gradient_matches_float64[kernel_1x1x1_c8-4x32]",
    "test_emulated_gluon_tiles_skip_the_taps_along_d_in_the_padding[1-causal-pipelined-fwd]",
    "test_emulated_gluon_transposed_channels_after[kernel_2_stride_2-pipelined]",
    "test_emulated_half_tail_is_checked[fwd_128x128]",
    "test_emulated_halo_tiles_in_other_interleavings[1]",
    "test_emulated_halo_tiles_store_each_frame_where_it_belongs",
    "test_emulated_warp_specialized_interleavings[4]",
    "test_emulator_catches_a_halo_stage_released_early",
    "test_emulator_catches_a_wrong_coordinate",
    "test_emulator_catches_broken_kernels[box_never_loaded]",
    "test_emulator_catches_broken_kernels[box_never_loaded_specialized]",
    "test_emulator_catches_broken_kernels[next_stage_read]",
    "test_emulator_catches_broken_kernels[no_fence_before_tma_store]",
    "test_emulator_refuses_fp32_operands_that_are_not_k_major",
    "test_exact_fp32_keeps_the_forward_off_the_gluon_kernel",
    "test_fp32_input_gradient_needs_the_transposed_weight",
    "test_halo_splits_share_the_kh_kw_steps",
)

HERE = Path(__file__).resolve().parent
FILE = HERE / "test_gluon_emulated.py"
TRACED = {str(HERE.parent / "tconv3d" / "kernels" / "conv_gluon.py"), str(HERE / "gluon_emulator.py")}


class _Lines:
    """A pytest plugin: the lines of TRACED each test runs (its set-up and teardown included; coverage.py's
    tracer, threads too: the warp-specialized kernels' partitions run in threads), and its time."""

    def __init__(self):
        import coverage

        self.coverage = coverage.Coverage(data_file=None, include=sorted(TRACED), concurrency=["thread"])
        self.seconds = collections.defaultdict(float)

    def pytest_sessionstart(self, session):
        self.coverage.start()

    def pytest_sessionfinish(self, session):
        self.coverage.stop()

    def pytest_runtest_protocol(self, item, nextitem):
        self.coverage.switch_context(item.name)
        self.test, self.start = item.name, time.perf_counter()

    def pytest_runtest_logfinish(self, nodeid, location):
        self.seconds[self.test] += time.perf_counter() - self.start
        self.coverage.switch_context("")

    def lines(self) -> dict[str, set]:
        data, lines = self.coverage.get_data(), collections.defaultdict(set)
        for path in data.measured_files():
            for line, tests in data.contexts_by_lineno(path).items():
                for test in filter(None, tests):
                    lines[test].add((Path(path).name, line))
        return lines


def suggest(lines, seconds) -> list[str]:
    """A cover of every traced line, the most new lines a second first, and each function's cheapest test of
    those that ran a traced line (not one that skips before)."""
    left, chosen = set().union(*lines.values()), set()
    while left:
        best = max(lines, key=lambda t: len(lines[t] & left) / (seconds[t] + 0.05))
        chosen.add(best)
        left -= lines[best]
    functions = collections.defaultdict(list)
    for test in lines:
        functions[test.split("[")[0]].append(test)
    chosen |= {min(tests, key=seconds.get) for tests in functions.values()}
    return sorted(chosen)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suggest", action="store_true", help="print a SUBSET that covers every line")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (-k to try a part)")
    args = parser.parse_args(argv)
    plugin = _Lines()
    code = pytest.main(
        [str(FILE), *args.pytest_args, "-q", "-p", "no:cacheprovider", "-p", "no:xdist"], plugins=[plugin]
    )
    import triton  # after conftest has set TRITON_INTERPRET: triton imported before it would compile the kernels

    if code != 0:
        print(f"the file failed under triton {triton.__version__} (exit {code})")
        return 1
    lines = plugin.lines()
    unknown = set(SUBSET) - set(plugin.seconds)
    whole = set().union(*lines.values())
    ours = set().union(*(lines[t] for t in SUBSET if t in lines))
    missed = sorted(whole - ours)
    total, subset = sum(plugin.seconds.values()), sum(plugin.seconds.get(t, 0.0) for t in SUBSET)
    files = ", ".join(sorted(Path(path).name for path in TRACED))
    print(f"triton {triton.__version__}: the file runs {len(whole)} lines of {files} in {len(plugin.seconds)} tests,"
          f" {total:.0f} s traced; SUBSET's {len(SUBSET)} tests miss {len(missed)}, {subset:.1f} s")  # fmt: skip
    for name, line in missed:
        print(f"  missed {name}:{line}")
    for test in sorted(unknown):
        print(f"  not among the tests run (renamed? left out by -k?): {test}")
    if args.suggest:
        chosen = suggest(lines, plugin.seconds)
        print(f"a cover: {len(chosen)} tests, {sum(plugin.seconds[t] for t in chosen):.1f} s traced")
        print("SUBSET = (\n" + "".join(f'    "{t}",\n' for t in chosen) + ")")
    return 1 if missed or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
