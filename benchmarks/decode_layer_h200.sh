#!/usr/bin/env bash
# The GPU run recorded in BENCHMARKS.md, from the repository root: bash benchmarks/decode_layer_h200.sh OUT
#
# Inductor compiles each of the 8 buckets from scratch (dynamic=False), and one process does that
# serially on one core. So four compile-only jobs first fill Inductor's on-disk caches in parallel
# (their kernels are not autotuned into the cache: they share the GPU); then the benchmark runs
# alone on the GPU, its compiles mostly cache hits, and times everything.
set -u
OUT=${1:-out}
VARIANTS=${VARIANTS:-eager,inductor}
EXTRA=${EXTRA:-}  # e.g. "--config tiny --device cpu --context 64" for a dry run without a GPU
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__)"
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)"
  nproc
} > "$OUT/env.txt" 2>&1

t0=$(date +%s)
compile_only() {  # $1: tag, rest: bucket arguments
  local tag=$1; shift
  TORCHINDUCTOR_COMPILE_THREADS=4 timeout "${WARM_TIMEOUT:-150}" python3 benchmarks/decode_layer.py \
    --compile-only --max-batch 64 --variants "${VARIANTS#eager,}" $EXTRA "$@" \
    > "$OUT/warm_$tag.log" 2>&1 || echo "exit $? (124: timed out)" >> "$OUT/warm_$tag.log"
}
compile_only t8 --batches none --verify 8 &
compile_only a --batches 1,64 --verify 0 &
compile_only b --batches 2,32 --verify 0 &
compile_only c --batches 4,8,16 --verify 0 &
wait
echo "cache warm-up: $(( $(date +%s) - t0 )) s" | tee "$OUT/warm.log"
cat "$OUT"/warm_*.log >> "$OUT/warm.log" && rm -f "$OUT"/warm_*.log

set -o pipefail
python3 benchmarks/decode_layer.py --variants "$VARIANTS" --out "$OUT" $EXTRA \
  --time-budget "${TIME_BUDGET:-170}" --max-time-s 2 2>&1 | tee "$OUT/log.txt"
echo "total: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/log.txt"
