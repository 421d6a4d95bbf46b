"""CuPy for CUDA 12 or 13, without a GPU: which CuPy is used, and what the messages name.

The backend runs over the stand-in ``cupy`` (:mod:`fake_cupy`), given the version answers a
real ``cupy-cuda12x`` or ``cupy-cuda13x`` gives (``runtimeGetVersion``, its NVRTC's
``getVersion``)."""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path

import fake_cupy
import pytest

from ocannl.backends.cuda import nvrtc
from ocannl.backends.cuda import runtime as rt
from ocannl.backends.cuda.runtime import CudaUnavailable, CupyCudaBackend


def _cupy_of(monkeypatch: pytest.MonkeyPatch, runtime_version: int,
             nvrtc_version: tuple[int, int] | None, *, cublas: bool = True
             ) -> types.ModuleType:
    """The stand-in cupy, answering as a CuPy built for CUDA ``runtime_version`` (e.g. 13020)
    whose NVRTC is ``nvrtc_version`` (None: it has none)."""
    cp = fake_cupy.install(monkeypatch, cublas=cublas)
    monkeypatch.setattr(cp.cuda.runtime, "runtimeGetVersion", lambda: runtime_version,
                        raising=False)
    if nvrtc_version is not None:
        monkeypatch.setattr(cp.cuda, "nvrtc", types.SimpleNamespace(
            getVersion=lambda: nvrtc_version), raising=False)
    cp.__version__ = "14.2.0"
    monkeypatch.setattr(rt, "cupy_distributions", lambda: {
        f"cupy-cuda{runtime_version // 1000}x": "14.2.0"})
    return cp


def test_two_cupy_wheels_are_refused_naming_both(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch)
    monkeypatch.setattr(rt, "cupy_distributions",
                        lambda: {"cupy-cuda12x": "14.2.0", "cupy-cuda13x": "14.2.0"})
    reason = rt.cuda_unavailable_reason()
    assert reason is not None
    assert "cupy-cuda12x 14.2.0 and cupy-cuda13x 14.2.0 are both installed" in reason
    with pytest.raises(CudaUnavailable, match="cupy-cuda12x 14.2.0 and cupy-cuda13x"):
        CupyCudaBackend()


def test_no_cupy_names_the_wheel_of_each_cuda_major(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    monkeypatch.setattr(rt, "cupy_distributions", lambda: {})
    reason = rt.cuda_unavailable_reason()
    assert reason is not None and "CuPy is not installed" in reason
    assert "cupy-cuda12x (CUDA 12 driver)" in reason and "cupy-cuda13x (CUDA 13 driver)" in reason


def test_the_installed_cupy_wheels_are_listed() -> None:
    """What is really installed here (the test environment's CuPy, if any)."""
    from importlib import metadata

    for name, version in rt.cupy_distributions().items():
        assert name.startswith("cupy") and metadata.version(name) == version


@pytest.mark.parametrize("major", [12, 13])
def test_messages_name_the_cuda_major_cupy_was_built_for(
        monkeypatch: pytest.MonkeyPatch, major: int) -> None:
    cp = _cupy_of(monkeypatch, major * 1000 + 20, (major, 0), cublas=False)
    with pytest.warns(RuntimeWarning, match="cuBLAS is not loadable") as caught:
        backend = CupyCudaBackend()
    text = str(caught[0].message)
    assert rt.CUDA_WHEELS[major]["cublas"] in text
    assert f"cupy-cuda{major}x, CUDA {major}" in text
    assert backend.cuda_major == backend.nvrtc_major == major
    assert rt.describe_cupy(cp) == f"CuPy 14.2.0 (cupy-cuda{major}x, CUDA {major})"


@pytest.mark.parametrize("major", [12, 13])
def test_headers_go_with_the_nvrtc_cupy_compiles_with(
        monkeypatch: pytest.MonkeyPatch, major: int) -> None:
    if nvrtc.cuda_include_dir(major) is None:
        pytest.skip(f"no CUDA {major} headers here (pip install {nvrtc.WHEELS[major][1]})")
    _cupy_of(monkeypatch, major * 1000 + 20, (major, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same majors: no warning
        backend = CupyCudaBackend()
    assert backend.include_dir == nvrtc.cuda_include_dir(major)
    assert nvrtc._header_major(Path(backend.include_dir)) == major
    assert f"-I{backend.include_dir}" in backend.options


def test_an_nvrtc_of_another_major_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    """cupy-cuda12x beside the CUDA 13 NVRTC wheel: cuda-pathfinder loads NVRTC 13 first (seen
    with CuPy 14.2), whose code needs a CUDA 13 driver; the headers follow NVRTC 13."""
    _cupy_of(monkeypatch, 12090, (13, 0))
    with pytest.warns(RuntimeWarning, match=r"cupy-cuda12x, CUDA 12\) compiles with NVRTC 13"):
        backend = CupyCudaBackend()
    assert backend.include_dir == nvrtc.cuda_include_dir(13)


def test_missing_headers_name_the_wheel_of_the_major(monkeypatch: pytest.MonkeyPatch) -> None:
    _cupy_of(monkeypatch, 13020, (13, 0))
    backend = CupyCudaBackend()
    backend.include_dir = None
    with pytest.raises(CudaUnavailable, match=r"of CUDA 13 .*pip install nvidia-cuda-runtime==13"):
        backend._load("#include <cuda_fp16.h>\n", {})
