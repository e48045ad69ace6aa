#!/bin/bash
# Online serving, jaxbatch then `vllm serve` (bf16), one after the other on this machine:
# scripts/bench_serving.py at Poisson rates $RATES (default 2 4 8) on bench64 and on the
# shared-prefix chat workload (made by scripts/make_shared_prefix_workload.py when missing).
#   PEERS=/path/to/peers bash scripts/serving_vs_vllm.sh
# (PEERS: a vLLM-CPU set-up made with the team's ../shared/peers/setup_vllm_cpu.sh, an optional
# extra outside this repository; SKIP_VLLM=1 runs jaxbatch alone without it)
# Env: RATES, OUT (results folder), PEER_SCRIPTS (where vllm_cli.py is; ../shared/peers), SKIP_OURS=1, SKIP_VLLM=1, JAXBATCH_ARGS (more `jaxbatch serve`
# options, e.g. --no-live-replan for an A/B of re-planning), GAP (seconds of quiet between two
# runs, default 15: jaxbatch compiles a re-planned set in such lulls, and a run should not start
# on top of that compile; both servers get the same gaps). jaxbatch runs the SmolLM2 preset
# (live re-planning on; its learned bucket sets are cleared first so runs start alike).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/serving-$(date +%H%M)}
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
  [ -n "${PEERS:-}" ] || { echo "PEERS is not set: point it at a vLLM-CPU set-up, or SKIP_VLLM=1" >&2; exit 2; }
  # shellcheck disable=SC1091
  source "$PEERS/env.sh"
  "$PEERS/venv/bin/python" "${PEER_SCRIPTS:-../shared/peers}/vllm_cli.py" serve "$PEERS/smollm2-bf16" --host 127.0.0.1 \
    --port 8011 --dtype bfloat16 --max-model-len 2048 > "$OUT/vllm-server.log" 2>&1 &
  P=$!
  wait_up http://127.0.0.1:8011 && run_set vllm http://127.0.0.1:8011
  kill -INT $P; wait $P
fi
echo "results in $OUT"
