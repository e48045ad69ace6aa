#!/usr/bin/env bash
# One command on a GPU machine:
#   1. the ragged paged attention tests through Triton on the GPU (RPA_INTERPRET=0),
#   2. scripts/bench_kernel.py (kernel GB/s and TFLOP/s next to measured copy and matmul rates),
#   3. scripts/bench_throughput.py, if it exists (engine throughput),
# then a short summary table, printed last. Full logs go to $OUT (or a temp dir) .
#
#   bash scripts/gpu_check.sh                 # everything
#   SKIP_TESTS=1 bash scripts/gpu_check.sh    # benchmarks only
# Env: PY (python with a CUDA jax; default: first of .venv/bin/python, python3 that sees a GPU),
#      TEST_TIMEOUT (s, default 420), BENCH_TIMEOUT (300), THROUGHPUT_TIMEOUT (300),
#      BENCH_ARGS, THROUGHPUT_ARGS (arguments for the two scripts; the latter replaces the
#      default "--dtypes bfloat16 --passes 2 --out $LOG/throughput"),
#      CPU_SMOKE=1 (no GPU: check this script itself; interpret mode, lowering tests, tiny bench).
set -uo pipefail
cd "$(dirname "$0")/.."

LOG="${OUT:-$(mktemp -d -t gpu_check.XXXXXX)}"
mkdir -p "$LOG"
SUMMARY="$LOG/summary.txt"
: >"$SUMMARY"
note() { printf '%-22s %s\n' "$1" "$2" | tee -a "$SUMMARY"; }

sees_gpu() { "$1" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; }
PLATFORM=cuda INTERPRET=0 TESTS="tests/kernels/test_rpa_kernel.py"
TESTS="$TESTS tests/kernels/test_rpa_reference.py tests/kernels/test_rpa_lowering.py"
if [[ -n "${CPU_SMOKE:-}" ]]; then
  sees_gpu() { "$1" -c 'import jax' 2>/dev/null; }
  PLATFORM=cpu INTERPRET=1 TESTS="tests/kernels/test_rpa_lowering.py"
  BENCH_ARGS="--interpret --small --models smollm2 ${BENCH_ARGS:-}"
  [[ -f scripts/bench_throughput.py ]] && THROUGHPUT_ARGS="${THROUGHPUT_ARGS:---help}"
fi
if [[ -z "${PY:-}" ]]; then
  for cand in .venv/bin/python python3 python; do
    if command -v "$cand" >/dev/null && sees_gpu "$cand"; then PY="$cand"; break; fi
  done
fi
if [[ -z "${PY:-}" ]] || ! sees_gpu "$PY"; then
  echo "gpu_check: no python whose jax sees a GPU (set PY=...)." >&2
  exit 2
fi
{
  nvidia-smi 2>&1 || true
  "$PY" -c 'import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())'
} >"$LOG/env.txt" 2>&1
note "logs" "$LOG"
note "python" "$PY ($(tail -n1 "$LOG/env.txt"))"

status=0
export JAX_PLATFORMS=$PLATFORM   # tests/conftest.py defaults to cpu only when this is unset
# The reference's float32 einsums would run in TF32 on the GPU; the tests compare at 1e-5.
export JAX_DEFAULT_MATMUL_PRECISION=highest
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# 1. Kernel tests on the GPU (interpret=False), plus the reference and lowering tests.
if [[ -z "${SKIP_TESTS:-}" ]]; then
  start=$SECONDS
  # shellcheck disable=SC2086
  RPA_INTERPRET=$INTERPRET timeout "${TEST_TIMEOUT:-420}" "$PY" -m pytest -o addopts= -q \
    -p no:cacheprovider $TESTS >"$LOG/tests_gpu.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  note "tests (GPU, Triton)" "rc=$rc in $((SECONDS - start))s: $(grep -E '(passed|failed|error)' \
    "$LOG/tests_gpu.log" | tail -n1)"
fi

# 2. Kernel benchmark.
unset JAX_DEFAULT_MATMUL_PRECISION
start=$SECONDS
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-300}" "$PY" scripts/bench_kernel.py --json "$LOG/bench_kernel.json" \
  ${BENCH_ARGS:-} >"$LOG/bench_kernel.log" 2>&1
rc=$?
[[ $rc -ne 0 ]] && status=1
note "bench_kernel" "rc=$rc in $((SECONDS - start))s"

# 3. Engine throughput, when that script exists.
if [[ -f scripts/bench_throughput.py ]]; then
  start=$SECONDS
  # shellcheck disable=SC2086
  timeout "${THROUGHPUT_TIMEOUT:-300}" "$PY" scripts/bench_throughput.py \
    ${THROUGHPUT_ARGS:---dtypes bfloat16 --passes 2 --out $LOG/throughput} \
    >"$LOG/bench_throughput.log" 2>&1
  rc=$?
  [[ $rc -ne 0 ]] && status=1
  note "bench_throughput" "rc=$rc in $((SECONDS - start))s"
else
  note "bench_throughput" "skipped (no scripts/bench_throughput.py)"
fi

# Summary last: failing tests, the kernel table, the end of the throughput log.
echo
if [[ -f "$LOG/tests_gpu.log" ]] && grep -qE '^(FAILED|ERROR)' "$LOG/tests_gpu.log"; then
  grep -E '^(FAILED|ERROR)' "$LOG/tests_gpu.log" | head -n 20
  echo
fi
if grep -q '^roofline:' "$LOG/bench_kernel.log" 2>/dev/null; then
  sed -n '/^roofline:/,$p' "$LOG/bench_kernel.log"
else
  tail -n 15 "$LOG/bench_kernel.log" 2>/dev/null
fi
if [[ -f "$LOG/bench_throughput.log" ]]; then
  echo
  tail -n 12 "$LOG/bench_throughput.log"
fi
echo
cat "$SUMMARY"
exit $status
