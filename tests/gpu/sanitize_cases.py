"""Forward, input-grad and weight-grad on small awkward shapes, for compute-sanitizer (tests/gpu/memcheck.sh).

Odd channels, stride 2, dilation, causal 6-value padding, a 1x3x3 kernel and a Cin=3 stem, in bf16 and fp32.
Also checks every result against float64, so a run that touches no bad memory also computed the right thing.
"""

import sys

import torch

import tconv3d
from tconv3d.testing import float64_errors, random_conv_inputs, tolerance

CASES = [
    # (N, Cin, Cout, (D, H, W), kernel, stride, padding, dilation)
    (2, 3, 17, (5, 7, 9), 3, 1, 1, 1),
    (1, 17, 33, (7, 6, 9), 3, 2, 1, 1),
    (1, 5, 6, (5, 6, 7), 3, 1, (2, 0, 1, 1, 1, 1), 1),
    (2, 24, 20, (4, 9, 7), (1, 3, 3), (1, 2, 2), (0, 1, 1), 1),
    (1, 4, 5, (9, 8, 10), 3, 1, 2, 2),
]


def main(quick: bool = False) -> int:
    failures = 0
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        for n, cin, cout, size, kernel, stride, padding, dilation in CASES[:1] if quick else CASES:
            k = (kernel,) * 3 if isinstance(kernel, int) else kernel
            x, w = random_conv_inputs((n, cin, *size), (cout, cin, *k), dtype, "cuda")
            errors = list(float64_errors(tconv3d.conv3d, x, w, None, stride, padding, dilation).values())
            ok = max(errors) < tolerance(dtype)  # TF32 bound for fp32 when cuDNN may use TF32 (torch's default)
            failures += not ok
            print(f"{dtype} {(n, cin, cout, size, kernel, stride, padding, dilation)}: "
                  f"errors {' '.join(f'{e:.1e}' for e in errors)} {'ok' if ok else 'FAIL'}")  # fmt: skip
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(quick="--quick" in sys.argv))
