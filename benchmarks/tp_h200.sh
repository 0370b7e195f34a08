#!/usr/bin/env bash
# One call on a multi-GPU H200 host (device kind nvidia-h200-x2 or larger), from the repo root:
#   source .devcarry/prelude.sh && bash benchmarks/tp_h200.sh "$OUT"
# 1. two single-GPU lanes side by side:
#    last GPU: TESTS (default: the CUDA-graph replay tests), then BENCH (benchmarks/<name>.py
#      each, e.g. "kernels --only moe_route");
#    GPU 0:    KERNEL_TESTS (test files, if set), then with AB=streams the per-layer yardstick
#      (AB_BATCHES) with K3_SIDE_STREAMS=1 and =0 (folders streams1/, streams0/);
# 2. the 2-GPU collective test (NCCL / one-shot / two-shot under CUDA graphs, torchrun);
# 3. the all-reduce benchmark per bucket (AR=0: skip);
# 4. the tensor-parallel yardstick (TP_VARIANTS of eager, k3, k3 without shard, Inductor) at
#    TP = all GPUs over TP_BATCHES; with STREAMS=auto it runs with K3_SIDE_STREAMS=1 (the L2
#    prefetch beside the fused collectives) when step 1's Inductor side-stream test passed; a
#    kernel named in SKIP_IF_FAILED whose test file failed in step 1 is set aside
#    (K3_KERNELS_SKIP) for it;
# 5. the single-GPU yardstick at B = 1 (k3 vs Inductor) on GPU 0 (YARD=0: skip).
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l)
lane_last() {
  step tests "${GRAPH_TIMEOUT:-150}" python3 -m pytest -q -rA -p no:cacheprovider \
    ${TESTS:-tests/e2e/test_cuda_graphs.py}
  if [ -n "${BENCH:-}" ]; then
    step bench "${BENCH_TIMEOUT:-90}" python3 benchmarks/$BENCH --out "$OUT/bench.json"
  fi
}
lane_0() {
  if [ -n "${KERNEL_TESTS:-}" ]; then
    step kernel_tests "${KERNEL_TIMEOUT:-200}" python3 -m pytest -q -rA -p no:cacheprovider \
      -n "${PYTEST_N:-8}" $KERNEL_TESTS
  fi
  if [ "${AB:-}" = streams ]; then
    for s in 1 0; do
      K3_SIDE_STREAMS=$s step "yard_streams$s" "${AB_TIMEOUT:-110}" python3 benchmarks/decode_layer.py \
        --variants k3 --batches "${AB_BATCHES:-1,8,64}" --verify 0 --out "$OUT/streams$s" \
        --time-budget "${AB_BUDGET:-80}" --max-time-s 2
      grep -E "^(B[0-9]|bucket)" "$OUT/yard_streams$s.log" | tail -5
    done
  fi
}
CUDA_VISIBLE_DEVICES=$((GPUS - 1)) lane_last &
last=$!
CUDA_VISIBLE_DEVICES=0 lane_0
wait $last
step collective_test "${COLL_TIMEOUT:-170}" python3 -m pytest -q -p no:cacheprovider \
  tests/kernels/test_collective.py
if [ "${AR:-1}" != 0 ]; then
  step allreduce "${AR_TIMEOUT:-70}" python3 -m torch.distributed.run --nproc-per-node "$GPUS" \
    benchmarks/allreduce.py --out "$OUT" --buckets 1,2,4,8,16,32,64 --replays 100
fi
if [ "${STREAMS:-}" = auto ] && grep -hq "PASSED .*side_streams_equals_eager" "$OUT"/*tests.log; then
  export K3_SIDE_STREAMS=1; echo "tp_decode with K3_SIDE_STREAMS=1" | tee -a "$OUT/steps.txt"
fi
skip=
for k in ${SKIP_IF_FAILED:-}; do
  grep -hq "FAILED tests/kernels/test_$k" "$OUT"/*tests.log && skip=$skip${skip:+,}$k
done
[ -n "$skip" ] && echo "tp_decode with K3_KERNELS_SKIP=$skip" | tee -a "$OUT/steps.txt"
K3_KERNELS_SKIP=$skip step tp_decode "${TP_TIMEOUT:-250}" python3 -m torch.distributed.run \
  --nproc-per-node "$GPUS" benchmarks/tp_decode.py --out "$OUT" --batches "${TP_BATCHES:-1,8}" \
  --variants "${TP_VARIANTS:-eager,k3,k3_noshard,inductor}" --time-budget "${TP_BUDGET:-170}"
tail -24 "$OUT/tp_decode.log"
if [ "${YARD:-1}" != 0 ]; then
  CUDA_VISIBLE_DEVICES=0 step yardstick "${YARD_TIMEOUT:-100}" python3 benchmarks/decode_layer.py \
    --variants inductor,k3 --batches 1 --verify 0 --out "$OUT" --time-budget 80 --max-time-s 2
fi
echo "total: $(( $(date +%s) - t0 )) s"
