"""Train a few steps of a small Llama-style model whose blocks (and LM head + loss) are fused
GEMM+epilogue programs, next to the same model written in plain PyTorch, from the same seed
and the same batches.

    python examples/train_llama.py [--steps 8] [--layers 2]

On a Hopper GPU both run in bf16 and the fused model's kernels are the generated ones; the
losses agree to within bf16 rounding (the script checks |difference| < 2 % of the loss).
Without one, the fused model runs in fp32 through the reference interpreter (slowly) and
the losses agree to ~1e-5.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from coda_cute.nn import LlamaBlock, linear_cross_entropy, llama_attention_reference, llama_mlp_reference


class FusedModel(nn.Module):
    def __init__(self, vocab, d, heads, kv_heads, ffn, layers, dtype, device):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, ffn, n_kv_heads=kv_heads, dtype=dtype, device=device,
                                               max_positions=256) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-6, dtype=dtype, device=device)
        self.head = nn.Linear(d, vocab, bias=False, dtype=dtype, device=device)

    def loss(self, tokens, targets):
        h, sumsq = self.embed(tokens), None
        for block in self.blocks:
            h, sumsq = block(h, sumsq)  # each residual GEMM hands the next norm its statistics
        # the LM head's logits are never stored: its GEMM epilogue keeps log-sum-exp statistics
        return linear_cross_entropy(self.norm(h), self.head.weight, targets)


class ReferenceModel(nn.Module):
    """The same model in plain PyTorch, with Hugging Face-layout weights copied from `fused`."""

    def __init__(self, fused: FusedModel):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(fused.embed.weight.detach().clone(), freeze=False)
        self.norm = nn.RMSNorm(fused.norm.normalized_shape, eps=1e-6, dtype=fused.norm.weight.dtype,
                               device=fused.norm.weight.device)
        self.norm.load_state_dict(fused.norm.state_dict())
        self.head = nn.Linear(fused.head.in_features, fused.head.out_features, bias=False,
                              dtype=fused.head.weight.dtype, device=fused.head.weight.device)
        self.head.load_state_dict(fused.head.state_dict())
        self.layers = nn.ModuleList()
        self.config = []
        for block in fused.blocks:
            layer = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.clone())
                                      for k, v in block.hf_weights().items()})
            self.layers.append(layer)
            att = block.attention
            self.config.append((att.n_heads, att.n_kv_heads, att.head_dim, att.cos, att.sin, att.eps, block.mlp.eps))

    def loss(self, tokens, targets):
        h = self.embed(tokens)
        for p, (heads, kv, hd, cos, sin, eps, mlp_eps) in zip(self.layers, self.config):
            h = llama_attention_reference(h, p["input_layernorm_weight"], p["self_attn_q_proj_weight"],
                                          p["self_attn_k_proj_weight"], p["self_attn_v_proj_weight"],
                                          p["self_attn_o_proj_weight"], heads, kv, hd, cos, sin, eps)
            h = llama_mlp_reference(h, p["post_attention_layernorm_weight"], p["mlp_gate_proj_weight"],
                                    p["mlp_up_proj_weight"], p["mlp_down_proj_weight"], mlp_eps)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    device, dtype = ("cuda", torch.bfloat16) if on_gpu else ("cpu", torch.float32)
    if not on_gpu:
        print("no Hopper GPU: the fused model runs through the reference interpreter (fp32, slow)")
    vocab, d, heads, kv_heads, ffn, batch, seq = 512, 256, 4, 2, 512, 4, 64
    torch.manual_seed(0)
    fused = FusedModel(vocab, d, heads, kv_heads, ffn, args.layers, dtype, device)
    reference = ReferenceModel(fused)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (fused, reference)]
    data = torch.Generator().manual_seed(1)
    tolerance = 2e-2 if on_gpu else 1e-4
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=data).to(device)
        losses = []
        for model, opt in zip((fused, reference), opts):
            loss = model.loss(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        gap = abs(losses[0] - losses[1]) / losses[1]
        print(f"step {step}: fused loss {losses[0]:.5f}   plain PyTorch loss {losses[1]:.5f}   relative gap {gap:.2e}")
        assert gap < tolerance, f"losses diverged beyond {tolerance}"
    print("losses match step for step")


if __name__ == "__main__":
    main()
