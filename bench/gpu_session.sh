#!/usr/bin/env bash
# The device-machine calls, run from the repository root with the machine's own torch and triton:
#   bash bench/gpu_session.sh STAGE...   # the stages in order, all within CALL_SECONDS (default 570: a call may
#                                        # run 600 s); each stage's own limit shrinks to the time left
# Stages:
#   probe     tests/gpu/tma_probe.py: which tensor maps the driver encodes and the TMA unit loads and stores right (~30 s)
#   tests     the suite on CUDA tensors (pytest-xdist), torch.compile, GPU-marked and static-compile tests aside
#   gpu       tests/test_gpu.py, tests/test_compile.py (GPU modes, profiler), then the main job
#   report    what the device's Triton compiled: registers, spills, smem, HGMMA
#   check     tests, gpu, report
#   variants  the Gluon and TMA kernels' tests (VARIANTS_TESTS=0: not), then bench.variants: pointer, TMA, Gluon
#             and cuDNN per large layer, each checked before it is timed, compiled ahead in parallel
#   tune      python -m tconv3d.tune over the bench suite (resumes; rerun until done)
#   bench     python -m bench, merged into bench/results/<device>.json (STACK_LAYERS=1: the stack's layers too)
#   memcheck  compute-sanitizer memcheck over every kernel family, racecheck on the TMA, Gluon and split-K ones
#   reliability  memcheck, a >2**31-element tensor, the UNet training run
#   host      kernel vs eager-op time and the host's issue time on small layers
#   resample  torch's 3-D nearest, trilinear and average-pool kernels on channels_last_3d against NCDHW, and
#             tconv3d's replacements, forward and backward (~20 s)
#   layers    tests/gpu/layer_errors.py over LAYER_MODELS (default monai_densenet121): each layer's bf16 error against
#             float64, stock and converted, where a real model's test failed on the whole model's (needs .whl)
#   models    the five diffusers video VAEs at their released sizes: stock vs converted decodes, a CUDA-graph
#             replay, tests/test_integrations.py on CUDA
#   profile   Nsight Compute (ncu, NCU_ARGS: --set detailed) over one launch of each variant row PROFILE_ARGS names
#             (bench.variants --launch-only): what bounds a kernel, where a timing cannot say
#   fuzz      tests/fuzz.py for FUZZ_SECONDS (default 120) from FUZZ_SEED (default: a new one, printed): random
#             problems up to hundreds of channels, every variant forced, Gluon natively, against float64
#             (FUZZ_FOCUS=halo: only the Gluon problems that halo tiles take, as tests/fuzz.py --focus halo)
#   fuzzargs  tests/fuzz_args.py for FUZZ_SECONDS (default 120) from FUZZ_SEED: the public entries' calls, good and
#             bad, on CUDA tensors (the kernels themselves: bad input must be refused before any launch, never an
#             illegal memory access), held to torch's CUDA ops and their fakes; a dead process's log names its draw
# bench/NOTES.md ("The next GPU session in 15 minutes") gives the calls that fit a session: plan1, plan2 below.
# A kernel that hangs (an mbarrier wait nobody arrives at) costs one test or one candidate, not the call: tests
# run under pytest-timeout's thread method (an xdist worker ends, another starts); the tuner and bench.variants
# record what hung, exit 75 and are run again here, resuming past it.
# diffusers and monai are not on the GPU image: run bench/fetch_wheels.sh here first and name `.whl` in the call's
# carry; whatever .whl/ holds is installed into /tmp/site before any stage.
# Logs and results go under $OUT (the device tool brings that folder back, at most 8 files: combine stages in one
# call only where their files together stay within that).
# Kernels compiled here ahead of a call (bench/precompile.py, with the GPU image's triton wheel), one cache for the
# session's calls (plan1's models stage needs diffusers in that venv: pip install --no-deps .whl/*.whl and theirs):
#   PATH=<a venv with triton 3.6>/bin:$PATH PRECOMPILE=<triton-3.6.0-cp312 wheel> bash bench/gpu_session.sh plan1 plan2
# then name `.triton-sm90` in the call's carry; each call unpacks it and reports what it spared in environment.txt.
# The device machine keeps nothing between calls: copy a returned table into autotune_configs/ once it is whole
# (or into tuning/, carried, to resume it), and the returned results into bench/results/ before the next bench
# call, so that it merges instead of starting over. The tree travels without .git: pass the
# commit being measured as TCONV3D_COMMIT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
# The models stage's VAEs (bench.vae_decode --model, at their released sizes: bench.vaes.DEFAULT_LATENTS).
DEFAULT_MODELS="wan cogvideox mochi hunyuan_video ltx_video"
# The census stage's models (bench.census argument lists): MONAI's UNets training at their tutorials' size, and the
# video VAEs' decodes of 17 frames at 256 x 256 (bench.vaes.DEFAULT_LATENTS).
DEFAULT_CENSUS_MODELS="--unet unet --training; --unet basic_unet --training; --unet dynunet --training; --vae wan; \
--vae hunyuan_video; --vae cogvideox; --vae ltx2"
# The 15-minute session's two calls (bench/NOTES.md, "Fourth H100 session", as re-planned after H100 runs 16 to
# 18 of 2026-11-27), each one word; any variable set in the call's environment still wins:
#   plan1   probe, the small layers' host time and which capture recipe each backward takes (issue 29), the suite
#           on CUDA past what H200 runs 9 and 11 ran of it and their failures, then three video VAEs' decodes
#           stock against converted (issue 30, never run yet).
#           compute-sanitizer over every kernel family (issue 30's memcheck: 0 errors in H200 run 7, 95 s with
#           JOBS=8) is `memcheck` alone in a call of its own (CALL_SECONDS=230) where a kernel changed
#   plan2   issue 28's bars in one run (the bf16 suite against cuDNN, then the stack scenario), the norms scenario,
#           the host-bound cases and unet_64 eager and replayed from CUDA graphs (issue 29), then bench.variants on
#           what H200 runs 8 and 10 had no time for (wan_dec_192's weight gradient, the 16-channel layers,
#           HunyuanVideo's replicate layer, Wan's cached layer, unet_64 in fp32); unet_32's rows (run 10) last
#   plan3   ncu over the Gluon kernels bench/NOTES.md asks about (wan_dec_384b's 128x128 and swapped 256x128,
#           down_s2's and unet_64's forward and weight gradient): shared memory, L2, tensor pipe, stalls
#   plan4   the real models layer by layer: bench.census --time over MONAI UNets' training steps and video VAEs'
#           decodes, each geometry's chosen kernels against cuDNN and the model's convolutions in all (needs .whl:
#           bench/fetch_wheels.sh)
#   plan5   the awkward set's layers of channels not 16-divisible (bench.variants, bf16 and fp32): chosen (a plain
#           layer's tiles on the box kernels, the pointer kernels' shorter loops), timed_only and pointer
#           (bench/NOTES.md, thirty-fifth and thirty-sixth sessions)
# Several plans at once only to precompile (PRECOMPILE: one cache for a session's calls); a call runs one plan.
planned=()
while [[ "${1:-}" =~ ^plan[0-9]$ ]]; do
  case "$1" in
  plan1)  # H200 run 4 (2026-12-04): the suite ran whole in 269 s on 12 workers (diffusers and MONAI carried),
    # compiling its own kernels. Runs 9 and 11 (fifty-first, fifty-second sessions): the suite on 16 workers, 1818
    # and 1080 tests (junit files committed; the 13 of run 11 that failed were test-side, mended since), the
    # GPU-marked tests all 51 passed in run 11 (157 s). Now: probe, host_overhead (which capture recipe each
    # backward takes, how each compiled kernel launches: issue 29's questions), the suite's rest and run 11's
    # failures (TCONV3D_TESTS_RAN: conftest deselects what those junit files record as passed or skipped), then
    # issue 30's VAE decodes on CUDA, stock against converted, never run yet (precompiled: PRECOMPILE with plan1
    # compiles their layers' chosen kernels; diffusers from .whl)
    export CALL_SECONDS=${CALL_SECONDS:-430} TESTS_TIMEOUT=${TESTS_TIMEOUT:-110} HOST_TIMEOUT=${HOST_TIMEOUT:-110} \
      WORKERS=${WORKERS:-16} MODELS=${MODELS:-"wan hunyuan_video cogvideox"} MODEL_TIMEOUT=${MODEL_TIMEOUT:-55} \
      MODEL_TESTS=${MODEL_TESTS:-0} \
      TCONV3D_TESTS_RAN=${TCONV3D_TESTS_RAN-tests/gpu_logs/NVIDIA_H200/run9_ad5388d/tests.xml:tests/gpu_logs/NVIDIA_H200/run11_6c241f9/tests.xml} \
      TCONV3D_TESTS_AGAIN=${TCONV3D_TESTS_AGAIN-replicate,reflect,circular,test_padding_modes,border}
    # TCONV3D_TESTS_AGAIN: the bordered layers' tests (286 on CPU) first, whatever runs 9 and 11 recorded: their input
    # gradient is written in float32 before its fold since the fifty-sixth session, the TMA and Gluon epilogues'
    # float32 stores on a 2-stage ring never run on a GPU
    planned+=(probe host tests models)
    ;;
  plan2)
    # Issue 28's bars in one run at one commit: the suite (bf16, forward and backward against cuDNN) and the stack
    # scenario. H200 run 10 (ad5388d): forward 1.13x, backward 0.95x (the host-bound small layers' eager times;
    # 0.99x with the graphs step's rows), stack 1.39x. Then the norms scenario, the graph columns of the
    # host-bound cases, then bench.variants on the rows runs 8 and 10 did not reach: wan_dec_192's weight gradient
    # (its backward's 0.81x), the unets' 16-channel layers, HunyuanVideo's replicate-bordered layer, Wan's cached
    # layer on channel taps, unet_64 in fp32; last unet_32's, now on the lent forward and input-gradient tiles
    # again (NEAR_FILL_RATIO 0.4: run 10 timed the heuristic's 1.14x and 1.39x slower there). The causal scenario
    # after the norms: wan_dec_384b's replicate-bordered fwd+bwd, its input gradient in float32 before the fold on a
    # 2-stage ring, against the zeros row's 3 (bench/NOTES.md, "A bordered input gradient written in float32").
    PLAN2_IMPLS=$(printf '%s,' wan_dec_192:chosen wan_dec_192:timed_only wan_dec_192:gluon_ws_grouped_taps \
      unet_16:chosen unet_16:timed_only unet_down_16:chosen unet_down_16:timed_only \
      hunyuan_dec_128_replicate:chosen hunyuan_dec_128_replicate:timed_only unet_64:chosen \
      wan_dec_96_cached:gluon_ws_channel_taps unet_32:chosen )unet_32:timed_only
    PLAN2_CASES=wan_dec_192,unet_16,unet_down_16,hunyuan_dec_128_replicate,wan_dec_96_cached,unet_64@fp32,unet_32
    export CALL_SECONDS=${CALL_SECONDS:-465} BENCH_STEPS=${BENCH_STEPS:-"suite scenarios graphs"} \
      IMPLS=${IMPLS:-tconv3d,cudnn_cl3d} BENCH_ARGS=${BENCH_ARGS:-"--dtype bf16 --no-graphs"} \
      BENCH_TIMEOUT=${BENCH_TIMEOUT:-100} SCENARIOS=${SCENARIOS:-stack,norms,causal} SCENARIO_TIMEOUT=${SCENARIO_TIMEOUT:-120} \
      GRAPH_CASES=${GRAPH_CASES-unet_320,down_s2,hunyuan_512,resnext3d_g32_256,unet_64} GRAPHS_TIMEOUT=${GRAPHS_TIMEOUT:-70} \
      VARIANTS_TESTS=${VARIANTS_TESTS:-0} VARIANTS_TIMEOUT=${VARIANTS_TIMEOUT:-260} \
      VARIANTS_ARGS=${VARIANTS_ARGS:-"--cases $PLAN2_CASES --impls $PLAN2_IMPLS"}
    planned+=(bench variants)
    ;;
  plan3)
    export CALL_SECONDS=${CALL_SECONDS:-220} PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-190}
    planned+=(profile)
    ;;
  plan4)
    export CALL_SECONDS=${CALL_SECONDS:-420} CENSUS_TIMEOUT=${CENSUS_TIMEOUT:-90}
    planned+=(census)
    ;;
  plan5)
    PLAN5_CASES=odd_36_20,odd_64_40,stride2_odd,odd_dilated,odd_12_44,odd_44_12
    export CALL_SECONDS=${CALL_SECONDS:-240} VARIANTS_TESTS=${VARIANTS_TESTS:-0} VARIANTS_TIMEOUT=${VARIANTS_TIMEOUT:-210} \
      VARIANTS_ARGS=${VARIANTS_ARGS:-"--cases $PLAN5_CASES --dtype bf16,fp32 --impls chosen,timed_only,pointer"}
    planned+=(variants)
    ;;
  *) echo "unknown plan $1: plan1 to plan5" >&2; exit 2 ;;
  esac
  plans=$((${plans:-0} + 1))
  shift
done
if [ ${#planned[@]} -gt 0 ]; then
  if [ $# -gt 0 ] || { [ "$plans" -gt 1 ] && [ -z "${PRECOMPILE:-}" ]; }; then
    echo "a call runs one plan alone (several only to precompile), no stages after it" >&2
    exit 2
  fi
  set -- "${planned[@]}"
fi
for stage in "${@:-tests}"; do  # a misspelt stage fails here, not minutes into the call
  case "$stage" in
    check | probe | tests | gpu | report | tune | bench | memcheck | reliability | host | resample | variants | models | layers | census | profile | fuzz | fuzzargs) ;;
    *) echo "unknown stage $stage: plan1, plan2, plan3, plan4 or plan5 alone, or check, probe, tests, gpu, report, tune, bench, memcheck, reliability, host, resample, variants, models, layers, census, profile, fuzz or fuzzargs" >&2
       exit 2 ;;
  esac
done
for step in ${BENCH_STEPS:-}; do
  case "$step" in
    suite | scenarios | graphs | stack_layers) ;;
    *) echo "unknown bench step $step: suite, scenarios, graphs or stack_layers" >&2; exit 2 ;;
  esac
done
if [ -n "${PRECOMPILE:-}" ]; then  # here, on a machine with no GPU: compile what these stages will launch
  exec python3 -m bench.precompile --wheel "$PRECOMPILE" --stages "${*:-tests}" --variants-args "${VARIANTS_ARGS:-}" \
    --bench-args "${BENCH_ARGS:-}" --scenarios "${SCENARIOS:-stack,conv2d,causal,skip,subpixel,norms}" \
    --tune-args "--shapes bench ${TUNE_ARGS:-}" --census-models "${CENSUS_MODELS:-$DEFAULT_CENSUS_MODELS}" \
    --models "${MODELS:-$DEFAULT_MODELS}"
fi
OUT=${OUT:-/tmp/tconv3d-out}
CALL_SECONDS=${CALL_SECONDS:-570}
mkdir -p "$OUT"
# Kernels compiled ahead on a CPU machine (bench/precompile.py), carried as .triton-sm90: Triton finds them on disk.
if [ -f .triton-sm90/manifest.json ] && cache_dir=$(python3 -m bench.precompile --unpack .triton-sm90); then
  export TRITON_CACHE_DIR=$cache_dir
fi
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=.:/tmp/site
fi
# Parallel test workers when pytest-xdist is there (the GPU image has it): compiling kernels is the slow part.
xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-12}")
# A test whose kernel never finishes ends its xdist worker, not the call: pytest-timeout (on the GPU image) with its
# thread method leaves the process; xdist starts another worker.
per_test=$([ -n "$xdist" ] && python3 -c "import pytest_timeout" 2>/dev/null \
  && echo "--timeout ${TEST_TIMEOUT:-180} --timeout-method thread")

# Tables tuned in this call (the tune stage) take precedence over the shipped ones in every later stage.
TUNE_DIR=${TUNE_DIR:-tuning}
export TCONV3D_CONFIG_DIR=$PWD/$TUNE_DIR

# left SECONDS: SECONDS, or what is left of the call (less a margin for the last lines) where that is less.
left() {
  local rest=$((CALL_SECONDS - SECONDS - 15))
  if [ "$1" -lt "$rest" ]; then echo "$1"; elif [ "$rest" -gt 1 ]; then echo "$rest"; else echo 1; fi
}

# until_done SECONDS LOG COMMAND...: run COMMAND (appending to LOG) again while it exits 75 (testing.HUNG_EXIT: a
# kernel hung, what hung is recorded, a rerun resumes past it), all runs within SECONDS.
until_done() {
  local deadline=$((SECONDS + $1)) log=$2 rc
  shift 2
  while :; do
    timeout $((deadline - SECONDS)) "$@" 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 75 ] && [ $((deadline - SECONDS)) -gt 30 ] || return "$rc"
    echo "[gpu_session] exit 75 (a kernel hung): running again, resuming past it" | tee -a "$log"
  done
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cudnn', torch.backends.cudnn.version())"
  echo "commit ${TCONV3D_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

# bench_step STEP: one step of the bench stage (BENCH_STEPS).
bench_step() {
  case "$1" in
  suite)
    local direction
    for direction in ${DIRECTIONS:-fwd bwd}; do
      timeout "$(left "${BENCH_TIMEOUT:-240}")" python3 -m bench --out bench/results --merge --direction "$direction" \
        --impls "${IMPLS:-tconv3d,cudnn_cl3d,cudnn_ncdhw,compile}" --scenarios none ${BENCH_ARGS:-} 2>&1 \
        | tee -a "$OUT/bench.log"
    done
    ;;
  scenarios)  # one invocation each: a cut-off loses that scenario, not those before it
    local scenario scenarios=${SCENARIOS:-stack,conv2d,causal,skip,subpixel,norms}
    [ "$scenarios" = none ] && return 0
    for scenario in ${scenarios//,/ }; do
      timeout "$(left "${SCENARIO_TIMEOUT:-150}")" python3 -m bench --out bench/results --merge --cases none \
        --scenarios "$scenario" 2>&1 | tee -a "$OUT/bench.log"
    done
    ;;
  graphs)
    [ -z "${GRAPH_CASES:-}" ] && return 0
    timeout "$(left "${GRAPHS_TIMEOUT:-60}")" python3 -m bench --out bench/results --merge --dtype bf16 \
      --cases "$GRAPH_CASES" --impls tconv3d,cudnn_cl3d --scenarios none 2>&1 | tee -a "$OUT/bench.log"
    ;;
  stack_layers)  # the stack scenario's three layers, each against cuDNN: bench.log's lines
    timeout "$(left "${STACK_LAYERS_TIMEOUT:-60}")" python3 -m bench --suite stack --out /tmp/stack_layers \
      --impls tconv3d,cudnn_cl3d --dtype bf16 --scenarios none --no-graphs 2>&1 | tee -a "$OUT/bench.log"
    ;;
  *) echo "[gpu_session] unknown bench step $1" | tee -a "$OUT/bench.log"; return 1 ;;
  esac
}

run_stage() {
  case "$1" in
  check)
    for s in tests gpu report; do run_stage "$s" > /dev/null; done
    ;;
  probe)  # first: a map the driver refuses fails every TMA and Gluon test after it for the same reason
    timeout "$(left 90)" python3 tests/gpu/tma_probe.py --out "$OUT/tma_probe.json" 2>&1
    # A map among the risks not taken: the rest of the call runs launches with such maps on the pointer kernels.
    # A control that fails is the probe's table to read: nothing TMA will run then. No verdict at all (the probe
    # cut off) changes nothing: on the H200 (2026-11-26) the tests passed with those maps.
    if [ ! -s "$OUT/tma_probe.json" ]; then
      echo "[gpu_session] the probe gave no verdict: tensor maps as by default"
    elif ! python3 -c "import json, sys; sys.exit(any(r['verdict'] != 'ok' for r in json.load(open(sys.argv[1]))))" \
        "$OUT/tma_probe.json"; then
      export TCONV3D_TMA_MAPS=strict
      echo "[gpu_session] a tensor map in doubt was not taken: TCONV3D_TMA_MAPS=strict for the rest of this call"
    fi
    ;;
  tests)  # here the kernels run; the static compile (the same triton 3.6) and the scripts' CPU logic are CI's.
    # TCONV3D_TESTS_RAN (junit files of earlier calls, os.pathsep-separated): those tests are not run again, but
    # those whose node ids hold a word of TCONV3D_TESTS_AGAIN (comma-separated), which run first
    # SIGINT at the limit: pytest stops as on Ctrl-C and still names the failures so far
    timeout -s INT -k 15 "$(left "${TESTS_TIMEOUT:-560}")" python3 -m pytest tests -q -p no:cacheprovider --durations=10 $xdist \
      $per_test --ignore=tests/test_compile.py --ignore=tests/test_gpu.py --ignore=tests/test_static_compile.py \
      --ignore=tests/test_hopper_main_loops.py --ignore=tests/test_gpu_scripts.py --junitxml "$OUT/tests.xml" \
      ${TESTS_ARGS:-} 2>&1 | tee "$OUT/tests.log"
    ;;
  gpu)
    timeout "$(left "${GPU_TIMEOUT:-420}")" python3 -m pytest tests/test_gpu.py tests/test_compile.py -q -s \
      -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/gpu_tests.log"
    timeout "$(left 120)" python3 -m tconv3d 2>&1 | tee -a "$OUT/gpu_tests.log"  # the main job
    ;;
  report)
    timeout "$(left 240)" python3 tests/gpu/kernel_report.py --out "$OUT/kernel_report.json" 2>&1 \
      | tee "$OUT/kernel_report.log"
    ;;
  tune)
    # A fresh table in $TUNE_DIR (git-ignored), not autotune_configs/: the tuner resumes from the keys a table
    # holds, so tuning into the shipped table would tune nothing. Carry $TUNE_DIR to a later call to resume it.
    # Exit status 75: a candidate hung; it is in <device>.hung.json and the next run resumes without it.
    mkdir -p "$TUNE_DIR"
    until_done "$(left "${TUNE_TIMEOUT:-540}")" "$OUT/tune.log" python3 -m tconv3d.tune --shapes bench \
      --out "$TUNE_DIR" --budget "${BUDGET:-15}" ${TUNE_ARGS:-}
    # Not under its own name: the benchmark's results file has the same one (<device>.json); with what hung, if any.
    for table in "$TUNE_DIR"/*.json; do cp "$table" "$OUT/tune_table_$(basename "$table")"; done
    ;;
  bench)
    # BENCH_STEPS, in order (default: suite scenarios graphs, and stack_layers where STACK_LAYERS=1): suite = each
    # direction separately; scenarios = one invocation each; graphs = GRAPH_CASES again, eager and replayed from
    # CUDA graphs (issue 29). The JSON is saved after every case, so a cut-off keeps most; a case measured again
    # replaces its row.
    for step in ${BENCH_STEPS:-suite scenarios graphs ${STACK_LAYERS:+stack_layers}}; do
      bench_step "$step"
    done
    # The JSON alone (the tool returns 8 files a call): `python -m bench.report` remakes the .md and .png here.
    cp "bench/results/$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))").json" "$OUT/"
    ;;
  memcheck)
    OUT="$OUT" timeout "$(left "${SANITIZER_TIMEOUT:-300}")" bash tests/gpu/memcheck.sh
    ;;
  reliability)
    run_stage memcheck
    timeout "$(left 150)" python3 tests/gpu/huge_tensor.py --out "$OUT/huge_tensor.json" 2>&1 \
      | tee "$OUT/huge_tensor.log"
    timeout "$(left 200)" python3 tests/gpu/train_unet.py --out "$OUT/train_unet.json" 2>&1 | tee "$OUT/train_unet.log"
    ;;
  host)
    timeout "$(left "${HOST_TIMEOUT:-200}")" python3 tests/gpu/host_overhead.py --out "$OUT/host_overhead.json" 2>&1 \
      | tee "$OUT/host_overhead.log"
    ;;
  resample)
    timeout "$(left "${RESAMPLE_TIMEOUT:-60}")" python3 tests/gpu/resample.py --out "$OUT/resample.json" 2>&1 \
      | tee "$OUT/resample.log"
    ;;
  variants)  # VARIANTS_TESTS=0: the timings alone (after a tests stage, which runs these tests too)
    if [ "${VARIANTS_TESTS:-1}" != 0 ]; then
      timeout "$(left "${VARIANT_TESTS_TIMEOUT:-240}")" python3 -m pytest tests/test_gluon.py tests/test_tma.py -q \
        -p no:cacheprovider $xdist $per_test 2>&1 | tee "$OUT/variants_tests.log"
    fi
    # Exit status 75: a variant hung (its row says so); --resume keeps the rows and goes on past it.
    until_done "$(left "${VARIANTS_TIMEOUT:-320}")" "$OUT/variants.log" python3 -m bench.variants \
      --out "$OUT/variants.json" --resume ${VARIANTS_ARGS:-}
    ;;
  models)  # MODELS, MODEL_VARIANTS, MODEL_SCALE: to split it over calls (compiled variants take minutes each);
    # MODEL_TRAINING=1: a decoder fine-tuning step each (bench.vae_decode --training; not converted_graph)
    if ! python3 -c "import diffusers" 2>/dev/null; then
      echo "diffusers is missing: run bench/fetch_wheels.sh and carry .whl" | tee "$OUT/models.log"
      return 1
    fi
    # each model's JSON, then one file of them all in $OUT (a call returns at most 8 files)
    local decoded=/tmp/tconv3d-models${MODEL_TRAINING:+-training} model
    rm -rf "$decoded" && mkdir -p "$decoded"  # this run's models alone in its file
    for model in ${MODELS:-$DEFAULT_MODELS}; do
      timeout "$(left "${MODEL_TIMEOUT:-100}")" python3 -m bench.vae_decode --model "$model" \
        --scale "${MODEL_SCALE:-0}" --variants "${MODEL_VARIANTS:-stock,converted,converted_graph}" \
        ${MODEL_TRAINING:+--training} --json "$decoded/$model.json" 2>&1 | tee -a "$OUT/models.log"
    done
    python3 -c "import json, pathlib, sys; print(json.dumps({p.stem: json.loads(p.read_text()) for p in \
sorted(pathlib.Path(sys.argv[1]).glob('*.json'))}, indent=1))" "$decoded" \
      > "$OUT/vae_decode${MODEL_TRAINING:+_training}.json"
    if [ "${MODEL_TESTS:-1}" != 0 ]; then
      timeout "$(left "${MODEL_TESTS_TIMEOUT:-150}")" python3 -m pytest tests/test_integrations.py -q \
        -p no:cacheprovider 2>&1 | tee "$OUT/integrations.log"  # CPU (aten) as in CI, and the models on CUDA
    fi
    ;;
  layers)  # one JSON a model would exceed the files a call returns: the log holds each model's table
    for model in ${LAYER_MODELS:-monai_densenet121}; do
      timeout "$(left "${LAYERS_TIMEOUT:-60}")" python3 tests/gpu/layer_errors.py --model "$model" 2>&1 \
        | tee -a "$OUT/layers.log"
    done
    ;;
  census)  # CENSUS_MODELS: bench.census argument lists, ';'-separated; each model's conv rows timed against cuDNN
    if ! python3 -c "import diffusers, monai" 2>/dev/null; then
      echo "diffusers or monai is missing: run bench/fetch_wheels.sh and carry .whl" | tee "$OUT/census.log"
      return 1
    fi
    local index=0 spec
    IFS=';' read -ra specs <<< "${CENSUS_MODELS:-$DEFAULT_CENSUS_MODELS}"
    for spec in "${specs[@]}"; do
      index=$((index + 1))
      timeout "$(left "${CENSUS_TIMEOUT:-90}")" python3 -m bench.census --time $spec \
        --out "$OUT/census_$index.json" 2>&1 | tee -a "$OUT/census.log"
    done
    ;;
  profile)  # each launch's report in profile.log, in the order bench.variants prints its "launched" lines
    ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -n 1)
    if [ -z "$ncu_bin" ]; then
      echo "[gpu_session] no ncu on this machine" | tee "$OUT/profile.log"
      return 1
    fi
    profile_args=${PROFILE_ARGS:-"--cases wan_dec_384b,down_s2,unet_64 --directions fwd,wgrad --impls gluon_ws,gluon_ws_256x128_swapped"}
    # --clock-control none: the clocks as the timings saw them (device METHOD.md); only tconv3d's conv kernels
    timeout "$(left "${PROFILE_TIMEOUT:-240}")" "$ncu_bin" --clock-control none --kernel-name regex:_conv3d_ \
      ${NCU_ARGS:---set detailed} python3 -m bench.variants --launch-only $profile_args 2>&1 | tee "$OUT/profile.log"
    ;;
  fuzz)  # one JSON line per failure: `python tests/fuzz.py --replay '<line>'` reproduces it, here or on CPU
    seed=${FUZZ_SEED:-$((RANDOM * 32768 + RANDOM))}
    echo "[gpu_session] fuzz from seed $seed" | tee "$OUT/fuzz.log"
    timeout "$(left $((${FUZZ_SECONDS:-120} + 60)))" python3 tests/fuzz.py --seconds "${FUZZ_SECONDS:-120}" \
      --seed "$seed" ${FUZZ_FOCUS:+--focus "$FUZZ_FOCUS"} 2>&1 | tee -a "$OUT/fuzz.log"
    ;;
  fuzzargs)  # one JSON line per failure: `python tests/fuzz_args.py --replay SEED` reproduces it
    seed=${FUZZ_SEED:-$((RANDOM * 32768 + RANDOM))}
    echo "[gpu_session] fuzz_args from seed $seed" | tee "$OUT/fuzz_args.log"
    # stderr names each draw as it starts (tens of thousands): only its last lines are kept, the summary and the
    # draw a dead process died in
    timeout "$(left $((${FUZZ_SECONDS:-120} + 60)))" python3 tests/fuzz_args.py --seconds "${FUZZ_SECONDS:-120}" \
      --seed "$seed" 2> /tmp/fuzz_args.stderr | tee -a "$OUT/fuzz_args.log"
    grep -v '^# draw ' /tmp/fuzz_args.stderr | tail -n 20 >> "$OUT/fuzz_args.log"
    grep '^# draw ' /tmp/fuzz_args.stderr | tail -n 1 | tee -a "$OUT/fuzz_args.log"
    ;;
  esac
}

for stage in "${@:-tests}"; do
  if [ $((CALL_SECONDS - SECONDS)) -lt 45 ]; then
    echo "[gpu_session] no time left for stage $stage (${SECONDS} s of ${CALL_SECONDS} used)"
    continue
  fi
  echo "[gpu_session] stage $stage at ${SECONDS} s"
  run_stage "$stage"
done
echo "[gpu_session] done at ${SECONDS} s"
if [ -f .triton-sm90/manifest.json ]; then  # how many kernels the carried cache spared this call, and how many not
  echo "precompiled $(python3 -m bench.precompile --census .triton-sm90)" | tee -a "$OUT/environment.txt"
fi
tail -n 25 "$OUT"/*.log
