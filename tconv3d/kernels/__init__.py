"""The kernel layer: every `@triton.jit` family with its launcher (one module each), the launch config type
(`config.py`), the shared kernel helpers (`utils.py`) and the same launchers on torch's own ops for CPU tensors
(`aten.py`). Launchers take a config; they never choose one (tconv3d/tune/ does)."""
