#!/usr/bin/env bash
# compute-sanitizer over every CuTe kernel in one H200 call, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/sanitize_h200.sh "$OUT"
# 1. Can the sanitizer run here at all: `compute-sanitizer --version` and a tiny torch kernel
#    under memcheck (a clear SANITIZER UNAVAILABLE line and exit 3 if not: gVisor refuses it).
# 2. memcheck over every case of benchmarks/sanitize.py (each kernel once per bucket, values
#    checked against the op's reference), racecheck and synccheck over the kernels with device
#    code of their own (--no-composites), and the canary (an out-of-range slot that memcheck
#    must report: it shows the tool sees launches made through TVM-FFI). All at once, each tool
#    in SAN_JOBS processes (kernels dealt round-robin; CuTe compiles are CPU-bound, 16 cores).
# 3. $OUT/summary.txt: per tool, per kernel, cases ok / failed and sanitizer reports.
# SAN_BUDGET (s, default 500) bounds the whole call; SAN_TOOLS picks tools (default
# "memcheck racecheck synccheck"); SAN_BUCKETS (default 1,8,64); SAN_ONLY=k,k narrows.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, t0
budget=${SAN_BUDGET:-500} jobs=${SAN_JOBS:-4} tools=${SAN_TOOLS:-memcheck racecheck synccheck}
# --report-api-errors no: cuda-python probes driver entry points with cuGetProcAddress at import,
# 34 CUDA_ERROR_INVALID_VALUE API errors per process that memcheck counted as errors (2026-12-02)
san=(compute-sanitizer --target-processes all --print-limit 50 --report-api-errors no)

if ! compute-sanitizer --version > "$OUT/sanitizer_version.txt" 2>&1; then
  echo "SANITIZER UNAVAILABLE: compute-sanitizer --version failed:"
  tail -3 "$OUT/sanitizer_version.txt"
  exit 3
fi
tail -2 "$OUT/sanitizer_version.txt"
timeout -k 10 120 "${san[@]}" --tool memcheck python3 -c \
  "import torch; x = torch.arange(1024., device='cuda'); print('tiny kernel sum', float(x.sum()))" \
  > "$OUT/preflight.log" 2>&1
rc=$?
if [ $rc != 0 ] || ! grep -q "ERROR SUMMARY: 0 errors" "$OUT/preflight.log"; then
  echo "SANITIZER UNAVAILABLE: a tiny torch kernel under memcheck gave exit $rc (the gVisor"
  echo "runtime refuses the sanitizer; Firecracker should take it). Its log:"
  tail -8 "$OUT/preflight.log"
  exit 3
fi
echo "preflight: memcheck runs a torch kernel cleanly after $(( $(date +%s) - t0 )) s"

left=$(( budget - ($(date +%s) - t0) - 20 ))  # 20 s for the summary
# each process stops starting cases 60 s before its limit: a running case (a compile and a
# launch under the tool) finishes, its results are written after every case
case_budget=$(( left > 120 ? left - 60 : left / 2 ))
pids=()
timeout -k 10 120 "${san[@]}" --tool memcheck python3 benchmarks/sanitize.py --canary \
  > "$OUT/canary_0.log" 2>&1 &
pids+=($!)
for tool in $tools; do
  extra=()
  [ "$tool" != memcheck ] && extra=(--no-composites)
  [ -n "${SAN_ONLY:-}" ] && extra+=(--only "$SAN_ONLY")
  for (( i = 0; i < jobs; i++ )); do
    timeout -k 10 "$left" "${san[@]}" --tool "$tool" python3 benchmarks/sanitize.py \
      --shard "$i/$jobs" --buckets "${SAN_BUCKETS:-1,8,64}" --time-budget "$case_budget" \
      --out "$OUT" --tag "${tool}_$i" "${extra[@]}" > "$OUT/${tool}_$i.log" 2>&1 &
    pids+=($!)
  done
done
echo "started ${#pids[@]} processes (tools: $tools; $jobs each; limit ${left} s)"
for pid in "${pids[@]}"; do wait "$pid"; done
echo "tools done after $(( $(date +%s) - t0 )) s; exit codes and last lines:"
for log in "$OUT"/*_[0-9]*.log; do
  last=$(grep -E 'cases ok|ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tr '\n' ' ')
  echo "  $(basename "$log"): $last"
done
python3 benchmarks/sanitize.py --summarize "$OUT" | tee "$OUT/summary_stdout.txt"
echo "total: $(( $(date +%s) - t0 )) s"
