"""Incremental K3 inference (prefill / extend / rollback) equals a full forward over the whole sequence."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import make_target

from lightning_eagle.inference import IncrementalTarget

PRESETS = ["k3-tiny", "k3-tiny-no-attnres", "k3-tiny-partial-block", "k3-tiny-trailing-mla"]


def full(model, ids, aux_ids, stream):
    return model.capture(ids, None, aux_ids, stream, return_logits=True)


def run(session, pieces, prefill=True):
    outs = []
    for i, piece in enumerate(pieces):
        if i == 0 and prefill:
            outs.append(session.prefill(piece, return_logits=True))
        else:
            outs.append(session.extend(piece))
    logits = torch.cat([o.logits for o in outs], dim=1)
    aux = torch.cat([o.aux_hidden_states for o in outs], dim=1)
    return logits, aux


def assert_matches(got, ref, start=0):
    logits, aux = got
    torch.testing.assert_close(logits, ref.logits[:, start:], rtol=1e-4, atol=2e-5)
    torch.testing.assert_close(aux, ref.aux_hidden_states[:, start:], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("stream", ["prefix", "mixed"])
def test_extend_pieces_equal_full_forward(preset, stream):
    model = make_target(preset, seed=1)
    L = model.config.num_hidden_layers
    aux_ids = [1, L - 1, L] if stream == "mixed" else [1, 3, L]  # id L = the final norm's input
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(2))
    # A chunked prefill (long enough for the chunked KDA form) then extensions of 1, 3 and 8 tokens.
    cuts = [0, 25, 26, 29, 37]
    pieces = [ids[:, a:b] for a, b in zip(cuts, cuts[1:])]
    session = IncrementalTarget(model, aux_ids, stream, kda_recurrence="auto")
    assert_matches(run(session, pieces), full(model, ids, aux_ids, stream))
    assert session.length == 37


@pytest.mark.parametrize("preset", PRESETS)
def test_rollback_then_extend_equals_full_forward_of_the_kept_sequence(preset):
    model = make_target(preset, seed=2)
    aux_ids = [1, 3, model.config.num_hidden_layers]
    gen = torch.Generator().manual_seed(3)
    prompt, verify, junk_tail, cont = (torch.randint(0, 256, (1, n), generator=gen) for n in (9, 3, 5, 4))
    session = IncrementalTarget(model, aux_ids)
    session.prefill(prompt)
    session.extend(torch.cat([verify, junk_tail], dim=1))  # a verification of 8 tokens; keep only 3
    session.rollback(9 + 5)  # first a partial rollback ...
    session.rollback(9 + 3)  # ... then further back inside the same extension (replayed from its snapshot)
    got = [session.extend(cont[:, :1]), session.extend(cont[:, 1:])]
    kept = torch.cat([prompt, verify, cont], dim=1)
    ref = full(model, kept, aux_ids, "prefix")
    assert_matches(
        (torch.cat([o.logits for o in got], 1), torch.cat([o.aux_hidden_states for o in got], 1)), ref, start=12
    )
    # Rolling back to the very start of a verification (nothing accepted) and continuing is exact too.
    session.extend(junk_tail)
    session.rollback(16)
    again = session.extend(cont[:, :2])
    ref2 = full(model, torch.cat([kept, cont[:, :2]], dim=1), aux_ids, "prefix")
    torch.testing.assert_close(again.logits, ref2.logits[:, 16:], rtol=1e-4, atol=2e-5)


def test_rollback_limits():
    model = make_target(seed=3)
    session = IncrementalTarget(model)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    session.prefill(ids[:, :6])
    with pytest.raises(ValueError, match="cannot roll back"):
        session.rollback(5)  # into the prefill: not rollbackable
    session.extend(ids[:, 6:10])
    session.rollback(8)
    with pytest.raises(ValueError, match="cannot roll back"):
        session.rollback(9)  # forward is not a rollback
    with pytest.raises(ValueError, match="cannot roll back"):
        session.rollback(5)  # before the last extension
    session.rollback(6)
    assert session.length == 6


def test_kda_rollback_replay_is_bit_exact():
    """Replaying the kept tokens from the snapshot reproduces the extension's own states bit for bit, and the
    rolled-back cache agrees with a session that never saw the rejected tokens (to fp32 rounding: its projections
    ran over fewer rows)."""
    model = make_target(seed=4)
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(5))
    a, b = IncrementalTarget(model), IncrementalTarget(model)
    a.prefill(ids[:, :8])
    b.prefill(ids[:, :8])
    a.extend(ids[:, 8:14])
    kda = [c for c in a.caches if hasattr(c, "state")]
    after_six = [(c.state.clone(), [t.clone() for t in c.tails]) for c in kda]
    for c, (state, tails) in zip(kda, after_six):
        c.truncate_extension(6)  # replay all six tokens
        assert torch.equal(c.state, state)
        assert all(torch.equal(x, y) for x, y in zip(c.tails, tails))
    a.rollback(11)
    b.extend(ids[:, 8:11])
    for ca, cb in zip(a.caches, b.caches):
        if hasattr(ca, "state"):
            torch.testing.assert_close(ca.state, cb.state, rtol=1e-4, atol=1e-5)
            for x, y in zip(ca.tails, cb.tails):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
        else:
            assert ca.keys.shape[2] == 11
            torch.testing.assert_close(ca.keys, cb.keys, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(ca.values, cb.values, rtol=1e-4, atol=1e-5)
