#!/usr/bin/env bash
# One H200 call that checks a change to the runner and times it against another commit on the same machine:
#   source bench/h200_env.sh && bash bench/stage_ab.sh OUT_DIR BASE_DIR
# BASE_DIR: a checkout of the commit to compare with, inside the tree, git-ignored and named in the call's carry list
# (`git worktree add ab_base SHA && echo /ab_base >> .git/info/exclude`; its docs/ and tests/ can be deleted there).
# In order, each under its own limit, so that a cut keeps what came before: greedy codes with graphs against eager
# (this tree), the stage profile of this tree, the same profile of BASE_DIR (python -m runs from there, so its
# engine/ is the one imported). MODEL, BATCHES, CHUNKS, STAGES, GRAPHS, CHECK_BATCHES, FRAMES, CHECK_ARGS, the *_S limits
# override the defaults (a CPU dry run: MODEL=random:tiny GRAPHS=emulate CHECK_ARGS=--smoke CHECK_BATCHES=1 FRAMES=3
# TRITON_INTERPRET=1).
set -u
OUT=${1:?usage: bench/stage_ab.sh OUT_DIR BASE_DIR}
BASE=${2:?usage: bench/stage_ab.sh OUT_DIR BASE_DIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
MODEL=${MODEL:-random:1.7b}
PROFILE=(--model "$MODEL" --batches ${BATCHES:-1 8} --prompt-lens 16 --cached-lens 1 --chunks ${CHUNKS:-1 12}
         --graphs ${GRAPHS:-on} --stages ${STAGES:-first_audio talker code_predictor codec} --repeat 10)
status=0
run() {  # run NAME LIMIT_S COMMAND...: its output in OUT/NAME.log, the tail shown
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || { echo "=== $name: exit $?"; status=1; }
  tail -n "${TAIL:-14}" "$OUT/$name.log" | grep -v USDT
}
run check "${CHECK_S:-120}" python3 -m engine.tools.gpu_check_kernels "$OUT/check" --graphs-only --model "$MODEL" \
  --batches ${CHECK_BATCHES:-1 8} --frames ${FRAMES:-24} ${CHECK_ARGS:-}
run new "${PROFILE_S:-150}" python3 -m engine.tools.profile_stages "${PROFILE[@]}" --out "$OUT/stages_new.json"
run base "${PROFILE_S:-150}" bash -c 'cd "$0" && exec python3 -m engine.tools.profile_stages "$@"' "$BASE" \
  "${PROFILE[@]}" --out "$OUT/stages_base.json"
exit $status
