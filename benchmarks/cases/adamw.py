"""AdamW step: ours vs the jnp spec on GPT-2's largest leaf, and blujax.optim.adamw vs
optax.adamw over GPT-2 124M's whole parameter tree (148 leaves, weight decay on the matrices).

Both sides run with their inputs donated, as a jitted train step donates its optimizer state:
our kernel updates the moments in place, which without donation would cost XLA a copy of them.
Bytes per step: read param, grad, m, v and write update, m, v (the moments float32).
"""

import math

import jax
import jax.numpy as jnp
import optax

import blujax
from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1
STEPS = 100  # optimizer steps per timed call of the whole-tree case
IMPLS = {"ours": kernels.adamw_update, "xla": xla.adamw_update}
OPTIMIZERS = {"ours": blujax.optim.adamw, "xla": optax.adamw}


def gpt2_shapes(vocab=50304, context=1024, layers=12, width=768):
    """The parameter tree of GPT-2 (124M at the defaults), as shapes."""
    ln = {"w": (width,), "b": (width,)}
    linear = lambda n_in, n_out: {"w": (n_in, n_out), "b": (n_out,)}  # noqa: E731
    block = {"ln_1": ln, "attn": {"c_attn": linear(width, 3 * width),
                                  "c_proj": linear(width, width)},
             "ln_2": ln, "mlp": {"c_fc": linear(width, 4 * width),
                                 "c_proj": linear(4 * width, width)}}
    return {"wte": (vocab, width), "wpe": (context, width), "h": [block] * layers, "ln_f": ln}


def _is_shape(x):
    return isinstance(x, tuple)


def _random_tree(key, shapes, dtype, scale=1.0, positive=False):
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(key, len(leaves))
    arrays = [normal(k, s, dtype, scale) for k, s in zip(keys, leaves)]
    return treedef.unflatten([jnp.abs(a) if positive else a for a in arrays])


def _matrices_only(params):
    return jax.tree.map(lambda p: p.ndim >= 2, params)


def _leaf_case(rows, cols, dtype):
    def make(impl, key):
        kp, kg, km, kv = jax.random.split(key, 4)
        p = normal(kp, (rows, cols), dtype)
        g = normal(kg, (rows, cols), dtype, 1e-2)
        m = normal(km, (rows, cols), jnp.float32, 1e-3)
        v = jnp.abs(normal(kv, (rows, cols), jnp.float32, 1e-4))
        hp = jnp.asarray([3e-4, WD, 1 - B1**10, 1 - B2**10], jnp.float32)
        op = IMPLS[impl]

        def step(g, m, v, p, hp):
            u, m, v = op(p, g, m, v, hp, b1=B1, b2=B2, eps=EPS)
            # In the inputs' order: the update takes the grad's buffer, the moments their own.
            return u, m, v, p, hp

        return step, (g, m, v, p, hp)

    n = rows * cols
    return Case("adamw", "step", f"{rows}x{cols}", jnp.dtype(dtype).name,
                n * (3 * itemsize(dtype) + 4 * 4), make, donate=True)


def _tree_case(name, shapes):
    leaves = jax.tree.leaves(shapes, is_leaf=_is_shape)
    n = sum(math.prod(s) for s in leaves)
    schedule = optax.warmup_cosine_decay_schedule(0.0, 6e-4, warmup_steps=700,
                                                  decay_steps=19000, end_value=6e-5)

    def make(impl, key):
        kp, kg, km, kv = jax.random.split(key, 4)
        params = _random_tree(kp, shapes, jnp.float32)
        grads = _random_tree(kg, shapes, jnp.float32, 1e-2)
        tx = OPTIMIZERS[impl](schedule, b1=B1, b2=B2, eps=EPS, weight_decay=WD,
                              mask=_matrices_only)
        state = tx.init(params)
        mu = _random_tree(km, shapes, jnp.float32, 1e-3)
        nu = _random_tree(kv, shapes, jnp.float32, 1e-4, positive=True)
        count = jnp.asarray(1000, jnp.int32)
        if impl == "ours":
            state = state._replace(count=count, mu=mu, nu=nu)
        else:  # optax.adamw's state: (ScaleByAdamState, masked decay, schedule)
            state = (state[0]._replace(count=count, mu=mu, nu=nu),) + tuple(state[1:])

        def steps(grads, state, params):
            # STEPS optimizer steps in one call: passing ~600 donated arrays in and out of a
            # program costs the host several steps' worth of time, which the harness's queued
            # programs do not hide (a train step hides it behind the previous step); with
            # enough steps a call it is a small part of the row (measured in LOG.md). Each
            # step's update is fed back as the next "gradient" so nothing is loop-invariant.
            def body(_, carry):
                grads, state = carry
                return tx.update(grads, state, params)

            grads, state = jax.lax.fori_loop(0, STEPS, body, (grads, state))
            return grads, state, params  # in the inputs' order (see step above)

        return steps, (grads, state, params)

    return Case("adamw", "step", f"{name} ({len(leaves)} leaves, {STEPS} steps a call)",
                "float32", STEPS * n * 7 * 4, make, donate=True)


def cases(quick: bool = False):
    if quick:
        return [_leaf_case(1024, 768, jnp.float32),
                _tree_case("gpt2-tiny", gpt2_shapes(vocab=512, context=64, layers=2, width=64))]
    return [_leaf_case(50304, 768, jnp.float32), _leaf_case(50304, 768, jnp.bfloat16),
            _tree_case("gpt2-124m", gpt2_shapes())]
