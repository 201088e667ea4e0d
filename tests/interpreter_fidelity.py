"""Where Triton's interpreter computes other values than the GPU, made the GPU's, for the tests (tests/conftest.py)
and the standalone fuzzer (tests/fuzz.py).

Its float32 -> bfloat16 cast truncates: triton/runtime/interpreter.py's cast converts with no rounding mode, the
16 low bits dropped, and tl.tensor.to's fp_downcast_rounding ("rtne" by default) never reaches it. Every GPU
target rounds to nearest even (cvt.rn.bf16.f32 on NVIDIA). So every bfloat16 a kernel stores under the
interpreter carries up to a whole ulp of error, biased toward zero: twice the rounding error of the GPU's result
(a 1x1x1 bf16 conv: 3.3e-3 from float64 against torch's 1.7e-3, its rounding alone), and the tests hold it to
the GPU's tolerance. `install()` makes the cast round to nearest even, as the GPU and torch do (NaN stays a quiet
NaN, overflow goes to infinity); where the interpreter's internals are not the ones this was written against
(triton 3.6 and 3.9), nothing is patched.
"""

import os


def round_bfloat16_to_nearest_even() -> bool:
    """Patch the interpreter's float32 -> bfloat16 cast to round to nearest even; whether it was patched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    truncating = getattr(builder, "cast_impl", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if truncating is None or handle is None or getattr(truncating, "rounds_to_nearest_even", False):
        return False

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncating(self, src, dst_type)
        values = np.asarray(src.data, dtype=np.float32)
        return handle(to_bfloat16_bits(values), dst_type.scalar)

    cast_impl.rounds_to_nearest_even = True
    cast_impl.truncating = truncating  # the interpreter's own, which tests/test_conftest.py compares against
    builder.cast_impl = cast_impl
    return True


def to_bfloat16_bits(values):
    """The bfloat16 bit patterns (uint16) of float32 `values` (numpy) rounded to nearest, ties to even."""
    import numpy as np

    bits = values.view(np.uint32)
    with np.errstate(over="ignore"):  # only NaNs' patterns wrap, and they are replaced
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    rounded = rounded.astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16)
    return rounded


_installed = []


def install():
    """The fixes, once a process, where kernels run on the interpreter; nothing on a GPU."""
    if os.environ.get("TRITON_INTERPRET") == "1" and not _installed:
        round_bfloat16_to_nearest_even()
        _installed.append(True)
