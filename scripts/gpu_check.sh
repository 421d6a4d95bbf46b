#!/usr/bin/env bash
# GPU check: does the CUDA backend work, and agree with its references, on this machine?
#
#   scripts/gpu_check.sh            # logs under $OUT (default: ./gpu_check_out)
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# For a machine with an NVIDIA GPU; made for a bare one (cold caches, maybe no internet).
# Steps, each under its own time limit (7 min 40 s at most in all), the tail of a failed step's
# log echoed here:
#   env        date, python, nvidia-smi                                        -> setup.log
#   install    the project, the normal way: `pip install -e .`, without build isolation (so
#              nothing to download when the dependencies are there); the `test` / `gpu` extras
#              only for what is missing, never the gpu extra's cupy-cuda12x over an installed
#              CuPy; offline, the project alone. Not fatal: the tree is on PYTHONPATH anyway,
#              and the packages step decides whether anything is missing       -> setup.log
#   packages   every package the GPU steps import: its version, or MISSING and which steps need
#              it (those are then SKIPPED and the run is not a pass)           -> setup.log
#   smoke      tests/backends/gpu_smoke.py: CuPy / CUDA runtime / driver / NVRTC / cuBLAS
#              versions and the device; one f16 and one bf16 kernel compiled and launched; one
#              cublas.gemm with beta=1; 16-bit buffers through Context.cuda()   -> smoke.log
#   pytest     the gpu-marked tests of tests/backends/test_cuda_gpu.py (that file alone: no
#              other test's imports needed) but the sanitizer ones; -v -rfEs names every test
#              as it ends, so a timeout keeps the results so far               -> pytest.log
#   sanitizer  its compute-sanitizer tests (memcheck, racecheck, synccheck)     -> sanitizer.log
#   example    examples/gpu_wide_mlp.py --backend cuda --prec bf16, short       -> example.log
#   timing     scripts/gpu_timing.py --f16: CPU against GPU, FMA contraction on against off
#                                                                              -> timing.log
# Each step ends as PASS, FAIL (rc), TIMEOUT, NO GPU, SKIPPED or (install only) WARN, in
# summary.log; the last line is the verdict, and the exit status is 0 only when every step
# passed: no GPU is not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # importable even if the install fails
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
summary="$OUT/summary.log"
: > "$summary"
: > "$OUT/setup.log"
failed=0
gpu_reason=""  # why no GPU is usable; empty when one is
declare -A missing_for=()  # step -> the packages it needs that are missing

say() { echo "$*" | tee -a "$summary"; }

step() {  # step NAME LOG LIMIT_S COMMAND...: run under a time limit, appending to $OUT/LOG
    local name="$1" log="$OUT/$2" limit="$3" t0=$SECONDS status rc setup=0
    [ "$2" = setup.log ] && setup=1
    shift 3
    echo "==> $name (limit $limit s, log $log)"
    echo "===== $name: $*" >> "$log"
    local before
    before=$(wc -l < "$log")
    if [ -n "${missing_for[$name]:-}" ]; then
        echo "not run: missing ${missing_for[$name]}" >> "$log"
        say "$(printf '%-10s SKIPPED (missing: %s)' "$name" "${missing_for[$name]}")"
        failed=1
        return
    fi
    timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT after $limit s (rc=$rc)"
    elif [ -n "$gpu_reason" ] && [ "$setup" -eq 0 ]; then status="NO GPU (rc=$rc)"
    elif [ "$rc" -eq 0 ]; then status="PASS"
    elif [ "$name" = install ]; then status="WARN (rc=$rc): not installed; the tree is imported \
through PYTHONPATH, and the packages step says what is missing"
    else status="FAIL (rc=$rc)"; fi
    if [ "$status" != PASS ]; then  # the end of this step's part of the log
        [ "$name" = install ] || failed=1
        tail -n +$((before + 1)) "$log" | tail -n "$([ -n "$gpu_reason" ] && echo 4 || echo 15)" \
            | cut -c1-240 | sed 's/^/    | /'
    fi
    say "$(printf '%-10s %s in %d s' "$name" "$status" $((SECONDS - t0)))"
}

# --- setup ------------------------------------------------------------------------------------
step env setup.log 15 bash -c "date -u; echo \"python: $PY\"; \"$PY\" --version; uname -srm; \
    nvidia-smi || echo 'nvidia-smi: not available'"

NEED="numpy:numpy llvmlite:llvmlite scipy:scipy ml_dtypes:ml-dtypes safetensors:safetensors \
cupy:cupy pytest:pytest"  # import name : pip name
install_project() {
    local missing extras=() spec
    local pip=("$PY" -m pip install --disable-pip-version-check --no-build-isolation
               --timeout 10 --retries 0)
    missing="$("$PY" -c 'import importlib.util, sys
print(" ".join(s.split(":")[1] for s in sys.argv[1].split()
               if importlib.util.find_spec(s.split(":")[0]) is None))' "$NEED")"
    echo "missing before the install: ${missing:-nothing}"
    case " $missing " in *" pytest "*) extras+=(test);; esac
    case " $missing " in *" cupy "*) extras+=(gpu);; esac  # never a second CuPy
    if [ "${#extras[@]}" -gt 0 ]; then
        spec=".[$(IFS=,; echo "${extras[*]}")]"
        echo "+ pip install -e '$spec'"
        "${pip[@]}" -e "$spec" && return 0
        echo "pip could not install $spec (offline?); installing the project alone"
    elif [ -n "$missing" ]; then
        echo "+ pip install -e . (fetches: $missing)"
        "${pip[@]}" -e . && return 0
        echo "pip could not fetch $missing (offline?); installing the project alone"
    fi
    echo "+ pip install --no-deps -e ."
    "${pip[@]}" --no-deps -e . || {
        echo "pip install -e . failed: the steps import the tree through PYTHONPATH"; return 1; }
}
export PY NEED
export -f install_project
step install setup.log 40 bash -c install_project

export MISSING_OUT="$OUT/.missing" GPU_OUT="$OUT/.gpu"
: > "$MISSING_OUT"
echo "the packages step did not say" > "$GPU_OUT"
step packages setup.log 30 "$PY" - <<'PYEOF'
import importlib
import os

needs = {  # import name -> the steps that need it
    "numpy": "smoke pytest sanitizer example timing", "llvmlite": "pytest example timing",
    "scipy": "pytest example timing", "ml_dtypes": "smoke pytest sanitizer example timing",
    "safetensors": "smoke pytest sanitizer example timing",
    "cupy": "smoke pytest sanitizer example timing", "pytest": "pytest sanitizer",
}
optional = {"pytest_timeout": "names a hanging test", "xdist": "runs the tests in parallel",
            "tqdm": "progress bars", "torch": "not needed by the GPU steps"}
missing = {}
for name, steps in needs.items():
    try:
        m = importlib.import_module(name)
        print(f"{name:14} {getattr(m, '__version__', '?')}")
    except Exception as err:  # a broken install is missing too
        print(f"{name:14} MISSING ({type(err).__name__}: {err}); needed by: {steps}")
        for s in steps.split():
            missing.setdefault(s, []).append(name)
for name, why in optional.items():
    try:
        m = importlib.import_module(name)
        print(f"{name:14} {getattr(m, '__version__', '?')} (optional: {why})")
    except Exception:
        print(f"{name:14} absent (optional: {why})")
try:
    import ocannl
    from ocannl.backends.cuda.nvrtc import cuda_include_dir
    from ocannl.backends.cuda.runtime import cuda_unavailable_reason

    print(f"ocannl         from {os.path.dirname(ocannl.__file__)}")
    reason = cuda_unavailable_reason()
    print(f"GPU: {'usable' if reason is None else reason}")
    print(f"cuda_fp16.h folder: {cuda_include_dir()}")
except Exception as err:
    reason = f"ocannl does not import: {type(err).__name__}: {err}"
    print(reason)
    for s in ("smoke", "pytest", "sanitizer", "example", "timing"):
        missing.setdefault(s, []).append("ocannl")
with open(os.environ["MISSING_OUT"], "w") as fh:
    for s, names in missing.items():
        fh.write(f"{s} {','.join(names)}\n")
with open(os.environ["GPU_OUT"], "w") as fh:
    fh.write(reason or "")
if missing:
    print("MISSING: " + ", ".join(sorted({n for v in missing.values() for n in v})))
raise SystemExit(1 if missing else 0)
PYEOF
while read -r s names; do
    if [ -n "$s" ]; then missing_for[$s]="$names"; fi
done < "$MISSING_OUT"
gpu_reason="$(cat "$GPU_OUT")"
rm -f "$MISSING_OUT" "$GPU_OUT"
if [ -n "$gpu_reason" ]; then say "no GPU: $gpu_reason"; fi

# --- on the GPU -------------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -v -rfEs -p no:cacheprovider -m gpu)
has() { "$PY" -c "import $1" > /dev/null 2>&1; }
if has pytest_timeout; then PYTEST+=(--timeout 150); fi
if has xdist && [ -z "$gpu_reason" ]; then  # in parallel: the CPU references compile too
    TESTS=("${PYTEST[@]}" -n 6)
    SANITIZE=("${PYTEST[@]}" -n 3)
else
    TESTS=("${PYTEST[@]}")
    SANITIZE=("${PYTEST[@]}")
fi

step smoke smoke.log 45 "$PY" tests/backends/gpu_smoke.py
step pytest pytest.log 165 "${TESTS[@]}" -k "not sanitizer" tests/backends/test_cuda_gpu.py
step sanitizer sanitizer.log 70 "${SANITIZE[@]}" -k sanitizer tests/backends/test_cuda_gpu.py
step example example.log 35 "$PY" examples/gpu_wide_mlp.py --backend cuda --prec bf16 \
    --steps 100
step timing timing.log 60 "$PY" scripts/gpu_timing.py --f16 --chunks 5

say "logs in $OUT ($((SECONDS - START)) s in all)"
missing="$(sed -n 's/^MISSING: //p' "$OUT/setup.log" | tail -n 1)"
if [ "$failed" -eq 0 ]; then
    say "gpu_check: PASS (every step passed)"
elif [ -n "$missing" ]; then
    say "gpu_check: NOT A PASS: missing packages: $missing"
elif [ -n "$gpu_reason" ]; then
    say "gpu_check: NOT A PASS: no GPU ($gpu_reason)"
else
    say "gpu_check: NOT A PASS: some steps did not pass (see above)"
fi
exit "$failed"
