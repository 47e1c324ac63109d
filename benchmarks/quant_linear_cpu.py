"""What a quantized frozen base (model.base_quant) costs per use of a weight, on the CPU: the
forward and input-gradient backward of one frozen linear of Wan 1.3B's sizes (dim 1536, FFN 8960),
each torchao quantization against the plain weight, median of REPEATS after a warm-up. It is the
input of the one-GPU planner's order (dit_train/planning/one_gpu.py: nf4 after block swap) and of
docs/one-gpu.md; a GPU's kernels differ (not measured here).

Usage: OMP_NUM_THREADS=1 python benchmarks/quant_linear_cpu.py [TOKENS] [REPEATS]  (default 256, 5)
"""
import statistics
import sys
import time

import torch
from torch import nn

from dit_train.models import quant

SHAPES = {"attn 1536x1536": (1536, 1536), "ffn 1536->8960": (1536, 8960)}


def timed(layer: nn.Linear, x: torch.Tensor, repeats: int) -> float:
    """Median seconds of forward + backward to the input (the frozen weight gets no gradient)."""
    out = []
    for i in range(repeats + 1):
        xi = x.detach().requires_grad_(True)
        t = time.perf_counter()
        layer(xi).sum().backward()
        if i:  # the first is warm-up
            out.append(time.perf_counter() - t)
    return statistics.median(out)


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, {tokens} tokens, fp32 input, median of {repeats}")
    print("| layer | " + " | ".join(("none", *quant.KINDS)) + " |")
    print("|---" * (len(quant.KINDS) + 2) + "|")
    for name, (i, o) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(tokens, i)
        cells = []
        for kind in ("none", *quant.KINDS):
            layer = nn.Linear(i, o).requires_grad_(False)
            quant.quantize_base([layer], kind)
            s = timed(layer, x, repeats)
            base = s if kind == "none" else base
            cells.append(f"{s * 1e3:.1f} ms" + ("" if kind == "none" else f" ({s / base:.2f}x)"))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
