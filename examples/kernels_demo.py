"""A tour of blujax's kernels until the GPT-2 example lands: run each op of ours beside its
plain-XLA spec on random data, show they agree (values and gradients), and time both.

    python examples/kernels_demo.py [--rows 4096] [--cols 768] [--dtype float32|bfloat16]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import blujax
from blujax import kernels
from blujax.kernels import xla


def timed(fn, *args, repeat=20):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeat * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="rows of the input (default 4096)")
    parser.add_argument("--cols", type=int, default=768, help="features per row (default 768)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="activation dtype (default float32)")
    args = parser.parse_args()

    print(f"blujax kernels loaded: {blujax.kernel_backends()}; JAX runs on "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    dtype = jnp.dtype(args.dtype)
    x = jax.random.normal(k1, (args.rows, args.cols)).astype(dtype)
    w = (1 + 0.1 * jax.random.normal(k2, (args.cols,))).astype(dtype)
    b = (0.1 * jax.random.normal(k3, (args.cols,))).astype(dtype)

    print(f"\nLayerNorm over {args.rows} x {args.cols} {args.dtype}")
    for name, impl in (("blujax", kernels.layer_norm), ("XLA", xla.layer_norm)):
        loss = jax.jit(jax.value_and_grad(
            lambda x, w, b: jnp.sum(jnp.sin(impl(x, w, b).astype(jnp.float32))), (0, 1, 2)))
        value, grads = loss(x, w, b)
        fwd_ms = timed(jax.jit(impl), x, w, b)
        step_ms = timed(loss, x, w, b)
        print(f"  {name:7s} loss {float(value):12.5f}  |dx| {float(jnp.linalg.norm(grads[0])):10.4f}"
              f"  forward {fwd_ms:7.3f} ms  forward+backward {step_ms:7.3f} ms")
    y, y_ref = kernels.layer_norm(x, w, b), xla.layer_norm(x, w, b)
    err = float(np.max(np.abs(np.asarray(y, np.float32) - np.asarray(y_ref, np.float32))))
    print(f"  max |blujax - XLA| = {err:.2e}")


if __name__ == "__main__":
    main()
