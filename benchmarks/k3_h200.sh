#!/usr/bin/env bash
# One H200 call for the backend and its kernels, from the repository root:
#   source .devcarry/prelude.sh && bash benchmarks/k3_h200.sh "$OUT"
# 1. every GPU test of the kernels (CuTe DSL kernels and composites against their references),
#    alongside the backend's GPU tests (CUDA-graph replay of tiny and small over 50 steps vs
#    eager; mostly CPU-bound compiles, so the two share the call's first ~4 minutes);
# 2. optional kernel benchmarks: BENCH="gemv moe_experts ..." runs benchmarks/<name>.py each;
# 3. the per-layer yardstick with eager, Inductor and k3 in the same run, with top kernels.
# K3_KERNELS_EXTRA=name,... registers kernels awaiting their tests (their effect in step 3);
# KERNEL_TESTS="tests/kernels/test_x.py ..." narrows step 1; GRAPH=0 skips the CUDA-graph
# tests, YARD=0 step 3.
# Default timeouts sum to ~520 s, inside one device call's 600 s.
source benchmarks/device_call.sh "${1:-out}"  # $OUT, PYTHONPATH, the DSL check, step()
graph=
if [ "${GRAPH:-1}" != 0 ]; then
  timeout "${GRAPH_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_cuda_graphs.py > "$OUT/graph_tests.log" 2>&1 &
  graph=$!
fi
# KERNEL_TESTS: which test files (default all); the kernels' compiles are CPU-bound and the
# machine has 16 cores, so pytest-xdist spreads them (PYTEST_N workers, 0: off)
step kernel_tests "${KERNEL_TIMEOUT:-250}" python3 -m pytest -q -p no:cacheprovider \
  $( [ "${PYTEST_N:-6}" != 0 ] && echo "-n ${PYTEST_N:-6}" ) ${KERNEL_TESTS:-tests/kernels}
if [ -n "$graph" ]; then
  wait $graph; echo "graph_tests: exit $? after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
  tail -2 "$OUT/graph_tests.log"
fi
for name in ${BENCH:-}; do
  step "bench_$name" "${BENCH_TIMEOUT:-60}" python3 "benchmarks/$name.py" --out "$OUT"
done
[ "${YARD:-1}" = 0 ] && { echo "total: $(( $(date +%s) - t0 )) s"; exit 0; }
step yardstick "${YARD_TIMEOUT:-240}" python3 benchmarks/decode_layer.py \
  --variants "${VARIANTS:-eager,inductor,k3}" --batches "${BATCHES:-1,8,64}" \
  --verify "${VERIFY:-8}" --out "$OUT" --time-budget "${TIME_BUDGET:-200}" --max-time-s 2
grep -v Warn "$OUT/yardstick.log" | tail -8
python3 - "$OUT/decode_layer.json" <<'PY' | tee "$OUT/top_kernels.txt"
import json, sys
for b in json.load(open(sys.argv[1]))["buckets"]:
    for name, v in b["variants"].items():
        top = (v.get("kernel_count") or {}).get("top_kernels")
        if top:
            total = v["kernel_count"].get("kernel_us_sum")
            print(f"== {b['name']} {name}: {total} us of kernels per 4-layer step (profiled replay)")
            for kname, n, us in top[:15]:
                print(f"  {us:9.2f} us  x{n:<3} {kname}")
PY
echo "total: $(( $(date +%s) - t0 )) s"
