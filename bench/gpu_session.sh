#!/usr/bin/env bash
# One device-machine call per stage, run from the repository root with the machine's own torch and triton:
#   bash bench/gpu_session.sh tests   # the whole suite on CUDA tensors, then the main job
#   bash bench/gpu_session.sh tune    # python -m tconv3d.tune over the bench suite (resumes; rerun until done)
#   bash bench/gpu_session.sh bench   # python -m bench, merged into bench/results/<device>.json
# Logs and results go under $OUT (the device tool brings that folder back); each stage fits one 10-minute call.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tconv3d-out}
mkdir -p "$OUT"
stage=${1:-tests}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  git rev-parse HEAD 2>/dev/null || echo "commit: unknown"
} > "$OUT/environment.txt" 2>&1

case "$stage" in
  tests)
    timeout 420 python3 -m pytest tests -q -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
    timeout 120 python3 -m tconv3d 2>&1 | tee "$OUT/main_job.log"
    ;;
  tune)
    mkdir -p autotune_configs
    timeout 540 python3 -m tconv3d.tune --shapes bench --out autotune_configs --budget "${BUDGET:-15}" 2>&1 | tee "$OUT/tune.log"
    cp autotune_configs/*.json "$OUT/" 2>/dev/null
    ;;
  bench)
    timeout 560 python3 -m bench --out bench/results --merge ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    cp bench/results/* "$OUT/" 2>/dev/null
    ;;
  *)
    echo "unknown stage $stage: tests, tune or bench" >&2
    exit 2
    ;;
esac
tail -n 25 "$OUT"/*.log
