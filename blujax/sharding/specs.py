"""Where every parameter and optimizer-state leaf lives on the mesh, derived from the tree.

Tensor parallelism splits one axis of some leaves over "tensor" (TENSOR_AXIS below): the
vocabulary rows of wte, the output columns of the column-parallel products (QKV, MLP in) and
their biases, the input rows of the row-parallel ones (attention out, MLP out). Everything
else (LayerNorms, wpe, row-parallel biases) is replicated. Every leaf is replicated over
"data" and "context", except with shard_optimizer=True (ZeRO-1), where AdamW's moments are
also split over "data" along one axis of each leaf (`zero_axis`).

The fused QKV weight [L, C, 3C] splits over "tensor" only as [L, C, 3, C] (bias [L, 3, C]):
each device then holds whole heads of q, k and v. The sharded train state keeps that
*parallel layout* (`to_parallel_layout`); on a device, `from_parallel_layout` turns the local
[.., 3, C / tensor] back into the model's [.., 3C / tensor]. Both are reshapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax.sharding.mesh import DATA, TENSOR, mesh_sizes

# The axis each leaf (parallel layout, by its path) splits over "tensor".
TENSOR_AXIS = {
    "wte": 0,                   # [V, C]: vocabulary-parallel
    "blocks/attn/w": 3,         # [L, C, 3, C]: column-parallel, whole heads
    "blocks/attn/b": 2,         # [L, 3, C]
    "blocks/attn_proj/w": 1,    # [L, C, C]: row-parallel
    "blocks/mlp_fc/w": 2,       # [L, C, 4C]: column-parallel
    "blocks/mlp_fc/b": 1,       # [L, 4C]
    "blocks/mlp_proj/w": 1,     # [L, 4C, C]: row-parallel
}


def to_parallel_layout(params):
    """The model's params with the QKV weight [L, C, 3C] as [L, C, 3, C], bias [L, 3, C]."""
    return _map_qkv(params, lambda x: x.reshape(*x.shape[:-1], 3, x.shape[-1] // 3))


def from_parallel_layout(params):
    """The inverse of to_parallel_layout; on a device, local shards become the model's."""
    return _map_qkv(params, lambda x: x.reshape(*x.shape[:-2], -1))


def _map_qkv(params, f):
    attn = params["blocks"]["attn"]
    blocks = {**params["blocks"], "attn": {"w": f(attn["w"]), "b": f(attn["b"])}}
    return {**params, "blocks": blocks}


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in path)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per leaf of the params, in treedef order: its rank, the axis split over "tensor", and
    the axis its optimizer state splits over "data" (None: not split)."""

    treedef: Any
    ndims: tuple
    tensor_axes: tuple
    zero_axes: tuple

    @classmethod
    def of(cls, params, sizes: dict[str, int], shard_optimizer: bool = False) -> "Layout":
        """The layout of parallel-layout params (arrays or shapes) on a mesh of these sizes."""
        if len(params["blocks"]["attn"]["w"].shape) != 4:
            raise ValueError("blujax.sharding: the params are not in the parallel layout (QKV "
                             "weight [L, C, 3, C]); make the state with init_sharded_state or "
                             "shard_state")
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        tensor_axes = tuple(TENSOR_AXIS.get(_path(path)) for path, _ in leaves)
        zero_axes = tuple(
            zero_axis(x.shape, t, sizes[TENSOR], sizes[DATA]) if shard_optimizer else None
            for (_, x), t in zip(leaves, tensor_axes))
        return cls(treedef, tuple(len(x.shape) for _, x in leaves), tensor_axes, zero_axes)

    def param_specs(self):
        return self.treedef.unflatten(
            [_spec(n, t, None) for n, t in zip(self.ndims, self.tensor_axes)])

    def moment_specs(self):
        """Specs of a params-shaped optimizer-state tree (AdamW's moments)."""
        return self.treedef.unflatten(
            [_spec(n, t, z) for n, t, z in zip(self.ndims, self.tensor_axes, self.zero_axes)])

    def state_specs(self, state):
        """A TrainState of specs: the params, and every params-shaped subtree of the optimizer
        state (the moments), by the layout; the other leaves (step counts) replicated."""
        return type(state)(P(), self.param_specs(),
                           map_moments(lambda _: self.moment_specs(), state.opt_state,
                                       self.treedef, other=lambda _: P()))


def map_moments(f, opt_state, treedef, other=lambda x: x):
    """f applied to every subtree of opt_state shaped like the params (treedef), `other` to
    every other leaf."""
    def is_moments(x):
        return jax.tree.structure(x) == treedef

    return jax.tree.map(lambda x: f(x) if is_moments(x) else other(x), opt_state,
                        is_leaf=is_moments)


def zero_axis(shape, tensor_axis, tp: int, dp: int):
    """The axis along which a leaf's optimizer state splits over "data": the longest (first of
    equals) whose per-device length dp divides; None when dp == 1 or none does."""
    if dp == 1:
        return None
    local = [n // tp if i == tensor_axis else n for i, n in enumerate(shape)]
    fits = [i for i, n in enumerate(local) if n % dp == 0]
    return max(fits, key=lambda i: local[i]) if fits else None


def _spec(ndim, tensor_axis, zero_axis):
    entries = [None] * ndim
    if tensor_axis is not None:
        entries[tensor_axis] = TENSOR
    if zero_axis is not None:
        # Both on one axis: device (t, d) holds piece d of tensor piece t.
        entries[zero_axis] = (TENSOR, DATA) if zero_axis == tensor_axis else DATA
    return P(*entries)


def state_shardings(state, mesh, shard_optimizer: bool = False):
    """NamedShardings of a parallel-layout TrainState (arrays or shapes) on `mesh`."""
    layout = Layout.of(state.params, mesh_sizes(mesh), shard_optimizer)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), layout.state_specs(state),
                        is_leaf=lambda x: isinstance(x, P))


def to_parallel_state(state):
    """A TrainState (params and moments) in the parallel layout."""
    treedef = jax.tree.structure(state.params)
    return type(state)(state.step, to_parallel_layout(state.params),
                       map_moments(to_parallel_layout, state.opt_state, treedef))


def from_parallel_state(state):
    """The inverse of to_parallel_state: params and moments in the model's layout."""
    treedef = jax.tree.structure(state.params)
    return type(state)(state.step, from_parallel_layout(state.params),
                       map_moments(from_parallel_layout, state.opt_state, treedef))
