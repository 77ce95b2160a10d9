"""Ring attention: causal attention over a sequence split across the "context" axis.

The sequence is cut into 2 x n chunks (n = the axis size) and device r holds chunks r and
2n-1-r, the zig-zag layout (`zigzag`), so every device does the same causal work. Each device
keeps its queries; the keys and values travel round the ring (`ppermute`), and each visit's
partial attention merges into the running result through its log-sum-exp:

    lse = logaddexp(lse1, lse2),  out = out1 exp(lse1 - lse) + out2 exp(lse2 - lse)

With the chunks visiting from device s, chunk a = r and b = 2n-1-r of the queries see:
    s == r (the first step, no transfer): causal attention over the local [a, b] sequence;
    s < r: chunk s is wholly in the past of both a and b, chunk 2n-1-s in the future of both;
    s > r: chunk a sees neither, chunk b sees both wholly.
So after the first step every step is one non-causal block of 2c x c or c x 2c (c = the chunk
length). Gradients flow back through the same ring: JAX transposes each ppermute into the
reverse one and the attention op takes a cotangent for its lse. Autodiff keeps every visiting
block for the backward (n - 1 blocks of K and V per layer; with remat, per layer at a time).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zigzag(x, n: int, axis: int = -1):
    """x's `axis` (length divisible by 2n) reordered as chunks 0, 2n-1, 1, 2n-2, ...: split
    into n equal parts, part r holds chunks r and 2n-1-r."""
    if n == 1:
        return x
    axis = axis % x.ndim
    order = [c for r in range(n) for c in (r, 2 * n - 1 - r)]
    chunks = x.reshape(*x.shape[:axis], 2 * n, x.shape[axis] // (2 * n), *x.shape[axis + 1:])
    return jnp.take(chunks, jnp.asarray(order), axis=axis).reshape(x.shape)


def zigzag_positions(length: int, n: int, index):
    """The sequence positions of the `length` tokens device `index` (a traced int) of n holds."""
    if n == 1:
        return jnp.arange(length)
    c = length // 2
    return jnp.concatenate([index * c + jnp.arange(c), (2 * n - 1 - index) * c + jnp.arange(c)])


def ring_attention(q, k, v, *, attention_with_lse, axis_name: str, axis_size: int):
    """Causal attention of this device's zig-zag queries [B, 2c, H, D] against the keys and
    values [B, 2c, KV, D] (KV dividing H) of all `axis_size` devices of `axis_name`. Call
    inside shard_map.
    attention_with_lse: (q, k, v, causal=) -> (out, lse), e.g. blujax.kernels'."""
    n = axis_size
    if n == 1:
        return attention_with_lse(q, k, v, causal=True)[0]
    r = jax.lax.axis_index(axis_name)
    c = q.shape[1] // 2
    perm = [(i, (i + 1) % n) for i in range(n)]

    def from_earlier(q, k, v):  # s < r: all queries, the visiting first chunk
        return attention_with_lse(q, k[:, :c], v[:, :c], causal=False)

    def from_later(q, k, v):  # s > r: the second chunk of queries, both visiting chunks
        o, l = attention_with_lse(q[:, c:], k, v, causal=False)
        return (jnp.concatenate([jnp.zeros_like(o), o], axis=1),
                jnp.concatenate([jnp.full_like(l, -jnp.inf), l], axis=2))

    def visit(out, lse, k, v, i):  # the blocks of device s = r - i
        o, l = jax.lax.cond((r - i) % n < r, from_earlier, from_later, q, k, v)
        return _merge(out, lse, o, l)

    # Each transfer is issued before the attention of the blocks in hand and does not depend
    # on it, so the two can overlap.
    k_in, v_in = jax.lax.ppermute((k, v), axis_name, perm)
    out, lse = attention_with_lse(q, k, v, causal=True)  # the local chunks: s == r
    out = out.astype(jnp.float32)

    def step(carry, i):
        out, lse, k, v = carry
        k_in, v_in = jax.lax.ppermute((k, v), axis_name, perm)
        return (*visit(out, lse, k, v, i), k_in, v_in), None

    (out, lse, k, v), _ = jax.lax.scan(step, (out, lse, k_in, v_in), jnp.arange(1, n - 1))
    out, _ = visit(out, lse, k, v, n - 1)
    return out.astype(q.dtype)


def _merge(out1, lse1, out2, lse2):
    """Two softmax-normalised partial results over disjoint keys, as one. out [B, T, H, D]
    (float32), lse [B, H, T]; lse2 may be -inf (no keys), lse1 may not."""
    lse = jnp.logaddexp(lse1, lse2)

    def weight(l):
        return jnp.exp(l - lse).transpose(0, 2, 1)[..., None]  # [B, T, H, 1]

    return out1 * weight(lse1) + out2.astype(jnp.float32) * weight(lse2), lse
