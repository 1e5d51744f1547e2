"""One-batch training end to end through Lightning: what is trained, what is checkpointed, resume, research hooks."""

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import data_kwargs, module_kwargs, trainer_kwargs

from lightning_eagle import Eagle3Module
from lightning_eagle.data import ChatDataModule


def _fit(module, tmp_path, **trainer_overrides):
    data = ChatDataModule(**data_kwargs())
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, **trainer_overrides))
    trainer.fit(module, data)
    return trainer, data


def test_one_step_trains_only_the_draft(target_dir, tmp_path):
    grads = {}

    class Probe(Eagle3Module):
        def on_after_backward(self):
            grads.update({n: p.grad is not None for n, p in self.named_parameters()})

    module = Probe(**module_kwargs(target_dir))
    trainer, data = _fit(
        module, tmp_path, max_steps=1, limit_val_batches=1, val_check_interval=1, enable_checkpointing=False
    )
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert grads and all(not g for n, g in grads.items() if n.startswith("target."))
    assert not grads["draft.embed_tokens.weight"]  # frozen copy of the target's embedding
    assert grads["draft.fc.weight"] and grads["draft.midlayer.self_attn.g_proj.weight"]
    torch.testing.assert_close(module.draft.embed_tokens.weight, module.target.model.embed_tokens.weight)
    assert torch.equal(module.draft.selected_token_ids, data.vocab_mapping.selected)
    optimizer = trainer.optimizers[0]
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(module.draft.embed_tokens.weight) not in optimised
    assert all(id(p) not in optimised for p in module.target.parameters())
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    assert 1.0 <= trainer.callback_metrics["val/tau_sim"] <= 1 + module.objective.ttt_steps


def test_checkpoint_holds_only_the_draft_and_resume_matches_uninterrupted(target_dir, tmp_path):
    kw = {"limit_train_batches": 2, "limit_val_batches": 1, "enable_checkpointing": False}
    full = Eagle3Module(**module_kwargs(target_dir))
    _fit(full, tmp_path / "full", max_epochs=2, **kw)

    class StopAfterFirstEpoch(pl.Callback):  # same schedule (max_epochs=2) as the uninterrupted run, then stop
        def on_train_epoch_end(self, trainer, module):
            trainer.should_stop = True

    first = Eagle3Module(**module_kwargs(target_dir))
    trainer, _ = _fit(first, tmp_path / "a", max_epochs=2, callbacks=[StopAfterFirstEpoch()], **kw)
    assert trainer.global_step == 2
    ckpt = tmp_path / "one_epoch.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["state_dict"] and all(k.startswith("draft.") for k in saved["state_dict"])
    assert {"draft.d2t", "draft.t2d"} <= set(saved["state_dict"])
    assert saved["optimizer_states"] and saved["lr_schedulers"]

    resumed = Eagle3Module(**module_kwargs(target_dir))
    data = ChatDataModule(**data_kwargs())
    pl.Trainer(**trainer_kwargs(tmp_path / "b", max_epochs=2, **kw)).fit(resumed, data, ckpt_path=ckpt)
    for (name, a), b in zip(full.draft.state_dict().items(), resumed.draft.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_resume_refuses_a_different_vocab_map(target_dir, tmp_path):
    module = Eagle3Module(**module_kwargs(target_dir))
    trainer, _ = _fit(module, tmp_path, max_steps=1, limit_val_batches=0, enable_checkpointing=False)
    ckpt = tmp_path / "m.ckpt"
    trainer.save_checkpoint(ckpt)
    other = Eagle3Module(**module_kwargs(target_dir))
    data = ChatDataModule(**data_kwargs(draft_vocab_size=300))
    trainer = pl.Trainer(**trainer_kwargs(tmp_path, max_steps=2, limit_val_batches=0))
    with pytest.raises(ValueError, match="vocabulary map"):
        trainer.fit(other, data, ckpt_path=ckpt)


def test_research_hooks_are_used(target_dir, tmp_path):
    calls = {"loss": 0, "weights": 0, "step": 0, "teacher": 0}

    class Research(Eagle3Module):
        def compute_teacher(self, draft, loss_mask, **sources):
            calls["teacher"] += 1
            return super().compute_teacher(draft, loss_mask, **sources)

        def draft_step(self, draft, input_ids, hidden, attention_mask, cache):
            calls["step"] += 1
            return super().draft_step(draft, input_ids, hidden, attention_mask, cache)

        def step_loss(self, logits, target_probs, position_mask):
            calls["loss"] += 1
            return 2.0 * super().step_loss(logits, target_probs, position_mask)

        def step_weights(self, ttt_steps, decay):
            calls["weights"] += 1
            return torch.ones(ttt_steps)

    module = Research(**module_kwargs(target_dir))
    plain = Eagle3Module(**module_kwargs(target_dir))
    data = ChatDataModule(**data_kwargs())
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    for m in (module, plain):
        m.configure_model(vocab_mapping=data.vocab_mapping)
    plain.draft.load_state_dict(module.draft.state_dict())
    out, ref = module.shared_step(batch), plain.shared_step(batch)
    assert calls == {"loss": 3, "weights": 1, "step": 3, "teacher": 1}
    torch.testing.assert_close(out.loss, 2.0 * ref.per_step_loss.mean())


def test_bf16_true_precision_is_refused(target_dir, tmp_path):
    module = Eagle3Module(**module_kwargs(target_dir))
    with pytest.raises(ValueError, match="fp32 parameters and MXFP4 scales"):
        _fit(module, tmp_path, max_steps=1, precision="bf16-true")
