#!/usr/bin/env bash
# One call on a multi-GPU H200 host (device kind nvidia-h200-x2 or larger), from the repo root:
#   source .devcarry/prelude.sh && bash benchmarks/tp_h200.sh "$OUT"
# 1. the 2-GPU collective test (NCCL / one-shot / two-shot under CUDA graphs) while the
#    single-GPU CUDA-graph replay tests run on the last GPU;
# 2. the all-reduce benchmark (algorithms, the fused op vs the unfused torch path) per bucket;
# 3. the tensor-parallel yardstick (eager, k3, k3 without shard, Inductor) at TP = all GPUs;
# 4. the single-GPU yardstick at B = 1 (k3 vs Inductor) on GPU 0.
# Timeouts sum to ~570 s. Keep PYTHONPATH's prelude entries (the CuTe DSL lives there).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -c "import cutlass.cute, tvm_ffi" || { echo "CuTe DSL not importable: source .devcarry/prelude.sh first"; exit 2; }
GPUS=$(nvidia-smi -L | wc -l)
t0=$(date +%s)
note() { echo "$1: exit $2 after $(( $(date +%s) - t0 )) s (124: timed out)" | tee -a "$OUT/steps.txt"; }
CUDA_VISIBLE_DEVICES=$((GPUS - 1)) timeout "${GRAPH_TIMEOUT:-150}" python3 -m pytest -q -v \
  -p no:cacheprovider -o faulthandler_timeout=140 tests/backend/test_cuda_graphs.py \
  > "$OUT/graph_tests.log" 2>&1 &
graph=$!
timeout "${COLL_TIMEOUT:-140}" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_collective.py \
  > "$OUT/collective_test.log" 2>&1; note collective_test $?
wait $graph; note graph_tests $?
timeout "${AR_TIMEOUT:-70}" python3 -m torch.distributed.run --nproc-per-node "$GPUS" \
  benchmarks/allreduce.py --out "$OUT" --buckets 1,2,4,8,16,32,64 --replays 100 \
  > "$OUT/allreduce.log" 2>&1; note allreduce $?
timeout "${TP_TIMEOUT:-250}" python3 -m torch.distributed.run --nproc-per-node "$GPUS" \
  benchmarks/tp_decode.py --out "$OUT" --batches "${TP_BATCHES:-1,8}" --time-budget 170 \
  > "$OUT/tp_decode.log" 2>&1; note tp_decode $?
CUDA_VISIBLE_DEVICES=0 timeout "${YARD_TIMEOUT:-100}" python3 benchmarks/decode_layer.py \
  --variants inductor,k3 --batches 1 --verify 0 --out "$OUT" --time-budget 80 --max-time-s 2 \
  > "$OUT/yardstick.log" 2>&1; note yardstick $?
for f in collective_test graph_tests; do tail -4 "$OUT/$f.log"; done
grep -v Warn "$OUT/allreduce.log" | tail -12
tail -20 "$OUT/tp_decode.log"
grep -v Warn "$OUT/yardstick.log" | tail -6
echo "total: $(( $(date +%s) - t0 )) s"
