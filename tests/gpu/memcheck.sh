#!/usr/bin/env bash
# compute-sanitizer over every kernel family on small awkward problems (tests/gpu/sanitize_cases.py): memcheck on
# all of them, racecheck on the first problem of the TMA, Gluon and split-K families (RACE_FAMILIES). Run from the
# repository root on a CUDA machine; logs go to ${OUT:-tests/gpu_logs}.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-tests/gpu_logs}
mkdir -p "$out"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found" >&2
  exit 2
fi
status=0
"$sanitizer" --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_cases.py 2>&1 | tee "$out/memcheck.log" || status=1
"$sanitizer" --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_cases.py --quick \
  --family "${RACE_FAMILIES:-tma,split_k,gluon,gluon_ws}" 2>&1 | tee "$out/racecheck.log" || status=1
grep -h "ERROR SUMMARY" "$out/memcheck.log" "$out/racecheck.log"
exit $status
