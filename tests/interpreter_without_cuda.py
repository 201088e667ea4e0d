"""Imported first by the fuzzers (tests/fuzz.py, fuzz_args.py, fuzz_models.py), run as scripts or imported by the
test modules: on a machine without CUDA, TRITON_INTERPRET=1 before tconv3d defines its kernels, so that they run
through Triton's interpreter. Not on a GPU machine, where the test modules imported after a fuzzer would otherwise
define their own kernels for the interpreter (H200 run 4). A TRITON_INTERPRET already set is kept."""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
