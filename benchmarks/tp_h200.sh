#!/usr/bin/env bash
# One call on a multi-GPU H200 host (device kind nvidia-h200-x2 or larger), from the repo root:
#   source .devcarry/prelude.sh && bash benchmarks/tp_h200.sh "$OUT"
# 1. the single-GPU CUDA-graph replay tests on the last GPU, beside KERNEL_TESTS (if set: kernel
#    test files) on GPU 0; then the 2-GPU collective test (NCCL / one-shot / two-shot under CUDA
#    graphs, torchrun);
# 2. the all-reduce benchmark (algorithms, the fused op vs the unfused torch path) per bucket
#    (AR=0: skip);
# 3. the tensor-parallel yardstick (TP_VARIANTS of eager, k3, k3 without shard, Inductor) at
#    TP = all GPUs over TP_BATCHES; with STREAMS=auto it runs with K3_SIDE_STREAMS=1 (the L2
#    prefetch beside the fused collectives) when step 1's Inductor side-stream test passed;
# 4. the single-GPU yardstick at B = 1 (k3 vs Inductor) on GPU 0 (YARD=0: skip).
# Default timeouts sum to ~570 s.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
CUDA_VISIBLE_DEVICES=$((GPUS - 1)) timeout "${GRAPH_TIMEOUT:-150}" python3 -m pytest -q -rA \
  -p no:cacheprovider -o faulthandler_timeout=140 tests/backend/test_cuda_graphs.py \
  > "$OUT/graph_tests.log" 2>&1 &
graph=$!
if [ -n "${KERNEL_TESTS:-}" ]; then
  CUDA_VISIBLE_DEVICES=0 step kernel_tests "${KERNEL_TIMEOUT:-200}" python3 -m pytest -q \
    -p no:cacheprovider -n "${PYTEST_N:-8}" $KERNEL_TESTS
fi
wait $graph; echo "graph_tests: exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
tail -4 "$OUT/graph_tests.log"
step collective_test "${COLL_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_collective.py
if [ "${AR:-1}" != 0 ]; then
  step allreduce "${AR_TIMEOUT:-70}" python3 -m torch.distributed.run --nproc-per-node "$GPUS" \
    benchmarks/allreduce.py --out "$OUT" --buckets 1,2,4,8,16,32,64 --replays 100
fi
if [ "${STREAMS:-}" = auto ] && grep -q "PASSED .*side_streams_equals_eager" "$OUT/graph_tests.log"; then
  export K3_SIDE_STREAMS=1; echo "tp_decode with K3_SIDE_STREAMS=1" | tee -a "$OUT/steps.txt"
fi
step tp_decode "${TP_TIMEOUT:-250}" python3 -m torch.distributed.run --nproc-per-node "$GPUS" \
  benchmarks/tp_decode.py --out "$OUT" --batches "${TP_BATCHES:-1,8}" \
  --variants "${TP_VARIANTS:-eager,k3,k3_noshard,inductor}" --time-budget "${TP_BUDGET:-170}"
tail -24 "$OUT/tp_decode.log"
if [ "${YARD:-1}" != 0 ]; then
  CUDA_VISIBLE_DEVICES=0 step yardstick "${YARD_TIMEOUT:-100}" python3 benchmarks/decode_layer.py \
    --variants inductor,k3 --batches 1 --verify 0 --out "$OUT" --time-budget 80 --max-time-s 2
fi
echo "total: $(( $(date +%s) - t0 )) s"
