"""Compiling tconv3d's kernels for a GPU that is not there (`compile.py`, also the tuner's spill filter) and
`python -m tconv3d.inspect`, the report of what the compiler made of every launch (`__main__.py`)."""
