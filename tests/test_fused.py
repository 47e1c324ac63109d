"""Hand-written backwards (models/fused.py) give the stock ops' values and gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dit_train.models.fused import RMSNorm, _RMSNorm, addcmul


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rmsnorm_matches_stock_on_a_strided_view(dtype):
    torch.manual_seed(0)
    L, H, D = 37, 3, 16
    # the q slice of a qkv projection: a non-contiguous [L, H, D] view, as in Attention
    qkv = torch.randn(L, 3 * H * D, dtype=dtype, requires_grad=True)
    norm = RMSNorm(D, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    g = torch.randn(L, H, D, dtype=dtype)

    def run(fn):
        y = fn(qkv.view(L, 3, H, D).unbind(1)[0])
        return (y, *torch.autograd.grad(y, (qkv, norm.weight), g))

    ours = run(norm)
    stock = run(lambda x: F.rms_norm(x, (D,), norm.weight, norm.eps))
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(ours, stock):
        torch.testing.assert_close(a, b, **tol)


def test_rmsnorm_gradcheck():
    torch.manual_seed(0)
    x = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-6), (x, w))


def test_rmsnorm_keeps_input_dtype_under_autocast():
    norm = RMSNorm(16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert norm(x).dtype == F.rms_norm(x, (16,), norm.weight, norm.eps).dtype == torch.bfloat16


@pytest.mark.parametrize("shapes", [((6, 5), (6, 5), (6, 5)), ((6, 5), (1, 5), (6, 5)), ((6, 5), (6, 5), (5,))])
def test_addcmul_matches_stock_with_broadcasting(shapes):
    torch.manual_seed(0)
    a, b, c = (torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes)
    g = torch.randn(6, 5, dtype=torch.float64)
    ours = addcmul(a, b, c)
    stock = torch.addcmul(a, b, c)
    torch.testing.assert_close(ours, stock)
    for x, y in zip(torch.autograd.grad(ours, (a, b, c), g), torch.autograd.grad(stock, (a, b, c), g)):
        torch.testing.assert_close(x, y)
    assert torch.autograd.gradcheck(addcmul, (a, b, c))
