#!/usr/bin/env bash
# GPU check, for a machine with an NVIDIA GPU, CuPy, PyTorch and Numba. Installs nothing.
#
#   scripts/gpu_check.sh            # logs under $OUT (default: ./gpu_check_out)
#
# Runs, each under its own time limit (7.3 minutes at most in all):
#   1. the environment: nvidia-smi, the Python packages ocannl needs, CuPy's device view;
#   2. the gpu-marked tests (pytest -m gpu): CPU-backend parity on CUDA, set_values without
#      recompiling, the on-device skip of a non-finite step;
#   3. the GPU example (examples/gpu_wide_mlp.py, short);
#   4. a short CPU-vs-GPU timing of the benchmark MLPs 2-64-64-2 b32 and 256-1024-1024-10 b256
#      (scripts/gpu_timing.py, f32 and the fused gated f16 step).
# Exit status: 0 when every part passed; the summary at the end names those that did not.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package works without installing
export PYTHONUNBUFFERED=1

summary="$OUT/summary.log"
: > "$summary"
failed=0
step() {  # step NAME LIMIT_S COMMAND...: run with a time limit, log to $OUT/NAME.log
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local msg="$name: rc=$rc in $((SECONDS - t0)) s"
    [ "$rc" -eq 124 ] && msg="$msg (timed out after $limit s)"
    echo "$msg" | tee -a "$summary"
    [ "$rc" -eq 0 ] || failed=1
}

{
    echo "date: $(date -u)"; echo "python: $PY"; "$PY" --version
    nvidia-smi || echo "nvidia-smi: not available"
} > "$OUT/env.log" 2>&1
step packages 30 "$PY" - <<'EOF'
import importlib
need = ["numpy", "numba", "scipy", "ml_dtypes", "cupy", "pytest", "hypothesis", "torch"]
missing = []
for name in need:
    try:
        m = importlib.import_module(name)
        print(f"{name} {getattr(m, '__version__', '?')}")
    except Exception as err:  # noqa: BLE001
        missing.append(name)
        print(f"{name}: MISSING ({err})")
from ocannl.backends.cuda.runtime import cuda_unavailable_reason
from ocannl.backends.cuda.nvrtc import cuda_include_dir
reason = cuda_unavailable_reason()
print("GPU:", "usable" if reason is None else reason)
print("cuda_fp16.h folder:", cuda_include_dir())
if reason is None:
    import cupy
    p = cupy.cuda.runtime.getDeviceProperties(0)
    print("device 0:", p["name"].decode(), "cc", p["major"], p["minor"])
    try:
        from cupy import cublas  # noqa: F401
        print("cuBLAS: loadable")
    except ImportError as err:
        print("cuBLAS: NOT loadable, GEMMs will run as generated kernels:", err)
raise SystemExit(1 if missing or reason else 0)
EOF
step pytest_gpu 180 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests
step example 60 "$PY" examples/gpu_wide_mlp.py --backend cuda --steps 200
step example_bf16 45 "$PY" examples/gpu_wide_mlp.py --backend cuda --prec bf16 --steps 100
step timing 100 "$PY" scripts/gpu_timing.py --f16
echo "logs in $OUT" | tee -a "$summary"
[ "$failed" -eq 0 ] && echo "gpu_check: all passed" | tee -a "$summary" \
    || echo "gpu_check: FAILURES (see the logs above)" | tee -a "$summary"
exit "$failed"
