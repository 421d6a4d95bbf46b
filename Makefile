# One entry point: `make demo` runs the main example, `make test` the test suite.
# Each creates the local virtual environment .venv on first use and installs what it needs:
# the demo the package and what the examples use (no PyTorch, no CUDA wheels); the tests add
# PyTorch (the oracle) and the CUDA compiler wheels (CI compiles every kernel with NVRTC).
# One stamp per set, so `make test` after `make demo` upgrades the same .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_STAMP := $(VENV)/.installed-demo
TEST_STAMP := $(VENV)/.installed-test

.PHONY: demo demo-f32 test bench gpu-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(DEMO_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[plot,examples]'
	touch $@

$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[plot,examples,test,gpu]'
	touch $@

demo: $(DEMO_STAMP)
	$(PY) examples/moons_mixed_precision.py

demo-f32: $(DEMO_STAMP)
	$(PY) examples/moons_demo.py

test: $(TEST_STAMP)
	$(PY) -m ruff check ocannl tests examples benchmarks scripts
	$(PY) -m pytest -q

bench: $(TEST_STAMP)
	$(PY) benchmarks/quick_mlp.py

# On a machine with an NVIDIA GPU, CuPy, PyTorch and Numba (installs nothing; logs under $OUT).
gpu-check:
	scripts/gpu_check.sh
