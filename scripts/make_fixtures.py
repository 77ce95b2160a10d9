"""Reference outputs of transformers' GPT-2, Llama and Qwen2, so CI checks blujax against them
without installing transformers.

    python scripts/make_fixtures.py --out tests/fixtures/hf_gpt2_tiny
        # a small random GPT2LMHeadModel (save_pretrained), its logits and loss on fixed tokens
    python scripts/make_fixtures.py --family llama --out tests/fixtures/hf_llama_tiny
        # the same of a small random LlamaForCausalLM: grouped-query attention (2 query heads
        # per KV head), RMSNorm scales away from 1, Llama 3's rope scaling, an untied head
    python scripts/make_fixtures.py --family qwen2 --out tests/fixtures/hf_qwen2_tiny
        # a small random Qwen2ForCausalLM: biases on q, k and v, a RoPE theta that is neither
        # transformers' nor our default, a tied head
    python scripts/make_fixtures.py --family llama3 --out tests/fixtures/hf_llama3_tiny
        # a small random LlamaForCausalLM as Meta publishes Llama 3.1 8B: config.json of the
        # same keys (rope_theta, rope_scaling of rope_type llama3, torch_dtype), bfloat16
        # weights split over safetensors shards with model.safetensors.index.json; logits and
        # loss computed in float32 from the saved bfloat16 weights
    python scripts/make_fixtures.py --family llama-bpe --corpus tinyshakespeare.txt \
            --out tests/fixtures/hf_llama_bpe
        # a small random LlamaForCausalLM that speaks its own tokenizer: a byte-level BPE of
        # 1000 tokens trained by `tokenizers` on the corpus (bos <|begin_of_text|>, eos
        # <|end_of_text|>), an excerpt of the corpus, the loss transformers computes over it as
        # the tokenizer encodes it (blujax.evaluate's rows), and a greedy generate()
    python scripts/make_fixtures.py --check-export DIR --expected FILE.npz [--atol 1e-4]
        # GPT2LMHeadModel.from_pretrained(DIR) (a folder blujax.interop.export_hf wrote) on
        # FILE.npz's `tokens` (int [B, T]): its logits against FILE.npz's `logits` ([B, T, V],
        # or our padded vocabulary, whose extra columns are ignored), the max |difference|
        # printed; exit status 1 above --atol. A tokenizer in DIR is loaded and tried too.

Needs torch and transformers (the GPU machine has them; blujax itself does not). Deterministic:
the same versions write the same files. Every parameter is made non-trivial (biases nonzero,
LayerNorm scales away from 1, weights large enough that the logits spread over a few units), so
a parameter mapped to the wrong place shows in the logits.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

import numpy as np

# Heads of 64 (what the GPU attention kernels take, so the fixture runs on them too) and a
# vocabulary that is not a multiple of 128 (ours pads it to 1024).
CONFIG = dict(vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=2, bos_token_id=999,
              eos_token_id=999)
# Llama: the rope scaling's original length (16) below the positions used (32), so that the
# scaled frequencies matter.
LLAMA_CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                    rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 16},
                    bos_token_id=999, eos_token_id=999)
# Llama 3: Meta's theta and rope scaling but the original length (16) below the positions used
# (32), so that the scaled frequencies matter; an eos list (as Meta's Instruct models have).
LLAMA3_CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=384,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                     max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False,
                     rope_scaling={"factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16,
                                   "rope_type": "llama3"},
                     bos_token_id=997, eos_token_id=[998, 999])
# The keys of meta-llama/Llama-3.1-8B's config.json (transformers 4.43), which the fixture's
# config.json has, no more: transformers 5 writes rope_parameters and dtype instead of
# rope_theta, rope_scaling and torch_dtype, and head_dim, pad_token_id besides.
META_KEYS = ("architectures", "attention_bias", "attention_dropout", "bos_token_id",
             "eos_token_id", "hidden_act", "hidden_size", "initializer_range",
             "intermediate_size", "max_position_embeddings", "mlp_bias", "model_type",
             "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pretraining_tp",
             "rms_norm_eps", "rope_scaling", "rope_theta", "tie_word_embeddings", "torch_dtype",
             "transformers_version", "use_cache", "vocab_size")
# Shards of at most this much (save_pretrained's max_shard_size): the bfloat16 weights (1.3 MB)
# in several files, as Meta's 16 GB are in four.
LLAMA3_SHARD = "200KB"
# Qwen2: theta 50000 (transformers' default is 1e4, ours 1e6: a config read wrong shows).
QWEN2_CONFIG = dict(vocab_size=1000, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                    rms_norm_eps=1e-6, rope_theta=50000.0, tie_word_embeddings=True,
                    use_sliding_window=False, bos_token_id=999, eos_token_id=999)
TOKENS_SHAPE = (2, 32)
SEED = 0
# The model of its own tokenizer: ids 0 and 1 the tokenizer's bos and eos.
BPE_VOCAB = 1000
BPE_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")
BPE_LLAMA_CONFIG = dict(vocab_size=BPE_VOCAB, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0,
                        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
BPE_SEQ = 64            # the evaluation's rows: BPE_SEQ + 1 tokens, as blujax.evaluate reads
BPE_EXCERPT = 4000      # characters of the corpus's end, the evaluation text
BPE_PROMPT = "ROMEO:\nWhat"
BPE_NEW_TOKENS = 24


def _import_torch():
    try:
        import torch
        import transformers
    except ImportError as e:
        sys.exit(f"make_fixtures.py needs torch and transformers ({e.name} is missing): run it "
                 f"where they are installed (pip install torch transformers)")
    return torch, transformers


def _versions(torch, transformers) -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": np.__version__}


def _randomize(torch, model) -> None:
    """Every parameter re-drawn to be non-trivial (see the module's docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # tied: one tensor
                p.normal_(0.0, 0.2)
            elif name.endswith("norm.weight"):  # Llama's and Qwen2's RMSNorm scales
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("wte.weight"):
                p.normal_(0.0, 0.2)  # the tied head too: logits of a few units
            elif name.endswith("wpe.weight"):
                p.normal_(0.0, 0.1)
            elif ".ln_" in name and name.endswith(".weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # GPT-2's, Qwen2's q, k and v
                p.normal_(0.0, 0.05)
            else:
                p.normal_(0.0, 0.08)


def make_bpe(out: Path, corpus: Path) -> None:
    """A LlamaForCausalLM with a tokenizer of its own (see the module's docstring)."""
    torch, transformers = _import_torch()
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    text = corpus.read_text(encoding="utf-8")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text.split("\n\n"), trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, special_tokens=list(BPE_SPECIALS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BPE_SPECIALS[0],
                                                eos_token=BPE_SPECIALS[1])
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    config = transformers.LlamaConfig(**BPE_LLAMA_CONFIG, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).float().eval()
    _randomize(torch, model)
    excerpt = text[-BPE_EXCERPT:]
    ids = fast(excerpt, add_special_tokens=False)["input_ids"]
    rows = (len(ids) - 1) // BPE_SEQ
    x = torch.tensor([ids[r * BPE_SEQ:r * BPE_SEQ + BPE_SEQ + 1] for r in range(rows)])
    prompt = fast(BPE_PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        # Every row has BPE_SEQ predictions: the mean of the rows' means is the mean of all.
        loss = float(model(x, labels=x).loss.item())
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=BPE_NEW_TOKENS,
                                do_sample=False, eos_token_id=1, pad_token_id=1)[0].tolist()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)
    fast.save_pretrained(out)
    (out / "text.txt").write_text(excerpt, encoding="utf-8")
    versions = _versions(torch, transformers) | {"tokenizers": tokenizers.__version__}
    expected = {"seq": BPE_SEQ, "rows": rows, "loss": loss, "text_ids": ids,
                "prompt": BPE_PROMPT, "prompt_ids": prompt, "greedy_ids": greedy,
                "greedy_text": fast.decode(greedy, skip_special_tokens=True)}
    (out / "expected.json").write_text(json.dumps(expected) + "\n", encoding="utf-8")
    readme = [
        f"# {out.name}",
        "",
        "A small random transformers `LlamaForCausalLM` that speaks its own tokenizer, for the",
        "tokenizer tests. Made by `python scripts/make_fixtures.py --family llama-bpe --corpus",
        f"tinyshakespeare.txt --out tests/fixtures/{out.name}` with",
        ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"- tokenizer.json, tokenizer_config.json: a byte-level BPE of {BPE_VOCAB} tokens",
        f"  trained by `tokenizers` on tinyshakespeare (its paragraphs); bos {BPE_SPECIALS[0]} (id 0), eos",
        f"  {BPE_SPECIALS[1]} (id 1)",
        f"- config.json, model.safetensors: `{json.dumps(BPE_LLAMA_CONFIG)}`",
        f"  (eager attention, float32, seed {SEED}; every parameter re-drawn to be non-trivial)",
        f"- text.txt: the corpus's last {BPE_EXCERPT} characters",
        "- expected.json: `text_ids` (the tokenizer's ids of text.txt, no special tokens),",
        f"  `loss`: transformers' mean next-token loss over its {rows} rows of {BPE_SEQ} + 1",
        f"  tokens (row r: ids[r*{BPE_SEQ} : r*{BPE_SEQ} + {BPE_SEQ + 1}], blujax.evaluate's "
        "rows);",
        f"  `greedy_ids`: `generate(prompt_ids, max_new_tokens={BPE_NEW_TOKENS}, do_sample=False)`",
        "  (prompt and continuation; it stops at eos), `greedy_text` their decoding",
    ]
    (out / "README.md").write_text("\n".join(readme) + "\n", encoding="utf-8")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e3:.0f} kB): loss {loss:.6f} over {rows} rows; greedy "
          f"{fast.decode(greedy)!r}; {versions}")


def make(out: Path, family: str = "gpt2") -> None:
    torch, transformers = _import_torch()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    if family == "llama":
        config_dict = LLAMA_CONFIG
        config = transformers.LlamaConfig(**config_dict, attn_implementation="eager")
        model = transformers.LlamaForCausalLM(config).float().eval()
    elif family == "qwen2":
        config_dict = QWEN2_CONFIG
        config = transformers.Qwen2Config(**config_dict, attn_implementation="eager")
        model = transformers.Qwen2ForCausalLM(config).float().eval()
    else:
        config_dict = CONFIG
        config = transformers.GPT2Config(**config_dict, attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(config).float().eval()
    _randomize(torch, model)
    tokens = np.random.default_rng(SEED).integers(0, config_dict["vocab_size"], TOKENS_SHAPE)
    with torch.no_grad():
        t = torch.from_numpy(tokens)
        logits = model(t).logits.float().numpy()
        # transformers shifts the labels: the mean next-token loss over 2 x 31 predictions.
        loss = np.float32(model(t, labels=t).loss.item())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").unlink(missing_ok=True)  # not used: keep the folder small
    np.savez(out / "expected.npz", tokens=tokens.astype(np.int32), logits=logits, loss=loss)
    versions = _versions(torch, transformers)
    logits_shape = [*TOKENS_SHAPE, config_dict["vocab_size"]]
    readme = [
        f"# {out.name}",
        "",
        f"A small random transformers `{type(model).__name__}` (`save_pretrained`, safetensors) "
        "and what",
        "transformers computes with it, for the interop tests. Made by",
        f"`python scripts/make_fixtures.py --family {family} --out "
        f"tests/fixtures/{out.name}` with",
        ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"- config: `{json.dumps(config_dict)}`",
        f"  (eager attention, float32, seed {SEED}; every parameter re-drawn to be non-trivial)",
        f"- expected.npz: `tokens` int32 {list(TOKENS_SHAPE)} (numpy default_rng({SEED})),",
        f"  `logits` float32 {logits_shape} (`model(tokens).logits`), `loss` float32",
        "  (`model(tokens, labels=tokens).loss`: the mean next-token cross-entropy over",
        f"  {TOKENS_SHAPE[0]} x {TOKENS_SHAPE[1] - 1} predictions)",
    ]
    (out / "README.md").write_text("\n".join(readme) + "\n", encoding="utf-8")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e3:.0f} kB): loss {float(loss):.6f}; {versions}")


def _meta_config(written: dict) -> dict:
    """config.json as Meta's Llama 3.1 has it (META_KEYS) from what save_pretrained wrote:
    rope_theta and rope_scaling from transformers 5's rope_parameters, torch_dtype from its
    dtype."""
    rope = dict(written.get("rope_parameters") or
                {**(written.get("rope_scaling") or {}), "rope_theta": written["rope_theta"]})
    meta = {k: v for k, v in written.items() if k in META_KEYS}
    meta["rope_theta"] = float(rope.pop("rope_theta"))
    meta["rope_scaling"] = {k: rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings",
                                                 "rope_type")}
    meta["torch_dtype"] = written.get("dtype", written.get("torch_dtype"))
    missing = [k for k in META_KEYS if k not in meta]
    assert not missing, f"save_pretrained wrote no {missing}"
    return dict(sorted(meta.items()))


def make_llama3(out: Path) -> None:
    """A LlamaForCausalLM as Meta publishes Llama 3.1 (see the module's docstring)."""
    torch, transformers = _import_torch()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    config_dict = copy.deepcopy(LLAMA3_CONFIG)  # transformers rewrites rope_scaling in place
    config = transformers.LlamaConfig(**config_dict, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config).float().eval()
    _randomize(torch, model)
    model = model.to(torch.bfloat16)  # Meta's weights are bfloat16
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=LLAMA3_SHARD)
    (out / "generation_config.json").unlink(missing_ok=True)  # not used: keep the folder small
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists(), shards
    written = json.loads((out / "config.json").read_text(encoding="utf-8"))
    meta = _meta_config(written)
    assert meta["torch_dtype"] == "bfloat16", meta["torch_dtype"]
    (out / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    # The reference: the saved bfloat16 weights read back (through the Meta-style config.json)
    # as float32, and computed in float32. Every weight must come back as saved.
    ref = transformers.LlamaForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager").eval()
    saved = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, saved[name].float()), name
    tokens = np.random.default_rng(SEED).integers(0, config_dict["vocab_size"], TOKENS_SHAPE)
    with torch.no_grad():
        t = torch.from_numpy(tokens)
        logits = ref(t).logits.float().numpy()
        loss = np.float32(ref(t, labels=t).loss.item())
    np.savez(out / "expected.npz", tokens=tokens.astype(np.int32), logits=logits, loss=loss)
    versions = _versions(torch, transformers)
    logits_shape = [*TOKENS_SHAPE, config_dict["vocab_size"]]
    readme = [
        f"# {out.name}",
        "",
        "A small random transformers `LlamaForCausalLM` as Meta publishes Llama 3.1 8B, and what",
        "transformers computes with it, for the interop tests. Made by",
        f"`python scripts/make_fixtures.py --family llama3 --out "
        f"tests/fixtures/{out.name}` with",
        ", ".join(f"{k} {v}" for k, v in versions.items()) + ".",
        "",
        f"- config: `{json.dumps(LLAMA3_CONFIG)}`",
        f"  (eager attention, seed {SEED}; every parameter re-drawn to be non-trivial)",
        "- config.json: the keys of meta-llama/Llama-3.1-8B's, no more (rope_theta, rope_scaling",
        "  and torch_dtype, where transformers 5 writes rope_parameters and dtype)",
        f"- model-*.safetensors: the weights in bfloat16, `save_pretrained(max_shard_size="
        f"\"{LLAMA3_SHARD}\")`",
        f"  ({len(shards)} shards, listed in model.safetensors.index.json)",
        f"- expected.npz: `tokens` int32 {list(TOKENS_SHAPE)} (numpy default_rng({SEED})),",
        f"  `logits` float32 {logits_shape} (`model(tokens).logits`), `loss` float32",
        "  (`model(tokens, labels=tokens).loss`: the mean next-token cross-entropy over",
        f"  {TOKENS_SHAPE[0]} x {TOKENS_SHAPE[1] - 1} predictions), of the folder's bfloat16",
        "  weights loaded back as float32 (`from_pretrained(dtype=torch.float32)`) and computed",
        "  in float32",
    ]
    (out / "README.md").write_text("\n".join(readme) + "\n", encoding="utf-8")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e3:.0f} kB, {len(shards)} shards): loss {float(loss):.6f}; "
          f"{versions}")


def check_export(folder: Path, expected: Path, atol: float) -> int:
    torch, transformers = _import_torch()
    want = np.load(expected)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", torch_dtype=torch.float32).eval()
    tokens = want["tokens"].astype(np.int64)
    with torch.no_grad():
        t = torch.from_numpy(tokens)
        logits = model(t).logits.float().numpy()
        loss = model(t, labels=t).loss.item()
    # The expected logits may keep a padded vocabulary: compare the model's columns.
    ref = want["logits"][..., :logits.shape[-1]]
    diff = float(np.max(np.abs(logits - ref)))
    print(f"{folder}: transformers {transformers.__version__} logits vs {expected}: max |diff| "
          f"{diff:.3e} (max |logit| {float(np.max(np.abs(ref))):.3f}); loss {loss:.6f}"
          + (f" (expected {float(want['loss']):.6f})" if "loss" in want else ""))
    ok = diff <= atol
    if (folder / "vocab.json").is_file():
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        ids = tok("Hello, I'm a")["input_ids"]
        print(f"tokenizer {type(tok).__name__}: 'Hello, I'm a' -> {ids}")
        ok &= ids == [15496, 11, 314, 1101, 257]
    print("OK" if ok else f"FAILED (atol {atol})")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=("gpt2", "llama", "qwen2", "llama3", "llama-bpe"),
                   default="gpt2",
                   help="the model family of the fixture; llama3: a Llama as Meta publishes "
                        "Llama 3.1 (bfloat16 shards); llama-bpe: a Llama with its own "
                        "tokenizer, trained on --corpus (default: %(default)s)")
    p.add_argument("--corpus", type=Path, metavar="FILE",
                   help="with --family llama-bpe: the text its tokenizer is trained on")
    p.add_argument("--out", type=Path, default=None,
                   help="where to write the fixture (default: tests/fixtures/hf_FAMILY_tiny)")
    p.add_argument("--check-export", type=Path, metavar="DIR",
                   help="instead: load DIR with AutoModelForCausalLM.from_pretrained and compare")
    p.add_argument("--expected", type=Path, metavar="FILE.npz",
                   help="with --check-export: tokens and the logits expected on them")
    p.add_argument("--atol", type=float, default=1e-4,
                   help="with --check-export: the largest |logit difference| that passes")
    args = p.parse_args(argv)
    if args.check_export:
        if not args.expected:
            p.error("--check-export needs --expected FILE.npz")
        return check_export(args.check_export, args.expected, args.atol)
    if args.family == "llama-bpe":
        if not args.corpus:
            p.error("--family llama-bpe needs --corpus FILE (tinyshakespeare.txt)")
        make_bpe(args.out or Path("tests/fixtures/hf_llama_bpe"), args.corpus)
        return 0
    if args.family == "llama3":
        make_llama3(args.out or Path("tests/fixtures/hf_llama3_tiny"))
        return 0
    make(args.out or Path(f"tests/fixtures/hf_{args.family}_tiny"), args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
