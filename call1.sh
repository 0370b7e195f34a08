source benchmarks/device_call.sh "$1"
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
step rounding 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/fusions/test_kda_decode_rounding.py tests/fusions/test_moe_experts_kernel.py
VARIANTS=eager,inductor,k3 WARM_TIMEOUT=200 TIME_BUDGET=300 step yard 420 bash benchmarks/decode_layer_h200.sh $OUT/y
