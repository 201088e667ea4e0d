"""Every setting tconv3d reads from the environment, read once at import, in one place."""

import os

# Triton decides at decoration time whether @triton.jit kernels are compiled or interpreted, so this must be
# set before `import tconv3d`. When it is, CPU tensors run the Triton kernels through Triton's interpreter.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# What CPU tensors run: "triton" (the kernels, through the interpreter) or "aten" (torch's own conv3d, so code
# written against tconv3d still runs on a machine without a GPU).
CPU_BACKEND = "triton" if INTERPRET else "aten"
