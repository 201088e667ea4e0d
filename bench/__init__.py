"""tconv3d's benchmarks against cuDNN and torch.compile: `python -m bench` (see bench/run.py)."""
