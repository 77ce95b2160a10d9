"""The PyTorch contender for the Llama rows of benchmarks/train.py: the same architecture as
blujax.model.llama (RMSNorm, RoPE, grouped-query attention through SDPA, SwiGLU, the tied
embedding, the padded vocabulary), trained with torch.compile, bf16 autocast and fused AdamW.
PyTorch is not a dependency of blujax: this runs where it is installed.

    python -m benchmarks.torch_llama --model llama-d12 --seq 1024 --batch 16,32
    python -m benchmarks.torch_llama --model llama-1b --seq 2048 --batch 4,8
    python -m benchmarks.torch_llama --model llama-1b --seq 2048 --batch 8 --float8 off,tensorwise

--float8 also trains the blocks' linear layers in float8 through torchao
(convert_to_float8_training with the recipe named: "tensorwise", torchtitan's default, dynamic
per-tensor scales; or "rowwise"), as torchtitan does; the LM head stays bf16. torchao is not a
dependency either.

Prints one JSON row per batch size (tokens/s, step ms, MFU against 800 and 989 TFLOP/s with
blujax's FLOP count, peak memory) and a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def build(torch, config):
    nn, F = torch.nn, torch.nn.functional
    C, H, KV, D, Fh = (config.n_embd, config.n_head, config.n_kv_head, config.head_dim,
                       config.ffn_hidden)

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(C))

        def forward(self, x):
            return F.rms_norm(x, (C,), self.weight, config.norm_eps)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
            self.wq = nn.Linear(C, H * D, bias=False)
            self.wk = nn.Linear(C, KV * D, bias=False)
            self.wv = nn.Linear(C, KV * D, bias=False)
            self.wo = nn.Linear(H * D, C, bias=False)
            self.w_gate_up = nn.Linear(C, 2 * Fh, bias=False)
            self.w_down = nn.Linear(Fh, C, bias=False)

        def forward(self, x, cos, sin):
            B, T, _ = x.shape
            h = self.attn_norm(x)
            q = self.wq(h).view(B, T, H, D).transpose(1, 2)
            k = self.wk(h).view(B, T, KV, D).transpose(1, 2)
            v = self.wv(h).view(B, T, KV, D).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(a.transpose(1, 2).reshape(B, T, H * D))
            gate, up = self.w_gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
            return x + self.w_down(F.silu(gate) * up)

    def rope(x, cos, sin):
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(config.padded_vocab_size, C)
            self.blocks = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.norm_f = RMSNorm()
            inv = 1.0 / config.rope_theta ** (torch.arange(0, D, 2).double() / D)
            ang = torch.outer(torch.arange(config.block_size).double(), inv)
            self.register_buffer("cos", ang.cos().float(), persistent=False)
            self.register_buffer("sin", ang.sin().float(), persistent=False)

        def forward(self, idx, targets):
            T = idx.shape[1]
            cos, sin = self.cos[:T].to(torch.bfloat16), self.sin[:T].to(torch.bfloat16)
            x = self.wte(idx)
            for block in self.blocks:
                x = block(x, cos, sin)
            logits = F.linear(self.norm_f(x), self.wte.weight)  # tied
            return F.cross_entropy(logits[..., :config.vocab_size].float().flatten(0, 1),
                                   targets.flatten())

    return Llama()


def run(torch, config, seq, batch, steps, float8="off"):
    model = build(torch, config).cuda()
    if float8 != "off":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(float8),
                                   module_filter_fn=lambda m, fqn: fqn.startswith("blocks"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    step_fn = torch.compile(model)
    x = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    y = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), torch.cuda.max_memory_allocated(), float(loss)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.torch_llama",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-d12", help="a Llama preset (default llama-d12)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", default="16,32", help="batch sizes, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--float8", default="off",
                   help="torchao float8 recipes, comma-separated: off, tensorwise, rowwise")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON lines")
    a = p.parse_args(argv)
    import torch

    from blujax.model import llama
    if a.model not in llama.PRESETS:
        p.error(f"--model {a.model}: not a Llama preset ({', '.join(llama.PRESETS)})")
    config = llama.PRESETS[a.model]
    flops_token = llama.flops_per_token(config, a.seq)
    rows = []
    for batch, float8 in ((int(b), f) for b in a.batch.split(",") for f in a.float8.split(",")):
        step_s, mem, loss = run(torch, config, a.seq, batch, a.steps, float8)
        tok_s = batch * a.seq / step_s
        row = {"ops": "torch", "model": a.model, "dtype": "bf16", "float8": float8,
               "batch": batch, "seq": a.seq,
               "tokens_per_s": tok_s, "step_ms": step_s * 1e3,
               "mfu": flops_token * tok_s / 800e12, "mfu_989": flops_token * tok_s / 989e12,
               "peak_gb": mem / 1e9, "loss": loss, "torch": torch.__version__}
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print("| batch | float8 | tokens/s | step ms | MFU (800) | MFU (989) | peak GB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['float8']} | {r['tokens_per_s'] / 1e3:.1f}K | "
              f"{r['step_ms']:.1f} | "
              f"{r['mfu']:.1%} | {r['mfu_989']:.1%} | {r['peak_gb']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
