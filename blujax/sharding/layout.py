"""Where every parameter and optimizer-state leaf lives on the mesh, and the collectives that
follow from it.

Each parameter declares its logical axes where its family creates it (`family.Param`;
`family.logical_axes(config)`); RULES, the one table, maps a logical axis to the mesh axis it
splits over. "tensor" splits heads, MLP and vocabulary (Megatron); "fsdp" splits the width
("embed") of every leaf that has one (ZeRO-3: the parameter, its gradient and its optimizer
state; the model gathers each layer's weights where it runs, `Parallel.take`), and the other
leaves (biases without a width) stay whole on it. Everything is replicated over "data" and
"context", except with shard_optimizer=True (ZeRO-1), where AdamW's moments (and the update)
are also split over "data" along one axis of each leaf (`zero_axis`). A family may keep some
of its logical axes whole for a given mesh (`whole`, from its optional `whole_axes(config,
sizes)`): Llama's key / value heads where n_kv_head does not divide by "tensor" are replicated
over it instead, each device computing all of them (`Parallel.attention` picks the ones its
query heads use).

On one device (mesh None) a Layout has no mesh axes and every collective below is the
identity: the train step is the same code on one device and on any mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax.sharding.mesh import AXES, DATA, FSDP, TENSOR, mesh_sizes

# Logical axis -> the mesh axis it splits over (None: replicated). Megatron's layout: the
# vocabulary (embedding rows, the LM head's columns, the loss), attention heads (the QKV
# projection's outputs, the output projection's inputs) and the MLP's hidden units over
# "tensor"; the width over "fsdp" (every weight matrix has one, so each is split there).
RULES = {
    "vocab": TENSOR,
    "heads": TENSOR,     # n_head x head_dim: whole heads per device
    "kv_heads": TENSOR,  # n_kv_head x head_dim (grouped-query attention)
    "mlp": TENSOR,
    "embed": FSDP,
    "positions": None,
    "layers": None,      # the stacked blocks (the scan's axis)
    "qkv": None,         # q, k, v side by side
    "gate_up": None,     # a SwiGLU MLP's gate and up projections side by side
}


def mesh_axis_dim(axes: tuple[str, ...], mesh_axis: str, where: str = "a parameter",
                  whole: tuple[str, ...] = ()) -> int | None:
    """The dimension of a leaf with these logical axes that RULES splits over `mesh_axis`
    (None: none); names in `whole` stay whole (replicated) though RULES splits them.
    ValueError for a name RULES does not know, or two dimensions on one mesh axis."""
    unknown = [a for a in axes + tuple(whole) if a not in RULES]
    if unknown:
        raise ValueError(f"blujax.sharding: {where} has the logical axis {unknown[0]!r}, which "
                         f"blujax.sharding.layout.RULES does not map (it maps "
                         f"{', '.join(RULES)})")
    split = [i for i, a in enumerate(axes) if RULES[a] == mesh_axis and a not in whole]
    if len(split) > 1:
        raise ValueError(f"blujax.sharding: {where} has two axes on \"{mesh_axis}\": {axes}")
    return split[0] if split else None


def tensor_axis(axes: tuple[str, ...], where: str = "a parameter",
                whole: tuple[str, ...] = ()) -> int | None:
    """The dimension of a leaf with these logical axes that splits over "tensor"."""
    return mesh_axis_dim(axes, TENSOR, where, whole)


def fsdp_axis(axes: tuple[str, ...], where: str = "a parameter") -> int | None:
    """The dimension of a leaf with these logical axes that splits over "fsdp"."""
    return mesh_axis_dim(axes, FSDP, where)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per leaf of the params, in treedef order: its rank, the axis split over "tensor", the
    axis split over "fsdp", and the axis its optimizer state splits over "data" (None: not
    split). `axes`: the mesh's axes (() on one device)."""

    treedef: Any
    ndims: tuple
    tensor_axes: tuple
    zero_axes: tuple
    fsdp_axes: tuple = ()
    axes: tuple = AXES

    @classmethod
    def of(cls, params, logical_axes, sizes: dict[str, int] | None,
           shard_optimizer: bool = False, whole: tuple[str, ...] = ()) -> "Layout":
        """The layout of params (arrays or shapes) with these logical axes (a tree of the same
        structure) on a mesh of these sizes; sizes None: one device. `whole`: logical axes
        replicated over "tensor" on this mesh though RULES splits them (the family's
        whole_axes(config, sizes)); such a leaf's gradient is then summed over "tensor" too
        (`reduce`), and counted once in `global_norm`. ValueError for a leaf whose "fsdp"
        dimension does not divide by it."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        n = len(leaves)
        if sizes is None:
            return cls(treedef, tuple(len(x.shape) for _, x in leaves), (None,) * n,
                       (None,) * n, (None,) * n, ())
        names = treedef.flatten_up_to(logical_axes)
        where = [f"params{jax.tree_util.keystr(path)}" for path, _ in leaves]
        tensor_axes = tuple(tensor_axis(a, w, whole) for a, w in zip(names, where))
        fsdp_axes = fsdp_axes_of(logical_axes, treedef, sizes[FSDP]) if FSDP in sizes \
            else (None,) * n
        for (_, x), f, w in zip(leaves, fsdp_axes, where):
            if f is not None and x.shape[f] % sizes[FSDP]:
                raise ValueError(f"blujax.sharding: {w} has {x.shape[f]} along its width, which "
                                 f"the fsdp axis ({sizes[FSDP]}) must divide: every weight is "
                                 f"split over it")
        zero_axes = tuple(
            zero_axis(local_shape(x.shape, sizes, t, f), sizes[DATA]) if shard_optimizer
            else None
            for (_, x), t, f in zip(leaves, tensor_axes, fsdp_axes))
        return cls(treedef, tuple(len(x.shape) for _, x in leaves), tensor_axes, zero_axes,
                   fsdp_axes)

    # --- specs ------------------------------------------------------------------------------

    def param_specs(self):
        return self.treedef.unflatten(
            [_spec(n, t, f, None) for n, t, f in zip(self.ndims, self.tensor_axes,
                                                     self.fsdp_axes)])

    def moment_specs(self):
        """Specs of a params-shaped optimizer-state tree (AdamW's moments)."""
        return self.treedef.unflatten(
            [_spec(n, t, f, z) for n, t, f, z in zip(self.ndims, self.tensor_axes,
                                                     self.fsdp_axes, self.zero_axes)])

    def state_specs(self, state):
        """A TrainState of specs: the params, and every params-shaped subtree of the optimizer
        state (the moments), by the layout; the other leaves (step counts, FP8 amax
        histories) replicated."""
        return type(state)(P(), self.param_specs(),
                           map_moments(lambda _: self.moment_specs(), state.opt_state,
                                       self.treedef, other=lambda _: P()),
                           jax.tree.map(lambda _: P(), state.fp8))

    # --- per device, inside the step ---------------------------------------------------------

    def reduce(self, grads, *, reduced=False):
        """Each gradient summed over the devices that share its leaf: all-reduce over the axes
        it is replicated on; with a ZeRO axis, reduce-scatter over "data" along it instead.
        (A leaf split over "fsdp" was reduce-scattered there already, in the backward of its
        gather: `Parallel.take`.) Gradients `reduced` already (in the backward) are only cut to
        this device's piece."""
        if reduced:
            return self.zero_pieces(grads)
        out = []
        for g, t, f, z in zip(self.treedef.flatten_up_to(grads), self.tensor_axes,
                              self.fsdp_axes, self.zero_axes):
            replicated = tuple(a for a in self.axes if not (a == TENSOR and t is not None)
                               and not (a == FSDP and f is not None)
                               and not (a == DATA and z is not None))
            if replicated:
                g = jax.lax.psum(g, replicated)
            if z is not None:
                g = jax.lax.psum_scatter(g, DATA, scatter_dimension=z, tiled=True)
            out.append(g)
        return self.treedef.unflatten(out)

    def global_norm(self, grads):
        """optax.tree.norm of the whole (unsharded) gradient: squares summed per device, then
        over the axes each leaf is split along."""
        sums = {}
        for g, t, f, z in zip(self.treedef.flatten_up_to(grads), self.tensor_axes,
                              self.fsdp_axes, self.zero_axes):
            axes = (TENSOR,) * (t is not None) + (FSDP,) * (f is not None) + \
                (DATA,) * (z is not None)
            sums[axes] = sums.get(axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
        return jnp.sqrt(sum(jax.lax.psum(s, axes) if axes else s for axes, s in sums.items()))

    def zero_pieces(self, params):
        """This device's piece of each leaf along its ZeRO axis (the part it updates)."""
        def piece(p, z):
            if z is None:
                return p
            n = p.shape[z] // jax.lax.axis_size(DATA)
            return jax.lax.dynamic_slice_in_dim(p, jax.lax.axis_index(DATA) * n, n, axis=z)

        return self.treedef.unflatten(
            [piece(p, z) for p, z in zip(self.treedef.flatten_up_to(params), self.zero_axes)])

    def zero_gather(self, params):
        """The updated pieces put together again on every device of "data"."""
        return self.treedef.unflatten([
            p if z is None else jax.lax.all_gather(p, DATA, axis=z, tiled=True, to="invarying")
            for p, z in zip(self.treedef.flatten_up_to(params), self.zero_axes)])


def map_moments(f, opt_state, treedef, other=lambda x: x):
    """f applied to every subtree of opt_state shaped like the params (treedef), `other` to
    every other leaf."""
    def is_moments(x):
        return jax.tree.structure(x) == treedef

    return jax.tree.map(lambda x: f(x) if is_moments(x) else other(x), opt_state,
                        is_leaf=is_moments)


def fsdp_axes_of(logical_axes, treedef, fsdp: int) -> tuple:
    """Per leaf (treedef order) of params with these logical axes, the dimension split over
    "fsdp"; all None where fsdp is 1 (no gathers: the one-device program)."""
    names = treedef.flatten_up_to(logical_axes)
    if fsdp == 1:
        return (None,) * len(names)
    return tuple(fsdp_axis(a) for a in names)


def local_shape(shape, sizes, tensor_axis, fsdp_axis) -> list[int]:
    """A leaf's shape on one device: split over "tensor" and "fsdp" where its layout says."""
    return [n // sizes[TENSOR] if i == tensor_axis else n // sizes[FSDP] if i == fsdp_axis
            else n for i, n in enumerate(shape)]


def zero_axis(local, dp: int):
    """The axis along which a leaf's optimizer state splits over "data", of its per-device
    shape `local`: the longest (first of equals) that dp divides; None when dp == 1 or none
    does."""
    if dp == 1:
        return None
    fits = [i for i, n in enumerate(local) if n % dp == 0]
    return max(fits, key=lambda i: local[i]) if fits else None


def _spec(ndim, tensor_axis, fsdp_axis, zero_axis):
    entries = [None] * ndim
    if tensor_axis is not None:
        entries[tensor_axis] = TENSOR
    if fsdp_axis is not None:
        entries[fsdp_axis] = FSDP
    if zero_axis is not None:
        # Both on one axis: device (t, d) holds piece d of tensor piece t.
        entries[zero_axis] = (entries[zero_axis], DATA) if entries[zero_axis] else DATA
    return P(*entries)


def state_shardings(state, logical_axes, mesh, shard_optimizer: bool = False,
                    whole: tuple[str, ...] = ()):
    """NamedShardings of a TrainState (arrays or shapes) on `mesh` (`whole` as Layout.of's)."""
    layout = Layout.of(state.params, logical_axes, mesh_sizes(mesh), shard_optimizer, whole)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), layout.state_specs(state),
                        is_leaf=lambda x: isinstance(x, P))
