"""Golden draft (`../shared/golden/draft`, produced by NeMo Automodel 0.7.0 on CPU in fp32): load its export through
the real loader, run the TTT loss on its batch and match losses, counts, prefix hits, logits and every parameter
gradient. The golden README states no draft tolerances; these are fp32 ones (measured: losses ≤ 5e-7 abs, gradients
≤ 1e-5 of each tensor's max magnitude, counts exact).

The import sorts the reference's frequency-ordered draft vocabulary ascending, so draft-vocabulary tensors of the
golden (``lm_head`` gradient rows, logits / teacher columns, argmax ids) are compared after the same permutation.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lightning_eagle.draft import KimiK3Eagle3Draft, TTTCache, export_draft
from lightning_eagle.draft.reference_import import reference_vocab_permutation
from lightning_eagle.training import ttt_loss

LOSS_TOL = {"rtol": 1e-4, "atol": 1e-5}
GRAD_REL_TOL = 1e-4  # max |ours − golden| / max |golden|, per parameter
LOGIT_TOL = {"rtol": 1e-4, "atol": 2e-5}


@pytest.fixture(scope="module")
def golden(golden_dir):
    path = golden_dir / "draft"
    raw = load_file(str(path / "export" / "model-00001-of-00001.safetensors"))
    return {
        "dir": path,
        "batch": load_file(str(path / "batch.safetensors")),
        "expected": load_file(str(path / "expected.safetensors")),
        "perm": reference_vocab_permutation(raw["d2t"], raw["t2d"]),
        "ref_selected": torch.arange(raw["d2t"].numel()) + raw["d2t"],
    }


def run_golden(draft, batch):
    draft.zero_grad(set_to_none=True)
    out = ttt_loss(
        draft,
        batch["input_ids"],
        batch["attention_mask"],
        batch["loss_mask"],
        batch["aux_hidden_states"],
        batch["target_logits"],
        ttt_steps=7,
        return_argmax=True,
    )
    out.loss.backward()
    return out


@pytest.mark.parametrize("backend", ["eager", "flash_lse"])
def test_golden_ttt_loss_counts_and_gradients(golden, backend):
    draft = KimiK3Eagle3Draft.from_pretrained(golden["dir"] / "export", attention_backend=backend)
    batch, exp, perm = golden["batch"], golden["expected"], golden["perm"]
    # The batch's selected ids are the export's map (frequency order); ours is the same set, ascending.
    assert torch.equal(draft.selected_token_ids, torch.sort(batch["selected_token_ids"]).values)
    assert torch.equal(draft.t2d, batch["selected_token_mask"])
    out = run_golden(draft, batch)

    torch.testing.assert_close(out.loss.detach(), exp["loss"][0], **LOSS_TOL)
    torch.testing.assert_close(out.per_step_loss.detach(), exp["per_step_loss"], **LOSS_TOL)
    torch.testing.assert_close(out.step_weights, exp["step_weights"], rtol=1e-6, atol=0)
    assert out.per_step_correct.tolist() == exp["per_step_correct"].long().tolist()
    assert out.per_step_valid.tolist() == exp["per_step_valid"].long().tolist()
    assert out.step_prefix_hits.tolist() == exp["step_prefix_hits"].tolist()
    assert out.step_valid.tolist() == exp["step_valid"].tolist()
    assert int(out.per_step_valid.sum()) == int(exp["valid_tokens"][0])
    torch.testing.assert_close(out.accuracy.float(), exp["accuracy"][0], rtol=1e-6, atol=0)
    torch.testing.assert_close(out.per_step_accuracy.float(), exp["per_step_accuracy"], rtol=1e-6, atol=0)

    params = dict(draft.named_parameters())
    grads = {k[len("grad.") :]: v for k, v in exp.items() if k.startswith("grad.")}
    ours = {n for n, p in params.items() if p.requires_grad}
    mapped = {k.replace("model.layers.0.", "midlayer.").replace("model.", "") for k in grads}
    assert mapped == ours  # every trainable parameter has a golden gradient and vice versa
    for name, expected in grads.items():
        ours_name = name.replace("model.layers.0.", "midlayer.").replace("model.", "")
        if ours_name == "lm_head.weight":
            expected = expected[perm]
        got = params[ours_name].grad
        rel = (got - expected).abs().max() / expected.abs().max()
        assert rel < GRAD_REL_TOL, f"{ours_name}: relative gradient error {rel:.2e}"
    assert params["embed_tokens.weight"].grad is None

    # Positions, teacher and per-step greedy drafts, on real (non-padding) slots.
    real = batch["attention_mask"].bool()
    pos = out.teacher.pos
    for k in range(7):
        shifted = torch.cat([pos[:, k:], torch.zeros_like(pos[:, :k])], dim=1)
        assert torch.equal(shifted.long(), exp["position_mask_per_step"][k]), f"step {k}"
    torch.testing.assert_close(
        out.teacher.probs[real], exp["target_probs_step0"][..., perm][real], rtol=1e-5, atol=1e-7
    )
    ours_tokens = draft.selected_token_ids[out.draft_argmax]
    golden_tokens = golden["ref_selected"][exp["draft_argmax_per_step"]]
    assert torch.equal(ours_tokens[:, real], golden_tokens[:, real])


def test_golden_step0_logits(golden):
    draft = KimiK3Eagle3Draft.from_pretrained(golden["dir"] / "export")
    batch, exp = golden["batch"], golden["expected"]
    with torch.no_grad():
        h = draft.layer(
            batch["input_ids"], draft.project(batch["aux_hidden_states"]), batch["attention_mask"], TTTCache()
        )
        logits = draft.logits(h)
    real = batch["attention_mask"].bool()
    # Padding query rows differ by design: ours attend to key 0 only, the reference's to every real key.
    torch.testing.assert_close(logits[real], exp["draft_logits_step0"][..., golden["perm"]][real], **LOGIT_TOL)


def test_golden_reexport_round_trip(golden, tmp_path):
    draft = KimiK3Eagle3Draft.from_pretrained(golden["dir"] / "export")
    out_dir = export_draft(
        draft, tmp_path / "ours", aux_layer_ids=[1, 3, 4], aux_stream="prefix", include_embeddings=True
    )
    again = KimiK3Eagle3Draft.from_pretrained(out_dir)
    a, b = run_golden(draft, golden["batch"]), run_golden(again, golden["batch"])
    # The parameters are the bit-exact contract. The two drafts' tensors sit at different byte alignments in their
    # safetensors buffers, where BLAS may take other code paths, so loss and gradients agree to fp32 noise only.
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.per_step_loss, a.per_step_loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(draft.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6 * float(p.grad.abs().max()), msg=name)
