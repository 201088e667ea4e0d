#!/usr/bin/env bash
# compute-sanitizer over every kernel family on small awkward problems (tests/gpu/sanitize_cases.py): memcheck on
# all of them, racecheck on the first problem of the TMA, Gluon (halo tiles too) and split-K families
# (RACE_FAMILIES). Run from the repository root on a CUDA machine; logs go to ${OUT:-tests/gpu_logs}.
# Compiling each kernel on first use is most of a memcheck's time (H100 run 14: 8 problems in 45 s), and a GPU
# machine has the cores: the families go to JOBS sanitizer processes at once (default 4), each its own log, one
# memcheck.log after (the device tool brings back eight files a call), each process's ERROR SUMMARY line kept.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-tests/gpu_logs}
mkdir -p "$out"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$sanitizer" ]; then
  echo "compute-sanitizer not found" >&2
  exit 2
fi
families=${FAMILIES:-$(python3 -c "import sys; sys.path.insert(0, 'tests/gpu'); import sanitize_cases; print(' '.join(sanitize_cases.FAMILIES))")}
if [ -z "${families// /}" ]; then
  echo "no families to check (tests/gpu/sanitize_cases.py's FAMILIES)" >&2
  exit 2
fi
jobs=${JOBS:-4}
parts=$(mktemp -d)
status=0
# The first family (pointer: the most problems) a process of its own, the others dealt out over the rest.
declare -a groups
i=0
for family in $families; do
  j=$(( jobs > 1 && i > 0 ? 1 + (i - 1) % (jobs - 1) : 0 ))
  groups[j]="${groups[j]:+${groups[j]},}$family"
  i=$((i + 1))
done
assemble() {  # the parts into one memcheck.log, in the groups' order
  for j in "${!groups[@]}"; do
    echo "=== families ${groups[j]}"
    cat "$parts/memcheck.$j.log"
  done > "$out/memcheck.log"
  cat "$out/memcheck.log"
}
pids=()
# Stopped (gpu_session.sh's timeout): the processes go, what they logged still makes memcheck.log.
trap 'kill "${pids[@]}" 2>/dev/null; wait; assemble; exit 124' TERM INT
for j in "${!groups[@]}"; do
  "$sanitizer" --tool memcheck --error-exitcode 1 python3 tests/gpu/sanitize_cases.py --family "${groups[j]}" \
    > "$parts/memcheck.$j.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || status=1
done
trap - TERM INT
assemble
rm -rf "$parts"
"$sanitizer" --tool racecheck --error-exitcode 1 python3 tests/gpu/sanitize_cases.py --quick \
  --family "${RACE_FAMILIES:-tma,split_k,gluon,gluon_ws,halo}" 2>&1 | tee "$out/racecheck.log" || status=1
grep -h "ERROR SUMMARY" "$out/memcheck.log" "$out/racecheck.log"
exit $status
