"""The CPU JIT's settings from the environment: a wrong value is refused, naming the variable
and the value, before anything is compiled or allocated."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import ocannl.tensor as T
from ocannl import Context, train
from ocannl.backends.cpu import jit


@pytest.mark.parametrize("name", ["OCANNL_THREADS", "OCANNL_COMPILE_WORKERS"])
@pytest.mark.parametrize("value", ["two", "0", "-3", "1.5"])
def test_a_count_that_is_not_a_positive_integer_is_refused(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    x = T.term(np.arange(3.0, dtype=np.float32), label="x")
    ctx = Context.cpu()
    with pytest.raises(ValueError, match=f"{name}='{value}': expected a whole number"):
        ctx.compile(train.forward(T.exp(x)))
    assert not ctx.is_allocated(x)
    monkeypatch.setenv(name, " 2 ")
    assert (jit.workers() if name == "OCANNL_COMPILE_WORKERS" else jit.threads()) == 2


def test_an_unknown_blas_is_refused():
    script = ("import numpy as np, ocannl.tensor as T\n"
              "from ocannl import Context, train\n"
              "x = T.term(np.arange(3.0, dtype=np.float32), label='x')\n"
              "Context.cpu().compile(train.forward(T.exp(x)))\n")
    env = {**os.environ, "OCANNL_BLAS": "mkl"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "OCANNL_BLAS='mkl': expected 'numpy'" in done.stderr
