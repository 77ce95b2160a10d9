"""GPT-2 to and from llm.c's model file: its 16 tensors in llm.c's order.

llm.c stacks each kind of tensor over the layers, as we do, in torch Linear's (out, in), and
fuses q, k and v as transformers does; its embedding keeps the padded vocabulary rows (it pads
the same way). blujax.interop reads and writes the file's header and bytes.
"""

from __future__ import annotations

import numpy as np

from blujax.model import convert
from blujax.model.gpt2.layouts import fused_qkv, fused_shapes, split_qkv
from blujax.model.gpt2.model import GPT2Config, init

# llm.c's parameter order (train_gpt2.c: fill_in_parameter_sizes) as paths into our params.
_ORDER = (
    ("wte",), ("wpe",),
    *(("blocks", sub, leaf) for sub, leaf in (
        ("ln1", "w"), ("ln1", "b"), ("attn", "w"), ("attn", "b"), ("attn_proj", "w"),
        ("attn_proj", "b"), ("ln2", "w"), ("ln2", "b"), ("mlp_fc", "w"), ("mlp_fc", "b"),
        ("mlp_proj", "w"), ("mlp_proj", "b"))),
    ("ln_f", "w"), ("ln_f", "b"),
)


def llmc_shapes(config: GPT2Config) -> list[tuple[int, ...]]:
    """The shapes of llm.c's 16 parameter tensors, in its order (wte has padded_vocab_size
    rows)."""
    want = fused_shapes(config)
    return [_layout(_at(want, path)) for path in _ORDER]


def _layout(x):
    """A stacked matrix (L, in, out) as llm.c's (L, out, in) (its own inverse); others as are."""
    if isinstance(x, tuple):
        return (x[0], x[2], x[1]) if len(x) == 3 else x
    return np.ascontiguousarray(x.transpose(0, 2, 1)) if x.ndim == 3 else x


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def to_llmc(params, config: GPT2Config) -> list:
    """Our params as llm.c's 16 tensors in its order: float32 numpy, matrices (out, in), the
    embedding with its padded_vocab_size rows."""
    p = fused_qkv(convert.to_numpy(params, convert.shapes(init, config), what="GPT-2's"))
    return [np.ascontiguousarray(_layout(_at(p, path))) for path in _ORDER]


def from_llmc(arrays, config: GPT2Config) -> dict:
    """Our params from llm.c's 16 tensors in its order (see `llmc_shapes`; its embedding may be
    padded to any number of rows >= vocab_size: the rows past vocab_size are dropped and ours
    padded with zeros)."""
    arrays = list(arrays)
    shapes = llmc_shapes(config)
    if len(arrays) != len(shapes):
        raise ValueError(f"llm.c's GPT-2 has {len(shapes)} tensors, got {len(arrays)}")
    params = {}
    for path, x, shape in zip(_ORDER, arrays, shapes):
        x = np.asarray(x, np.float32)
        if path == ("wte",):
            if x.ndim != 2 or x.shape[0] < config.vocab_size or x.shape[1] != config.n_embd:
                raise ValueError(f"wte has shape {x.shape}, expected (>= {config.vocab_size}, "
                                 f"{config.n_embd})")
            x = convert.vocab_rows(x[:config.vocab_size], shape[0])
        elif x.shape != shape:
            raise ValueError(f"{'.'.join(path)} has shape {x.shape}, expected {shape}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _layout(x)
    return split_qkv(params)
