"""The tuning layer: configs as data and the heuristics (`configs.py`), the per-GPU tables (`tables.py`), the named
shape sets (`shapes.py`, `shape_sets/`), the tuner (`tuner.py`, `python -m tconv3d.tune`) and `choice.py`, the one
place a launch's variant and tiling are chosen."""
