"""A draft loaded from our serving export without its frozen embedding (NaN until filled) decodes exactly like the
in-memory draft: the inference entry points fill the embedding from the target's; when they cannot, they raise
instead of drafting with NaN."""

from __future__ import annotations

import pytest
import torch
from inference_helpers import draft_for_target, make_target
from safetensors.torch import load_file

from lightning_eagle.draft import Eagle3DraftConfig, KimiK3Eagle3Draft, export_draft
from lightning_eagle.inference import (
    DecodingSettings,
    DraftRunner,
    evaluate_acceptance,
    plain_generate,
    speculative_generate,
)
from lightning_eagle.training import ttt_loss
from lightning_eagle.training.shift import shift_target_outputs

K = 3


def token_prompts(n: int, vocab: int, seed: int, length: int = 4) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def train_draft(target, draft, steps: int = 40):
    """A few TTT steps on the target's own greedy continuations, so that the draft gets real acceptances."""
    x = torch.tensor([p + plain_generate(target, p, 20).tokens for p in token_prompts(8, 256, seed=0)])
    captured = target.capture(x, None, [1, 3, 5], return_logits=True)
    ids, loss_mask, logits = shift_target_outputs(x, torch.ones_like(x), captured.logits)
    optimizer = torch.optim.Adam([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    draft.train()
    for _ in range(steps):
        out = ttt_loss(draft, ids, None, loss_mask, captured.aux_hidden_states, logits, ttt_steps=K)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return draft.eval()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(target, in-memory trained draft, its default serving export)``."""
    torch.set_num_threads(1)
    target = make_target(seed=6)
    draft = train_draft(target, draft_for_target(target, draft_vocab_size=72, seed=1))
    folder = export_draft(draft, tmp_path_factory.mktemp("export") / "draft")
    assert "embed_tokens.weight" not in load_file(str(folder / "model.safetensors"))  # the frozen copy is omitted
    return target, draft, folder


def load_without_embedding(folder):
    with pytest.warns(UserWarning, match="no embed_tokens.weight"):
        draft = KimiK3Eagle3Draft.from_pretrained(folder)
    assert bool(draft.embed_tokens.weight.isnan().all())
    return draft


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_generate_fills_the_missing_embedding(trained, temperature):
    target, draft, folder = trained
    loaded = load_without_embedding(folder)
    accepted = 0
    for i, prompt in enumerate(token_prompts(4, 256, seed=1)):
        ref = speculative_generate(target, draft, prompt, 20, K, temperature, seed=i)
        out = speculative_generate(target, loaded, prompt, 20, K, temperature, seed=i)
        assert out.tokens == ref.tokens
        assert out.accepted_per_round == ref.accepted_per_round
        accepted += sum(ref.accepted_per_round)
    assert accepted > 0  # a NaN draft accepts nothing: equality above is not vacuous
    assert torch.equal(loaded.embed_tokens.weight, target.model.embed_tokens.weight)
    assert not loaded.embed_tokens.weight.requires_grad


def test_evaluate_acceptance_fills_the_missing_embedding(trained):
    target, draft, folder = trained
    prompts = token_prompts(4, 256, seed=0)  # the prompts it was trained on: real acceptances
    decoding = DecodingSettings(max_new_tokens=16, num_draft_tokens=K)
    options = {"stop_token_ids": None, "compare_plain": False}
    ref = evaluate_acceptance(target, draft, prompts, decoding, warmup=False, **options)
    report = evaluate_acceptance(target, load_without_embedding(folder), prompts, decoding, **options)  # warm-up fills
    assert report.accepted_per_round == ref.accepted_per_round
    assert report.spec_tokens == ref.spec_tokens
    assert ref.tau > 1.0


def test_draft_runner_needs_the_target_to_fill_it(trained):
    target, draft, folder = trained
    loaded = load_without_embedding(folder)
    with pytest.raises(ValueError, match="embedding is missing"):
        DraftRunner(loaded)
    assert bool(loaded.embed_tokens.weight.isnan().all())
    aux = target.capture(torch.tensor([[5, 9, 11, 3]]), None, [1, 3, 5]).aux_hidden_states
    proposals = []
    for runner in (DraftRunner(draft), DraftRunner(loaded, target)):
        runner.extend(aux, torch.tensor([[9, 11, 3, 7]]))
        proposals.append(runner.propose(K).logits)
    torch.testing.assert_close(proposals[1], proposals[0], rtol=0, atol=0)


def test_an_embedding_that_cannot_be_filled_raises(trained, tmp_path):
    target, _, _ = trained
    # Draft hidden 64 on a 128-wide target: fc fits the target's aux states, the embedding cannot come from it.
    narrow = KimiK3Eagle3Draft(
        Eagle3DraftConfig.from_target_config(
            target.config, hidden_size=64, intermediate_size=64, aux_layer_ids=[1, 3, 5]
        )
    )
    loaded = load_without_embedding(export_draft(narrow, tmp_path / "narrow"))
    with pytest.raises(ValueError, match=r"\(256, 128\).*\(256, 64\)"):
        speculative_generate(target, loaded, [1, 2, 3], 8, K)
    with pytest.raises(ValueError, match=r"\(256, 128\).*\(256, 64\)"):
        evaluate_acceptance(target, loaded, [[1, 2, 3]], DecodingSettings(max_new_tokens=8), stop_token_ids=None)
    # An embedding the draft trained is not the target's: refilling it from the target would be a different draft.
    unfrozen = draft_for_target(target, draft_vocab_size=72, seed=3, freeze_embeddings=False)
    folder = export_draft(unfrozen, tmp_path / "unfrozen", include_embeddings=False)
    with pytest.raises(ValueError, match="freeze_embeddings=False"):
        speculative_generate(target, load_without_embedding(folder), [1, 2, 3], 8, K)


def test_from_pretrained_checks_the_target_embedding_shape(trained):
    target, _, folder = trained
    with pytest.raises(ValueError, match=r"\(256, 64\).*\(256, 128\)"):
        KimiK3Eagle3Draft.from_pretrained(folder, target_embedding=target.model.embed_tokens.weight[:, :64])
