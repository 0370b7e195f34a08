#!/usr/bin/env bash
# One H200 call for K3_MOE_F16 (moe_experts' packed fp16 decode, issue 21), from the repository
# root, ~4 min:
#   source .devcarry/prelude.sh && bash benchmarks/moe_f16_h200.sh "$OUT"
# 1. the moe_experts GPU and build tests that take the switch (`-k f16`: both decodes; the
#    f16_on ones against the exact fp16 emulation and the reference), WORKERS (8) processes;
# 2. benchmarks/moe_experts.py at B 1, 8, 64 (TP16 rank, CUDA-graph replay): `kernel` then
#    `kernel_f16` at each batch, one process; $OUT/moe_f16.json, the table in moe_bench.log.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
step f16_tests "${TEST_TIMEOUT:-170}" python3 -m pytest -q -rf -p no:cacheprovider \
  -n "${WORKERS:-8}" -m "gpu or dsl" -k f16 tests/fusions/test_moe_experts_kernel.py
PYTHONPATH=$PYTHONPATH:benchmarks step moe_bench "${BENCH_TIMEOUT:-100}" python3 \
  benchmarks/moe_experts.py --batches 1,8,64 --variants kernel,kernel_f16 \
  --out "$OUT/moe_f16.json"
grep -E "^\| [0-9]" "$OUT/moe_bench.log"
echo "total: $(( $(date +%s) - t0 )) s"
