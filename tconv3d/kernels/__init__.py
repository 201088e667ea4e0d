"""The kernel layer: every `@triton.jit` family with its launcher (one module each), the launch config type
(`config.py`), the shared kernel helpers (`utils.py`; on torch tensors alone, `tensors.py`) and the same launchers
on torch's own ops for CPU tensors (`aten.py`). Launchers take a config; they never choose one (tconv3d/tune/
does). `aten.py`, `config.py` and `tensors.py` import no Triton: where it is not installed, they are the layer."""
