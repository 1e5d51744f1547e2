"""The stateful KDA recurrence (initial state in, final state out) against the target's zero-state twin."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_eagle.k3.kda import l2_normalize
from lightning_eagle.k3.kda_ops import chunk_kda, naive_recurrent_kda

# The stateful forms (flash-linear-attention names: initial_state in, output_final_state -> (o, S_T)).
naive_recurrent_kda_with_state = partial(naive_recurrent_kda, output_final_state=True)
chunk_kda_with_state = partial(chunk_kda, output_final_state=True)


def inputs(T, B=2, H=3, K=8, V=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=g))
    k = l2_normalize(torch.randn(B, T, H, K, generator=g))
    v = torch.randn(B, T, H, V, generator=g)
    log_decay = -5 * torch.rand(B, T, H, K, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    return q, k, v, log_decay, beta


def test_zero_state_is_the_target_twin_op_for_op():
    q, k, v, g, beta = inputs(11)
    o, _ = naive_recurrent_kda_with_state(q, k, v, g, beta, 0.3)
    assert torch.equal(o, naive_recurrent_kda(q, k, v, g, beta, 0.3))


@pytest.mark.parametrize("split", [1, 5, 16, 23])
def test_state_carries_across_pieces(split):
    q, k, v, g, beta = inputs(29)
    full, S_full = naive_recurrent_kda_with_state(q, k, v, g, beta, 0.3)
    first = [t[:, :split] for t in (q, k, v, g, beta)]
    rest = [t[:, split:] for t in (q, k, v, g, beta)]
    o1, S1 = naive_recurrent_kda_with_state(*first, 0.3)
    o2, S2 = chunk_kda_with_state(*rest, 0.3, chunk_size=8, initial_state=S1)  # mixed forms on purpose
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S2, S_full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T", [1, 8, 13, 40])
def test_chunked_equals_naive_from_a_nonzero_state(T):
    q, k, v, g, beta = inputs(T, seed=T)
    S0 = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(9))
    o_n, S_n = naive_recurrent_kda_with_state(q, k, v, g, beta, 0.25, S0)
    o_c, S_c = chunk_kda_with_state(q, k, v, g, beta, 0.25, chunk_size=8, initial_state=S0)
    torch.testing.assert_close(o_c, o_n, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(S_c, S_n, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(o_n, naive_recurrent_kda(q, k, v, g, beta, 0.25), atol=1e-3)  # the state matters
