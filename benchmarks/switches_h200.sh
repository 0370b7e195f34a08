#!/usr/bin/env bash
# One H200 call that decides decode switches by A/B yardsticks, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/switches_h200.sh "$OUT"
#   RUNS="streams1:K3_SIDE_STREAMS=1 streams0:K3_SIDE_STREAMS=0" bash benchmarks/switches_h200.sh "$OUT"
# 1. TESTS, if given (pytest arguments, e.g. the Inductor side-stream CUDA-graph test);
# 2. one yardstick process (decode_layer.py, k3 only) per entry of RUNS, NAME:VAR=V,VAR=V, in
#    order, each in $OUT/NAME with those environment variables set on top of the defaults;
#    INDUCTOR=1 adds Inductor to the first run (a same-call baseline).
# BATCHES (default 1,8,64), VERIFY (T of the verify bucket, default 8, 0: none) and BUDGET (s
# per run, default 80) for every run.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
if [ -n "${TESTS:-}" ]; then
  step tests "${TEST_TIMEOUT:-150}" python3 -m pytest -q -rA -p no:cacheprovider $TESTS
fi
variants="${INDUCTOR:+inductor,}k3"
for run in ${RUNS:-pdl1:K3_PDL=1 pdl0:K3_PDL=0}; do
  name=${run%%:*}; vars=${run#*:}
  mkdir -p "$OUT/$name"
  # a comma starts the next VAR=V only before a name and "=" (K3_GEMV_FUSED=norm,situ stays whole)
  step "yard_$name" $(( ${BUDGET:-80} + 45 )) env $(sed -E 's/,([A-Za-z_][A-Za-z0-9_]*=)/ \1/g' <<< "$vars") python3 benchmarks/decode_layer.py \
    --variants "$variants" --batches "${BATCHES:-1,8,64}" --verify "${VERIFY:-8}" \
    --out "$OUT/$name" --time-budget "${BUDGET:-80}" --max-time-s 2
  grep -E "^(B[0-9]|bucket)" "$OUT/yard_$name.log" | tail -5
  variants=k3
done
echo "total: $(( $(date +%s) - t0 )) s"
