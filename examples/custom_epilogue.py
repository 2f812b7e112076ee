"""Write an epilogue program, look at it, emit its kernel, run it.

    python examples/custom_epilogue.py            # any machine; the kernel runs on a Hopper GPU

On a machine without a Hopper GPU the program runs in the reference interpreter.
"""

import torch

import coda_cute as cc
from coda_cute.config import KernelConfig
from coda_cute.render import emit


@cc.epilogue
def scaled_gelu_with_stats(acc, bias: cc.ColVec, scale: cc.Scalar):
    """y = scale * gelu_tanh(acc + bias), plus each row's max |y| (e.g. for fp8 scaling)."""
    y = scale * cc.gelu_tanh(acc + bias)
    return {"D": y, "amax": cc.row_maxabs(y)}


print(scaled_gelu_with_stats.describe())
source = emit(scaled_gelu_with_stats, KernelConfig(tile=(128, 256), cluster=(1, 2)))
start = source.index("# -- epilogue of")
print("\n--- the generated epilogue (see `coda-cute emit` for the whole module) ---")
print(source[start:start + 2400])

on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
device = "cuda" if on_gpu else "cpu"
if not on_gpu:
    print("\nno Hopper GPU here: running the reference interpreter instead of the kernel")
x = torch.randn(1000, 512, device=device, dtype=torch.bfloat16)
w = torch.randn(768, 512, device=device, dtype=torch.bfloat16) * 512 ** -0.5
bias = torch.randn(768, device=device, dtype=torch.bfloat16)
kernel = cc.Kernel(scaled_gelu_with_stats)
out = kernel(x, w, bias=bias, scale=0.5)
want = 0.5 * torch.nn.functional.gelu(x.float() @ w.float().t() + bias.float(), approximate="tanh")
print(f"\nran via {kernel.last.path}; D {tuple(out['D'].shape)} {out['D'].dtype}, amax {tuple(out['amax'].shape)}")
print(f"max |D - torch| = {(out['D'].float() - want).abs().max().item():.3g}, "
      f"max |amax - torch| = {(out['amax'] - want.abs().amax(-1)).abs().max().item():.3g}")
