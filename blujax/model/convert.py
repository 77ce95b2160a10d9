"""What every family's converters share: the checks of a set of named tensors against the
shapes a config implies, our params as float32 numpy checked against their shapes, stacking
per-layer tensors, and the padded vocabulary rows.

A family's converter (`blujax/model/<family>/hf.py`, `llmc.py`) is a pair of pure functions
between our params and another tool's named numpy arrays; blujax.interop reads and writes the
files. Every problem with what a user gave raises ValueError with a one-line message.
"""

from __future__ import annotations

import jax
import numpy as np


def expect(tensors: dict, expected: dict[str, tuple], *, arch: str) -> dict:
    """`tensors` as float32 numpy, once its names are exactly those of `expected` ({name:
    shape}) and each has its shape; ValueError naming the first tensor missing, unexpected
    (not part of `arch`, e.g. "LlamaForCausalLM", as blujax reads it) or of another shape."""
    for name in expected:
        if name not in tensors:
            raise ValueError(f"tensor {name} is missing")
    for name in tensors:
        if name not in expected:
            raise ValueError(f"unexpected tensor {name}: not part of {arch} as blujax reads it")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensors[name].shape)}, but the "
                             f"config implies {tuple(shape)}")
    return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}


def check_tied(head, embedding, what: str):
    """A tied model's LM head, where a file carries one anyway, must be its embedding: a
    ValueError saying `what` otherwise."""
    if head is not None and not np.array_equal(np.asarray(head, np.float32), embedding):
        raise ValueError(what)


def shapes(init, config) -> dict:
    """The shapes of init(config, key)'s params (a tree of tuples), without computing them."""
    return jax.tree.map(lambda x: tuple(x.shape),
                        jax.eval_shape(lambda k: init(config, k), jax.random.key(0)))


def to_numpy(params, want: dict, *, what: str) -> dict:
    """params as float32 numpy, checked against `want` (a tree of shape tuples, as `shapes`
    gives): the same leaves, each of its shape; ValueError naming the first that differs
    (`what` names the model: "GPT-2's")."""
    expected = jax.tree_util.tree_flatten_with_path(want, is_leaf=_is_shape)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    if [k for k, _ in got] != [k for k, _ in expected]:
        raise ValueError(f"the params are not {what}: their leaves are "
                         f"{[jax.tree_util.keystr(k) for k, _ in got]}")
    for (path, x), (_, shape) in zip(got, expected):
        if tuple(np.shape(x)) != shape:
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
                             f"but the config implies {shape}")
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


def _is_shape(x):
    return isinstance(x, tuple)


def stack(tensors: dict, name: str, n_layer: int, *, transpose: bool = False) -> np.ndarray:
    """[n_layer, ...] of the per-layer tensors name.format(i) (e.g. "h.{}.ln_1.weight"),
    each transposed (torch Linear's (out, in) -> our (in, out)) if asked."""
    layers = [tensors[name.format(i)] for i in range(n_layer)]
    return np.stack([x.T if transpose else x for x in layers])


def unstack(stacked: np.ndarray, name: str, *, transpose: bool = False) -> dict:
    """The inverse of `stack`: {name.format(i): layer i} of [n_layer, ...]."""
    return {name.format(i): x.T if transpose else x for i, x in enumerate(stacked)}


def vocab_rows(x: np.ndarray, padded_vocab_size: int) -> np.ndarray:
    """Embedding rows [vocab, C] padded with zero rows to [padded_vocab_size, C]."""
    out = np.zeros((padded_vocab_size, x.shape[1]), np.float32)
    out[:x.shape[0]] = x
    return out
