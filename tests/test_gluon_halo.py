"""The halo probe (tests/gluon_halo.py): three taps of a 64-voxel-wide patch read as row slices of one TMA box, the
step bench/NOTES.md ("What 64 columns cost") proposes for the narrow layers. On a Hopper GPU it runs for real (what
only the hardware can say: the wgmma descriptors of the slices, the swizzle); on CPU through the Gluon emulator;
and compiled for sm_90 its slices must stay wgmma operands in shared memory."""

import pytest
import torch
import torch.nn.functional as F
from test_static_compile import CUOBJDUMP, compile_script

from tconv3d.kernels import conv_gluon
from tconv3d.testing import rel_l2

pytestmark = pytest.mark.skipif(conv_gluon.UNAVAILABLE is not None, reason=str(conv_gluon.UNAVAILABLE))


def test_halo_row_slices_match_float64(device):
    """Each output row's three kh taps read rows r, r + 1, r + 2 of one box: a slice at the wrong row, a box
    shifted the wrong way along W or padding rows that are not zeros change every output row."""
    from gluon_halo import halo_conv2d

    x = torch.randn(2, 64, 64, device=device).to(torch.bfloat16)
    weight = torch.randn(64, 64, 3, 3, device=device).to(torch.bfloat16)
    expected = F.conv2d(x.double().permute(2, 0, 1)[None], weight.double(), padding=1)[0].permute(1, 2, 0)
    if device == "cuda":
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("wgmma: sm_90 only")
        out = halo_conv2d(x, weight)
    else:
        from gluon_emulator import Emulator

        out = halo_conv2d(x, weight, Emulator().launch)
    # bf16 products summed in fp32: only the order of the sums differs from float64
    assert rel_l2(out, expected) < 1e-5


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="this triton wheel ships no NVIDIA toolchain")
def test_halo_row_slices_compile_to_wgmma_from_shared_memory():
    """Under the installed Triton (CI: the newest and 3.6, the GPU machines'), for sm_90: the 18 wgmmas of a K step
    (9 taps x 2 output rows) read both operands from shared memory (HGMMA, no LDS/LDSM/STS anywhere), the boxes
    come by TMA, nothing spills."""
    script = """
import json, subprocess, sys, tempfile, torch
sys.path.insert(0, "tests")
from gluon_halo import halo_conv2d
from tconv3d.inspect.compile import _nvidia_tool, _sass_lines, compile_only, read_cubin
launches = []
with compile_only(90, launches):
    halo_conv2d(torch.empty(2, 64, 64, dtype=torch.bfloat16), torch.empty(64, 64, 3, 3, dtype=torch.bfloat16))
(_, _, _, kernel, _, _), = launches
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(kernel.asm["cubin"])
    f.flush()
    sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
opcodes = [text.split()[1 if text.startswith("@") else 0] for _, text in _sass_lines(sass)]
print(json.dumps({**read_cubin(kernel.asm["cubin"]), "opcodes": opcodes}))
"""
    report = compile_script(script)
    opcodes = report["opcodes"]
    hgmma = [op for op in opcodes if op.startswith("HGMMA.64x64x16")]
    assert len(hgmma) == 18 * 64 // 16, opcodes  # 18 wgmmas of K 64, 4 instructions of K 16 each
    assert not [op for op in opcodes if op.split(".")[0] in ("LDS", "LDSM", "STS")]
    assert "UTMALDG.5D" in report["loads"] and report["spill_bytes"] == 0
