"""FP8 block products (blujax.fp8): the product and its gradients against a jnp spec of the
quantized product, the scales and the delayed amax history, the train step with FP8 on one
device and on a mesh, the measured rule, and the command line's --fp8 (recorded, resumed bit
for bit). On the CPU XLA emulates FP8, so this is the program a GPU runs, to its rounding."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import fp8, sharding, train
from blujax.checkpoint import Checkpointer
from blujax.model import gpt2, llama, ops as model_ops
from tests.test_gpt2_cli import _run, corpus, private_cache  # noqa: F401

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _operands(shape_x=(2, 24, 96), n=40, seed=0, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.key(seed), 3)
    x = (3.0 * jax.random.normal(k[0], shape_x)).astype(dtype)
    w = (0.02 * jax.random.normal(k[1], (shape_x[-1], n))).astype(dtype)
    g = (1e-5 * jax.random.normal(k[2], (*shape_x[:-1], n))).astype(dtype)
    return x, w, g


def _dq(t, fmt):
    """t rounded to fmt with its own per-tensor scale, back in float32 (the spec's operand)."""
    s = fp8.scale_of(fp8.amax(t), fmt)
    return fp8.quantize(t, s, fmt).astype(jnp.float32) * s


def _hi(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.max(np.abs(a - b)) / np.max(np.abs(b))


def test_scale_maps_the_amax_into_the_format_top_binade():
    for fmt, top in ((fp8.E4M3, E4M3_MAX), (fp8.E5M2, E5M2_MAX)):
        for a in (3.0, 0.7 * top, top, 2 * top, 1e-3):
            x = jnp.array([0.5, -a, 1e-4], jnp.float32)
            s = fp8.scale_of(fp8.amax(x), fmt)
            q = fp8.quantize(x, s, fmt)
            m, _ = np.frexp(float(s))
            assert m == 0.5  # a power of two
            assert q.dtype == fmt and top / 2 < float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= top
        # The amax exactly a power of two times the maximum: that power, nothing lost.
        assert float(fp8.scale_of(jnp.float32(top / 8), fmt)) == 0.125
    # Nothing to scale, or nothing sensible: 1.
    for a in (0.0, np.inf, np.nan):
        assert float(fp8.scale_of(jnp.float32(a), fp8.E4M3)) == 1.0
    # Past the scale's range: saturated to the largest finite value, never inf or NaN.
    q = fp8.quantize(jnp.array([1e6, -1e6]), jnp.float32(1.0), fp8.E4M3).astype(jnp.float32)
    assert q.tolist() == [E4M3_MAX, -E4M3_MAX]


def test_product_matches_the_quantized_spec():
    x, w, _ = _operands()
    y = jax.jit(lambda x, w: fp8.matmul(x, w, recipe=fp8.Recipe()))(x, w)
    assert y.dtype == jnp.bfloat16 and y.shape == (2, 24, 40)
    spec = _hi(_dq(x, fp8.E4M3), _dq(w, fp8.E4M3))
    exact = _hi(x.astype(jnp.float32), w.astype(jnp.float32))
    # To the bfloat16 output's rounding of the quantized product; the unquantized product is
    # further off by e4m3's (3 mantissa bits): the operands were rounded.
    assert _rel(y, spec) < 8e-3
    assert _rel(y, exact) > 4 * _rel(y, spec)


@pytest.mark.parametrize("grad", ["e5m2", "e4m3"])
def test_gradients_match_the_quantized_spec(grad):
    x, w, g = _operands(seed=1)
    recipe = fp8.Recipe(grad=grad)
    _, vjp = jax.vjp(lambda x, w: fp8.matmul(x, w, recipe=recipe), x, w)
    dx, dw = jax.jit(vjp)(g)
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    gq = _dq(g, fp8.FORMATS[grad])
    xq, wq = _dq(x, fp8.E4M3), _dq(w, fp8.E4M3)
    assert _rel(dx, _hi(gq, wq.T)) < 8e-3
    assert _rel(dw, _hi(xq.reshape(-1, 96).T, gq.reshape(-1, 40))) < 8e-3
    # Against the exact gradients: the formats' rounding, not more.
    assert _rel(dw, _hi(x.astype(jnp.float32).reshape(-1, 96).T,
                        g.astype(jnp.float32).reshape(-1, 40))) < (0.15 if grad == "e5m2"
                                                                   else 0.08)


def test_fan_out_gives_back_the_max_of_its_copies():
    """The slices of a collective matmul share a history through fan_out: the new history is
    the max of theirs (an input used three times would get the sum)."""
    h = jnp.arange(6.0).reshape(3, 2)
    copies, vjp = jax.vjp(lambda h: fp8.fan_out(h, 3), h)
    assert copies.shape == (3, 3, 2) and (copies == h).all()
    g = jnp.stack([h + 1, 3 * h, h - 1])
    np.testing.assert_array_equal(vjp(g)[0], jnp.max(g, axis=0))


def _mlp_operands():
    k = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(k[0], (2, 24, 32), jnp.bfloat16)
    w_up = (0.2 * jax.random.normal(k[1], (32, 80))).astype(jnp.bfloat16)
    w_down = (0.2 * jax.random.normal(k[2], (40, 24))).astype(jnp.bfloat16)
    g = jax.random.normal(k[3], (2, 24, 24), jnp.bfloat16)
    h_up = 4 * jnp.abs(jax.random.normal(k[4], (3, 16)))  # not the current amaxes: the scales
    return x, w_up, w_down, h_up, h_up[::-1] / 2, g       # must come from the histories


@pytest.mark.parametrize("ops_name", ["ffi", "xla"])
def test_swiglu_mlp_is_its_two_products_bit_for_bit(ops_name):
    """The gated MLP as one piece (swiglu's FP8 forms writing the copies the products would
    cast) computes what the two products around swiglu do: output, every gradient and both
    new histories, to the bit, with our kernels and with the plain-XLA ops."""
    ops = model_ops.get(ops_name)
    x, w_up, w_down, h_up, h_down, g = _mlp_operands()
    recipe = fp8.Recipe("delayed", every=True)

    def products(x, w_up, w_down, h_up, h_down):
        h = fp8.matmul(x, w_up, h_up, recipe=recipe)
        return fp8.matmul(ops.swiglu(h.reshape(2, 24, 2, 40)), w_down, h_down, recipe=recipe)

    def piece(x, w_up, w_down, h_up, h_down):
        return fp8.swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe=recipe, ops=ops)

    args = (x, w_up, w_down, h_up, h_down)
    want, want_vjp = jax.vjp(products, *args)
    got, got_vjp = jax.vjp(piece, *args)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(jax.jit(got_vjp)(g), jax.jit(want_vjp)(g)):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="calibrated"):
        fp8.swiglu_mlp(*args, recipe=fp8.Recipe("dynamic"), ops=ops)
    with pytest.raises(ValueError, match="gated MLP"):
        fp8.swiglu_mlp(x, w_down, w_up, h_up, h_down, recipe=recipe, ops=ops)


@pytest.mark.parametrize("ops_name", ["ffi", "xla"])
def test_norm_pieces_are_the_norm_and_products_bit_for_bit(ops_name):
    """The pieces that begin with add_rms_norm (its FP8 form writing the copy the product
    would cast) compute what the norm and then the products do: both outputs, every gradient
    and the new histories, to the bit, with our kernels and with the plain-XLA ops."""
    ops = model_ops.get(ops_name)
    x, w_up, w_down, h_up, h_down, g = _mlp_operands()
    k = jax.random.split(jax.random.key(4), 3)
    residual = jax.random.normal(k[0], x.shape, jnp.bfloat16)
    gamma = (1 + 0.1 * jax.random.normal(k[1], (32,))).astype(jnp.bfloat16)
    ds = jax.random.normal(k[2], x.shape, jnp.bfloat16)
    recipe = fp8.Recipe("delayed", every=True)
    eps = 1e-5

    def by_parts(*args):
        x, residual, gamma, *rest = args
        h, s = ops.add_rms_norm(x, residual, gamma, eps=eps)
        if len(rest) == 2:
            return fp8.matmul(h, *rest, recipe=recipe), s
        return fp8.swiglu_mlp(h, *rest, recipe=recipe, ops=ops), s

    def norm_matmul(x, residual, gamma, w, h):
        return fp8.norm_matmul(x, residual, gamma, w, h, eps=eps, recipe=recipe, ops=ops)

    def norm_mlp(x, residual, gamma, *rest):
        return fp8.norm_swiglu_mlp(x, residual, gamma, *rest, eps=eps, recipe=recipe, ops=ops)

    cases = ((norm_matmul, (x, residual, gamma, w_up, h_up), (g[..., :1].repeat(80, -1), ds)),
             (norm_mlp, (x, residual, gamma, w_up, w_down, h_up, h_down), (g, ds)))
    for piece, args, cts in cases:
        want, want_vjp = jax.vjp(by_parts, *args)
        got, got_vjp = jax.vjp(piece, *args)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.jit(got_vjp)(cts), jax.jit(want_vjp)(cts)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="calibrated"):
        fp8.norm_matmul(x, residual, gamma, w_up, h_up, eps=eps, recipe=fp8.Recipe("dynamic"),
                        ops=ops)
    with pytest.raises(ValueError, match="do not multiply"):
        fp8.norm_matmul(x, residual, gamma, w_down, h_up, eps=eps, recipe=recipe, ops=ops)


def test_the_calibrated_step_runs_the_pieces():
    """Delayed scaling after its first step runs each block's norms and MLP through their
    kernels' FP8 forms; the first step, dynamic scaling and fp8_fuse=False run the products
    one by one."""
    config = llama.PRESETS["llama-tiny"]
    x = jnp.zeros((1, 2, 16), jnp.int32)

    def lowered(calibrated, **kw):
        tcfg = train.TrainConfig(steps=2, dtype="bf16", fp8="all", **kw)
        state = jax.eval_shape(lambda: train.init_state(config, tcfg, jax.random.key(0)))
        if calibrated:
            state = state._replace(fp8=fp8.History(state.fp8.amaxes, True))
        return train.make_train_step(config, tcfg).lower(state, x, x).as_text()

    fused = ("blujax_swiglu_fwd_fp8", "blujax_swiglu_bwd_fp8", "blujax_add_rms_norm_fwd_fp8")
    text = lowered(True)
    assert all(t in text for t in fused) and "blujax_add_rms_norm_fwd\"" not in text
    for text in (lowered(False), lowered(True, fp8_fuse=False)):
        assert not any(t in text for t in fused)
        assert "blujax_swiglu_fwd" in text and "blujax_add_rms_norm_fwd" in text
    assert "blujax_swiglu_fwd_fp8" not in lowered(False, fp8_scaling="dynamic")


def test_delayed_scaling_reads_the_history_and_shifts_the_new_amaxes_in():
    x, w, g = _operands(seed=2)
    recipe = fp8.Recipe("delayed", history=4)
    ax, aw, ag = (float(fp8.amax(t)) for t in (x, w, g))
    # Histories whose largest values are 2x the current amaxes: the scales are theirs.
    history = jnp.array([[ax, 2 * ax, 0, 0], [aw, 2 * aw, 0, 0], [ag, 2 * ag, 0, 0]],
                        jnp.float32)
    y, vjp = jax.vjp(lambda x, w, h: fp8.matmul(x, w, h, recipe=recipe), x, w, history)
    dx, dw, new = vjp(g)

    def dq(t, a, fmt):
        s = fp8.scale_of(jnp.float32(a), fmt)
        return fp8.quantize(t, s, fmt).astype(jnp.float32) * s

    xq, wq, gq = dq(x, 2 * ax, fp8.E4M3), dq(w, 2 * aw, fp8.E4M3), dq(g, 2 * ag, fp8.E5M2)
    assert _rel(y, _hi(xq, wq)) < 8e-3
    assert _rel(dx, _hi(gq, wq.T)) < 8e-3
    want = jnp.array([[ax, ax, 2 * ax, 0], [aw, aw, 2 * aw, 0], [ag, ag, 2 * ag, 0]])
    np.testing.assert_allclose(new, want, rtol=1e-6)
    # Calibrating (a fresh history of zeros): the current amaxes, as dynamic scaling.
    fresh = dataclasses.replace(recipe, calibrating=True)
    y0 = fp8.matmul(x, w, jnp.zeros((3, 4)), recipe=fresh)
    np.testing.assert_array_equal(y0, fp8.matmul(x, w, recipe=fp8.Recipe()))
    with pytest.raises(ValueError, match="history"):
        fp8.matmul(x, w, recipe=recipe)


def test_recipe_and_train_config_reject_bad_settings():
    with pytest.raises(ValueError, match="scaling"):
        fp8.Recipe("sometimes")
    with pytest.raises(ValueError, match="gradient format"):
        fp8.Recipe(grad="e3m4")
    with pytest.raises(ValueError, match="TrainConfig.fp8"):
        train.TrainConfig(steps=1, fp8="most")
    assert train.TrainConfig(steps=1).fp8_recipe is None
    assert train.TrainConfig(steps=1, fp8="all").fp8_recipe.every


def test_the_rule_keeps_narrow_products_in_bf16():
    """--fp8 on: a product goes to FP8 only where both widths reach fp8.MIN_WIDTH (measured
    on an H200); a tiny model's products are all narrower, so its step is the bf16 one."""
    assert fp8.pays(2048, 8192) and not fp8.pays(768, 3072) and not fp8.pays(4096, 768)
    config = llama.PRESETS["llama-tiny"]
    x = jnp.zeros((1, 2, 16), jnp.int32)

    def lowered(mode):
        tcfg = train.TrainConfig(steps=2, dtype="bf16", fp8=mode, fp8_scaling="dynamic")
        state = jax.eval_shape(lambda: train.init_state(config, tcfg, jax.random.key(0)))
        return train.make_train_step(config, tcfg).lower(state, x, x).as_text()

    off, on, every = lowered("off"), lowered("on"), lowered("all")
    assert "f8E4M3FN" not in off and "f8E4M3FN" not in on and "f8E4M3FN" in every
    assert "f8E5M2" in every  # the gradients' format


def _train(config, tcfg, steps=3, mesh=None, batch=4, **kw):
    x = jax.random.randint(jax.random.key(7), (tcfg.accum_steps, batch, 32), 0, 500)
    state = train.init_state(config, tcfg, jax.random.key(0), mesh=mesh)
    step = train.make_train_step(config, tcfg, mesh=mesh, **kw)
    losses = []
    for _ in range(steps):
        state, m = step(state, x, x)
        losses.append(float(m["loss"]))
    return losses, state


@pytest.mark.parametrize("config,scaling", [(gpt2.PRESETS["tiny"], "dynamic"),
                                            (llama.PRESETS["llama-tiny"], "delayed")],
                         ids=["gpt2-dynamic", "llama-delayed"])
def test_train_step_in_fp8_follows_bf16(config, scaling):
    """Every block product in FP8: the losses of a few steps (two micro-batches each) stay
    within FP8's rounding of the bf16 step's; delayed scaling's first step calibrates the
    history and the next ones carry it."""
    base = train.TrainConfig(steps=10, dtype="bf16", accum_steps=2, learning_rate=1e-3)
    want, _ = _train(config, base)
    got, state = _train(config, dataclasses.replace(base, fp8="all", fp8_scaling=scaling))
    np.testing.assert_allclose(got, want, rtol=2e-3)
    if scaling == "dynamic":
        assert state.fp8 is None
        return
    assert state.fp8.calibrated and state.step == 3
    for name in fp8.PRODUCTS:
        h = np.asarray(state.fp8.amaxes[name])  # [L, 3, 16]: the last 3 steps' amaxes
        assert h.shape == (config.n_layer, 3, 16)
        assert (h[:, :, :3] > 0).all() and (h[:, :, 3:] == 0).all()


_MESH_CASE = (dataclasses.replace(llama.PRESETS["llama-tiny"], n_kv_head=2),
              train.TrainConfig(steps=10, dtype="f32", fp8="all", fp8_scaling="delayed",
                                learning_rate=1e-3))


@functools.cache
def _one_device_run():
    """The mesh tests' reference (computed once for both)."""
    return _train(*_MESH_CASE, batch=8)


@pytest.mark.slow
@pytest.mark.parametrize("collective_matmul", [False, True])
def test_fp8_on_a_mesh_matches_one_device(collective_matmul):
    """data 2 x fsdp 2 x tensor 2, delayed scaling: each amax is the max over every device, so
    the mesh scales as one device does: the same losses and amax histories to rounding. The
    MLP runs as one FP8 piece between the sequence's gather and reduce. With collective
    matmul each tensor-parallel product runs slice by slice (the MLP product by product):
    every slice scales as the whole, and the history records the whole's amaxes (not their
    sum over the slices)."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (the emulated CPUs of tests/conftest.py)")
    config, tcfg = _MESH_CASE
    one, s1 = _one_device_run()
    mesh = sharding.make_mesh(2, 2, 1, fsdp=2)
    many, s8 = _train(config, tcfg, mesh=mesh, batch=8, collective_matmul=collective_matmul)
    # The first step (calibrating: every scale from the amaxes of this step, reduced over the
    # mesh) agrees to float32's rounding: its loss and all its amaxes (the oldest of the
    # three in the history). After it the mesh's other order of summing leaves the weights an
    # ulp apart, which can move an element across an FP8 rounding boundary (an e5m2 step is
    # up to a quarter of its value), and every gradient downstream of it: the losses stay
    # close, the later amaxes within half an e5m2 step (seen: up to 5.4%, which case and
    # which jax version varying). Under collective matmul the first step scales each slice's
    # gradient by the slice's own amax (fp8.Hooks._dot), so from the first backward on the
    # gradients round apart from one device's: its gradient amaxes and the later losses are
    # held to that.
    grad_first, later_loss = (0.125, 1e-3) if collective_matmul else (1e-5, 1e-4)
    np.testing.assert_allclose(many[0], one[0], rtol=1e-6)
    np.testing.assert_allclose(many, one, rtol=later_loss)
    for name in fp8.PRODUCTS:
        got, want = jax.device_get(s8.fp8.amaxes[name]), np.asarray(s1.fp8.amaxes[name])
        np.testing.assert_allclose(got[:, :2, 2], want[:, :2, 2], rtol=1e-5)
        np.testing.assert_allclose(got[:, 2, 2], want[:, 2, 2], rtol=grad_first)
        np.testing.assert_allclose(got, want, rtol=0.125)


@pytest.mark.slow
def test_cli_fp8_is_recorded_and_resumes_bit_for_bit(corpus, tmp_path, capsys):  # noqa: F811
    """train --fp8 all (delayed scaling, the default): config.json records it, a run stopped
    and resumed equals the straight one bit for bit (its losses and checkpoint, the amax
    history included), eval and sample read it, and a resume that asks for other FP8
    settings stops with one line."""
    base = ["train", "--data", corpus, "--model", "tiny", "--batch", 4, "--seq", 32,
            "--steps", 4, "--eval-every", 0, "--sample-tokens", 0, "--no-progress",
            "--fp8", "all"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    status, stdout, err = _run(capsys, *base, "--out", straight)
    assert status == 0, err
    assert "FP8 products (all, delayed scaling)" in stdout
    settings = json.loads((straight / "config.json").read_text())["settings"]
    assert (settings["fp8"], settings["fp8_scaling"]) == ("all", fp8.DEFAULT_SCALING)
    status, _, err = _run(capsys, *base, "--stop-after", 2, "--out", resumed)
    assert status == 0, err
    status, stdout, err = _run(capsys, "train", "--resume", "--out", resumed, "--no-progress")
    assert status == 0 and "resuming after step 2" in stdout, err

    def losses(out):
        return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text()
                .splitlines()]

    assert losses(resumed) == losses(straight)
    a, b = Checkpointer(straight / "ckpt").restore(), Checkpointer(resumed / "ckpt").restore()
    assert a.step == b.step == 4 and a.tree.keys() == b.tree.keys()
    assert any(k.startswith("['fp8']") for k in a.tree)  # the amax histories
    for key in a.tree:
        np.testing.assert_array_equal(a.tree[key], b.tree[key], err_msg=key)
    # eval and sample read the run's checkpoint (they multiply in the compute dtype).
    status, stdout, err = _run(capsys, "eval", "--out", straight)
    assert status == 0 and "val loss" in stdout, err
    status, stdout, err = _run(capsys, "sample", "--out", straight, "--max-new-tokens", 4)
    assert status == 0 and "--- sample 1 ---" in stdout, err
    status, _, err = _run(capsys, "train", "--resume", "--out", resumed, "--fp8", "off",
                          "--steps", 6)
    assert status == 2 and "--fp8 off (the run has all)" in err
    assert len(err.strip().splitlines()) == 1
