#!/usr/bin/env bash
# Greedy codes with CUDA graphs against eager, once per environment variant, each in a process of its own (cuBLAS
# reads CUBLAS_WORKSPACE_CONFIG when CUDA starts): tells which part a graphs-against-eager difference comes from.
#   source bench/h200_env.sh && bash bench/graphs_diag.sh OUT_DIR
# Variants: as shipped; every decode projection on the skinny Triton kernel (no cuBLAS at B1..64); cuBLAS with one
# fixed workspace per stream (bit-reproducible across streams, by cuBLAS's own rules). Each run also repeats eager and
# graphs once (--repeat-check): a mode that differs from itself is nondeterministic, not wrong. VARIANTS picks some
# (e.g. VARIANTS=default BATCHES="1 32", then the other two at BATCHES=1 only).
set -u
OUT=${1:?usage: bench/graphs_diag.sh OUT_DIR}
mkdir -p "$OUT"
status=0
for variant in ${VARIANTS:-default linear_triton:VOICELANE_LINEAR=triton cublas_fixed:CUBLAS_WORKSPACE_CONFIG=:4096:8}; do
  name=${variant%%:*}
  assign=(); [ "$name" != "$variant" ] && assign=("${variant#*:}")
  echo "=== $name ${assign[*]:-}"
  env "${assign[@]}" timeout "${CHECK_S:-90}" python3 -m engine.tools.gpu_check_kernels "$OUT/$name" --graphs-only \
    --repeat-check --model "${MODEL:-random:1.7b}" --batches ${BATCHES:-1 32} --frames ${FRAMES:-64} ${CHECK_ARGS:-} \
    >"$OUT/$name.log" 2>&1 || status=1
  grep -E "^(ok|FAIL)" "$OUT/$name.log" || tail -n 5 "$OUT/$name.log"
done
exit $status
