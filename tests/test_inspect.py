"""python -m tconv3d.inspect's reading of a spill: where its local-memory accesses are, and what it says of a launch
that does not fit. The compiled kernels' own checks are tests/test_static_compile.py's."""

from tconv3d.inspect.__main__ import problems
from tconv3d.inspect.compile import _cubin_facts

USAGE = " Function _conv3d_wgrad_kernel:\n  REG:128 STACK:8 SHARED:0 LOCAL:0 CONSTANT[0]:552\n"


def _sass(*body: str) -> str:
    return "".join(f"        /*{0x100 + 16 * i:04x}*/                   {text} ;\n" for i, text in enumerate(body))


# The shape of the sm_80 fp32 weight gradient's SASS at MONAI's sub-pixel geometry (64x64x32, 4 warps, 2 stages):
# an index stored once before the main loop and read back around it.
OUTSIDE = _sass(
    "STL [R1], R0",
    "LDL R3, [R1]",
    "HMMA.1688.F32.TF32 R4, R36, R2, R4",
    "IADD3 R5, R5, 0x20, RZ",
    "@!P2 BRA 0x120",
    "LDL.LU R52, [R1]",
    "EXIT",
)
INSIDE = _sass(
    "STL [R1], R0",
    "LDL R3, [R1]",
    "HMMA.1688.F32.TF32 R4, R36, R2, R4",
    "STL [R1+0x4], R5",
    "@!P2 BRA 0x120",
    "EXIT",
)


def test_local_accesses_are_placed_in_or_outside_the_main_loop():
    outside, inside = _cubin_facts(USAGE, OUTSIDE), _cubin_facts(USAGE, INSIDE)
    assert (outside["spill_bytes"], outside["local_accesses"], outside["loop_local_accesses"]) == (8, 3, 0)
    assert (inside["local_accesses"], inside["loop_local_accesses"]) == (3, 1)
    assert _cubin_facts(USAGE, _sass("STL [R1], R0", "EXIT"))["loop_local_accesses"] is None  # no MMA loop


def _record(facts: dict, shared_bytes: int = 16384, arch: int = 80) -> dict:
    config = {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2, "split_k": 32}
    return {
        "case": "ldm_ae_up_40", "dtype": "fp32", "direction": "wgrad", "arch": arch, "config": config,
        "config_source": "heuristic", "compiled": True, "fits": False, "shared_bytes": shared_bytes,
        "spill_bytes": facts["spill_bytes"], "local_accesses": facts["local_accesses"],
        "loop_local_accesses": facts["loop_local_accesses"], "mma": "HMMA",
    }  # fmt: skip


def test_a_problem_says_where_the_spill_is_and_what_overflows():
    name = "ldm_ae_up_40 fp32 wgrad sm_80 64x64x32 w4 s2 k32"
    assert problems([_record(_cubin_facts(USAGE, OUTSIDE))]) == [
        f"{name}: spills 8 bytes a thread (3 local loads and stores, none in the main loop)"
    ]
    assert problems([_record(_cubin_facts(USAGE, INSIDE))]) == [
        f"{name}: spills 8 bytes a thread (3 local loads and stores, 1 of them in the main loop)"
    ]
    # A frame ptxas keeps for a 64-bit division's subroutine calls, nothing stored in it (a packed input gradient
    # of 36 -> 1 channels on sm_90, bench/results/odd_channels).
    called = _sass("CALL.REL.NOINC 0x180", "HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24", "@P0 BRA 0x110", "EXIT")
    assert problems([_record(_cubin_facts(USAGE, called), arch=90)]) == [
        f"{name.replace('sm_80', 'sm_90')}: keeps a stack frame of 8 bytes, with no local load or store"
    ]
    clean = {"spill_bytes": 0, "local_accesses": 0, "loop_local_accesses": 0}
    assert problems([_record(clean, shared_bytes=200 * 1024)]) == [
        f"{name}: takes 204800 bytes of shared memory, over sm_80's 166912"
    ]
    assert problems([{**_record(clean), "fits": True}]) == []
