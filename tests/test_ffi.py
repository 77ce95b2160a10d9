"""Loading and registration of the kernel libraries (blujax/_ffi.py)."""

import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import blujax
from blujax import _ffi, kernels


def test_kernel_backends_lists_what_loaded():
    backends = blujax.kernel_backends()
    assert backends[0] == "cpu"
    assert set(backends) <= {"cpu", "cuda"}
    if jax.default_backend() == "gpu":
        assert "cuda" in backends


def _registered_in(pattern):
    """Target names of the BLUJAX_REGISTER lines in xla_ext/<pattern>."""
    root = pathlib.Path(__file__).resolve().parents[1] / "xla_ext"
    return {name for f in root.glob(pattern)
            for name in re.findall(r"^BLUJAX_REGISTER\((\w+),", f.read_text(), re.M)}


def test_every_cpu_target_has_a_cuda_twin():
    loaded, _ = _ffi._load()
    cpu = set(loaded["cpu"].registrations())
    assert {"blujax_layer_norm_fwd", "blujax_layer_norm_bwd"} <= cpu
    if "cuda" in loaded:
        assert set(loaded["cuda"].registrations()) == cpu
    # In the sources too: a machine without a GPU builds no blujax._cuda (BLUJAX_CUDA=AUTO).
    assert _registered_in("cpu/*.cc") == cpu
    assert _registered_in("cuda/*.cu") == cpu


# A program that names a target itself, before any op has traced: importing blujax registered
# it, so the handler answers (its own message, the same on either platform), not XLA's "No FFI
# handler registered". A fresh process, since this one registered everything long ago.
_RAW_CALL_FIRST = """
import jax, numpy as np
import blujax
x = np.ones((4, 8), np.float32)
call = jax.ffi.ffi_call("blujax_adamw", [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 3)
try:  # waited for: on a GPU the call's error comes with its (asynchronous) result
    jax.block_until_ready(jax.jit(lambda *a: call(*a, b1=1.0, b2=0.9, eps=1e-8, apply=False))(
        np.ones(5, np.float32), x, x, x, x))
except Exception as e:
    print(e)
"""


def test_targets_are_registered_at_import():
    run = subprocess.run([sys.executable, "-c", _RAW_CALL_FIRST], capture_output=True, text=True,
                         timeout=300, cwd=pathlib.Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    assert "blujax_adamw: b1 must be in [0, 1), got 1" in run.stdout, run.stdout


def test_lowers_to_our_custom_call_for_cuda_without_a_gpu():
    # CI has no GPU, but the CUDA lowering is still checked: one custom call per direction.
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    f = jax.jit(jax.grad(lambda x: kernels.layer_norm(x, w, w).sum()))
    hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "blujax_layer_norm_fwd" in hlo and "blujax_layer_norm_bwd" in hlo


def test_missing_cuda_kernels_on_a_gpu_is_an_error_not_a_fallback(monkeypatch):
    loaded, missing = _ffi._load()
    monkeypatch.setattr(_ffi, "_load", lambda: ({"cpu": loaded["cpu"]},
                                                {"cuda": "No module named 'blujax._cuda'"}))
    monkeypatch.setattr(_ffi, "current_platform", lambda: "gpu")
    with pytest.raises(RuntimeError, match="(?s)built without its CUDA kernels.*BLUJAX_CUDA=ON"):
        kernels.layer_norm(jnp.ones((2, 4)), jnp.ones(4), jnp.ones(4))
