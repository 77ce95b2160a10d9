"""Export a blujax GPT-2 to Hugging Face layout and check that transformers computes our logits.

    python scripts/check_hf_export.py --model gpt2 --out /tmp/export   # where torch and
                                                                       # transformers are

A randomly initialised model of the preset (or --init-from weights) runs on our kernels in
float32 over fixed tokens; blujax.interop.export_hf writes it; GPT2LMHeadModel.from_pretrained
loads it (on the GPU where there is one) and runs the same tokens. Prints the largest absolute
and relative differences of the logits over the real vocabulary, and exits 1 above --atol.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from blujax import interop
from blujax.model import gpt2
from blujax.model import ops as model_ops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", choices=list(gpt2.PRESETS),
                   help="a GPT-2 preset (default gpt2)")
    p.add_argument("--init-from", metavar="SRC", help="pretrained weights instead of a random "
                                                      "model (interop.load_pretrained)")
    p.add_argument("--out", required=True, help="folder to export into")
    p.add_argument("--batch", type=int, default=2, help="rows of tokens (default 2)")
    p.add_argument("--seq", type=int, default=256, help="tokens a row (default 256)")
    p.add_argument("--ops", choices=("ffi", "xla"), default="ffi", help="our side's ops")
    p.add_argument("--atol", type=float, default=1e-3, help="largest |difference| allowed")
    args = p.parse_args(argv)
    try:
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"error: this check needs torch and transformers ({e})", file=sys.stderr)
        return 2

    # float32 products on both sides (on a GPU both default to TF32).
    jax.config.update("jax_default_matmul_precision", "highest")
    if args.init_from:
        pre = interop.load_pretrained(args.init_from)
        config, params = pre.config, jax.device_put(pre.params)
    else:
        config = gpt2.PRESETS[args.model]
        params = gpt2.init(config, jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq))
    ours = gpt2.forward(params, jnp.asarray(tokens, jnp.int32), config=config,
                        ops=model_ops.get(args.ops), dtype=jnp.float32)
    ours = np.asarray(ours, np.float64)[..., :config.vocab_size]
    interop.export_hf(jax.device_get(params), config, args.out)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 on both sides
    torch.backends.cudnn.allow_tf32 = False
    model = GPT2LMHeadModel.from_pretrained(args.out).to(device).eval()
    with torch.no_grad():
        theirs = model(torch.as_tensor(tokens, device=device)).logits.double().cpu().numpy()
    diff = np.abs(ours - theirs)
    rel = diff.max() / np.abs(theirs).max()
    print(f"{args.init_from or args.model} ({args.ops} ops, {jax.devices()[0].device_kind} / "
          f"torch {device}, float32): logits {tokens.shape} x {config.vocab_size}, max |ours - "
          f"transformers| {diff.max():.3g}, relative to max |logit| {rel:.3g}; argmax agrees "
          f"on {np.mean(ours.argmax(-1) == theirs.argmax(-1)):.4f} of positions")
    return 0 if diff.max() <= args.atol else 1


if __name__ == "__main__":
    sys.exit(main())
