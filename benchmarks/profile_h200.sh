#!/bin/bash
# Nsight Compute over the kernels of benchmarks/profile_kernels.py (issue 21: why the GEMV falls
# short on 2112x7168 and 896x7168, and why the per-pair MoE experts reach 38-54% of copy
# bandwidth). One report per group, then its details page as text and CSV beside it.
#   source .devcarry/prelude.sh && bash benchmarks/profile_h200.sh $OUT
source benchmarks/device_call.sh "${1:-out}"
export PYTHONPATH=$PYTHONPATH:$PWD/benchmarks
for which in gemv moe; do
  step "ncu_$which" "${NCU_LIMIT:-150}" ncu --clock-control none \
    --profile-from-start off --nvtx --set full -f -o "$OUT/$which" \
    python3 benchmarks/profile_kernels.py "$which"
  if [ -s "$OUT/$which.ncu-rep" ]; then
    ncu --import "$OUT/$which.ncu-rep" --page details > "$OUT/$which.details.txt" 2>&1
    ncu --import "$OUT/$which.ncu-rep" --page details --csv > "$OUT/$which.details.csv" 2>&1
  fi
done
