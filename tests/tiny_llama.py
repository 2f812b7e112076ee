"""A small Llama-style language model built from coda_cute.nn, for the training tests
(test_distributed.py, test_nn_compile.py, test_gpu_training.py): token embedding, LlamaBlocks,
a final RMSNorm, and the LM head with its cross-entropy in one linear_cross_entropy."""

import torch
from torch import nn

from coda_cute.nn import LlamaBlock, linear_cross_entropy


class TinyLlama(nn.Module):
    def __init__(self, vocab=64, d=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=16, dtype=torch.float32,
                 device=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, dtype=dtype, device=device)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, ffn, n_kv_heads=kv_heads, dtype=dtype, device=device,
                                               max_positions=seq) for _ in range(layers))
        self.norm = nn.RMSNorm(d, eps=1e-6, dtype=dtype, device=device)
        self.head = nn.Linear(d, vocab, bias=False, dtype=dtype, device=device)

    def forward(self, tokens, targets):
        """Mean cross-entropy of next-token prediction over every (tokens, targets) position."""
        return self.hidden_loss(self.embed(tokens), targets)

    def hidden_loss(self, h, targets):
        """The same from hidden states h (batch, seq, d): the blocks, the norm and the LM head."""
        sumsq = None
        for block in self.blocks:
            h, sumsq = block(h, sumsq)  # each residual GEMM hands the next norm its statistics
        return linear_cross_entropy(self.norm(h), self.head.weight, targets)


def batches(steps, batch, seq, vocab, seed=1):
    """`steps` batches of (inputs, targets), each (batch, seq) next-token pairs, from one seed."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out
