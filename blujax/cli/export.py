"""`export`: a run's latest parameters in another tool's format.

    gpt2.py export --out runs/a --format hf --to runs/a/hf        # transformers' from_pretrained
    gpt2.py export --out runs/a --format llmc --to gpt2_124M.bin  # llm.c's train_gpt2

The library functions behind it are blujax.interop.export_hf and export_llmc, which refuse
what would destroy something of the user's (the run's own folder, other files without
--overwrite, a device) and write the target whole or not at all.
"""

from __future__ import annotations

from pathlib import Path

import jax

from blujax import interop, model
from blujax.cli.run import latest_params
from blujax.cli.settings import UsageError

# llm.c's names of --dtype's values.
LLMC_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def cmd_export(args) -> int:
    out = Path(args.out or "out")
    config, _, restored, tokenizer = latest_params(out)
    params = jax.device_get(restored.tree["params"])
    try:
        if args.format == "hf":
            if args.dtype not in (None, "f32"):
                raise UsageError("--dtype applies to --format llmc; the Hugging Face export "
                                 "is float32")
            path = interop.export_hf(params, config, args.to, tokenizer=tokenizer,
                                     overwrite=args.overwrite)
            what = f"a Hugging Face {model.family_of(config).TITLE} folder"
        else:
            dtype = LLMC_DTYPES[args.dtype or "f32"]
            path = interop.export_llmc(params, config, args.to, dtype=dtype,
                                       overwrite=args.overwrite)
            what = f"an llm.c model file ({dtype})"
    except OSError as e:
        raise UsageError(f"cannot write {args.to}: {e.strerror or e}") from None
    print(f"step {restored.step} of {out} written to {path}: {what}")
    return 0
