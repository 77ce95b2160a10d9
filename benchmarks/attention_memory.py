"""Device memory of one attention training step (forward + backward): ours vs XLA (and cuDNN).

    python -m benchmarks.attention_memory [--seq 8192] [--batch 1] [--heads 12] [--head-dim 64]
                                          [--causal | --no-causal] [--dtype bfloat16] [--quick]

For each implementation, jits q, k, v, dout -> (dq, dk, dv) and reads XLA's memory analysis
of the compiled program: arguments + outputs + temporaries is the peak the program needs
beyond what the caller already holds (XLA allocates temporaries for the whole program up
front). Nothing is run, so a contender that would not fit still reports its need. Ours keeps
O(T) residuals (out, lse, delta; on Hopper also a float32 dQ workspace, unless XLA's
deterministic mode is on or the call is causal and short) where XLA's jnp attention keeps
the [B, H, T, T] scores.
--quick: a small shape that also runs on the CPU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from blujax import kernels


def _step(impl: str, causal: bool):
    if impl == "ours":
        op = lambda q, k, v: kernels.attention(q, k, v, causal=causal)  # noqa: E731
    else:
        op = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=causal, implementation=impl)

    def step(q, k, v, dout):
        _, vjp = jax.vjp(op, q, k, v)
        return vjp(dout)
    return step


def memory(impl: str, shape, dtype, causal: bool) -> dict:
    arg = jax.ShapeDtypeStruct(shape, dtype)
    compiled = jax.jit(_step(impl, causal)).lower(arg, arg, arg, arg).compile()
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return dict(impl=impl, arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                temporaries=m.temp_size_in_bytes, total=total)


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_memory", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--quick", action="store_true", help="B1 T256 H2 D64: runs on a CPU")
    args = parser.parse_args(argv)
    if args.quick:
        args.seq, args.batch, args.heads, args.head_dim = 256, 1, 2, 64
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    dtype = jnp.dtype(args.dtype)
    impls = ["ours", "xla"]
    if jax.default_backend() == "gpu" and dtype == jnp.bfloat16:
        impls.append("cudnn")

    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}")
    print(f"attention fwd+bwd, q = k = v = dout {list(shape)} {dtype.name}, "
          f"causal={args.causal}\n")
    print("| impl | arguments MiB | outputs MiB | temporaries MiB | total MiB |")
    print("|---|---|---|---|---|")
    mib = 1 << 20
    for impl in impls:
        try:
            r = memory(impl, shape, dtype, args.causal)
        except Exception as e:  # noqa: BLE001 - a contender that cannot compile here is a note
            print(f"| {impl} | - | - | - | {type(e).__name__}: {str(e).splitlines()[0][:120]} |")
            continue
        print(f"| {impl} | {r['arguments'] / mib:.1f} | {r['outputs'] / mib:.1f} | "
              f"{r['temporaries'] / mib:.1f} | {r['total'] / mib:.1f} |")


if __name__ == "__main__":
    main()
