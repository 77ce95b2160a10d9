"""The model-family seam: every registered family defines what the step, sharding, sampling
and interop use; every parameter of every preset declares its logical axes, each of which the
one mapping table (sharding.layout.RULES) knows; the shared stack runs every family's blocks
alike (scan or loop, with or without a KV cache, forward = head(hidden))."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from blujax import model, sample
from blujax.model import family as family_lib
from blujax.model import gpt2
from blujax.model import ops as model_ops
from blujax.sharding import layout as layout_lib
from tests.util import rel_close

FAMILIES = list(model.FAMILIES.values())
PRESETS = [(f, name) for f in FAMILIES for name in f.PRESETS]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.NAME)
def test_family_defines_the_seam(family):
    missing = [name for name in family_lib.REQUIRED if not hasattr(family, name)]
    assert not missing, f"{family.NAME} lacks {missing}"
    assert model.FAMILIES[family.NAME] is family
    for config in family.PRESETS.values():
        assert isinstance(config, family.Config) and model.family_of(config) is family


@pytest.mark.parametrize("family,preset", PRESETS, ids=lambda x: getattr(x, "NAME", x))
def test_every_parameter_declares_known_logical_axes(family, preset):
    config = family.PRESETS[preset]
    shapes = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
    axes = family.logical_axes(config)
    assert jax.tree.structure(shapes) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, tuple))
    for (path, x), names in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))):
        where = jax.tree_util.keystr(path)
        assert len(names) == x.ndim, f"{where}: {names} for shape {x.shape}"
        unknown = [a for a in names if a not in layout_lib.RULES]
        assert not unknown, f"{where}: {unknown} not in sharding.layout.RULES"
        layout_lib.tensor_axis(names, where)  # at most one axis on "tensor"


def test_an_undeclared_parameter_fails():
    def declare(config, key):
        return {"w": family_lib.Param(jnp.zeros((4, 8)), ("embed", "mlp")),
                "b": jnp.zeros((8,))}  # no axes

    with pytest.raises(TypeError, match=r"parameter \['b'\] is not declared"):
        family_lib.axes_of(declare, None)

    def declare_wrong_rank(config, key):
        return {"w": family_lib.Param(jnp.zeros((4, 8)), ("embed",))}

    with pytest.raises(TypeError, match="one name per dimension"):
        family_lib.axes_of(declare_wrong_rank, None)


def test_an_unmapped_logical_axis_fails():
    params = {"w": jnp.zeros((4, 8))}
    sizes = {"data": 1, "tensor": 2, "context": 1}
    with pytest.raises(ValueError, match="'experts', which blujax.sharding.layout.RULES"):
        layout_lib.Layout.of(params, {"w": ("embed", "experts")}, sizes)


def test_gpt2_layout_on_a_mesh():
    config = gpt2.PRESETS["small"]
    params = jax.eval_shape(lambda k: gpt2.init(config, k), jax.random.key(0))
    sizes = {"data": 2, "tensor": 2, "context": 1}
    specs = layout_lib.Layout.of(params, gpt2.logical_axes(config), sizes).param_specs()
    assert specs["wte"] == P("tensor", None)                       # vocabulary-parallel
    assert specs["wpe"] == P(None, None)
    assert specs["blocks"]["attn"]["w"] == P(None, None, None, "tensor")   # whole heads
    assert specs["blocks"]["attn"]["b"] == P(None, None, "tensor")
    assert specs["blocks"]["attn_proj"]["w"] == P(None, "tensor", None)  # row-parallel
    assert specs["blocks"]["mlp_fc"]["w"] == P(None, None, "tensor")
    assert specs["blocks"]["mlp_proj"]["b"] == P(None, None)
    assert specs["ln_f"]["w"] == P(None)


def test_configs_round_trip_through_config_json():
    config = gpt2.PRESETS["small"]
    d = model.config_to_dict(config)
    assert d["family"] == "gpt2" and model.config_from_dict(d) == config
    old = {k: v for k, v in d.items() if k != "family"}  # runs from before families
    assert model.config_from_dict(old) == config
    with pytest.raises(ValueError, match="unknown model family 'mamba'"):
        model.config_from_dict({**d, "family": "mamba"})
    assert model.get_config("tiny") is gpt2.PRESETS["tiny"]
    with pytest.raises(ValueError, match="the presets are"):
        model.get_config("gpt5")


def _smallest(family):
    """The family's preset of fewest parameters on a vocabulary of 500 (padded to 512, so the
    head is cheap), params a little away from init (the norm scales not all one, the biases
    not all zero)."""
    def size(config):
        shapes = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
        return sum(x.size for x in jax.tree.leaves(shapes))

    config = dataclasses.replace(min(family.PRESETS.values(), key=size), vocab_size=500,
                                 padded_vocab_size=512)
    params = family.init(config, jax.random.key(0))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return config, tree.unflatten([x + 0.02 * jax.random.normal(k, x.shape)
                                   for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.NAME)
def test_the_stack_runs_every_family_alike(family):
    config, params = _smallest(family)
    ops = model_ops.get("ffi")
    tokens = jax.random.randint(jax.random.key(2), (2, 24), 0, config.vocab_size)
    with jax.default_matmul_precision("float32"):
        scanned = family.forward(params, tokens, config=config, ops=ops, scan_layers=True)
        looped = family.forward(params, tokens, config=config, ops=ops, scan_layers=False)
        rel_close(looped, scanned, 1e-6)
        h = family.hidden(params, tokens, config=config, ops=ops)
        rel_close(family.head(params, h), scanned, 1e-6)
        # Prefill then decode one token at a time: the logits of every position again.
        logits, cache = family.prefill(params, tokens[:, :16], config=config, ops=ops,
                                       dtype=jnp.float32, length=24)
        decode = jax.jit(functools.partial(family.decode, config=config, ops=ops,
                                           dtype=jnp.float32))
        steps = [logits]
        for at in range(16, 23):
            logits, cache = decode(params, tokens[:, at], at, cache)
            steps.append(logits)
    kv = getattr(config, "n_kv_head", config.n_head)
    assert cache[0].shape == (config.n_layer, 2, 24, kv, config.n_embd // config.n_head)
    rel_close(jnp.stack(steps, axis=1), scanned[:, 15:23], 1e-5)
    # Greedy sampling with and without the cache agree.
    kw = dict(config=config, key=jax.random.key(3), max_new_tokens=5, temperature=0.0, ops=ops)
    np.testing.assert_array_equal(sample.generate(params, tokens[:, :8], **kw),
                                  sample.generate(params, tokens[:, :8], use_cache=False, **kw))


def test_family_of_is_exact():
    """Qwen2's config derives from Llama's, yet each config finds its own family."""
    assert model.family_of(model.get_config("qwen2-tiny")).NAME == "qwen2"
    assert model.family_of(model.get_config("llama-tiny")).NAME == "llama"
    with pytest.raises(TypeError, match="not the config of a registered model family"):
        model.family_of(object())
