# Sourced by the device-call scripts (k3_h200.sh, tune_h200.sh): $OUT from the first argument,
# the repository on PYTHONPATH after the prelude's entries (where the CuTe DSL lives:
# overwriting PYTHONPATH silently turns every kernel into its torch fallback, as one run of
# 2026-11-29 found), a check that the DSL imports, and `step NAME TIMEOUT CMD...` (its output in
# $OUT/NAME.log, its exit code and time in $OUT/steps.txt).
set -u
OUT=${1:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import cutlass.cute, tvm_ffi" || { echo "CuTe DSL / TVM-FFI not importable: source .devcarry/prelude.sh first"; exit 2; }
# compressed-tensors (the release's MXFP4 format; the device has no package index): the wheels
# in .devct or .devcarry/ct (docs/next_session.md says how to fetch them; carry .devct only when
# needed: .devcarry alone is ~59 of the 64 MiB a call may carry); Moonshot's files in .moonshot
ct=$(ls .devct/*.whl .devcarry/ct/*.whl 2>/dev/null)
if [ -n "$ct" ] && ! python3 -c "import compressed_tensors" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/ct $ct >/dev/null 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/ct
fi
[ -d .moonshot ] && export K3_MOONSHOT_DIR=${K3_MOONSHOT_DIR:-$PWD/.moonshot}
# The DSL's bytecode, once per machine: the carry unpacks its sources only (pip --no-compile) and
# the machine sets PYTHONDONTWRITEBYTECODE, so each process compiled ~560 of them again (2.0 s of
# the first kernel call, session 20's warm-start profile); a pip install compiles them once.
if [ -d /tmp/site/nvidia_cutlass_dsl ] && [ ! -f /tmp/site/.k3-bytecode ]; then
  python3 -m compileall -q -j 0 /tmp/site/nvidia_cutlass_dsl/dsl_packages >/dev/null 2>&1
  touch /tmp/site/.k3-bytecode
fi
t0=$(date +%s)
step() {  # $1: name, $2: timeout (s), rest: command
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (124: timed out)" | tee -a "$OUT/steps.txt"
  tail -3 "$OUT/$name.log"
}
