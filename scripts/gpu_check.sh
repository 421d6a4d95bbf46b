#!/usr/bin/env bash
# GPU check: does the CUDA backend work, agree with its references and hold its speed, here?
#
#   scripts/gpu_check.sh                   # every part; logs under $OUT (default ./gpu_check_out)
#   scripts/gpu_check.sh --list            # the parts and their time limits
#   scripts/gpu_check.sh --only tests,moons    # a rerun of some parts (e.g. those that failed)
#   PYTHON=/path/to/python scripts/gpu_check.sh
#
# Made for the H200 machine's image as it is (Python 3.12, cupy-cuda13x, NumPy, PyTorch with
# CUDA 13, no network): nothing is downloaded. The tree is imported through PYTHONPATH (no
# install); a wheel the image lacks travels in the working tree under gpu_wheels/ and is
# installed from there with `pip install --no-index` (see README.md, "GPU"). Every part runs
# under its own time limit, and all of them within 6 minutes (a part never runs past what is
# left of them); each part's log is $OUT/<part>.log, complete when the part ends, its status
# line in $OUT/summary.log. The last line printed is the verdict; the exit status is 0 only on
# a pass (2: bad arguments). No GPU, a missing package, a failure or a timeout is not a pass;
# a compute-sanitizer that refuses this device is reported as SKIPPED and passes.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

# part | limit (s) | what it does
PARTS=(env tests sanitizer timing moons)
declare -A LIMIT=([env]=40 [tests]=70 [sanitizer]=45 [timing]=130 [moons]=45)
declare -A WHAT=(
    [env]="versions, nvidia-smi, wheels from gpu_wheels/, packages; smoke: one f16 and one bf16 kernel, cuBLAS GEMMs, 16-bit buffers (tests/backends/gpu_smoke.py)"
    [tests]="the gpu-marked tests of tests/backends/test_cuda_gpu.py but the sanitizer and moons ones, each under a per-test limit of ${TEST_LIMIT:-40} s"
    [sanitizer]="compute-sanitizer --tool memcheck on a fused gated f16 step (after a probe: a device it refuses is SKIPPED)"
    [timing]="scripts/gpu_timing.py: this project (f32, bf16, f16-gated16) against PyTorch CUDA (eager, autocast bf16, torch.compile reduce-overhead) on mlp_wide, convnet, gpt_mini"
    [moons]="examples/moons_mixed_precision.py --backend cuda with a checkpoint and a resume, bit-identical to the uninterrupted run"
)
TOTAL_LIMIT=360  # all parts together, in seconds
TEST_LIMIT="${TEST_LIMIT:-40}"

usage() {
    echo "usage: $0 [--list] [--only PART[,PART...]]   (parts: ${PARTS[*]})"
}

list_parts() {
    printf '%-10s %7s  %s\n' part "limit s" "what it does"
    for p in "${PARTS[@]}"; do printf '%-10s %7d  %s\n' "$p" "${LIMIT[$p]}" "${WHAT[$p]}"; done
    echo "all parts within $TOTAL_LIMIT s"
}

selected=("${PARTS[@]}")
while [ $# -gt 0 ]; do
    case "$1" in
        --list) list_parts; exit 0 ;;
        --only)
            if [ $# -lt 2 ] || [ -z "$2" ]; then
                echo "error: --only needs a comma-separated list of parts: ${PARTS[*]}" >&2
                exit 2
            fi
            IFS=, read -r -a asked <<< "$2"
            selected=()
            for a in "${asked[@]}"; do
                [ -z "$a" ] && continue
                if [ -z "${LIMIT[$a]:-}" ]; then
                    echo "error: unknown part '$a' in --only '$2'; the parts are: ${PARTS[*]}" >&2
                    exit 2
                fi
                selected+=("$a")
            done
            if [ "${#selected[@]}" -eq 0 ]; then
                echo "error: --only '$2' names no part; the parts are: ${PARTS[*]}" >&2
                exit 2
            fi
            shift 2 ;;
        -h|--help) usage; list_parts; exit 0 ;;
        *) echo "error: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
    esac
done
wants() { local p; for p in "${selected[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }

OUT="${OUT:-$ROOT/gpu_check_out}"
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x .venv/bin/python ]; then PY="$ROOT/.venv/bin/python"
else PY=python3; fi
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# the tree, the tests' helpers, the per-test limit plugin (scripts/gpu_check_time_limit.py)
export PYTHONPATH="$ROOT:$ROOT/tests/backends:$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
summary="$OUT/summary.log"
: > "$summary"
failed=0
gpu_reason=""  # why no GPU is usable; empty when one is
declare -A missing_for=()  # part -> the packages it needs that are missing

say() { echo "$*" | tee -a "$summary"; }

read_state() {  # what the env part found: the missing packages by part, and the GPU's absence
    local kind a b
    while read -r kind a b; do
        case "$kind" in
            missing) missing_for[$a]="$b" ;;
            gpu) gpu_reason="${a}${b:+ $b}" ;;
        esac
    done < "$GPU_CHECK_STATE"
}

# run_part NAME COMMAND...: the command under the part's limit (cut to what is left of the
# total), its output in $OUT/NAME.log; sets the part's status line.
run_part() {
    local name="$1" log="$OUT/$1.log" t0=$SECONDS rc status limit left
    shift
    limit="${LIMIT[$name]}"
    left=$((TOTAL_LIMIT - (SECONDS - START) - 2))
    [ "$left" -lt "$limit" ] && limit="$left"
    echo "==> $name (limit $limit s, log $log)"
    {
        echo "===== $name: $*"
        date -u
    } > "$log"
    if [ -n "${missing_for[$name]:-}" ]; then
        echo "not run: missing ${missing_for[$name]}" >> "$log"
        say "$(printf '%-10s SKIPPED (missing: %s)' "$name" "${missing_for[$name]}")"
        failed=1
        return
    fi
    if [ -n "$gpu_reason" ] && [ "$name" != env ]; then
        echo "not run: no GPU ($gpu_reason)" >> "$log"
        say "$(printf '%-10s NO GPU' "$name")"
        failed=1
        return
    fi
    if [ "$limit" -le 0 ]; then
        echo "not run: the $TOTAL_LIMIT s of the check are spent" >> "$log"
        say "$(printf '%-10s NOT RUN (the %d s of the check are spent)' "$name" "$TOTAL_LIMIT")"
        failed=1
        return
    fi
    timeout --kill-after=5 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    [ "$name" = env ] && read_state
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="TIMEOUT after $limit s (rc=$rc)"
    elif [ "$name" = env ] && [ -n "$gpu_reason" ]; then status="NO GPU (rc=$rc)"
    elif [ "$rc" -eq 0 ] && [ "$name" = sanitizer ] && grep -q '^SKIPPED \[' "$log"; then
        # pytest's own summary line: whatever the sanitizer said, the test skipped
        status="SKIPPED, not a failure: $(grep -m1 '^SKIPPED \[' "$log" | cut -c1-200)"
    elif [ "$rc" -eq 0 ]; then status="PASS"
    else status="FAIL (rc=$rc)"; fi
    case "$status" in
        PASS|SKIPPED*) ;;
        *) failed=1
           tail -n 15 "$log" | cut -c1-240 | sed 's/^/    | /' ;;
    esac
    say "$(printf '%-10s %s in %d s' "$name" "$status" $((SECONDS - t0)))"
}

# --- env: versions, wheels, packages, then the smoke step -------------------------------------
cat > "$TMP/env_check.py" <<'PYEOF'
"""The environment part: versions, wheels from gpu_wheels/, packages, the GPU, the smoke."""
import glob
import importlib
import os
import subprocess
import sys

root, py = os.environ["GPU_CHECK_ROOT"], sys.executable
print(f"python {sys.version.split()[0]} at {py}")
subprocess.run("uname -srm; nvidia-smi || echo 'nvidia-smi: not available'", shell=True)
wheels = sorted(glob.glob(os.path.join(root, "gpu_wheels", "*.whl")))
if wheels:  # what the image lacks, carried in the working tree: no network needed
    cmd = [py, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check",
           *wheels]
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd)
needs = {  # import name -> the parts that need it
    "numpy": "env tests sanitizer timing moons", "llvmlite": "tests timing moons",
    "scipy": "tests timing moons", "ml_dtypes": "env tests sanitizer timing moons",
    "safetensors": "tests moons", "cupy": "env tests sanitizer timing moons",
    "pytest": "tests sanitizer moons", "torch": "timing", "threadpoolctl": "tests moons",
}
optional = {"tqdm": "progress bars", "pytest_timeout": "not needed: the check's own limit"}
missing = {}
for name, parts in needs.items():
    try:
        m = importlib.import_module(name)
        print(f"{name:14} {getattr(m, '__version__', '?')}")
    except Exception as err:  # a broken install is missing too
        print(f"{name:14} MISSING ({type(err).__name__}: {err}); needed by: {parts}")
        for p in parts.split():
            missing.setdefault(p, []).append(name)
for name, why in optional.items():
    try:
        m = importlib.import_module(name)
        print(f"{name:14} {getattr(m, '__version__', '?')} (optional: {why})")
    except Exception:
        print(f"{name:14} absent (optional: {why})")
reason = None
try:
    from ocannl.backends.cuda import nvrtc
    from ocannl.backends.cuda.runtime import cuda_unavailable_reason, cupy_distributions

    print(f"CuPy wheels: {cupy_distributions() or 'none'}")
    print(f"NVRTC majors found by ocannl: {nvrtc.majors()}")
    reason = cuda_unavailable_reason()
    print(f"GPU: {'usable' if reason is None else reason}")
except Exception as err:
    reason = f"ocannl does not import: {type(err).__name__}: {err}"
    print(reason)
with open(os.environ["GPU_CHECK_STATE"], "w") as fh:
    for p, names in missing.items():
        fh.write(f"missing {p} {','.join(names)}\n")
    fh.write(f"gpu {reason or ''}\n")
if missing.get("env"):
    print("smoke: not run, missing " + ", ".join(missing["env"]))
    raise SystemExit(1)
print("----- smoke (tests/backends/gpu_smoke.py)", flush=True)
rc = subprocess.run([py, os.path.join(root, "tests", "backends", "gpu_smoke.py")]).returncode
raise SystemExit(rc)
PYEOF

export GPU_CHECK_ROOT="$ROOT" GPU_CHECK_STATE="$TMP/state"
echo "gpu the env part did not say (run it: --only env,...)" > "$GPU_CHECK_STATE"
if wants env; then
    run_part env "$PY" "$TMP/env_check.py"
else  # the other parts still need to know whether there is a GPU and what is missing
    timeout --kill-after=5 30 "$PY" - > "$OUT/gpu_state.log" 2>&1 <<'PYEOF'
import os
try:
    from ocannl.backends.cuda.runtime import cuda_unavailable_reason
    reason = cuda_unavailable_reason()
except Exception as err:
    reason = f"ocannl does not import: {type(err).__name__}: {err}"
print(f"GPU: {reason or 'usable'}")
open(os.environ["GPU_CHECK_STATE"], "w").write(f"gpu {reason or ''}\n")
PYEOF
fi
[ -n "$gpu_reason" ] || read_state  # (the env part read it already)
if [ -n "$gpu_reason" ]; then say "no GPU: $gpu_reason"; fi

# --- on the GPU -------------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -v -rfEs -p no:cacheprovider -p gpu_check_time_limit -m gpu)
GPU_TESTS=tests/backends/test_cuda_gpu.py
if wants tests; then
    GPU_CHECK_TEST_LIMIT="$TEST_LIMIT" run_part tests "${PYTEST[@]}" \
        -o faulthandler_timeout=$((TEST_LIMIT + 5)) -k "not sanitizer and not moons" "$GPU_TESTS"
fi
if wants sanitizer; then
    GPU_CHECK_TEST_LIMIT="${LIMIT[sanitizer]}" run_part sanitizer "${PYTEST[@]}" -k sanitizer \
        "$GPU_TESTS"
fi
if wants timing; then
    run_part timing "$PY" scripts/gpu_timing.py --budget-s $((LIMIT[timing] - 25))
fi
if wants moons; then
    GPU_CHECK_TEST_LIMIT="${LIMIT[moons]}" run_part moons "${PYTEST[@]}" -k moons "$GPU_TESTS"
fi

say "parts: ${selected[*]}; logs in $OUT ($((SECONDS - START)) s in all)"
what=""  # the missing packages of the parts run
for p in "${selected[@]}"; do
    [ -n "${missing_for[$p]:-}" ] && what="${what:+$what; }$p needs ${missing_for[$p]}"
done
if [ "$failed" -eq 0 ]; then
    say "gpu_check: PASS (every part passed)"
elif [ -n "$what" ]; then
    say "gpu_check: NOT A PASS: missing packages ($what)${gpu_reason:+; no GPU ($gpu_reason)}"
elif [ -n "$gpu_reason" ]; then
    say "gpu_check: NOT A PASS: no GPU ($gpu_reason)"
else
    say "gpu_check: NOT A PASS: some parts did not pass (see above)"
fi
exit "$failed"
