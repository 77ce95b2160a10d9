"""blujax.kernels.adamw_update(_many) against the jnp spec, and blujax.optim.adamw against optax.

Runs the CPU kernels on CPU and the CUDA kernels wherever JAX runs on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import blujax
from blujax import kernels as ops
from blujax.kernels import xla as spec
from tests.util import assert_close, cpu_float64, mesh_devices, randn

B1, B2, EPS = 0.9, 0.95, 1e-8
# 1, 3 and 1001 are smaller than one chunk of the CUDA kernel; 50304 x 7 spans many chunks and
# ends in a partial one; (4099,) is one full chunk plus a tail of 3.
SHAPES = [(), (1,), (3,), (1001,), (17, 5), (4099,), (50304, 7)]
DTYPES = [jnp.float32, jnp.bfloat16]
# The kernels follow the spec's operations one for one; XLA may rewrite the spec (a division by
# a scalar as a multiplication by its reciprocal, say), which moves a float32 result by an ulp.
F32_TIGHT = 0.05  # x TOL[float32] = 1e-6


def _state(rng, shape, dtype):
    mdt = ops.adamw.moment_dtype(dtype)
    p = randn(rng, shape, dtype)
    g = randn(rng, shape, dtype, 0.1)
    m = randn(rng, shape, mdt, 0.05)
    v = jnp.asarray(np.abs(rng.standard_normal(shape)) * 0.01 + 1e-4, mdt)
    return p, g, m, v


def _hparams(lr=3e-4, wd=0.1, step=7, dtype=jnp.float32):
    return jnp.asarray([lr, wd, 1 - B1**step, 1 - B2**step], dtype)


def _assert_step_close(got, want, param_dtype, factor=F32_TIGHT):
    u, m, v = got
    u_ref, m_ref, v_ref = want
    assert u.dtype == param_dtype and m.dtype == m_ref.dtype and v.dtype == v_ref.dtype
    mdt = m_ref.dtype
    assert_close(m, m_ref, mdt, factor=factor if mdt == jnp.float32 else 1)
    assert_close(v, v_ref, mdt, factor=factor if mdt == jnp.float32 else 1)
    assert_close(u, u_ref, param_dtype, factor=factor if param_dtype == jnp.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_update_matches_spec(rng, shape, dtype):
    p, g, m, v = _state(rng, shape, dtype)
    for wd in (0.1, 0.0):
        hp = _hparams(wd=wd)
        got = ops.adamw_update(p, g, m, v, hp, b1=B1, b2=B2, eps=EPS)
        want = spec.adamw_update(p, g, m, v, hp, b1=B1, b2=B2, eps=EPS)
        _assert_step_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (3,), (4099,), (50304, 7)], ids=str)
def test_apply_and_grad_scale_match_spec(rng, shape, dtype):
    # The train step's form: the gradient scaled (clipping), the update added to the param.
    p, g, m, v = _state(rng, shape, dtype)
    scale = jnp.float32(0.37)
    for wd in (0.1, 0.0):
        hp = _hparams(wd=wd)
        kw = dict(b1=B1, b2=B2, eps=EPS, grad_scale=scale)
        new_p, m1, v1 = ops.adamw_update(p, g, m, v, hp, apply=True, **kw)
        _assert_step_close((new_p, m1, v1), spec.adamw_update(p, g, m, v, hp, apply=True, **kw),
                           dtype)
        # Exactly the unfused form: the update (of g * scale, in the param dtype) added.
        u, m2, v2 = ops.adamw_update(p, g, m, v, hp, **kw)
        np.testing.assert_array_equal(np.asarray(new_p, np.float32), np.asarray(p + u, np.float32))
        np.testing.assert_array_equal(m1, m2)
        np.testing.assert_array_equal(v1, v2)


def test_apply_float64_cpu(rng):
    with cpu_float64():
        p, g, m, v = _state(rng, (17, 5), jnp.float64)
        hp = _hparams(dtype=jnp.float64)
        kw = dict(b1=B1, b2=B2, eps=EPS, grad_scale=jnp.float64(0.5), apply=True)
        _assert_step_close(ops.adamw_update(p, g, m, v, hp, **kw),
                           spec.adamw_update(p, g, m, v, hp, **kw), jnp.float64)


def test_apply_bad_arguments(rng):
    p, g, m, v = _state(rng, (4,), jnp.float32)
    hp = _hparams()
    with pytest.raises(ValueError, match=r"grad_scale must be a float32 scalar"):
        ops.adamw_update(p, g, m, v, hp, grad_scale=jnp.ones([1], jnp.float32))
    with pytest.raises(ValueError, match=r"grad_scale must be a float32 scalar"):
        ops.adamw_update(p, g, m, v, hp, grad_scale=jnp.ones([], jnp.bfloat16))
    with pytest.raises(TypeError, match="apply must be a bool"):
        ops.adamw_update(p, g, m, v, hp, apply=1)


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "unclipped"])
def test_adamw_apply_matches_optax_chain(rng, clip):
    # adamw_apply(grads, state, params, scale) == clip_by_global_norm, adamw, apply_updates.
    lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=12,
                                            end_value=3e-4)
    kw = dict(b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mask=_matrices_only)
    apply = jax.jit(blujax.optim.adamw_apply(lr, **kw))
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, **kw))
    params = _tree(rng)
    p_ours, p_ref = params, params
    s_ours, s_ref = blujax.optim.adamw(lr, **kw).init(params), ref.init(params)

    @jax.jit
    def ref_step(params, state, grads):
        updates, state = ref.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(8):
        grads = jax.tree.map(lambda p: randn(rng, p.shape, p.dtype, 3.0 if clip else 0.01),
                             params)
        norm = optax.tree.norm(grads)
        assert bool(norm > 1.0) == clip
        scale = jnp.where(norm < 1.0, 1.0, 1.0 / norm).astype(jnp.float32)
        p_ours, s_ours = apply(grads, s_ours, p_ours, scale)
        p_ref, s_ref = ref_step(p_ref, s_ref, grads)
        # g * (1 / norm) against optax's (g / norm) * 1: an ulp apart at most per gradient.
        _assert_trees_close(p_ours, p_ref)
    assert int(s_ours.count) == 8
    _assert_trees_close(s_ours.mu, s_ref[1][0].mu)
    _assert_trees_close(s_ours.nu, s_ref[1][0].nu)


def test_weight_decay_zero_never_reads_params(rng):
    # Masked-out leaves skip `weight_decay * p`: the kernel does not even read p.
    p, g, m, v = _state(rng, (1001,), jnp.float32)
    nan_p = jnp.full_like(p, jnp.nan)
    u, _, _ = ops.adamw_update(nan_p, g, m, v, _hparams(wd=0.0), b1=B1, b2=B2, eps=EPS)
    u_ref, _, _ = spec.adamw_update(p, g, m, v, _hparams(wd=0.0), b1=B1, b2=B2, eps=EPS)
    assert_close(u, u_ref, jnp.float32, factor=F32_TIGHT)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_many_tensors_in_one_call(rng, dtype):
    # More tensors than the CUDA kernel takes per launch (256), sizes from 1 to past one chunk
    # (few distinct sizes, so the spec compiles only a few times).
    sizes = [int(s) for s in rng.choice([1, 2, 5, 768, 4096, 4099, 8197], size=263)]
    states = [_state(rng, (s,), dtype) for s in sizes]
    hp = _hparams(lr=1e-3, wd=0.05, step=3)
    kw = dict(b1=0.8, b2=0.99, eps=1e-6)
    got = jax.jit(functools.partial(ops.adamw_update_many, **kw))(*zip(*states), hp)
    ref = jax.jit(functools.partial(spec.adamw_update, **kw))
    for i, state in enumerate(states):
        _assert_step_close([o[i] for o in got], ref(*state, hp), dtype)


@pytest.mark.parametrize("shape", [(), (3,), (17, 5), (1001,)], ids=str)
def test_float64_cpu(rng, shape):
    with cpu_float64():
        p, g, m, v = _state(rng, shape, jnp.float64)
        assert m.dtype == jnp.float64
        hp = _hparams(dtype=jnp.float64)
        got = ops.adamw_update(p, g, m, v, hp, b1=B1, b2=B2, eps=EPS)
        want = spec.adamw_update(p, g, m, v, hp, b1=B1, b2=B2, eps=EPS)
        _assert_step_close(got, want, jnp.float64)


def test_float64_optimizer_matches_optax(rng):
    with cpu_float64():
        params = _tree(rng, jnp.float64)
        kw = dict(b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mask=_matrices_only)
        ours, ref = blujax.optim.adamw(1e-3, **kw), optax.adamw(1e-3, **kw)
        s_ours, s_ref = ours.init(params), ref.init(params)
        for _ in range(4):
            grads = jax.tree.map(lambda p: randn(rng, p.shape, p.dtype), params)
            u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
            u_ref, s_ref = jax.jit(ref.update)(grads, s_ref, params)
        assert all(m.dtype == jnp.float64 for m in jax.tree.leaves(s_ours.mu))
        flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])  # noqa
        assert_close(flat(u_ours), flat(u_ref), jnp.float64)


def test_vmap(rng):
    p, g, m, v = _state(rng, (4, 33), jnp.float32)
    hp = jnp.stack([_hparams(lr=1e-3 * (i + 1)) for i in range(4)])  # one per batch member
    f = functools.partial(ops.adamw_update, b1=B1, b2=B2, eps=EPS)
    f_ref = functools.partial(spec.adamw_update, b1=B1, b2=B2, eps=EPS)
    _assert_step_close(jax.vmap(f)(p, g, m, v, hp), jax.vmap(f_ref)(p, g, m, v, hp),
                       jnp.float32)


def test_cannot_be_differentiated(rng):
    p, g, m, v = _state(rng, (5,), jnp.float32)
    with pytest.raises(Exception, match="cannot be differentiated"):
        jax.grad(lambda p: ops.adamw_update(p, g, m, v, _hparams())[0].sum())(p)


# --- blujax.optim.adamw against optax.adamw ------------------------------------------------------

def _tree(rng, dtype=jnp.float32):
    return {
        "scale": randn(rng, (), dtype),
        "ln": {"weight": randn(rng, (3,), dtype, 0.1, 1.0), "bias": randn(rng, (3,), dtype)},
        "proj": {"w": randn(rng, (17, 5), dtype), "b": randn(rng, (1001,), dtype)},
        "wte": randn(rng, (50, 7), dtype),
    }


def _matrices_only(params):
    # The usual GPT-2 choice: decay weight matrices, not biases, gains or scalars.
    return jax.tree.map(lambda p: p.ndim >= 2, params)


MASKS = {
    "callable": _matrices_only,
    "prefix_tree": {"scale": False, "ln": False, "proj": {"w": True, "b": False}, "wte": True},
    "none": None,
}


def _assert_trees_close(got, want):
    """float32 pytrees equal to ~1e-6 of the largest magnitude among all their leaves.

    One scale for the whole tree: a leaf whose update nearly cancels (the Adam step against the
    weight decay, say) is compared on the scale of its terms, not of their tiny difference.
    """
    flat = lambda t: jnp.concatenate([jnp.ravel(x) for x in jax.tree.leaves(t)])
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert_close(flat(got), flat(want), jnp.float32, factor=F32_TIGHT)


@pytest.mark.parametrize("mask,schedule", [("callable", True), ("prefix_tree", False),
                                           ("none", True)], ids=str)
def test_matches_optax_adamw(rng, mask, schedule):
    lr = (optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=5, decay_steps=25,
                                             end_value=3e-4) if schedule else 2e-3)
    kw = dict(b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mask=MASKS[mask])
    ours = optax.chain(optax.clip_by_global_norm(1.0), blujax.optim.adamw(lr, **kw))
    ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, **kw))
    params = _tree(rng)
    p_ours, p_ref = params, params
    s_ours, s_ref = ours.init(params), ref.init(params)

    @functools.partial(jax.jit, static_argnums=0)
    def step(tx, params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    for _ in range(22):
        grads = jax.tree.map(lambda p: randn(rng, p.shape, p.dtype, 3.0), params)
        p_ours, s_ours, u_ours = step(ours, p_ours, s_ours, grads)
        p_ref, s_ref, u_ref = step(ref, p_ref, s_ref, grads)
        _assert_trees_close(u_ours, u_ref)
    adam_ref = s_ref[1][0]  # chain -> (clip, adamw chain -> (scale_by_adam, ...))
    assert int(s_ours[1].count) == int(adam_ref.count) == 22
    _assert_trees_close(p_ours, p_ref)
    _assert_trees_close(s_ours[1].mu, adam_ref.mu)
    _assert_trees_close(s_ours[1].nu, adam_ref.nu)


def test_schedule_sees_count_before_the_step(rng):
    seen = []
    tx = blujax.optim.adamw(lambda count: seen.append(count) or 1e-3, weight_decay=0.0)
    params = {"w": randn(rng, (4,), jnp.float32)}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    _, state = tx.update(params, state, params)
    assert [int(c) for c in seen] == [0, 1] and int(state.count) == 2


def test_bfloat16_params_keep_float32_moments(rng):
    params = _tree(rng, jnp.bfloat16)
    params["f32_head"] = randn(rng, (9,), jnp.float32)  # mixed dtypes: one call per dtype
    kw = dict(b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mask=_matrices_only)
    ours, ref = blujax.optim.adamw(1e-3, **kw), blujax.optim.adamw(1e-3, **kw, ops=spec)
    s_ours, s_ref = ours.init(params), ref.init(params)
    assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(s_ours.mu))
    for _ in range(3):
        grads = jax.tree.map(lambda p: randn(rng, p.shape, p.dtype), params)
        u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        u_ref, s_ref = jax.jit(ref.update)(grads, s_ref, params)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_ref)):
            assert a.dtype == b.dtype
            if a.dtype == jnp.bfloat16:
                assert_close(a, b, a.dtype)
        _assert_trees_close({k: v for k, v in u_ours.items() if k == "f32_head"},
                            {k: v for k, v in u_ref.items() if k == "f32_head"})
        _assert_trees_close(s_ours.mu, s_ref.mu)
        _assert_trees_close(s_ours.nu, s_ref.nu)


@pytest.mark.parametrize("clip", [True, False], ids=["clipped", "plain"])
def test_donated_train_step_copies_nothing(rng, clip):
    params = _tree(rng)
    tx = blujax.optim.adamw(1e-3, mask=_matrices_only)
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx) if clip else tx

    def train_step(params, state, x):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(l * x)) for l in jax.tree.leaves(p)))(
            params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    x = jnp.float32(0.7)
    hlo = jax.jit(train_step, donate_argnums=(0, 1)).lower(params, state, x).compile()
    text = hlo.as_text()  # all computations: on a GPU the calls may sit in a command buffer
    # Only the int32 step count may be copied: the update overwrites the gradient, the moments
    # are written where they are. (A fusion's ROOT copy is how it emits a value; not a copy.)
    copies = [line for line in text.splitlines()
              if " copy(" in line and "f32[" in line and not line.strip().startswith("ROOT")]
    assert not copies, copies
    # Decayed and not decayed leaves: one call each.
    assert text.count('custom_call_target="blujax_adamw"') == 2


def test_inputs_still_needed_are_not_overwritten(rng):
    # Without donation XLA copies what the kernel overwrites; the caller's arrays stay intact.
    p, g, m, v = _state(rng, (1001,), jnp.float32)
    saved = [np.array(x) for x in (p, g, m, v)]
    hp = _hparams()
    u, m2, v2 = jax.jit(ops.adamw_update)(p, g, m, v, hp)
    u_eager, _, _ = ops.adamw_update(p, g, m, v, hp)
    for x, y in zip((p, g, m, v), saved):
        np.testing.assert_array_equal(np.asarray(x), y)
    np.testing.assert_array_equal(np.asarray(u), np.asarray(u_eager))
    assert not np.array_equal(np.asarray(m2), saved[2])


def test_weight_decay_without_params_raises(rng):
    params = _tree(rng)
    tx = blujax.optim.adamw(1e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(params, tx.init(params))
    # Without decay the params are not needed.
    tx = blujax.optim.adamw(1e-3, weight_decay=0.0)
    updates, _ = tx.update(params, tx.init(params))
    assert jax.tree.structure(updates) == jax.tree.structure(params)


# --- shard_map ----------------------------------------------------------------------------------

def test_shard_map(rng):
    devices = mesh_devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    sharded = _state(rng, (4 * n, 37), jnp.float32)   # ZeRO-style: each device a slice
    replicated = _state(rng, (11,), jnp.float32)      # every device the whole tensor
    hp = _hparams()
    f = functools.partial(ops.adamw_update_many, b1=B1, b2=B2, eps=EPS)

    @jax.jit
    def step(sharded, replicated, hp):
        def body(sharded, replicated, hp):
            (u, m, v) = f(*([t] for t in sharded), hp)
            (ur, mr, vr) = f(*([t] for t in replicated), hp)
            return (u[0], m[0], v[0]), (ur[0], mr[0], vr[0])
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P()),
                             out_specs=(P("data"), P()))(sharded, replicated, hp)

    got_s, got_r = step(sharded, replicated, hp)
    _assert_step_close(got_s, spec.adamw_update(*sharded, hp, b1=B1, b2=B2, eps=EPS),
                       jnp.float32)
    _assert_step_close(got_r, spec.adamw_update(*replicated, hp, b1=B1, b2=B2, eps=EPS),
                       jnp.float32)
    hlo = step.lower(sharded, replicated, hp).as_text()
    assert "blujax_adamw" in hlo and "all-gather" not in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    p, g, m, v = _state(rng, (4, 8), jnp.float32)
    hp = _hparams()
    bad = {
        "grad must match param": lambda: ops.adamw_update(p, g[:3], m, v, hp),
        "grad must match param ": lambda: ops.adamw_update(p, g.astype(jnp.bfloat16), m, v, hp),
        r"m must be float32\[4, 8\]": lambda: ops.adamw_update(p, g, m[:, :7], v, hp),
        r"v must be float32\[4, 8\] for bfloat16": lambda: ops.adamw_update(
            p.astype(jnp.bfloat16), g.astype(jnp.bfloat16), m, v.astype(jnp.bfloat16), hp),
        r"hparams must be float32\[4\]": lambda: ops.adamw_update(p, g, m, v, hp[:3]),
        r"hparams must be float32\[4\] ": lambda: ops.adamw_update(
            p, g, m, v, hp.astype(jnp.bfloat16)),
        "dtype int32": lambda: ops.adamw_update(*(x.astype(jnp.int32) for x in (p, g)), m, v,
                                                hp),
        "dtype float16": lambda: ops.adamw_update(*(x.astype(jnp.float16) for x in (p, g)), m,
                                                  v, hp),
        r"b1 must be a number in \[0, 1\)": lambda: ops.adamw_update(p, g, m, v, hp, b1=1.0),
        r"b1 must be a number in \[0, 1\) ": lambda: ops.adamw_update(p, g, m, v, hp, b1=-0.1),
        r"b2 must be a number in \[0, 1\)": lambda: ops.adamw_update(p, g, m, v, hp, b2=1.5),
        "eps must be a finite number >= 0": lambda: ops.adamw_update(p, g, m, v, hp, eps=-1e-8),
        "eps must be a finite number >= 0 ": lambda: ops.adamw_update(p, g, m, v, hp,
                                                                       eps=float("nan")),
        "must share a dtype": lambda: ops.adamw_update_many(
            [p, p.astype(jnp.bfloat16)], [g, g.astype(jnp.bfloat16)], [m, m], [v, v], hp),
        "one of each per tensor": lambda: ops.adamw_update_many([p, p], [g], [m], [v], hp),
        "no tensors": lambda: ops.adamw_update_many([], [], [], [], hp),
    }
    for message, call in bad.items():
        with pytest.raises((ValueError, TypeError), match=message.strip()):
            call()


def test_optimizer_rejects_bad_hyperparameters(rng):
    for kw, message in [(dict(b1=1.0), "b1"), (dict(b2=-0.5), "b2"), (dict(eps=-1.0), "eps"),
                        (dict(learning_rate=float("nan")), "learning_rate"),
                        (dict(weight_decay=float("inf")), "weight_decay")]:
        kw = {"learning_rate": 1e-3, **kw}
        with pytest.raises(ValueError, match=message):
            blujax.optim.adamw(**kw)
    params = {"w": randn(rng, (3, 3), jnp.float32)}
    tx = blujax.optim.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.sum() > 0, p))
    with pytest.raises(TypeError, match="static Python bools"):
        jax.jit(tx.update)(params, tx.init(params), params)


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(outs, *args, b1=B1, b2=B2, eps=EPS, apply=False):
    call = jax.ffi.ffi_call("blujax_adamw", outs)
    return jax.jit(lambda *a: call(*a, b1=b1, b2=b2, eps=eps, apply=apply))(*args)


def _kernel_hparams(**kw):
    """The kernel's five hparams: _hparams' four, then grad_scale 1."""
    return jnp.concatenate([_hparams(**kw), jnp.ones([1], jnp.float32)])


@pytest.mark.parametrize("case", ["odd_operands", "few_results", "grad_size", "m_dtype",
                                  "hparams_size", "hparams_dtype", "mixed_params", "update_dtype",
                                  "int_params", "b1", "eps_nan", "new_v_size"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    p, g, m, v = _state(rng, (4, 8), jnp.float32)
    hp = _kernel_hparams()
    sds = jax.ShapeDtypeStruct
    f32 = sds((4, 8), jnp.float32)
    outs = (f32, f32, f32)
    calls = {
        "odd_operands": lambda: _raw(outs, hp, p, g, m),
        "few_results": lambda: _raw((f32, f32), hp, p, g, m, v),
        "grad_size": lambda: _raw(outs, hp, p, g[:3], m, v),
        "m_dtype": lambda: _raw(outs, hp, p, g, m.astype(jnp.bfloat16), v),
        "hparams_size": lambda: _raw(outs, hp[:4], p, g, m, v),
        "hparams_dtype": lambda: _raw(outs, hp.astype(jnp.int32), p, g, m, v),
        "mixed_params": lambda: _raw(
            (f32, sds((4, 8), jnp.bfloat16), f32, f32, f32, f32), hp, p,
            p.astype(jnp.bfloat16), g, g.astype(jnp.bfloat16), m, m, v, v),
        "update_dtype": lambda: _raw((sds((4, 8), jnp.bfloat16), f32, f32), hp, p, g, m, v),
        "int_params": lambda: _raw((sds((4, 8), jnp.int32), f32, f32), hp, p.astype(jnp.int32),
                                   g.astype(jnp.int32), m, v),
        "b1": lambda: _raw(outs, hp, p, g, m, v, b1=1.0),
        "eps_nan": lambda: _raw(outs, hp, p, g, m, v, eps=float("nan")),
        "new_v_size": lambda: _raw((f32, f32, sds((4, 7), jnp.float32)), hp, p, g, m, v),
    }
    with pytest.raises(Exception, match="blujax_adamw: "):
        jax.block_until_ready(calls[case]())


@pytest.mark.gpu
def test_cuda_rejects_float64_buffers(rng):
    x = np.ones((4, 8), np.float64)
    with jax.enable_x64(True):
        sds = jax.ShapeDtypeStruct((4, 8), jnp.float64)
        with pytest.raises(Exception, match="unsupported parameter dtype float64"):
            jax.block_until_ready(_raw((sds, sds, sds), np.ones(5), x, x, x, x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_cuda_gpt2_sized_leaves(rng, dtype):
    # A leaf as large as GPT-2's embedding plus an odd tail, with small leaves in the same call.
    shapes = [(50304, 768), (768,), (3, 1001), (2304,), (1,)]
    states = [_state(rng, s, dtype) for s in shapes]
    hp = _hparams(step=1)
    got = ops.adamw_update_many(*zip(*states), hp, b1=B1, b2=B2, eps=EPS)
    want = spec.adamw_update_many(*zip(*states), hp, b1=B1, b2=B2, eps=EPS)
    for i in range(len(shapes)):
        _assert_step_close([o[i] for o in got], [o[i] for o in want], dtype)
    # The train step's form: clipped gradients, the update applied in place.
    kw = dict(b1=B1, b2=B2, eps=EPS, grad_scale=jnp.float32(0.25), apply=True)
    got = ops.adamw_update_many(*zip(*states), hp, **kw)
    want = spec.adamw_update_many(*zip(*states), hp, **kw)
    for i in range(len(shapes)):
        _assert_step_close([o[i] for o in got], [o[i] for o in want], dtype)
