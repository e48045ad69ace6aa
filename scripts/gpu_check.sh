#!/usr/bin/env bash
# The GPU path's first run, on a fresh GPU machine with only this repository (about 8 minutes):
#   1. install: a venv with the cuda12 extra (jax[cuda12]) and pytest, uv if it installs, else pip
#   2. the ragged paged attention tests through Triton (RPA_INTERPRET=0), and the CUDA lowering
#   3. end to end: a tiny random Llama's greedy float32 tokens with the Pallas kernel on the GPU
#      equal the CPU's with the jnp reference (both processes at once); dtype auto and the
#      KV cache's default size (gpu_memory_utilization) on the GPU
#   4. decode attention GB/s against a measured copy rate (and the jnp reference's answer), and a
#      cache past 2^31 elements
# One JSON line per check on stdout ({"check": ..., "ok": ...}; all kept in $OUT/results.jsonl,
# logs beside it) and a last "summary" line; exit 1 if any check failed.
#
#   bash scripts/gpu_check.sh
#   DRY_RUN=1 bash scripts/gpu_check.sh   # CPU: no install ($PY or python3), interpret mode,
#                                         # tiny sizes (tests/test_gpu_check.py runs this)
# Env: OUT (a folder; default a temp dir), PY (a python to use instead of installing), BUDGET
# (seconds for the whole run, default 460), CHECKS (a subset of: kernel_tests e2e bench),
# KERNEL_TESTS (pytest arguments), MIN_PCT_COPY (decode GB/s as % of copy, default 20).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$OUT" && : >"$OUT/results.jsonl"
RESULTS="$OUT/results.jsonl"
CHECKS="${CHECKS:-kernel_tests e2e bench}"
B=${BUDGET:-460}; t0=$SECONDS
left() { local l=$(( B - (SECONDS - t0) - $1 )); echo $(( l < 20 ? 20 : l )); }  # $1: kept back
emit() { echo "$1" | tee -a "$RESULTS"; }
json_str() { python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()[-400:]))'; }
want() { [[ " $CHECKS " == *" $1 "* ]]; }
export JAXBATCH_CACHE="$OUT/cache" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ -n "${DRY_RUN:-}" ]]; then
  PY="${PY:-python3}" PLATFORM=cpu INTERPRET=1 DEVICE_BACKEND=pallas
  export SMALL=1
  KERNEL_TESTS="${KERNEL_TESTS:-tests/kernels/test_rpa_kernel.py -k decode_only_batch}"
  emit "{\"check\":\"install\",\"ok\":true,\"skipped\":\"dry run: $PY\"}"
else
  PLATFORM=cuda INTERPRET=0 DEVICE_BACKEND=auto
  KERNEL_TESTS="${KERNEL_TESTS:-tests/kernels/test_rpa_kernel.py tests/kernels/test_rpa_reference.py tests/kernels/test_rpa_lowering.py}"
  if [[ -z "${PY:-}" ]]; then
    V="$OUT/venv"; PY="$V/bin/python"
    timeout "$(left 260)" bash -c "{ python3 -m pip install -q uv && python3 -m uv venv -q -p python3 '$V' &&
      python3 -m uv pip install -q -p '$PY' -e '.[cuda12]' pytest hypothesis; } ||
      { python3 -m venv --clear '$V' && '$V/bin/pip' install -q -e '.[cuda12]' pytest hypothesis; }" \
      >"$OUT/install.log" 2>&1
    rc=$?
    emit "{\"check\":\"install\",\"ok\":$([[ $rc == 0 ]] && echo true || echo false),\"rc\":$rc,\"s\":$((SECONDS - t0)),\"log\":$(json_str <"$OUT/install.log")}"
    [[ $rc == 0 ]] || { emit '{"check":"summary","ok":false,"failed":1}'; exit 1; }
  fi
  sees=$(JAX_PLATFORMS=cuda "$PY" -c 'import jax; print(jax.default_backend(), jax.devices()[0].device_kind)' 2>&1 | tail -n1)
  emit "{\"check\":\"gpu_visible\",\"ok\":$([[ $sees == gpu* ]] && echo true || echo false),\"jax\":$(echo "$sees" | json_str)}"
  [[ $sees == gpu* ]] || { emit '{"check":"summary","ok":false,"failed":1}'; exit 1; }
fi

pids=()
if want kernel_tests; then  # in the background, beside the CPU reference run
  # shellcheck disable=SC2086
  ( JAX_PLATFORMS=$PLATFORM RPA_INTERPRET=$INTERPRET JAX_DEFAULT_MATMUL_PRECISION=highest \
      timeout "$(left 150)" "$PY" -m pytest -o addopts= -q -p no:cacheprovider -rfE $KERNEL_TESTS \
      >"$OUT/kernel_tests.log" 2>&1; echo $? >"$OUT/kernel_tests.rc" ) &
  pids+=($!)
fi
if want e2e; then
  MD="$OUT/tiny"
  "$PY" scripts/gpu_check.py mkmodel "$MD" >"$OUT/mkmodel.log" 2>&1 \
    || emit "{\"check\":\"mkmodel\",\"ok\":false,\"log\":$(json_str <"$OUT/mkmodel.log")}"
  # the CPU reference (no C++ kernels needed: CXX=/bin/false skips their build) beside the device
  ( JAX_PLATFORMS=cpu CXX=/bin/false timeout "$(left 120)" "$PY" scripts/gpu_check.py tokens \
      "$MD" "$OUT/tokens_cpu.json" reference >"$OUT/tokens_cpu.log" 2>&1 ) &
  pids+=($!)
  JAX_PLATFORMS=$PLATFORM CXX=/bin/false timeout "$(left 120)" "$PY" scripts/gpu_check.py tokens \
    "$MD" "$OUT/tokens_device.json" "$DEVICE_BACKEND" 2>"$OUT/tokens_device.log" | tee -a "$RESULTS"
fi
for p in "${pids[@]}"; do wait "$p"; done
if want kernel_tests; then
  rc=$(cat "$OUT/kernel_tests.rc" 2>/dev/null || echo missing)
  summary=$(grep -E '[0-9]+ (passed|failed|error)' "$OUT/kernel_tests.log" | tail -n1)
  ok=false; [[ $rc == 0 && $summary == *passed* && $summary != *skipped* ]] && ok=true
  emit "{\"check\":\"kernel_tests\",\"ok\":$ok,\"rc\":\"$rc\",\"interpret\":$INTERPRET,\"summary\":$(echo "$summary" | json_str),\"failed\":$(grep -E '^(FAILED|ERROR)' "$OUT/kernel_tests.log" | head -n 5 | json_str)}"
fi
if want e2e; then
  grep -h '^{' "$OUT/tokens_cpu.log" | tee -a "$RESULTS"
  "$PY" scripts/gpu_check.py compare "$OUT/tokens_device.json" "$OUT/tokens_cpu.json" | tee -a "$RESULTS"
  JAX_PLATFORMS=$PLATFORM timeout "$(left 90)" "$PY" scripts/gpu_check.py defaults "$MD" \
    2>"$OUT/defaults.log" | tee -a "$RESULTS"
fi
if want bench; then  # alone on the device
  JAX_PLATFORMS=$PLATFORM timeout "$(left 5)" "$PY" scripts/gpu_check.py bench \
    2>"$OUT/bench.log" | tee -a "$RESULTS"
  [[ ${PIPESTATUS[0]} == 0 ]] || emit "{\"check\":\"bench_process\",\"ok\":false,\"log\":$(json_str <"$OUT/bench.log")}"
fi
bad=$(grep -c '"ok": *false' "$RESULTS")
n=$(grep -c '"check"' "$RESULTS")
emit "{\"check\":\"summary\",\"ok\":$([[ $bad == 0 && $n -gt 1 ]] && echo true || echo false),\"checks\":$n,\"failed\":$bad,\"s\":$((SECONDS - t0)),\"out\":\"$OUT\"}"
[[ $bad == 0 && $n -gt 1 ]]
