"""blujax.kernels.softmax_cross_entropy (and its per-row, vocab-parallel and mean entries) against
the jnp specs (blujax.kernels.xla.softmax_cross_entropy, softmax_cross_entropy_mean).

Runs the CPU kernels on CPU and the CUDA kernels wherever JAX runs on a GPU.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from blujax import kernels as ops
from blujax.kernels import xla as spec
from blujax.kernels.cross_entropy import _softmax_cross_entropy_mean_unaliased
from tests.util import assert_close, cpu_float64, mesh_devices, randn

DTYPES = [jnp.float32, jnp.bfloat16]
# V = 1 and 3 are shorter than one 16-byte pack, 1001 is odd, 50257 (GPT-2) leaves bfloat16
# rows at 8 different alignments, 50304 is the padded vocabulary; row counts are odd.
SHAPES = [(5, 1), (7, 3), (37, 1001), (5, 50257), (3, 50304)]


def _targets(rng, n, v, ignore_index=-1):
    """Random class ids, with an ignored row, and (for n >= 4) rows above and below [0, V)."""
    t = rng.integers(0, v, n)
    t[n // 2] = ignore_index
    if n >= 4:
        t[1], t[-1] = v + int(rng.integers(0, 3)), -int(rng.integers(2, 5))
    return jnp.asarray(t, jnp.int32)


def _logits(rng, n, v, dtype):
    # Spread like real logits (lse ~ 10 for V = 50k), and never zero.
    return randn(rng, (n, v), dtype, 3.0, 0.5)


def assert_close_nan(actual, expected, dtype, factor=1.0):
    """assert_close where NaN is expected exactly where the reference has NaN."""
    a = np.asarray(jnp.asarray(actual, jnp.float32) if actual.dtype == jnp.bfloat16 else actual)
    e = np.asarray(jnp.asarray(expected, jnp.float32) if expected.dtype == jnp.bfloat16
                   else expected)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e), err_msg="NaN in different places")
    assert_close(np.where(np.isnan(e), 0, a), np.where(np.isnan(e), 0, e), dtype, factor)


def _vjp(fn, x, ct):
    """(fn(x), the gradient of fn at x for cotangent ct), in one jitted program."""
    def run(x, ct):
        loss, vjp = jax.vjp(fn, x)
        return loss, vjp(ct)[0]
    return jax.jit(run)(x, ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_and_grads(rng, shape, dtype):
    n, v = shape
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, v)
    ct = randn(rng, (n,), jnp.float32)
    loss, dx = _vjp(lambda x: ops.softmax_cross_entropy(x, t), x, ct)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t), x, ct)
    assert loss.dtype == jnp.float32 and loss.shape == (n,)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    # The loss is float32 arithmetic on the same inputs for both dtypes.
    assert_close_nan(loss, loss_ref, jnp.float32, factor=2)
    assert_close_nan(dx, dx_ref, dtype, factor=2)
    ignored = np.asarray(t) == -1
    assert np.all(np.asarray(loss)[ignored] == 0)
    assert np.all(np.asarray(dx, np.float32)[ignored] == 0)
    if n >= 4:  # targets outside [0, V): NaN loss and NaN gradient row, no crash
        for row in (1, n - 1):
            assert np.isnan(loss[row]) and np.all(np.isnan(np.asarray(dx[row], np.float32)))


@pytest.mark.parametrize("ignore_index", [0, 7, -100])
def test_ignore_index(rng, ignore_index):
    n, v = 9, 33
    x = _logits(rng, n, v, jnp.float32)
    t = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[jnp.array([2, 5])].set(ignore_index)
    f = functools.partial(ops.softmax_cross_entropy, ignore_index=ignore_index)
    f_ref = functools.partial(spec.softmax_cross_entropy, ignore_index=ignore_index)
    ct = randn(rng, (n,), jnp.float32)
    loss, dx = _vjp(lambda x: f(x, t), x, ct)
    loss_ref, dx_ref = _vjp(lambda x: f_ref(x, t), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32)
    assert_close_nan(dx, dx_ref, jnp.float32)
    np.testing.assert_array_equal(np.asarray(dx)[[2, 5]], 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_masked_logits(rng, dtype):
    # Padded vocabulary entries set to -inf (and a row that starts with them) stay finite.
    n, v = 6, 1000
    x = _logits(rng, n, v, dtype).at[:, 950:].set(-jnp.inf).at[0, :40].set(-jnp.inf)
    t = jnp.asarray(rng.integers(40, 950, n), jnp.int32)
    ct = randn(rng, (n,), jnp.float32)
    loss, dx = _vjp(lambda x: ops.softmax_cross_entropy(x, t), x, ct)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t), x, ct)
    assert_close(loss, loss_ref, jnp.float32)
    assert_close(dx, dx_ref, dtype)
    np.testing.assert_array_equal(np.asarray(dx[:, 950:], np.float32), 0.0)


def test_empty_rows():
    x = jnp.ones((0, 50), jnp.float32)
    t = jnp.zeros((0,), jnp.int32)
    assert ops.softmax_cross_entropy(x, t).shape == (0,)
    assert jax.grad(lambda x: ops.softmax_cross_entropy(x, t).sum())(x).shape == (0, 50)


@pytest.mark.parametrize("shape", [(1, 1), (3, 2), (5, 7), (4, 33)], ids=str)
def test_check_grads_float64(rng, shape):
    n, v = shape
    with cpu_float64():
        x = randn(rng, shape, jnp.float64, 2.0)
        t = jnp.asarray(rng.integers(0, v, n), jnp.int32).at[n - 1].set(-1)
        f = lambda x: ops.softmax_cross_entropy(x, t)
        assert f(x).dtype == jnp.float64
        assert_close(f(x), spec.softmax_cross_entropy(x, t), jnp.float64)
        check_grads(f, (x,), order=1, modes=("rev",))
        # The per-row entries in float64 too.
        m, s, tl = ops.cross_entropy_stats(x, t)
        assert m.dtype == s.dtype == tl.dtype == jnp.float64
        assert_close(m + jnp.log(s), jax.nn.logsumexp(x, axis=-1), jnp.float64)


def test_int64_targets_are_narrowed_safely(rng):
    n, v = 6, 40
    with jax.enable_x64(True):
        x = _logits(rng, n, v, jnp.float32)
        # 2^32 + 3 would wrap onto class 3 in a plain cast; it must stay out of range (NaN).
        t64 = jnp.asarray([3, 2**32 + 3, -1, -(2**40), 17, 2**31], jnp.int64)
        loss = ops.softmax_cross_entropy(x, t64)
        want = spec.softmax_cross_entropy(x, t64)
        assert_close_nan(loss, want, jnp.float32)
        assert np.isnan(loss[1]) and np.isnan(loss[3]) and np.isnan(loss[5]) and loss[2] == 0
        dx = jax.grad(lambda x: jnp.nansum(ops.softmax_cross_entropy(x, t64)))(x)
        assert np.all(np.isnan(np.asarray(dx[1]))) and np.all(np.asarray(dx[2]) == 0)
    # A data loader's numpy int64 ids, without x64.
    t_np = np.array([3, 2**32 + 3, -1, -(2**40), 17, 2**31], np.int64)
    assert_close_nan(ops.softmax_cross_entropy(x, t_np), want, jnp.float32)


def test_jit_and_remat(rng):
    n, v = 11, 257
    x, t = _logits(rng, n, v, jnp.float32), _targets(rng, n, v)

    def loss(op, x):
        return jnp.nansum(jnp.sin(op(x * 1.5, t)))

    remat = jax.checkpoint(functools.partial(loss, ops.softmax_cross_entropy))
    got = jax.jit(jax.value_and_grad(remat))(x)
    want = jax.value_and_grad(functools.partial(loss, spec.softmax_cross_entropy))(x)
    assert_close(got[0], want[0], jnp.float32)
    assert_close_nan(got[1], want[1], jnp.float32, factor=2)


def test_vmap(rng):
    b, n, v = 3, 5, 129
    x = _logits(rng, b * n, v, jnp.float32).reshape(b, n, v)
    t = jnp.stack([_targets(rng, n, v) for _ in range(b)])

    def run(op, x, t):
        return (jax.vmap(op)(x, t),
                jax.vmap(op, (0, None))(x, t[0]),  # shared targets
                # Per-example gradients: the backward is batched too.
                jax.vmap(jax.grad(lambda x, t: jnp.nansum(op(x, t) ** 2)))(x, t))

    got = jax.jit(functools.partial(run, ops.softmax_cross_entropy))(x, t)
    want = jax.jit(functools.partial(run, spec.softmax_cross_entropy))(x, t)
    for g, w in zip(got, want):
        assert_close_nan(g, w, jnp.float32, factor=2)


def test_jacobian(rng):
    # jacrev vmaps the backward over cotangents while the saved logits are not batched.
    n, v = 4, 6
    x, t = _logits(rng, n, v, jnp.float32), jnp.asarray([1, -1, 5, 0], jnp.int32)
    got = jax.jacrev(lambda x: ops.softmax_cross_entropy(x, t))(x)
    want = jax.jacrev(lambda x: spec.softmax_cross_entropy(x, t))(x)
    assert_close(got, want, jnp.float32)


def test_gradient_into_logits_buffer_is_safe(rng):
    # dlogits reuses the logits buffer; wherever the logits live on, XLA must copy them first.
    n, v = 7, 300
    x = _logits(rng, n, v, jnp.float32)
    x_before = np.asarray(x).copy()
    t1, t2 = _targets(rng, n, v), jnp.asarray(rng.integers(0, v, n), jnp.int32)

    # Eager: the backward's input is the caller's array.
    _, vjp = jax.vjp(lambda x: ops.softmax_cross_entropy(x, t1), x)
    d1, d2 = vjp(jnp.ones(n))[0], vjp(2 * jnp.ones(n))[0]
    np.testing.assert_array_equal(np.asarray(x), x_before)
    assert_close_nan(2 * d1, d2, jnp.float32)

    def two_losses(op, x):
        # One logits buffer, two backward passes, and the logits returned as well.
        y = x * 2.0
        l = op(y, t1) + 3 * op(y, t2)
        return jnp.nansum(l), y

    got = jax.jit(jax.value_and_grad(functools.partial(two_losses, ops.softmax_cross_entropy),
                                     has_aux=True))(x)
    want = jax.value_and_grad(functools.partial(two_losses, spec.softmax_cross_entropy),
                              has_aux=True)(x)
    np.testing.assert_array_equal(np.asarray(got[0][1]), np.asarray(want[0][1]))
    assert_close(got[0][0], want[0][0], jnp.float32)
    assert_close_nan(got[1], want[1], jnp.float32, factor=2)
    np.testing.assert_array_equal(np.asarray(x), x_before)


def test_shard_map_rows(rng):
    devices = mesh_devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    n, v = 3 * len(devices), 1001
    x, t = _logits(rng, n, v, jnp.float32), _targets(rng, n, v)

    @jax.jit
    def sharded(x, t):
        body = lambda x, t: jax.lax.psum(jnp.nansum(ops.softmax_cross_entropy(x, t)), "data")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())(x, t)

    got = jax.value_and_grad(sharded)(x, t)
    want = jax.value_and_grad(lambda x: jnp.nansum(spec.softmax_cross_entropy(x, t)))(x)
    assert_close(got[0], want[0], jnp.float32)
    assert_close_nan(got[1], want[1], jnp.float32, factor=2)
    hlo = sharded.lower(x, t).as_text()
    assert "blujax_cross_entropy_fwd" in hlo and "all-gather" not in hlo


# --- vocabulary split over devices --------------------------------------------------------------

def _combine(parts, t, v, ignore_index=-1):
    """The documented recipe, over a list instead of a device axis: (loss, lse)."""
    m = functools.reduce(jnp.maximum, [p[0] for p in parts])
    lse = m + jnp.log(sum(s * jnp.exp(pm - m) for pm, s, _ in parts))
    picked = sum(p[2] for p in parts)
    ignored, known = t == ignore_index, (t >= 0) & (t < v)
    lse = jnp.where(known | ignored, lse, jnp.nan)
    return jnp.where(ignored, 0, lse - picked), lse


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n,v,cut", [(9, 1001, 400), (5, 50304, 25152), (4, 3, 1)], ids=str)
def test_vocab_split_stats_and_grad(rng, n, v, cut, dtype):
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, v)
    halves = [(x[:, :cut], 0), (x[:, cut:], cut)]
    parts = jax.jit(lambda halves: [ops.cross_entropy_stats(h, t, vocab_start=start)
                                    for h, start in halves])(halves)
    for (h, start), (m, s, tl) in zip(halves, parts):
        hf = h.astype(jnp.float32)
        assert_close(m, jnp.max(hf, axis=-1), jnp.float32)
        assert_close(s, jnp.sum(jnp.exp(hf - m[:, None]), axis=-1), jnp.float32)
        local = np.asarray(t) - start
        inside = (local >= 0) & (local < h.shape[1])
        want = np.where(inside, np.asarray(hf)[np.arange(n), np.clip(local, 0, h.shape[1] - 1)], 0)
        np.testing.assert_array_equal(np.asarray(tl), want)
    loss, lse = jax.jit(_combine, static_argnums=2)(parts, t, v)
    ct = randn(rng, (n,), jnp.float32)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32, factor=2)
    dx = jax.jit(lambda halves, lse, ct: jnp.concatenate(
        [ops.cross_entropy_grad(h, t, lse, ct, vocab_start=start) for h, start in halves],
        axis=1))(halves, lse, ct)
    assert_close_nan(dx, dx_ref, dtype, factor=2)


def test_vocab_start_may_be_traced(rng):
    n, v = 5, 64
    x, t = _logits(rng, n, v, jnp.float32), jnp.asarray(rng.integers(0, 2 * v, n), jnp.int32)
    f = jax.jit(lambda x, t, start: ops.cross_entropy_stats(x, t, vocab_start=start)[2])
    for start in (0, v):
        local = np.asarray(t) - start
        inside = (local >= 0) & (local < v)
        want = np.where(inside, np.asarray(x)[np.arange(n), np.clip(local, 0, v - 1)], 0)
        np.testing.assert_array_equal(np.asarray(f(x, t, jnp.int32(start))), want)


def _data_tensor_mesh():
    """A ("data", "tensor") mesh over the test devices, "tensor" 4 wide where they allow."""
    devices = mesh_devices()
    tp = 4 if len(devices) % 4 == 0 else 1
    mesh = jax.make_mesh((len(devices) // tp, tp), ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)
    return mesh, tp


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_vocab_parallel_shard_map(rng, dtype):
    mesh, tp = _data_tensor_mesh()
    n, v = 3 * (mesh.size // tp), 250 * tp
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, v, ignore_index=5)
    ct = randn(rng, (n,), jnp.float32)

    @jax.jit
    def sharded(x, t):
        f = functools.partial(ops.vocab_parallel_softmax_cross_entropy, axis_name="tensor",
                              ignore_index=5)
        return jax.shard_map(f, mesh=mesh, in_specs=(P("data", "tensor"), P("data")),
                             out_specs=P("data"))(x, t)

    loss, dx = jax.jit(lambda x, t, ct: _vjp(lambda x: sharded(x, t), x, ct))(x, t, ct)
    loss_ref, dx_ref = _vjp(
        lambda x: spec.softmax_cross_entropy(x, t, ignore_index=5), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32, factor=2)
    assert_close_nan(dx, dx_ref, dtype, factor=2)
    hlo = sharded.lower(x, t).as_text()
    assert "blujax_cross_entropy_stats" in hlo and "all-gather" not in hlo


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(7, 3, 2), (9, 1001, 997), (5, 50304, 50257)], ids=str)
def test_num_classes_leaves_out_padding(rng, shape, dtype):
    """num_classes = K on [N, V] logits: the loss of logits[:, :K], zero gradient beyond K,
    and targets in [K, V) are outside the vocabulary (NaN rows)."""
    n, v, k = shape
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, k)
    t = t.at[0].set(k + (v - k) // 2)  # a padding column: NaN, not a class
    ct = randn(rng, (n,), jnp.float32)
    loss, dx = _vjp(lambda x: ops.softmax_cross_entropy(x, t, num_classes=k), x, ct)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t, num_classes=k), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32)
    assert_close_nan(dx, dx_ref, dtype)
    assert np.isnan(loss[0])
    finite_rows = ~np.isnan(np.asarray(loss))
    np.testing.assert_array_equal(np.asarray(dx, np.float32)[finite_rows][:, k:], 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_vocab_parallel_num_classes(rng, dtype):
    """A padded vocabulary split over "tensor": the last device holds real and padded columns."""
    mesh, tp = _data_tensor_mesh()
    n, v = 3 * (mesh.size // tp), 128 * tp
    k = v - 77 if tp > 1 else v - 5
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, k)
    ct = randn(rng, (n,), jnp.float32)

    @jax.jit
    def sharded(x, t):
        f = functools.partial(ops.vocab_parallel_softmax_cross_entropy, axis_name="tensor",
                              num_classes=k)
        return jax.shard_map(f, mesh=mesh, in_specs=(P("data", "tensor"), P("data")),
                             out_specs=P("data"))(x, t)

    loss, dx = jax.jit(lambda x, t, ct: _vjp(lambda x: sharded(x, t), x, ct))(x, t, ct)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t, num_classes=k), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32, factor=2)
    assert_close_nan(dx, dx_ref, dtype, factor=2)


def test_lowers_for_cuda():
    # The GPU path lowers (with its logits/dlogits alias) even where no GPU is present.
    x, t = jnp.ones((4, 50257), jnp.bfloat16), jnp.zeros(4, jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda x: ops.softmax_cross_entropy(x, t).mean()))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "@blujax_cross_entropy_fwd" in text and "@blujax_cross_entropy_bwd" in text
    assert "output_operand_aliases" in text


# --- the mean loss, whose forward writes the gradient -------------------------------------------

def _mean_targets(rng, n, v, ignore_index=-1):
    """Class ids in [0, v) with one ignored row (n >= 2): a finite mean."""
    t = rng.integers(0, v, n)
    if n >= 2:
        t[n // 2] = ignore_index
    return jnp.asarray(t, jnp.int32)


def _value_and_grad(fn, x):
    return jax.jit(jax.value_and_grad(fn))(x)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n,v,k", [(1, 1, None), (7, 3, None), (37, 1001, None),
                                   (5, 50257, None), (3, 50304, 50257)], ids=str)
def test_mean_values_and_grads(rng, n, v, k, dtype):
    x, t = _logits(rng, n, v, dtype), _mean_targets(rng, n, k or v)
    loss, dx = _value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t, num_classes=k), x)
    loss_ref, dx_ref = _value_and_grad(
        lambda x: spec.softmax_cross_entropy_mean(x, t, num_classes=k), x)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert_close(loss, loss_ref, jnp.float32, factor=2)
    # The gradient is about 1/count: compare on its own scale, not the default floor of 1.
    floor = float(np.max(np.abs(np.asarray(dx_ref, np.float32))))
    assert_close(dx, dx_ref, dtype, factor=2, floor=floor)
    if n >= 2:
        np.testing.assert_array_equal(np.asarray(dx[n // 2], np.float32), 0.0)
    if k is not None:
        np.testing.assert_array_equal(np.asarray(dx[:, k:], np.float32), 0.0)
    # Not differentiated: the loss-only kernel, the same value.
    assert_close(jax.jit(lambda x: ops.softmax_cross_entropy_mean(x, t, num_classes=k))(x),
                 loss_ref, jnp.float32, factor=2)


@pytest.mark.parametrize("ignore_index", [-1, 0, -100])
def test_mean_ignored_rows(rng, ignore_index):
    n, v = 9, 33
    x = _logits(rng, n, v, jnp.float32)
    t = jnp.asarray(rng.integers(1, v, n), jnp.int32).at[jnp.array([2, 5, 6])].set(ignore_index)
    f = functools.partial(ops.softmax_cross_entropy_mean, ignore_index=ignore_index)
    f_ref = functools.partial(spec.softmax_cross_entropy_mean, ignore_index=ignore_index)
    loss, dx = _value_and_grad(lambda x: f(x, t), x)
    loss_ref, dx_ref = _value_and_grad(lambda x: f_ref(x, t), x)
    # The mean over the 6 counted rows, not over all 9.
    per_row = spec.softmax_cross_entropy(x, t, ignore_index=ignore_index)
    assert_close(loss, jnp.sum(per_row) / 6, jnp.float32)
    assert_close(loss, loss_ref, jnp.float32)
    assert_close(dx, dx_ref, jnp.float32, floor=1 / 6)
    np.testing.assert_array_equal(np.asarray(dx)[[2, 5, 6]], 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mean_all_rows_ignored(rng, dtype):
    x = _logits(rng, 5, 40, dtype)
    t = jnp.full((5,), -1, jnp.int32)
    loss, dx = _value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t), x)
    assert loss.dtype == jnp.float32 and float(loss) == 0.0
    np.testing.assert_array_equal(np.asarray(dx, np.float32), 0.0)
    assert float(spec.softmax_cross_entropy_mean(x, t)) == 0.0
    # No rows at all: the same.
    e = jnp.ones((0, 50), dtype)
    e_loss, e_dx = _value_and_grad(
        lambda x: ops.softmax_cross_entropy_mean(x, jnp.zeros((0,), jnp.int32)), e)
    assert float(e_loss) == 0.0 and e_dx.shape == (0, 50)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mean_unknown_target_is_nan(rng, dtype):
    # A target outside [0, num_classes) makes the mean NaN and its own gradient row NaN over
    # the classes (zero over the padding); the other rows keep their finite gradient.
    n, v, k = 6, 300, 290
    x, t = _logits(rng, n, v, dtype), _mean_targets(rng, n, k)
    t = t.at[1].set(v + 2).at[4].set(k + 3)
    f = lambda x: ops.softmax_cross_entropy_mean(x, t, num_classes=k)
    loss, dx = _value_and_grad(f, x)
    loss_ref, dx_ref = _value_and_grad(
        lambda x: spec.softmax_cross_entropy_mean(x, t, num_classes=k), x)
    assert np.isnan(loss) and np.isnan(loss_ref)
    dx32 = np.asarray(dx, np.float32)
    for row in (1, 4):
        assert np.all(np.isnan(dx32[row, :k])) and np.all(dx32[row, k:] == 0)
    assert_close_nan(dx, dx_ref, dtype, factor=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mean_cotangent_not_one(rng, dtype):
    n, v = 13, 257
    x, t = _logits(rng, n, v, dtype), _mean_targets(rng, n, v)

    def scaled(op, x):
        return 3.0 * op(x, t)

    def inside(op, x):  # the loss feeds a larger expression, with x used elsewhere too
        y = x * 2.0  # exact in bfloat16, which XLA may otherwise fuse at higher precision
        return jnp.sin(op(y, t)) * op(x, t) + jnp.sum(y.astype(jnp.float32)) * 1e-3

    def rematerialised(op, x):  # the fused forward runs again inside the backward
        return jax.checkpoint(functools.partial(inside, op))(x)

    for fn in (scaled, inside, rematerialised):
        got = _value_and_grad(functools.partial(fn, ops.softmax_cross_entropy_mean), x)
        want = _value_and_grad(functools.partial(fn, spec.softmax_cross_entropy_mean), x)
        assert_close(got[0], want[0], jnp.float32, factor=2)
        floor = float(np.max(np.abs(np.asarray(want[1], np.float32))))
        assert_close(got[1], want[1], dtype, factor=2, floor=floor)
    # A traced cotangent, through vjp.
    ct = jnp.float32(rng.standard_normal())
    _, dx = _vjp(lambda x: ops.softmax_cross_entropy_mean(x, t), x, ct)
    _, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy_mean(x, t), x, ct)
    floor = float(np.max(np.abs(np.asarray(dx_ref, np.float32))))
    assert_close(dx, dx_ref, dtype, factor=2, floor=floor)


def _big_ops(hlo_text, shape):
    """The entry computation's instructions that produce a `shape` array, by opcode."""
    entry = hlo_text[hlo_text.index("\nENTRY "):]
    dims = ",".join(map(str, shape))
    found = []
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+)\[" + dims + r"\]\{[^}]*\} ([\w-]+)\(", line)
        if m:
            found.append(m.group(2))
    return found


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_mean_grad_is_one_pass(rng, dtype):
    """Under jax.grad the backward's multiply by the cotangent (1) is simplified away: nothing
    but the fused kernel produces an [N, V] array. With 3 * loss, one elementwise pass does."""
    n, v = 37, 1001
    x, t = _logits(rng, n, v, dtype), _mean_targets(rng, n, v)

    def compiled(fn):
        return jax.jit(jax.grad(fn), donate_argnums=0).lower(x).compile().as_text()

    text = compiled(lambda x: ops.softmax_cross_entropy_mean(x, t))
    assert "blujax_cross_entropy_loss_grad" in text and "blujax_cross_entropy_fwd" not in text
    assert set(_big_ops(text, (n, v))) <= {"parameter", "get-tuple-element"}, text
    scaled = _big_ops(compiled(lambda x: 3 * ops.softmax_cross_entropy_mean(x, t)), (n, v))
    assert {"fusion", "multiply"} & set(scaled), scaled


@pytest.mark.parametrize("shape", [(1, 1), (5, 33)], ids=str)
def test_mean_check_grads_float64(rng, shape):
    n, v = shape
    with cpu_float64():
        x = randn(rng, shape, jnp.float64, 2.0)
        t = _mean_targets(rng, n, v)
        f = lambda x: ops.softmax_cross_entropy_mean(x, t)
        assert f(x).dtype == jnp.float64
        assert_close(f(x), spec.softmax_cross_entropy_mean(x, t), jnp.float64)
        check_grads(f, (x,), order=1, modes=("rev",))  # with random cotangents, not only 1


def test_mean_vmap(rng):
    b, n, v = 3, 5, 129
    x = _logits(rng, b * n, v, jnp.float32).reshape(b, n, v)
    t = jnp.stack([_mean_targets(rng, n, v) for _ in range(b)]).at[1].set(-1)  # one all ignored

    def run(op, x, t):
        return (jax.vmap(op)(x, t),
                jax.vmap(op, (0, None))(x, t[0]),
                jax.vmap(jax.value_and_grad(op))(x, t),  # one scale per batch member
                jax.vmap(jax.grad(op), (0, None))(x, t[2]))

    got = jax.jit(functools.partial(run, ops.softmax_cross_entropy_mean))(x, t)
    want = jax.jit(functools.partial(run, spec.softmax_cross_entropy_mean))(x, t)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(g, w, jnp.float32, factor=2, floor=0.1)


def test_mean_shard_map(rng):
    devices = mesh_devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    d, rows, v = len(devices), 3, 1001
    x, t = _logits(rng, d * rows, v, jnp.float32), _mean_targets(rng, d * rows, v)
    t = t.at[0].set(-1).at[1].set(-1)  # device 0 counts one row of three

    @jax.jit
    def per_device(x, t):  # each device's mean over its own rows
        body = lambda x, t: ops.softmax_cross_entropy_mean(x, t)[None]
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data")),
                             out_specs=P("data"))(x, t)

    def per_device_ref(x):
        return jax.vmap(spec.softmax_cross_entropy_mean)(x.reshape(d, rows, v),
                                                         t.reshape(d, rows))

    weights = jnp.arange(1.0, d + 1)  # a different cotangent per device

    def weighted(f, x):
        means = f(x)
        return jnp.sum(means * weights), means

    got = jax.jit(jax.value_and_grad(functools.partial(weighted, lambda x: per_device(x, t)),
                                     has_aux=True))(x)
    want = jax.value_and_grad(functools.partial(weighted, per_device_ref), has_aux=True)(x)
    assert_close(got[0][1], want[0][1], jnp.float32)  # the per-device means
    assert_close(got[1], want[1], jnp.float32, factor=2, floor=0.1)
    hlo = per_device.lower(x, t).as_text()
    assert "blujax_cross_entropy_fwd" in hlo and "all-gather" not in hlo


def test_mean_gradient_into_logits_buffer_is_safe(rng):
    n, v = 7, 300
    x = _logits(rng, n, v, jnp.float32)
    x_before = np.asarray(x).copy()
    t1, t2 = _mean_targets(rng, n, v), jnp.asarray(rng.integers(0, v, n), jnp.int32)

    # Eager: the fused kernel's input is the caller's array.
    _, dx = jax.value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t1))(x)
    np.testing.assert_array_equal(np.asarray(x), x_before)

    def two_losses(op, x):
        # One logits buffer, two fused kernels on it, and the logits returned as well.
        y = x * 2.0
        return op(y, t1) + 3 * op(y, t2), y

    got = jax.jit(jax.value_and_grad(
        functools.partial(two_losses, ops.softmax_cross_entropy_mean), has_aux=True))(x)
    want = jax.value_and_grad(
        functools.partial(two_losses, spec.softmax_cross_entropy_mean), has_aux=True)(x)
    np.testing.assert_array_equal(np.asarray(got[0][1]), np.asarray(want[0][1]))
    assert_close(got[0][0], want[0][0], jnp.float32)
    assert_close(got[1], want[1], jnp.float32, factor=2, floor=0.1)
    np.testing.assert_array_equal(np.asarray(x), x_before)


def test_mean_unaliased_is_the_same_op(rng):
    n, v = 9, 70
    x, t = _logits(rng, n, v, jnp.bfloat16), _mean_targets(rng, n, v)
    a = _value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t), x)
    b = _value_and_grad(lambda x: _softmax_cross_entropy_mean_unaliased(x, t), x)
    for u, w in zip(a, b):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(w, np.float32))


def test_mean_lowers_for_cuda():
    x, t = jnp.ones((4, 50257), jnp.bfloat16), jnp.zeros(4, jnp.int32)
    f = jax.jit(jax.value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t)))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "@blujax_cross_entropy_loss_grad" in text and "output_operand_aliases" in text
    assert "@blujax_cross_entropy_fwd" not in text and "@blujax_cross_entropy_bwd" not in text
    primal = jax.jit(lambda x: ops.softmax_cross_entropy_mean(x, t))
    text = primal.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "@blujax_cross_entropy_fwd" in text and "loss_grad" not in text


@pytest.mark.parametrize("case", ["targets_dtype", "targets_size", "scale_dtype", "scale_groups",
                                  "loss_size", "loss_dtype", "dlogits_shape", "dlogits_dtype",
                                  "logits_dtype", "num_classes"])
def test_loss_grad_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    t = jnp.asarray([1, 2, 3, 4], jnp.int32)
    sds = jax.ShapeDtypeStruct
    r4, out = sds((4,), jnp.float32), sds((4, 8), jnp.float32)
    one = jnp.float32(0.25)
    attrs = dict(ignore_index=np.int64(-1), num_classes=np.int64(8))
    call = functools.partial(_raw, "blujax_cross_entropy_loss_grad")
    calls = {
        "targets_dtype": lambda: call((r4, out), x, t.astype(jnp.float32), one, **attrs),
        "targets_size": lambda: call((r4, out), x, t[:3], one, **attrs),
        "scale_dtype": lambda: call((r4, out), x, t, jnp.bfloat16(1), **attrs),
        "scale_groups": lambda: call((r4, out), x, t, jnp.ones(3, jnp.float32), **attrs),
        "loss_size": lambda: call((sds((5,), jnp.float32), out), x, t, one, **attrs),
        "loss_dtype": lambda: call((sds((4,), jnp.bfloat16), out), x, t, one, **attrs),
        "dlogits_shape": lambda: call((r4, sds((4, 9), jnp.float32)), x, t, one, **attrs),
        "dlogits_dtype": lambda: call((r4, sds((4, 8), jnp.bfloat16)), x, t, one, **attrs),
        "logits_dtype": lambda: call((r4, sds((4, 8), jnp.int32)), x.astype(jnp.int32), t, one,
                                     **attrs),
        "num_classes": lambda: call((r4, out), x, t, one, ignore_index=np.int64(-1),
                                    num_classes=np.int64(0)),
    }
    with pytest.raises(Exception, match="blujax_cross_entropy_loss_grad: "):
        jax.block_until_ready(calls[case]())


# --- errors a user can act on, at trace time ----------------------------------------------------

@pytest.mark.parametrize("name", ["softmax_cross_entropy", "softmax_cross_entropy_mean"])
def test_bad_arguments_raise_clear_errors(rng, name):
    # The per-row loss and its mean share these checks; each names itself in its messages.
    x = randn(rng, (4, 8), jnp.float32)
    t = jnp.asarray([1, 2, 3, 4], jnp.int32)
    ce = getattr(ops, name)
    with pytest.raises(ValueError, match=rf"{name}: num_classes must be in \[1, 8\]"):
        ce(x, t, num_classes=9)
    with pytest.raises(ValueError, match=r"num_classes must be in \[1, 8\]"):
        ce(x, t, num_classes=0)
    with pytest.raises(TypeError, match="num_classes must be a Python int"):
        ce(x, t, num_classes=4.0)
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        ce(x[0], t[0])
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        ce(x[None], t[None])
    with pytest.raises(ValueError, match=r"targets must have shape \(4,\)"):
        ce(x, t[:3])
    with pytest.raises(ValueError, match=r"targets must have shape \(4,\)"):
        ce(x, t[:, None])
    with pytest.raises(TypeError, match="targets must be int32.*float32"):
        ce(x, t.astype(jnp.float32))
    with pytest.raises(TypeError, match="targets must be int32.*bool"):
        ce(x, t > 2)
    with pytest.raises(TypeError, match="targets must be int32.*uint32"):
        ce(x, t.astype(jnp.uint32))
    with pytest.raises(TypeError, match="logits has dtype int32"):
        ce(t.astype(jnp.int32).reshape(2, 2), t[:2])
    with pytest.raises(TypeError, match="logits has dtype float16"):
        ce(x.astype(jnp.float16), t)
    with pytest.raises(ValueError, match="no classes"):
        ce(jnp.ones((4, 0)), t)
    with pytest.raises(TypeError, match="ignore_index must be a Python int"):
        ce(x, t, ignore_index=1.5)
    with pytest.raises(ValueError, match="ignore_index must fit in int32"):
        ce(x, t, ignore_index=2**31)
    with pytest.raises(ValueError, match="ignore_index must fit in int32"):
        ce(x, t, ignore_index=-(2**31) - 1)


def test_vocab_split_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (4, 8), jnp.float32)
    t = jnp.asarray([1, 2, 3, 4], jnp.int32)
    with pytest.raises(ValueError, match="vocab_start must be in"):
        ops.cross_entropy_stats(x, t, vocab_start=-8)
    with pytest.raises(TypeError, match="vocab_start must be an int"):
        ops.cross_entropy_stats(x, t, vocab_start=jnp.float32(8))
    with pytest.raises(TypeError, match="vocab_start must be an int"):
        ops.cross_entropy_stats(x, t, vocab_start=jnp.zeros(2, jnp.int32))
    lse = jnp.zeros(4, jnp.float32)
    with pytest.raises(TypeError, match=r"lse must be float32\[4\]"):
        ops.cross_entropy_grad(x, t, lse[:3], lse)
    with pytest.raises(TypeError, match=r"g must be float32\[4\]"):
        ops.cross_entropy_grad(x, t, lse, lse.astype(jnp.bfloat16))


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


@pytest.mark.parametrize("case", ["targets_dtype", "targets_size", "loss_dtype", "lse_size",
                                  "logits_dtype", "scalar_logits", "stats_size", "start_groups",
                                  "start_dtype", "g_size", "dlogits_shape", "dlogits_dtype"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    t = jnp.asarray([1, 2, 3, 4], jnp.int32)
    row = jnp.zeros(4, jnp.float32)
    sds = jax.ShapeDtypeStruct
    r4, out = sds((4,), jnp.float32), sds((4, 8), jnp.float32)
    fwd, stats, bwd = ("blujax_cross_entropy_fwd", "blujax_cross_entropy_stats",
                       "blujax_cross_entropy_bwd")
    ig, nc = np.int64(-1), np.int64(8)
    s0 = jnp.int32(0)
    calls = {
        "targets_dtype": lambda: _raw(fwd, (r4, r4), x, t.astype(jnp.float32),
                                      ignore_index=ig, num_classes=nc),
        "targets_size": lambda: _raw(fwd, (r4, r4), x, t[:3], ignore_index=ig, num_classes=nc),
        "loss_dtype": lambda: _raw(fwd, (sds((4,), jnp.bfloat16), r4), x, t,
                                   ignore_index=ig, num_classes=nc),
        "lse_size": lambda: _raw(fwd, (r4, sds((5,), jnp.float32)), x, t,
                                 ignore_index=ig, num_classes=nc),
        "logits_dtype": lambda: _raw(fwd, (r4, r4), x.astype(jnp.int32), t,
                                     ignore_index=ig, num_classes=nc),
        "scalar_logits": lambda: _raw(fwd, (sds((), jnp.float32),) * 2, x[0, 0], t[0],
                                      ignore_index=ig, num_classes=nc),
        "stats_size": lambda: _raw(stats, (r4, r4, sds((3,), jnp.float32)), x, t, s0,
                                   num_classes=nc),
        "start_groups": lambda: _raw(stats, (r4, r4, r4), x, t, jnp.zeros(3, jnp.int32),
                                     num_classes=nc),
        "start_dtype": lambda: _raw(stats, (r4, r4, r4), x, t, jnp.float32(0), num_classes=nc),
        "num_classes": lambda: _raw(fwd, (r4, r4), x, t, ignore_index=ig, num_classes=np.int64(0)),
        "g_size": lambda: _raw(bwd, out, x, t, row, row[:2], s0, ignore_index=ig, num_classes=nc),
        "dlogits_shape": lambda: _raw(bwd, sds((4, 9), jnp.float32), x, t, row, row, s0,
                                      ignore_index=ig, num_classes=nc),
        "dlogits_dtype": lambda: _raw(bwd, sds((4, 8), jnp.bfloat16), x, t, row, row, s0,
                                      ignore_index=ig, num_classes=nc),
    }
    with pytest.raises(Exception, match="blujax_cross_entropy_(fwd|stats|bwd): "):
        jax.block_until_ready(calls[case]())


# --- GPU only -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_cuda_rejects_float64_buffers():
    x = np.ones((4, 8), np.float64)
    with jax.enable_x64(True):
        r4 = jax.ShapeDtypeStruct((4,), jnp.float64)
        with pytest.raises(Exception, match="unsupported logits dtype float64"):
            jax.block_until_ready(_raw("blujax_cross_entropy_fwd", (r4, r4), x,
                                       np.zeros(4, np.int32), ignore_index=np.int64(-1),
                                       num_classes=np.int64(8)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("v", [50257, 50304, 4099], ids=str)
def test_cuda_many_rows(rng, v, dtype):
    # Many more rows than blocks (every block loops), and rows at every alignment.
    n = 2053
    x, t = _logits(rng, n, v, dtype), _targets(rng, n, v)
    ct = randn(rng, (n,), jnp.float32)
    loss, dx = jax.jit(lambda x, ct: _vjp(lambda x: ops.softmax_cross_entropy(x, t), x, ct))(x, ct)
    loss_ref, dx_ref = _vjp(lambda x: spec.softmax_cross_entropy(x, t), x, ct)
    assert_close_nan(loss, loss_ref, jnp.float32, factor=2)
    assert_close_nan(dx, dx_ref, dtype, factor=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n,v", [(2053, 50257), (257, 50304), (37, 60001), (17001, 4099),
                                 (140003, 131)], ids=str)
def test_cuda_mean_paths(rng, n, v, dtype):
    # Every kernel path: rows cached in shared memory (50257, 50304; bfloat16 60001), rows too
    # long for it (float32 60001 on an H100), more rows than blocks with a block per row
    # (float32 4099) and with a warp per row (131), and bfloat16 rows at every alignment.
    x, t = _logits(rng, n, v, dtype), _mean_targets(rng, n, v)
    t = t.at[3].set(-1).at[n - 1].set(-1)
    loss, dx = _value_and_grad(lambda x: ops.softmax_cross_entropy_mean(x, t), x)
    loss_ref, dx_ref = _value_and_grad(lambda x: spec.softmax_cross_entropy_mean(x, t), x)
    assert_close(loss, loss_ref, jnp.float32, factor=2)
    floor = float(np.max(np.abs(np.asarray(dx_ref, np.float32))))
    assert_close(dx, dx_ref, dtype, factor=2, floor=floor)


@pytest.mark.gpu
def test_cuda_loss_grad_rejects_float64_buffers():
    with jax.enable_x64(True):
        x = np.ones((4, 8), np.float64)
        sds = jax.ShapeDtypeStruct
        with pytest.raises(Exception, match="unsupported logits dtype float64"):
            outs = (sds((4,), jnp.float64), sds((4, 8), jnp.float64))
            jax.block_until_ready(_raw(
                "blujax_cross_entropy_loss_grad", outs, x, np.zeros(4, np.int32), np.float64(1),
                ignore_index=np.int64(-1), num_classes=np.int64(8)))
