"""The benchmark harness (benchmarks/): each attention contender computes the op ours does,
on the same inputs, and a case times into a table row; every benchmark and probe imports as a
module of the package and parses its arguments. Values and row contents only: speed is measured
by `python -m benchmarks.kernels` on a GPU, never asserted here.

`benchmarks` is imported from the repository root, which `python -m pytest` run there puts on
sys.path (as `python -m benchmarks.NAME` does for the benchmarks themselves)."""

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmarks
import benchmarks.probes
from benchmarks.cases import attention
from benchmarks.harness import TorchFn, run_case

CASES = attention.cases(quick=True)
# Modules run as `python -m benchmarks.NAME` / `python -m benchmarks.probes.NAME`; the rest
# (harness, cases) are imported by them.
RUNNABLE = sorted(
    [f"benchmarks.{m.name}" for m in pkgutil.iter_modules(benchmarks.__path__)
     if not m.ispkg and m.name != "harness"]
    + [f"benchmarks.probes.{m.name}" for m in pkgutil.iter_modules(benchmarks.probes.__path__)])


def _floats(x):
    """float32 numpy arrays of a JAX or PyTorch result (an array or a tuple of them)."""
    if isinstance(x, (tuple, list)):
        return [a for y in x for a in _floats(y)]
    if hasattr(x, "detach"):  # a torch tensor
        return [x.detach().float().cpu().numpy()]
    return [np.asarray(jnp.asarray(x, jnp.float32))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.direction} {c.shape}")
def test_attention_contenders_agree(case):
    def run(impl):
        fn, args = case.make(impl, jax.random.key(0))
        return _floats(fn.fn(*args) if isinstance(fn, TorchFn) else fn(*args))

    ours = run("ours")
    assert len(ours) == (3 if case.direction == "fwd+bwd" else 1)
    compared = 0
    for impl in case.impls[1:]:
        try:
            theirs = run(impl)
        except Exception:  # noqa: BLE001 - an optional contender may refuse a shape
            if impl in case.optional and impl != "xla":
                continue
            raise
        assert len(theirs) == len(ours), impl
        for a, b in zip(theirs, ours):
            # bfloat16 results: a layout or masking mistake is off by O(1), rounding by 1e-2
            np.testing.assert_allclose(a, b, atol=3e-2 * np.abs(b).max(), rtol=3e-2,
                                       err_msg=impl)
        compared += 1
    assert compared >= 1  # at least XLA's attention, which runs everywhere


def test_attention_case_times_into_a_row():
    case = next(c for c in CASES if c.direction == "fwd" and "causal" not in c.shape)
    row = run_case(case, copy_bw=1e12)
    assert row["ours_tflops"] > 0 and row["ours_us"] > 0
    for impl in case.impls[1:]:
        assert f"{impl}_tflops" in row or f"{impl}_skipped" in row, impl


@pytest.mark.parametrize("name", RUNNABLE)
def test_benchmark_imports_and_parses_help(name, capsys):
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out
