#!/usr/bin/env bash
# The H200 report's load points, all against one server started here (docs/benchmarks/README.md says why each).
#   bench/run_h200.sh OUT_DIR PHASE...      phases: profile engine (no server), w1 w1:RPS:WINDOW_S capacity w2 w3
# (MODEL, SERVER_ARGS, WARMUP, WINDOW, W1_RPS, CAPACITY_ARGS (the capacity search's rates) and CLIENT_PROCS (the
# load generator's processes) override the defaults, e.g. for a CPU smoke run with tiny-random.)
# On a copy of the tree whose git metadata is stale, set VOICELANE_COMMIT so the reports name the right commit.
# capacity is resumable: keep OUT_DIR/capacity_w1.json and run the phase again until it exits 0.
set -u
OUT=${1:?usage: bench/run_h200.sh OUT_DIR PHASE...}; shift
URL=http://127.0.0.1:8000
BASE=${BASE:-docs/benchmarks/h200/baseline_official.json}
COMMON=(--url "$URL" --warmup "${WARMUP:-15}" --window "${WINDOW:-60}" --seed 0 --procs "${CLIENT_PROCS:-1}")
mkdir -p "$OUT"
SERVER_PID=
start_server() {  # once, before the first phase that needs it
  [ -n "$SERVER_PID" ] && return 0
  python3 -m server serve --model "${MODEL:-random:1.7b}" ${SERVER_ARGS:-} --bench-frames-per-word 5 --port 8000 \
    >"$OUT/server.log" 2>&1 &
  SERVER_PID=$!
  trap 'kill $SERVER_PID 2>/dev/null; wait $SERVER_PID 2>/dev/null' EXIT
  python3 - "$URL" <<'PY'
import sys, time, urllib.request
for _ in range(300):
    try:
        if urllib.request.urlopen(sys.argv[1] + "/ready", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        time.sleep(1)
sys.exit("server not ready after 300 s")
PY
}
status=0
for phase in "$@"; do
  case $phase in
    profile|engine) ;;
    *) start_server || exit 1 ;;
  esac
  case $phase in
    profile) python3 -m engine.tools.profile_stages --model "${MODEL:-random:1.7b}" --batches 1 8 64 \
          --prompt-lens 16 64 --chunks 1 12 --graphs on --out "$OUT/stages.json" || status=1 ;;
    engine) python3 -m engine.tools.bench_engine --model "${MODEL:-random:1.7b}" --streams 1 8 32 64 --frames 60 \
          --json "$OUT/bench_engine.json" || status=1 ;;
    w1) RATES=${W1_RPS:-1 10 20}
        python3 -m bench.loadgen "${COMMON[@]}" --workload w1 --rps $RATES --baseline "$BASE" \
          --out "$OUT/w1_rps${RATES// /_}.json" || status=1 ;;
    capacity) python3 -m bench.capacity "${COMMON[@]}" --workload w1 ${CAPACITY_ARGS:---start 1 --factor 2 \
          --min-rps 0.25 --max-rps 40 --resolution 0.1 --min-step 0.25} --budget "${CAPACITY_BUDGET:-240}" \
          --state "$OUT/capacity_w1.json"; rc=$?; [ $rc -eq 0 ] || { echo "capacity: exit $rc (75 = run again)"; status=$rc; } ;;
    w1:*:*) IFS=: read -r _ rps window <<<"$phase"  # one rate, its own window (e.g. w1:10:300)
        python3 -m bench.loadgen --url "$URL" --warmup "${WARMUP:-15}" --window "$window" --seed 0 --workload w1 \
          --procs "${CLIENT_PROCS:-1}" \
          --rps "$rps" --baseline "$BASE" --out "$OUT/w1_rps${rps}_${window}s.json" || status=1 ;;
    w2) python3 -m bench.loadgen "${COMMON[@]}" --workload w2 --rps 5 --baseline "$BASE" \
          --out "$OUT/w2_rps5.json" || status=1 ;;
    w3) python3 -m bench.loadgen "${COMMON[@]}" --workload w3 --rps 5 --out "$OUT/w3_rps5.json" || status=1 ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
exit $status
