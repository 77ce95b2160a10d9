"""A tour of blujax's kernels until the GPT-2 example lands: each op of ours beside its
plain-XLA spec (`blujax.kernels.xla`) on random data: do they agree (value and gradient), and
how long does each take on this machine.

    python examples/kernels_demo.py [--rows 4096] [--cols 768] [--vocab 50304] [--dtype float32]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blujax
from blujax import kernels
from blujax.kernels import xla


def timed(fn, *args, repeat=10):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / repeat * 1e3


def compare(title, make_loss, args):
    """make_loss(ops) -> scalar loss of args; prints value, gradient norm and times."""
    print(f"\n{title}")
    results = {}
    for name, ops in (("blujax", kernels), ("XLA", xla)):
        loss = jax.jit(jax.value_and_grad(make_loss(ops)))
        value, grad = loss(*args)
        results[name] = (float(value), np.asarray(grad, np.float32))
        print(f"  {name:7s} loss {float(value):14.5f}  |grad| "
              f"{float(jnp.linalg.norm(grad.astype(jnp.float32))):11.4f}  "
              f"forward+backward {timed(loss, *args):8.3f} ms")
    err = np.max(np.abs(results["blujax"][1] - results["XLA"][1]))
    print(f"  max |grad blujax - grad XLA| = {err:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096,
                        help="rows (tokens) of each input (default 4096)")
    parser.add_argument("--cols", type=int, default=768, help="features per row (default 768)")
    parser.add_argument("--vocab", type=int, default=50304,
                        help="vocabulary size for the cross-entropy (default 50304)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="activation dtype (default float32)")
    args = parser.parse_args()

    print(f"blujax kernels loaded: {blujax.kernel_backends()}; JAX runs on "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()})")
    keys = jax.random.split(jax.random.key(0), 6)
    dt, n, c = jnp.dtype(args.dtype), args.rows, args.cols
    x = jax.random.normal(keys[0], (n, c)).astype(dt)
    w = (1 + 0.1 * jax.random.normal(keys[1], (c,))).astype(dt)
    b = (0.1 * jax.random.normal(keys[2], (c,))).astype(dt)
    h = jax.random.normal(keys[3], (n, 4 * c)).astype(dt)
    hb = (0.1 * jax.random.normal(keys[4], (4 * c,))).astype(dt)
    logits = jax.random.normal(keys[5], (min(n, 1024), args.vocab)).astype(dt)
    targets = jax.random.randint(keys[5], (logits.shape[0],), 0, args.vocab)

    def f32sum(y):
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    compare(f"LayerNorm over {n} x {c} {args.dtype} (gradient for x)",
            lambda ops: lambda x: f32sum(ops.layer_norm(x, w, b)), (x,))
    compare(f"bias + GELU over {n} x {4 * c} {args.dtype} (gradient for x)",
            lambda ops: lambda h: f32sum(ops.gelu(h, hb)), (h,))
    compare(f"softmax cross-entropy over {logits.shape[0]} x {args.vocab} {args.dtype} "
            f"(gradient for the logits)",
            lambda ops: lambda l: ops.softmax_cross_entropy(l, targets).mean(), (logits,))

    print("\nAdamW: 5 steps of blujax.optim.adamw and of optax.adamw on the same gradients")
    params = {"w": jax.random.normal(keys[0], (c, c)), "b": jnp.zeros((c,))}
    grads = jax.tree.map(lambda p: 0.01 * jnp.cos(p + 1.0), params)
    finals = {}
    for name, make in (("blujax", blujax.optim.adamw), ("optax", optax.adamw)):
        tx = make(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
        p, state = params, tx.init(params)
        step = jax.jit(tx.update)
        for _ in range(5):
            updates, state = step(grads, state, p)
            p = optax.apply_updates(p, updates)
        finals[name] = p
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(finals["blujax"]), jax.tree.leaves(finals["optax"])))
    print(f"  max |params blujax - params optax| after 5 steps = {diff:.2e}")


if __name__ == "__main__":
    main()
