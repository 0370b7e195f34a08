#!/usr/bin/env bash
# One H200 call that tunes the kernels' configs, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/tune_h200.sh "$OUT"
# 1. TESTS (default: the CUDA-graph replay tests and the composites' GPU tests) check the
#    registered kernels first;
# 2. moe_experts --sweep (every FC1 / FC2 config at MOE_BATCHES);
# 3. gemm_tc --sweep at GEMM_M rows on GEMM_SHAPES, merged shape by shape into a copy of the
#    shipped table: $OUT/gemm_tc_tuned.json (copy it over kernels/ to ship it).
# Each step has its own timeout (seconds: TESTS_TIMEOUT, MOE_TIMEOUT, GEMM_TIMEOUT).
# Keep PYTHONPATH's prelude entries (see k3_h200.sh).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import cutlass.cute, tvm_ffi" || { echo "CuTe DSL / TVM-FFI not importable: source .devcarry/prelude.sh first"; exit 2; }
t0=$(date +%s)
step() {  # $1: name, $2: timeout (s), rest: command
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (124: timed out)" | tee -a "$OUT/steps.txt"
  tail -3 "$OUT/$name.log"
}
step tests "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -n 6 \
  ${TESTS:-tests/backend/test_cuda_graphs.py tests/kernels/test_composite.py}
step moe_sweep "${MOE_TIMEOUT:-110}" python3 benchmarks/moe_experts.py --sweep \
  --batches "${MOE_BATCHES:-1,8,64}" --out "$OUT"
cp kernels/gemm_tc_tuned.json "$OUT/gemm_tc_tuned.json"
step gemm_sweep "${GEMM_TIMEOUT:-230}" python3 benchmarks/gemm_tc.py --sweep --m "${GEMM_M:-8,64}" \
  ${GEMM_SHAPES:+--only "$GEMM_SHAPES"} --table "$OUT/gemm_tc_tuned.json" --out "$OUT"
echo "total: $(( $(date +%s) - t0 )) s"
