#!/usr/bin/env bash
# One device-machine call per stage, run from the repository root with the machine's own torch and triton:
#   bash bench/gpu_session.sh check   # tests, then gpu, then the kernel report, in one call (pytest-xdist)
#   bash bench/gpu_session.sh tests   # the suite on CUDA tensors, torch.compile and GPU-marked tests aside
#   bash bench/gpu_session.sh gpu     # tests/test_gpu.py, tests/test_compile.py (GPU modes, profiler), main job
#   bash bench/gpu_session.sh report  # what the device's Triton compiled: registers, spills, smem, HGMMA
#   bash bench/gpu_session.sh tune    # python -m tconv3d.tune over the bench suite (resumes; rerun until done)
#   bash bench/gpu_session.sh bench   # python -m bench, merged into bench/results/<device>.json
#   bash bench/gpu_session.sh reliability   # compute-sanitizer, a >2**31-element tensor, the UNet training run
#   bash bench/gpu_session.sh host    # kernel vs eager-op time and the host's issue time on small layers
#   bash bench/gpu_session.sh variants   # the Gluon and TMA kernels' tests, then bench.variants: pointer, TMA,
#                                        # Gluon and cuDNN per large layer, each checked before it is timed
#   bash bench/gpu_session.sh models  # the five diffusers video VAEs at their released sizes: stock vs converted
#                                     # decodes, a CUDA-graph replay, tests/test_integrations.py on CUDA
# diffusers and monai are not on the GPU image: run bench/fetch_wheels.sh here first and name `.whl` in the call's
# carry; whatever .whl/ holds is installed into /tmp/site before any stage.
# Logs and results go under $OUT (the device tool brings that folder back, at most 8 files: combine stages in one
# call only where their files together stay within that); each stage fits one 10-minute call.
# The device machine keeps nothing between calls: before the next tune or bench call, copy the returned
# <device>.json into autotune_configs/ (tune) or the returned results into bench/results/ (bench), so that the
# next call resumes (tune) or merges (bench) instead of starting over. The tree travels without .git: pass the
# commit being measured as TCONV3D_COMMIT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tconv3d-out}
mkdir -p "$OUT"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
stage=${1:-tests}
# Parallel test workers when pytest-xdist is there (the GPU image has it): compiling kernels is the slow part.
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-8}")
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  echo "commit ${TCONV3D_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} > "$OUT/environment.txt" 2>&1

case "$stage" in
  check)
    cat "$OUT/environment.txt"
    for s in tests gpu report; do OUT="$OUT" bash "$0" "$s" > /dev/null; done
    ;;
  tests)
    timeout ${TESTS_TIMEOUT:-560} python3 -m pytest tests -q -p no:cacheprovider --durations=10 $xdist \
      --ignore=tests/test_compile.py --ignore=tests/test_gpu.py 2>&1 | tee "$OUT/tests.log"
    ;;
  gpu)
    timeout ${GPU_TIMEOUT:-420} python3 -m pytest tests/test_gpu.py tests/test_compile.py -q -s -p no:cacheprovider \
      --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
    timeout 120 python3 -m tconv3d 2>&1 | tee "$OUT/main_job.log"
    ;;
  report)
    timeout 240 python3 tests/gpu/kernel_report.py --out "$OUT/kernel_report.json" 2>&1 | tee "$OUT/kernel_report.log"
    ;;
  tune)
    mkdir -p autotune_configs
    timeout ${TUNE_TIMEOUT:-540} python3 -m tconv3d.tune --shapes bench --out autotune_configs --budget "${BUDGET:-15}" \
      ${TUNE_ARGS:-} 2>&1 | tee "$OUT/tune.log"
    # Not under its own name: the benchmark's results file has the same one (<device>.json).
    for table in autotune_configs/*.json; do cp "$table" "$OUT/tune_table_$(basename "$table")"; done
    ;;
  bench)
    # Each direction separately, then the scenarios: the JSON is saved after every case, so a cut-off keeps most.
    impls=${IMPLS:-tconv3d,cudnn_cl3d,cudnn_ncdhw,compile}
    for direction in ${DIRECTIONS:-fwd bwd}; do
      timeout ${BENCH_TIMEOUT:-240} python3 -m bench --out bench/results --merge --direction "$direction" \
        --impls "$impls" --scenarios none ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
    done
    if [ "${SCENARIOS:-stack,conv2d,causal}" != none ]; then
      timeout ${SCENARIO_TIMEOUT:-150} python3 -m bench --out bench/results --merge --cases none \
        --scenarios "${SCENARIOS:-stack,conv2d,causal}" 2>&1 | tee -a "$OUT/bench.log"
    fi
    cp bench/results/* "$OUT/" 2>/dev/null
    ;;
  reliability)
    OUT="$OUT" timeout 200 bash tests/gpu/memcheck.sh
    timeout 150 python3 tests/gpu/huge_tensor.py --out "$OUT/huge_tensor.json" 2>&1 | tee "$OUT/huge_tensor.log"
    timeout 200 python3 tests/gpu/train_unet.py --out "$OUT/train_unet.json" 2>&1 | tee "$OUT/train_unet.log"
    ;;
  host)
    timeout 200 python3 tests/gpu/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 | tee "$OUT/host_overhead.log"
    ;;
  variants)  # VARIANTS_TESTS=0: the timings alone (a second call over the rest of the cases)
    if [ "${VARIANTS_TESTS:-1}" != 0 ]; then
      timeout ${VARIANT_TESTS_TIMEOUT:-240} python3 -m pytest tests/test_gluon.py tests/test_tma.py -q \
        -p no:cacheprovider $xdist 2>&1 | tee "$OUT/variants_tests.log"
    fi
    timeout ${VARIANTS_TIMEOUT:-320} python3 -m bench.variants --out "$OUT/variants.json" ${VARIANTS_ARGS:-} 2>&1 \
      | tee "$OUT/variants.log"
    ;;
  models)  # MODELS, MODEL_VARIANTS, MODEL_SCALE: to split it over calls (compiled variants take minutes each)
    if ! python3 -c "import diffusers" 2>/dev/null; then
      echo "diffusers is missing: run bench/fetch_wheels.sh and carry .whl" | tee "$OUT/models.log"; exit 1
    fi
    for model in ${MODELS:-wan cogvideox mochi hunyuan_video ltx_video}; do
      timeout ${MODEL_TIMEOUT:-100} python3 -m bench.vae_decode --model "$model" --scale "${MODEL_SCALE:-0}" \
        --variants "${MODEL_VARIANTS:-stock,converted,converted_graph}" --json "$OUT/vae_$model.json" 2>&1 \
        | tee -a "$OUT/models.log"
    done
    if [ "${MODEL_TESTS:-1}" != 0 ]; then
      timeout ${MODEL_TESTS_TIMEOUT:-150} python3 -m pytest tests/test_integrations.py -q -p no:cacheprovider \
        2>&1 | tee "$OUT/integrations.log"  # on CPU (aten) as in CI, and test_real_models_on_cuda_match_stock
    fi
    ;;
  *)
    echo "unknown stage $stage: check, tests, gpu, report, tune, bench, reliability, host, variants or models" >&2
    exit 2
    ;;
esac
tail -n 25 "$OUT"/*.log
