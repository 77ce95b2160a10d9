"""The model-family seam: every registered family defines what the step, sharding, sampling
and interop use; every parameter of every preset declares its logical axes, each of which the
one mapping table (sharding.layout.RULES) knows."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from blujax import model
from blujax.model import family as family_lib
from blujax.model import gpt2
from blujax.sharding import layout as layout_lib

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
