#!/usr/bin/env bash
# The Python packages the GPU machines lack, as wheels in .whl/ (git-ignored), for the device tool to carry:
# diffusers (the video VAEs of bench.vae_decode and tests/test_integrations.py) and monai (the 3D UNets). Run it
# here, where the package registries are reachable (the device machine reaches nothing), then name `.whl` in the
# run's `carry`; bench/gpu_session.sh installs whatever .whl/ holds into /tmp/site before any stage.
# Their other needs (huggingface-hub, safetensors, regex, requests, Pillow, numpy, torch) are on the GPU image.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "diffusers==${DIFFUSERS_VERSION:-0.42.1}" "monai==${MONAI_VERSION:-1.6.1}" importlib_metadata
ls -l .whl
