#!/usr/bin/env bash
# One H200 call that tunes the kernels' configs, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/tune_h200.sh "$OUT"
# 1. TESTS (default: the CUDA-graph replay tests and the composites' GPU tests) check the
#    registered kernels first;
# 2. moe_experts --sweep (every FC1 / FC2 config at MOE_BATCHES);
# 3. gemm_tc --sweep at GEMM_M rows on GEMM_SHAPES, merged shape by shape into a copy of the
#    shipped table: $OUT/gemm_tc_tuned.json (copy it over kernels/ to ship it).
# Each step has its own timeout (seconds: TESTS_TIMEOUT, MOE_TIMEOUT, GEMM_TIMEOUT).
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
step tests "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -n 6 \
  ${TESTS:-tests/e2e/test_cuda_graphs.py tests/kernels/test_composite.py}
step moe_sweep "${MOE_TIMEOUT:-110}" python3 benchmarks/moe_experts.py --sweep \
  --batches "${MOE_BATCHES:-1,8,64}" --out "$OUT"
cp kernels/common/gemm_tc_tuned.json "$OUT/gemm_tc_tuned.json"
step gemm_sweep "${GEMM_TIMEOUT:-230}" python3 benchmarks/gemm_tc.py --sweep --m "${GEMM_M:-8,64}" \
  ${GEMM_SHAPES:+--only "$GEMM_SHAPES"} --table "$OUT/gemm_tc_tuned.json" --out "$OUT"
echo "total: $(( $(date +%s) - t0 )) s"
