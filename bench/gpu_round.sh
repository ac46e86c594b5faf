#!/usr/bin/env bash
# One H200 call that checks every kernel against its reference, graphs against eager, and then times every stage
# (per-kernel breakdown included). Correctness first: a failed check is reported and the timings still run, so
# one call shows both. Usage (on the device machine, from the repo root, .whl and .deb carried):
#   source bench/h200_env.sh && bash bench/gpu_round.sh $OUT
set -u
OUT=${1:?usage: bench/gpu_round.sh OUT_DIR}
mkdir -p "$OUT"
status=0
step() {  # [LIMIT=s] step NAME COMMAND...: run (killed after LIMIT s), log to OUT/NAME.log, remember a failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "${LIMIT:-300}" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL:-25}" "$OUT/$name.log"
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  [ $rc -eq 0 ] || status=1
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
# TUNE=1: measure the skinny linear kernel against cuBLAS first; the steps after it run with the table it wrote.
if [ -n "${TUNE:-}" ]; then
  LIMIT=${TUNE_S:-240} step tune_linear python3 -m engine.tools.tune_linear "$OUT/linear"
  export VOICELANE_LINEAR_TABLE=$OUT/linear/linear_table.json
fi
# The profile first: if a check hangs until its limit, the stage times still come back.
# The language-model stages and the codec are two runs, so one slow half cannot take the other's numbers with it.
# VARIANTS="NAME:VAR=VALUE,VAR=VALUE ...": the language-model profile once per variant of the environment (e.g.
# VOICELANE_PDL on and off), each into stages_NAME.json, instead of the one profile.
lm_profile() {  # lm_profile NAME [VAR=VALUE...]
  local name=$1; shift
  LIMIT=${PROFILE_S:-200} step "$name" env "$@" python3 -m engine.tools.profile_stages --model random:1.7b \
    --batches ${BATCHES:-1 8 32 64} --prompt-lens ${PROMPT_LENS:-16 64} --graphs on \
    --stages ${LM_STAGES:-prefill talker code_predictor} ${PROFILE_ARGS:-} --out "$OUT/stages_$name.json"
}
if [ -n "${VARIANTS:-}" ]; then
  for v in $VARIANTS; do lm_profile "${v%%:*}" $(echo "${v#*:}" | tr , ' '); done
elif [ -z "${SKIP_PROFILE:-}" ]; then
  lm_profile lm
fi
[ -z "${SKIP_PROFILE_CODEC:-}" ] && LIMIT=${PROFILE_CODEC_S:-200} step profile_codec python3 -m engine.tools.profile_stages \
  --model random:1.7b --batches ${BATCHES:-1 8 32 64} --chunks ${CHUNKS:-1 4 12} --graphs on --stages codec \
  ${CODEC_LAYOUTS:+--codec-layouts $CODEC_LAYOUTS} --out "$OUT/stages_codec.json"
[ -z "${SKIP_KERNELS:-}" ] && LIMIT=${KERNELS_S:-160} step gpu_check_kernels python3 -m engine.tools.gpu_check_kernels "$OUT/kernels" \
  ${KERNELS_ARGS:-}
[ -z "${SKIP_CODEC:-}" ] && LIMIT=${CODEC_S:-110} step gpu_check_codec python3 -m engine.tools.gpu_check_codec \
  "$OUT/codec" ${CODEC_ARGS:-}
[ -z "${SKIP_SAMPLER:-}" ] && LIMIT=${SAMPLER_S:-80} step gpu_check_sampler python3 -m engine.tools.gpu_check_sampler \
  "$OUT/sampler"
[ -n "${ENGINE_TESTS:-}" ] && LIMIT=200 step engine_tests env VOICELANE_TEST_DEVICE=cuda python3 -m pytest -q -x tests/test_engine.py
# The device tool returns at most 8 files: everything else travels as one archive.
tar czf "$OUT/round.tgz" -C "$OUT" --exclude=round.tgz . 2>/dev/null
exit $status
