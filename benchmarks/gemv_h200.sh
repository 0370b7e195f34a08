#!/usr/bin/env bash
# One H200 call for gemv's configs (issue 21), from the repository root (~4 minutes):
#   source .devcarry/prelude.sh && bash benchmarks/gemv_h200.sh "$OUT"
# 1. the gemv GPU tests (tests/kernels/test_gemv.py: the heuristic's configs, the configs a
#    tuned table may pick, every one-launch variant with them);
# 2. benchmarks/gemv.py --sweep at SWEEP_M rows (default 1) on the TP16 shapes (SWEEP_SHAPES:
#    all), weights rotated past L2: every config built first in SWEEP_JOBS processes (the disk
#    cache), then timed one by one; no shape starts after SWEEP_BUDGET seconds. Above one row it
#    also times what router.linear runs there now (gemm_tc or cuBLAS). Writes
#    $OUT/gemv_sweep.json, $OUT/gemv_sweep.log (per shape: the heuristic's and the best config's
#    µs and % of copy bandwidth) and $OUT/gemv_tuned.json (copy it over kernels/common/ to ship).
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
step gemv_tests "${TESTS_TIMEOUT:-110}" python3 -m pytest -q -p no:cacheprovider -n 8 \
  tests/kernels/test_gemv.py
step gemv_sweep "${SWEEP_TIMEOUT:-150}" python3 benchmarks/gemv.py --sweep --m "${SWEEP_M:-1}" \
  ${SWEEP_SHAPES:+--only "$SWEEP_SHAPES"} --jobs "${SWEEP_JOBS:-12}" \
  --budget "${SWEEP_BUDGET:-100}" --out "$OUT"
echo "total: $(( $(date +%s) - t0 )) s"
