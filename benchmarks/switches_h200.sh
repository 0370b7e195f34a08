#!/usr/bin/env bash
# One H200 call that decides the decode switches, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/switches_h200.sh "$OUT"
# 1. the Inductor side-stream CUDA-graph test (K3_SIDE_STREAMS' gate) and TESTS, if given;
# 2. the per-layer yardstick (decode_layer.py) in separate processes, same machine, one call:
#    all/   inductor + k3 with K3_PDL=1 K3_GEMV_FUSED=1 (+ K3_SIDE_STREAMS=1 if step 1 passed)
#    pdl/   k3 with K3_PDL=1 only
#    off/   k3 with every switch off (K3_PDL=0 K3_GEMV_FUSED=0 K3_SIDE_STREAMS=0: session 4's)
# BATCHES (default 1,8,64) and VERIFY (T of the verify bucket, default 8) for every run.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
unset K3_PDL K3_GEMV_FUSED K3_SIDE_STREAMS
step stream_test "${STREAM_TIMEOUT:-150}" python3 -m pytest -q -rA -p no:cacheprovider \
  tests/backend/test_cuda_graphs.py -k side_streams ${TESTS:-}
streams=0
grep -q "PASSED .*side_streams_equals_eager" "$OUT/stream_test.log" && streams=1
yard() {  # $1: sub-folder, $2: variants, $3: time budget (s); the switches from the environment
  mkdir -p "$OUT/$1"
  step "yard_$1" "$(( $3 + 40 ))" python3 benchmarks/decode_layer.py --variants "$2" \
    --batches "${BATCHES:-1,8,64}" --verify "${VERIFY:-8}" --out "$OUT/$1" --time-budget "$3" \
    --max-time-s 2
  grep -v Warn "$OUT/yard_$1.log" | grep -E "^(B[0-9]|bucket)" | tail -6
}
K3_PDL=1 K3_GEMV_FUSED=1 K3_SIDE_STREAMS=$streams yard all inductor,k3 "${ALL_BUDGET:-190}"
K3_PDL=1 K3_GEMV_FUSED=0 K3_SIDE_STREAMS=0 yard pdl k3 "${PDL_BUDGET:-80}"
K3_PDL=0 K3_GEMV_FUSED=0 K3_SIDE_STREAMS=0 yard off k3 "${OFF_BUDGET:-80}"
echo "side streams in all/: $streams; total: $(( $(date +%s) - t0 )) s"
