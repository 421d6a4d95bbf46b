"""Runners: each trains a workload from its fixture, one step per call."""

from __future__ import annotations

from benchmarks.fixtures import Fixture
from benchmarks.runners.base import Runner, Unavailable
from benchmarks.specs import OTHER_PEERS, VARIANTS

FRAMEWORKS = ("torch", "ocannl", "jax", "tinygrad")

__all__ = ["Runner", "Unavailable", "make_runner", "row_specs"]


def make_runner(fx: Fixture, framework: str, variant: str, device: str, *,
                control: bool = False) -> Runner:
    """The runner for one row of the report; ``control``: the A/A control's runner, a second
    one of an ocannl row (``specs.CONTROL_VARIANT``)."""
    if control and framework != "ocannl":
        raise ValueError(f"the A/A control is a second ocannl runner, not a {framework!r} one")
    if framework == "torch":
        from benchmarks.runners.torch_runner import TorchRunner

        return TorchRunner(fx, variant=variant, device=device)
    if framework == "ocannl":
        from benchmarks.runners.ocannl_runner import OcannlRunner

        return OcannlRunner(fx, variant=variant, device=device, control=control)
    if framework == "jax":
        from benchmarks.runners.jax_runner import JaxRunner

        return JaxRunner(fx, variant=variant, device=device)
    if framework == "tinygrad":
        from benchmarks.runners.tinygrad_runner import TinygradRunner

        return TinygradRunner(fx, variant=variant, device=device)
    raise ValueError(f"unknown framework {framework!r}: expected one of {list(FRAMEWORKS)}")


def row_specs(devices: tuple[str, ...] = ("cpu", "cuda"),
              variants: tuple[str, ...] = tuple(VARIANTS),
              torch_compile: bool = True, autocast: bool = True,
              peers: bool = True) -> list[tuple[str, str, str]]:
    """(framework, variant, device) of every row, the PyTorch CPU eager reference first, then
    PyTorch's other CPU rows (``autocast``: its bf16 AMP row), the other frameworks' (``peers``:
    ``specs.OTHER_PEERS``), this project's."""
    specs = [("torch", "eager", "cpu")]
    if torch_compile:
        specs.append(("torch", "compile", "cpu"))
    if autocast and "cpu" in devices:
        specs.append(("torch", "autocast", "cpu"))
    if peers and "cpu" in devices:
        specs += [(f, v, "cpu") for f, v in OTHER_PEERS]
    specs += [("ocannl", v, "cpu") for v in variants if "cpu" in devices]
    if "cuda" in devices:
        specs.append(("torch", "eager", "cuda"))
        specs += [("ocannl", v, "cuda") for v in variants]
    return specs
