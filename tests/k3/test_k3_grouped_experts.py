"""Grouped routed experts (``RoutedExperts.forward``, grouped_mm and padded-bmm backends) ↔ the per-expert loop
(``forward_naive``): dequantized and MXFP4 storage, expert-parallel slices, empty experts, bf16, backward, and no
host sync on the grouped_mm backend."""

import pytest
import torch

from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.experts import RoutedExperts, grouped_mm_runs
from lightning_eagle.k3.mxfp4 import decode_mxfp4, encode_mxfp4

E, H, INTER, K = 8, 64, 32, 2


def _experts(storage="dequantized", expert_range=None, seed=0) -> RoutedExperts:
    torch.manual_seed(seed)
    experts = RoutedExperts(E, H, INTER, expert_range, storage=storage)
    if storage == "dequantized":
        for p in experts.parameters():
            torch.nn.init.normal_(p, std=0.3)
    else:
        for stem, rows, cols in (("gate_up", 2 * INTER, H), ("down", H, INTER)):
            for local in range(experts.count):
                packed, scale = encode_mxfp4(0.3 * torch.randn(rows, cols))
                getattr(experts, f"{stem}_packed")[local] = packed
                getattr(experts, f"{stem}_scale")[local] = scale
    return experts


def _routes(N=24, seed=1, skip=(1, 5)):
    """Top-k routes that never pick the experts in ``skip`` (they receive no token)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(N)])
    weight = torch.rand(N, K, generator=gen)
    return torch.randn(N, H, generator=gen), idx, weight


CASES = [
    ("dequantized", None),
    ("dequantized", (2, 4)),  # an expert-parallel slice: experts 1 (empty) .. 5 (empty)
    ("dequantized", (6, 2)),
    ("mxfp4", None),
    ("mxfp4", (4, 4)),
]


@pytest.mark.parametrize("backend", ["grouped_mm", "bmm"])
@pytest.mark.parametrize(("storage", "expert_range"), CASES)
def test_grouped_equals_loop_fp32(storage, expert_range, backend):
    if backend == "grouped_mm" and not grouped_mm_runs(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no CPU grouped_mm")
    experts = _experts(storage, expert_range)
    experts.experts_backend = backend
    z, idx, w = _routes()
    got, want = experts(z, idx, w), experts.forward_naive(z, idx, w)
    assert got.dtype == torch.float32 and got.shape == (24, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    start, count = expert_range or (0, E)
    no_local = ~((idx >= start) & (idx < start + count)).any(-1)
    assert no_local.any() == (count < E) and (got[no_local] == 0).all()  # tokens of remote experts contribute 0


@pytest.mark.parametrize("backend", ["auto", "bmm"])
@pytest.mark.parametrize(("storage", "expert_range"), [("dequantized", None), ("mxfp4", (2, 4))])
def test_grouped_equals_loop_bf16(storage, expert_range, backend):
    experts = _experts(storage, expert_range)
    if storage == "dequantized":
        experts.bfloat16()
    experts.experts_backend = backend
    z, idx, w = _routes()
    got, want = experts(z.bfloat16(), idx, w), experts.forward_naive(z.bfloat16(), idx, w)
    assert got.dtype == torch.float32
    # Expert outputs are rounded to bf16 before weighting; GEMMs over other row blocks may round differently.
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("backend", ["auto", "bmm"])
def test_grouped_backward_equals_loop_on_a_slice(backend):
    """Rows of remote experts (uninitialised in grouped_mm's output) must not leak into any gradient."""
    experts = _experts("dequantized", (2, 4))
    experts.experts_backend = backend
    z, idx, w = _routes()
    grads = []
    for fn in (experts.forward, experts.forward_naive):
        experts.zero_grad()
        zi, wi = z.clone().requires_grad_(), w.clone().requires_grad_()
        (fn(zi, idx, wi) * torch.linspace(-1, 1, H)).sum().backward()
        grads.append([zi.grad, wi.grad, experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone()])
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_no_tokens_and_no_local_tokens():
    experts = _experts("dequantized", (6, 2))
    z, idx, w = _routes(skip=(6, 7))
    assert (experts(z, idx, w) == 0).all()
    empty = experts(z[:0], idx[:0], w[:0])
    assert empty.shape == (0, H)


@pytest.mark.parametrize(("expert_range", "syncs"), [(None, 0), ((2, 4), 1)])
def test_grouped_mm_backend_host_syncs(monkeypatch, expert_range, syncs):
    """One process (complete slice): no read-back at all. An expert-parallel slice reads its local-pair count once
    (computing every slot of every received row would cost ~ep·k/... times the local work)."""
    assert grouped_mm_runs(torch.device("cpu"), torch.float32)  # torch 2.13 CPU has grouped_mm: the test must run
    experts = _experts("mxfp4", expert_range)
    z, idx, w = _routes()
    experts.experts_backend = "grouped_mm"
    want = experts(z, idx, w)  # the probe (one read-back per device and dtype) runs here, before the patch
    calls: list[str] = []

    def record(name):
        original = getattr(torch.Tensor, name)

        def counted(self, *args):
            calls.append(name)
            return original(self, *args)

        return counted

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, record(name))
    got = experts(z, idx, w)
    monkeypatch.undo()
    assert len(calls) == syncs, calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # exact: the same computation twice


def test_auto_backend_falls_back_to_bmm_for_unaligned_widths():
    experts = RoutedExperts(4, 12, 6)  # 6 fp32 = 24-byte rows: not 16-byte aligned
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    z, idx, w = torch.randn(5, 12), torch.tensor([[0, 1], [1, 2], [3, 0], [2, 3], [0, 2]]), torch.rand(5, 2)
    gate_up, down = experts.stacked_weights(z.dtype)
    assert experts.resolve_backend(z, gate_up, down) == "bmm"
    torch.testing.assert_close(experts(z, idx, w), experts.forward_naive(z, idx, w), rtol=1e-5, atol=1e-5)
    experts.experts_backend = "grouped_mm"
    with pytest.raises(RuntimeError, match="grouped_mm does not run here"):
        experts(z, idx, w)


def test_stacked_mxfp4_decode_equals_per_expert_decode():
    experts = _experts("mxfp4")
    gate_up, down = experts.stacked_weights(torch.float32)
    for local in range(E):
        g, d = experts.weights(local, torch.float32)
        assert torch.equal(gate_up[local], g) and torch.equal(down[local], d)  # exact: same fp32 decode
    stacked = decode_mxfp4(experts.down_packed, experts.down_scale)
    assert stacked.shape == (E, H, INTER)
    with pytest.raises(ValueError, match="scale byte 255"):
        decode_mxfp4(experts.down_packed, torch.full_like(experts.down_scale, 255))


def test_experts_backend_names_are_checked():
    experts = _experts("dequantized")
    with pytest.raises(ValueError, match="unknown routed-experts backend 'loop': experts_backend must be one of"):
        experts.experts_backend = "loop"  # never a silent fall-through to the padded bmm
    assert experts.experts_backend == "auto"
    model = KimiK3ForCausalLM(config_from_name("k3-tiny"), experts_backend="bmm")
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    assert routed and all(m.experts_backend == "bmm" for m in routed)
