"""What a newcomer meets first: every ```python snippet of the README runs as written, each in a
fresh interpreter, and a machine without a GPU says so in one plain line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from ocannl import Context

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 300


def python_blocks(text: str) -> list[tuple[str, str]]:
    """(the section heading and the block's number in it, the code) of every ```python block."""
    blocks = []
    heading, k = "top", 0
    fence = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
    pos = 0
    for m in fence.finditer(text):
        for h in re.finditer(r"^#+\s+(.*)$", text[pos:m.start()], re.M):
            heading, k = h.group(1).strip(), 0
        pos = m.end()
        k += 1
        blocks.append((f"{heading} #{k}", textwrap.dedent(m.group(1))))
    return blocks


def printed_outputs(text: str) -> list[str | None]:
    """For each ```python block, in order, the ```text block that follows it (what the README
    says it prints), when only one paragraph of prose lies between them; else None."""
    fence = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
    fences = list(fence.finditer(text))
    out: list[str | None] = []
    for k, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        nxt = fences[k + 1] if k + 1 < len(fences) else None
        between = text[m.end():nxt.start()].strip() if nxt is not None else ""
        if nxt is not None and nxt.group(1) == "text" and "\n\n" not in between \
                and not between.startswith("#"):
            out.append(textwrap.dedent(nxt.group(2)))
        else:
            out.append(None)
    return out


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))
PRINTED = dict(zip([name for name, _ in BLOCKS], printed_outputs(README.read_text("utf-8")),
                   strict=True))


def test_the_readme_has_python_snippets() -> None:
    assert len(BLOCKS) >= 2, "no ```python block found: the extraction or the README changed"


def test_extraction_finds_blocks_and_their_sections() -> None:
    text = "# T\n\n## One\n\n```python\na = 1\n```\n\n```sh\nls\n```\n\n## Two\n\n```python\n" \
           "b = 2\n\n# not a heading\nc = 3\n```\n"
    assert python_blocks(text) == [("One #1", "a = 1\n"),
                                   ("Two #1", "b = 2\n\n# not a heading\nc = 3\n")]


def test_extraction_pairs_each_snippet_with_what_it_prints() -> None:
    text = "```python\nprint(1)\n```\n\nIt prints:\n\n```text\n1\n```\n\n```python\nx = 1\n" \
           "```\n\nSome prose.\n\nMore prose.\n\n```text\nnot its output\n```\n"
    assert printed_outputs(text) == ["1\n", None]


def test_every_snippet_says_what_it_prints() -> None:
    missing = [name for name, printed in PRINTED.items() if printed is None]
    assert not missing, f"README snippets with no ```text block of their output: {missing}"


@pytest.mark.parametrize(("name", "code"), BLOCKS, ids=[name for name, _ in BLOCKS])
def test_readme_snippet_runs(name: str, code: str, tmp_path: Path) -> None:
    """Each snippet alone, as a newcomer would paste it into a fresh ``python``, printing what
    the README says it prints."""
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MPLBACKEND="Agg")
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"README snippet {name!r} ran past {TIMEOUT_S} s")
    assert proc.returncode == 0, (
        f"README snippet {name!r} failed (exit {proc.returncode}):\n{code}\n--- stderr ---\n"
        f"{proc.stderr[-4000:]}")
    if PRINTED[name] is not None:
        assert proc.stdout == PRINTED[name], (
            f"README snippet {name!r} printed\n{proc.stdout}\nbut the README says it prints\n"
            f"{PRINTED[name]}")


# --- a machine without a GPU ------------------------------------------------------------------

DRIVER_DUMP = ("Context.cuda(device_id=0): no GPU is usable: no usable NVIDIA driver "
               "(cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA "
               "runtime version)\n  at cupy_backends/cuda/api/runtime.pyx:1234")


@pytest.mark.parametrize(("error", "gist"), [
    (DRIVER_DUMP, "no usable NVIDIA driver"),
    ("Context.cuda(device_id=0): no GPU is usable: CuPy is not installed or fails to import "
     "(No module named 'cupy'); pip install cupy-cuda12x", "CuPy is not installed"),
    ("Context.cuda(device_id=0): no GPU is usable: no CUDA device is visible (the driver "
     "reports 0 devices)", "no CUDA device is visible"),
    ("", "RuntimeError"),
])
def test_the_cpu_fallback_is_one_plain_line(monkeypatch: pytest.MonkeyPatch, error: str,
                                            gist: str) -> None:
    def no_gpu(cls: type, device_id: int = 0) -> Context:
        raise RuntimeError(error)

    monkeypatch.setattr(Context, "cuda", classmethod(no_gpu))
    monkeypatch.setattr(Context, "_fallback_said", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert Context.auto().backend_name() == "cpu"
    (said,) = [str(w.message) for w in caught]
    assert "\n" not in said and len(said) < 120, said
    assert gist in said and "CPU" in said and "cudaError" not in said, said


def test_the_example_prints_one_note_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", MPLBACKEND="Agg",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "moons_mixed_precision.py"),
                           "--steps", "20"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # what is left of stderr once the progress bar's redrawn lines are gone
    lines = [line for line in re.split(r"[\r\n]", proc.stderr)
             if line.strip() and "it/s" not in line and "step/s" not in line
             and not re.match(r"\s*\d+%\|", line)]
    assert len(lines) <= 1, lines
    assert all(line.startswith("note: ocannl: no usable GPU") and "cudaError" not in line
               for line in lines), lines
