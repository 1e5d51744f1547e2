"""KDA: the chunked form against its naive per-token twin (forward and backward), masks and packing."""

import pytest
import torch

from lightning_eagle.k3 import config_from_name
from lightning_eagle.k3.kda import KimiDeltaAttention
from lightning_eagle.k3.kda_ops import chunk_kda, naive_recurrent_kda, safe_chunk_size


def _inputs(B=2, T=45, H=3, K=16, V=12, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    gate = -5 * torch.sigmoid(torch.randn(B, T, H, K, generator=g, dtype=dtype) * 3)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g, dtype=dtype))
    return q, k, v, gate, beta


@pytest.mark.parametrize("T", [1, 16, 45])
def test_chunk_equals_naive_forward_and_backward(T):
    tensors = [t.float().requires_grad_() for t in _inputs(T=T)]
    twins = [t.detach().clone().requires_grad_() for t in tensors]
    out = chunk_kda(*tensors, scale=0.25, chunk_size=16)
    ref = naive_recurrent_kda(*twins, scale=0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(out)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    for a, b, name in zip(tensors, twins, "q k v g beta".split()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=f"grad {name}")


def test_safe_chunk_size_bounds_the_in_chunk_decay():
    assert safe_chunk_size(-5.0) == 16
    assert safe_chunk_size(-1.0) == 64
    assert safe_chunk_size(-30.0) == 2


def _kda(seed=0, backend="chunk"):
    torch.manual_seed(seed)
    layer = KimiDeltaAttention(config_from_name("k3-tiny"), backend=backend)
    for name, p in layer.named_parameters():
        if name == "A_log":
            torch.nn.init.uniform_(p, 0, 2.7)
        elif name == "o_norm.weight":
            torch.nn.init.uniform_(p, 0.5, 1.5)
        else:
            torch.nn.init.normal_(p, std=0.15)
    return layer


def test_module_chunk_vs_naive_with_masks_forward_and_backward():
    chunked, naive = _kda(backend="chunk"), _kda(backend="naive")
    x = torch.randn(2, 37, 128)
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, 30:] = 0
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = chunked(xa, mask), naive(xb, mask)
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
    w = torch.randn_like(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    # fp32 sums in a different order: compare relative to each gradient's scale
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-5 * xb.grad.abs().max().item())
    for (name, pa), pb in zip(chunked.named_parameters(), naive.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-5 * pb.grad.abs().max().item(), msg=name)


def test_auto_is_the_chunked_path_where_fla_cannot_run(monkeypatch):
    """Without fla (CPU), ``auto`` is ``chunk`` and never reads the KDA check record (`kda_records.py`)."""
    from lightning_eagle.k3 import kda_records

    monkeypatch.setattr(kda_records, "passed_kda_backends", lambda device: pytest.fail("record consulted"))
    x = torch.randn(2, 19, 128)
    torch.testing.assert_close(_kda(backend="auto")(x), _kda(backend="chunk")(x), rtol=0, atol=0)


def test_decay_is_bounded_and_A_log_is_per_head():
    layer = _kda()
    assert layer.A_log.shape == (3,)
    g = layer.decay(torch.randn(2, 9, 128))
    # (-5, 0) mathematically; fp32 sigmoid saturates to the closed interval for very large rates
    assert g.dtype == torch.float32 and (g <= 0).all() and (g >= -5).all()
    assert ((g < 0) & (g > -5)).float().mean() > 0.9
    x = torch.randn(1, 4, 128)
    with torch.no_grad():
        layer.A_log[1] += 1.0
    g2 = layer.decay(x)
    with torch.no_grad():
        layer.A_log[1] -= 1.0
    g1 = layer.decay(x)
    changed = (g1 != g2).any(dim=(0, 1, 3))  # exact: heads 0 and 2 repeat the identical elementwise computation
    assert changed.tolist() == [False, True, False]


def test_causality():
    layer = _kda()
    x = torch.randn(1, 20, 128)
    y = layer(x)
    x2 = x.clone()
    x2[:, 12:] = torch.randn(1, 8, 128)
    # exact: same shapes, and later tokens reach earlier outputs only through exact zeros (causal masks)
    assert torch.equal(layer(x2)[:, :12], y[:, :12])


def test_left_and_right_padding_invariance():
    layer = _kda()
    x = torch.randn(1, 11, 128)
    y = layer(x)
    pad = torch.randn(1, 5, 128)
    right = layer(torch.cat([x, pad], 1), torch.tensor([[1] * 11 + [0] * 5]))
    left = layer(torch.cat([pad, x], 1), torch.tensor([[0] * 5 + [1] * 11]))
    torch.testing.assert_close(right[:, :11], y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(left[:, 5:], y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["chunk", "naive"])
def test_packed_documents_equal_separate_runs(backend):
    layer = _kda(backend=backend)
    a, b = torch.randn(1, 7, 128), torch.randn(1, 9, 128)
    packed = torch.cat([a, b, torch.randn(1, 2, 128)], 1)
    doc_ids = torch.tensor([[1] * 7 + [2] * 9 + [0] * 2])
    out = layer(packed, doc_ids)
    torch.testing.assert_close(out[:, :7], layer(a), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[:, 7:16], layer(b), rtol=1e-5, atol=1e-6)
    assert out[:, 16:].abs().max() == 0
