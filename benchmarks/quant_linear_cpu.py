"""What a quantized frozen base (model.base_quant) costs per use of a weight, on the CPU: the
forward and input-gradient backward of one frozen linear of Wan 1.3B's sizes (dim 1536, FFN 8960),
each torchao quantization against the plain weight, median of REPEATS after a warm-up round,
the kinds interleaved in each round. It is the
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


def step_s(layer: nn.Linear, x: torch.Tensor) -> float:
    """Seconds of one forward + backward to the input (the frozen weight gets no gradient)."""
    xi = x.detach().requires_grad_(True)
    t = time.perf_counter()
    layer(xi).sum().backward()
    return time.perf_counter() - t


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
        layers = {}
        for kind in ("none", *quant.KINDS):
            layers[kind] = nn.Linear(i, o).requires_grad_(False)
            quant.quantize_base([layers[kind]], kind)
        times: dict[str, list[float]] = {k: [] for k in layers}
        for r in range(repeats + 1):  # kinds interleaved: a shared machine's load drift hits them alike
            for kind, layer in layers.items():
                s = step_s(layer, x)
                if r:  # the first round is warm-up
                    times[kind].append(s)
        med = {k: statistics.median(v) for k, v in times.items()}
        cells = [f"{med[k] * 1e3:.1f} ms" + ("" if k == "none" else f" ({med[k] / med['none']:.2f}x)") for k in layers]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
