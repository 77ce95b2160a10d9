"""Helpers shared by the kernel tests."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

# Tolerances by dtype, relative to the largest magnitude of the reference: float32 kernels
# differ from XLA only in summation order; bfloat16 results differ by about one rounding step
# (2^-8 relative).
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 1.6e-2, jnp.float64: 1e-10}


def randn(rng, shape, dtype, scale=1.0, shift=0.0):
    """Random normal data (never zeros) of a dtype."""
    return jnp.asarray(rng.standard_normal(shape) * scale + shift, dtype=dtype)


def assert_close(actual, expected, dtype, factor=1.0, floor=1.0):
    """|actual - expected| <= tol * (|expected| + max(max |expected|, floor)), elementwise.

    The floor keeps a reference that is zero up to rounding (say dx of a LayerNorm over one
    feature) from demanding bit-exact zeros: inputs here are of order one.
    """
    a, e = (np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v, np.float64)
            for v in (actual, expected))
    assert a.shape == e.shape, (a.shape, e.shape)
    assert np.all(np.isfinite(a)), "result has NaN or inf"
    tol = TOL[jnp.dtype(dtype).type] * factor
    scale = max(np.max(np.abs(e)) if e.size else 0.0, floor)
    bad = np.abs(a - e) > tol * (np.abs(e) + scale)
    assert not bad.any(), (
        f"{bad.sum()} of {a.size} elements differ; worst |diff| "
        f"{np.max(np.abs(a - e)):.3e} (max |expected| {scale:.3e}, tol {tol:.1e})"
    )


@contextlib.contextmanager
def cpu_float64():
    """Run on the CPU kernels with float64 enabled (for check_grads)."""
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        yield


def mesh_devices():
    """The devices a sharded test spreads over: the GPUs on a GPU machine, else 8 CPUs."""
    return jax.devices()


def rel_close(a, b, rtol):
    """Every leaf of pytrees a and b: max |a - b| <= rtol * max |b|."""
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        err, scale = np.max(np.abs(x - y)), np.max(np.abs(y))
        assert err <= rtol * scale, f"{jax.tree_util.keystr(path)}: {err:.3e} vs scale {scale:.3e}"


def without_key_bias(params):
    """GPT-2 params with the attention's key bias zeroed. Softmax is invariant to it, so its
    gradient is rounding noise, which Adam's normalisation turns into steps of +-lr: two exact
    implementations differ there by design."""
    b = params["blocks"]["attn"]["b"]  # [L, 3, C]: q, k, v
    blocks = {**params["blocks"], "attn": {**params["blocks"]["attn"],
                                           "b": b.at[:, 1].set(0.0)}}
    return {**params, "blocks": blocks}


def make_bpe_tokenizer(folder, text: str, vocab_size: int = 300):
    """A small Hugging Face tokenizer in folder (made if missing): a byte-level BPE of
    vocab_size tokens trained on text, its special tokens <|begin_of_text|> (bos, ids begin
    with it) and <|end_of_text|> (eos), as tokenizer.json and tokenizer_config.json."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text], trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
                    "eos_token": eos}, indent=2) + "\n", encoding="utf-8")
    return folder
