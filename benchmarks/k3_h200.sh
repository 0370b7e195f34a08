#!/usr/bin/env bash
# One H200 call for the backend: its GPU tests (CUDA-graph replay of tiny/small vs eager), then
# the per-layer yardstick with Inductor and k3 in the same run. From the repository root, after
# `source .devcarry/prelude.sh`:  bash benchmarks/k3_h200.sh OUT
set -u
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -x -p no:cacheprovider \
  tests/backend/test_cuda_graphs.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu_tests.log"
tail -5 "$OUT/gpu_tests.log"
python3 benchmarks/decode_layer.py --variants "${VARIANTS:-eager,inductor,k3}" \
  --batches "${BATCHES:-1,8,64}" --verify "${VERIFY:-8}" --out "$OUT" \
  --time-budget "${TIME_BUDGET:-300}" --max-time-s 2 2>&1 | tee "$OUT/log.txt"
echo "total: $(( $(date +%s) - t0 )) s"
