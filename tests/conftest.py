"""Test set-up: 8 emulated CPU devices for the sharded tests, and a header that says which
kernels run (our CUDA kernels whenever JAX runs on a GPU, the CPU kernels otherwise)."""

import os
import zlib

# Before JAX starts a backend: the CPU platform gets 8 devices, so shard_map tests run on a
# laptop or CI; on a GPU machine the GPUs are unaffected.
# On a GPU, XLA's deterministic mode: the CLI's resume test compares a resumed run with a
# straight one bit for bit, and XLA's scatter-add (the embedding gradient) otherwise sums
# with atomics in any order. (Our attention backward honours the flag too: on Hopper it
# otherwise sums dQ in float32 in a varying order; test_attention.py tests both.)
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_gpu_deterministic_ops=true"):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# On a GPU, JAX would take 75% of its memory up front in the pytest process, and the CLI tests'
# train subprocesses (which inherit this) would run out of memory beside it.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import blujax  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"


def pytest_report_header(config):
    return (
        f"blujax kernels loaded: {blujax.kernel_backends()}; JAX backend: "
        f"{jax.default_backend()} ({jax.devices()[0].device_kind}); the tests exercise the "
        f"{'CUDA' if ON_GPU else 'CPU'} kernels"
    )


# The fast tier (pytest -m "not slow") of the op tests: every test of these files runs, but a
# parametrized one only with its first FAST_CASES cases (the other shapes and dtypes are
# marked slow); so every op's values, gradients, transformations and errors are still
# exercised, in less than the whole grid. CI and the README's command run everything.
OP_TEST_FILES = ("test_attention.py", "test_layernorm.py", "test_cross_entropy.py",
                 "test_gelu.py", "test_adamw.py", "test_rms_norm.py", "test_swiglu.py",
                 "test_rope.py")
FAST_CASES = 2


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs JAX on a CUDA GPU with blujax._cuda")
    seen = {}
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip)
        if item.path.name in OP_TEST_FILES and hasattr(item, "callspec"):
            key = (item.path.name, item.originalname)
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > FAST_CASES:
                item.add_marker(pytest.mark.slow)


@pytest.fixture
def rng(request):
    # A different stream per test, the same in every run (str hash() is salted per process).
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def enc():
    """tiktoken's GPT-2 encoding; the test skips where it cannot load (offline without
    TIKTOKEN_CACHE_DIR)."""
    from blujax import data
    try:
        return data.get_encoding("gpt2")
    except RuntimeError as e:
        pytest.skip(f"tiktoken cannot load the gpt2 encoding: {e}")
