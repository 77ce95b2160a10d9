"""The Qwen2 family's own: its q/k/v biases (declared, split over a mesh with their heads, not
decayed), its Hugging Face conversions and their refusals. What it shares with Llama (the
forward against an independent transcription and against transformers' fixture, gradients,
sampling, export, meshes) is tested for both in test_llama.py."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from blujax import sharding, train
from blujax.model import qwen2
from tests.test_llama import QWEN2 as CONFIG  # 4 heads of 64, 2 KV heads, untied
from tests.test_llama import _params


def test_params_add_biases_to_llamas():
    params = qwen2.init(CONFIG, jax.random.key(0))
    b = params["blocks"]
    assert b["bq"].shape == (2, 4 * 64) and b["bk"].shape == b["bv"].shape == (2, 2 * 64)
    np.testing.assert_array_equal(b["bq"], 0)
    axes = qwen2.logical_axes(CONFIG)["blocks"]
    assert axes["bq"] == ("layers", "heads") and axes["bk"] == ("layers", "kv_heads")
    mask = qwen2.decay_mask(params)
    assert mask["blocks"]["wq"] and mask["lm_head"]
    assert not (mask["blocks"]["bq"] or mask["blocks"]["bv"] or mask["blocks"]["attn_norm"])
    assert qwen2.PRESETS["qwen2-0.5b"].rope_theta == 1e6 and qwen2.Config is qwen2.Qwen2Config


def test_hf_conversion_round_trips():
    params = jax.tree.map(np.asarray, _params(CONFIG))
    hf = qwen2.to_hf(params, CONFIG)
    assert hf["model.layers.1.self_attn.k_proj.bias"].shape == (2 * 64,)
    assert hf["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 64, 256)  # (out, in)
    assert "lm_head.weight" in hf and "model.layers.0.self_attn.o_proj.bias" not in hf
    assert sorted(hf) == sorted(qwen2.hf_tensor_names(CONFIG))
    back = qwen2.from_hf(hf, CONFIG)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params)):
        if jax.tree_util.keystr(path) in ("['wte']", "['lm_head']"):
            b = np.where(np.arange(512)[:, None] < 500, b, 0.0)  # padded rows come back zero
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    hf_config = qwen2.hf_config(CONFIG)
    assert hf_config["model_type"] == "qwen2" and "attention_bias" not in hf_config
    assert qwen2.config_from_hf(hf_config) == CONFIG
    # transformers before 5 writes rope_theta instead of rope_parameters.
    old = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "layer_types")}
    assert qwen2.config_from_hf(old) == CONFIG
    with pytest.raises(ValueError, match="tensor model.layers.0.self_attn.v_proj.bias is "
                                         "missing"):
        qwen2.from_hf({k: v for k, v in hf.items() if not k.endswith("0.self_attn.v_proj.bias")},
                      CONFIG)
    with pytest.raises(ValueError, match="not part of Qwen2ForCausalLM"):
        qwen2.from_hf({**hf, "model.layers.0.self_attn.o_proj.bias": np.zeros(256)}, CONFIG)


@pytest.mark.parametrize("change,words", [
    ({"use_sliding_window": True, "sliding_window": 16}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}}, "yarn"),
    ({"hidden_act": "gelu"}, "hidden_act"), ({"head_dim": 32}, "head_dim")])
def test_hf_configs_we_cannot_honour_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        qwen2.config_from_hf({**qwen2.hf_config(CONFIG), **change})


# --- on a mesh: the biases split with their heads, or replicated with whole KV heads ---------


def _devices():
    devices = jax.devices()
    return devices if len(devices) >= 8 else jax.devices("cpu")


def test_biases_split_with_their_heads():
    state = jax.eval_shape(lambda k: train.init_state(CONFIG, train.TrainConfig(steps=1), k),
                           jax.random.key(0))
    for tensor, kv_spec in ((2, P(None, "tensor")), (4, P(None, None))):
        mesh = sharding.make_mesh(1, tensor, 1, devices=_devices()[:tensor])
        whole = train.whole_axes(CONFIG, sharding.mesh.mesh_sizes(mesh))
        sh = sharding.state_shardings(state, qwen2.logical_axes(CONFIG), mesh, whole=whole)
        assert sh.params["blocks"]["bq"].spec == P(None, "tensor")
        assert sh.params["blocks"]["bk"].spec == kv_spec  # 2 KV heads on 4 devices: whole
