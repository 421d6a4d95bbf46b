# One entry point: `make demo` runs the main example, `make test` the test suite.
# Each creates the local virtual environment .venv on first use and installs what it needs:
# the demo the package and what the examples use (no PyTorch, no CUDA wheels); the tests add
# PyTorch (the oracle), the CUDA compiler wheels of CUDA 12 and 13 (CI compiles every kernel
# with both NVRTC majors) and
# Intel's MKL (the products' BLAS on Intel CPUs; the benchmarks run in this environment) and
# oneDNN (bf16 products on other CPUs with AVX512-BF16).
# One stamp per set, so `make test` after `make demo` upgrades the same .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test
DIST_STAMP := $(VENV)/.installed-dist
NP ?= 2

.PHONY: demo demo-f32 demo-dp test test-serial bench gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[plot,examples]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[plot,examples,test,gpu,nvrtc-check,dist,mkl,onednn]'
	touch $@

$(DIST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[plot,examples,dist]'
	touch $@

demo: $(DEMO_STAMP)
	$(PY) examples/moons_mixed_precision.py

demo-f32: $(DEMO_STAMP)
	$(PY) examples/moons_demo.py

# The mixed-precision example trained data-parallel on NP processes (default 2), launched by
# the mpiexec of the project's environment (MPICH's wheel, the `dist` extra).
demo-dp: $(DIST_STAMP)
	$(VENV)/bin/mpiexec -n $(NP) $(PY) -m mpi4py examples/moons_mixed_precision.py --data-parallel

# The suite on every core (pytest-xdist, WORKERS of them), then the tests marked whole_machine
# alone in one process (more processes than cores, timing another test would upset). A pass
# that selects no test fails (pytest's exit 5): nothing is skipped silently.
WORKERS ?= auto
LINT := $(PY) -m ruff check ocannl tests examples benchmarks scripts
# The layering contracts of pyproject.toml ([tool.importlinter]), from the venv's import-linter.
IMPORTS := $(VENV)/bin/lint-imports

test: $(TEST_STAMP)
	$(LINT)
	$(IMPORTS)
	$(PY) -m pytest -q -n $(WORKERS) -m "not whole_machine"
	$(PY) -m pytest -q -p no:xdist -m whole_machine

# The whole suite in one process, as before pytest-xdist.
test-serial: $(TEST_STAMP)
	$(LINT)
	$(IMPORTS)
	$(PY) -m pytest -q

bench: $(TEST_STAMP)
	$(PY) benchmarks/quick_mlp.py

# On a machine with an NVIDIA GPU (its own Python and CuPy, no network needed): five parts
# (environment and smoke, the gpu-marked tests, memcheck, a timing against PyTorch CUDA, the
# moons example resumed from a checkpoint) within 6 minutes, logs under $OUT (default
# gpu_check_out/), the verdict last; exit status 0 only on a pass (README.md, "GPU").
gpu-check:
	bash scripts/gpu_check.sh
