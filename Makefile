# One entry point: `make demo` runs the main example, `make test` the test suite.
# Each creates the local virtual environment .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo demo-f32 test bench gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,plot,gpu]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/moons_mixed_precision.py

demo-f32: $(STAMP)
	$(PY) examples/moons_demo.py

test: $(STAMP)
	$(PY) -m ruff check ocannl tests examples benchmarks scripts
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/quick_mlp.py

# On a machine with an NVIDIA GPU, CuPy, PyTorch and Numba (installs nothing; logs under $OUT).
gpu-check:
	scripts/gpu_check.sh
