"""F.rms_norm under torch.compile against eager and an fp64 reference, on the strided views a
packed qkv projection gives (q = qkv.view(L, 3, H, D).unbind(1)[0]) and on a contiguous copy:
relative error of the input and weight gradients.

    python benchmarks/gpu/rms_norm_compile.py [cuda|cpu]

Why it exists: on an H200 (torch 2.11 + CUDA 13) the GPU check's compiled_blocks found the
compiled DiT's q_norm.weight gradient 100 % off the eager one while the forward matched. This
script ruled F.rms_norm out there (every error <= 3.1e-7, compiled or not, strided or not:
benchmarks/results/gpu_check_h200.json); the cause is still open (docs/performance.md), and
train.compile is refused on CUDA meanwhile.
"""
import sys

import torch
import torch.nn.functional as F

dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
L, H, D = 2048, 4, 32
g = torch.Generator().manual_seed(0)
qkv0 = torch.randn(L, 3 * H * D, generator=g, dtype=torch.float64)
w0 = torch.randn(D, generator=g, dtype=torch.float64)


def strided(qkv, w):
    q, k, v = qkv.view(L, 3, H, D).unbind(1)
    return (F.rms_norm(q, (D,), w, 1e-6) * v).sum()


def contiguous(qkv, w):
    q, k, v = qkv.view(L, 3, H, D).unbind(1)
    return (F.rms_norm(q.contiguous(), (D,), w, 1e-6) * v).sum()


def grads(fn, dtype, device):
    a = qkv0.to(device, dtype).clone().requires_grad_()
    b = w0.to(device, dtype).clone().requires_grad_()
    fn(a, b).backward()
    return a.grad.double().cpu(), b.grad.double().cpu()


print(f"torch {torch.__version__}, device {dev}")
print("| input | run | input grad rel err | weight grad rel err |\n|---|---|---|---|")
for name, fn in (("strided view", strided), ("contiguous", contiguous)):
    ref = grads(fn, torch.float64, "cpu")
    for run, f in (("eager", fn), ("compiled", torch.compile(fn, dynamic=True))):
        got = grads(f, torch.float32, dev)
        errs = [float((x - r).norm() / r.norm()) for x, r in zip(got, ref)]
        print(f"| {name} | {run} | {errs[0]:.2e} | {errs[1]:.2e} |")
