"""Offline features with long rows: the dump through the token-chunked target forward (same features as the unchunked
dump), shards cut by a token budget, batches that never pad a short row to a long one, and one chunked TTT step on a
batch of the dump that builds no ``[T,T]`` and no ``[T,V]`` tensor (the plain loss, its twin, does build ``[T,N_d]``:
the same check catches it)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from eagle_helpers import eagle_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_eagle import ChatDataModule, Eagle3Module
from lightning_eagle.data.long_corpus import write_long_corpus
from lightning_eagle.features import HiddenStateDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import FeatureDumper, dump_features
from lightning_eagle.training import ttt_loss
from lightning_eagle.training.shift import shift_left

MODULE = {"target": "quickstart", "aux_layer_ids": [1, 3, 5], "target_dtype": "float32", "ttt_steps": 3,
          "draft": {"intermediate_size": 64}, "attention_backend": "flash_lse"}  # fmt: skip
TOL = {"atol": 1e-4, "rtol": 1e-4}  # fp32; the chunked forward only re-blocks matmuls and the KDA recurrence
LOSS_CHUNK = 512


def _trainer(root: Path) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root))  # fmt: skip


def _chats(corpus: Path, max_length: int) -> ChatDataModule:
    return ChatDataModule(train_files=[str(corpus)], max_length=max_length, batch_size=2, val_fraction=0.25,
                          thinking_effort=None, draft_vocab_size=320, use_cache=False, seed=0)  # fmt: skip


def _dump(corpus: Path, max_length: int, out: Path, **kw) -> Path:
    spec = eagle_module(**MODULE).target_spec
    return dump_features(spec, _chats(corpus, max_length), out, _trainer(out.parent), dtype="float32", **kw)


def _rows(folder: Path) -> list[dict[str, torch.Tensor]]:
    data = HiddenStateDataModule(str(folder))
    data.setup("fit")
    return [part[i] for part in (data.train_dataset, data.val_dataset) for i in range(len(part))]


class LargestTensors(TorchDispatchMode):
    """While active: the most dims of at least ``length`` in any op's output (2 = a ``[T,T]`` tensor), and the most
    rows of a tensor whose last dim is a vocabulary width (``[R, V]`` / ``[R, N_d]``: logits, probabilities)."""

    def __init__(self, length: int, vocab_widths: set[int]) -> None:
        super().__init__()
        self.length, self.widths = length, vocab_widths
        self.long_dims, self.long_shape, self.vocab_rows = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                long_dims = sum(d >= self.length for d in t.shape)
                if long_dims > self.long_dims:
                    self.long_dims, self.long_shape = long_dims, tuple(t.shape)
                if t.shape[-1] in self.widths:
                    self.vocab_rows = max(self.vocab_rows, t.numel() // t.shape[-1])
        return out


def _offline_module(features: Path, data: HiddenStateDataModule) -> Eagle3Module:
    module = eagle_module(**MODULE, target_source="features")
    trainer = _trainer(features.parent)  # the module reads the manifest through trainer.datamodule
    trainer.datamodule, module._trainer = data, trainer
    module.configure_model(vocab_mapping=data.vocab_mapping)
    return module


def _step(module: Eagle3Module, batch: dict, backend: str):
    """One TTT step as ``Eagle3Module.shared_step`` runs it on dumped features (the teacher head's normed final hidden
    and ``lm_head``), with ``backend``; returns the loss, the draft's gradients and the sizes seen."""
    module.draft.zero_grad(set_to_none=True)
    widths = {module.target_spec.config.vocab_size, int(module.draft.selected_token_ids.numel())}
    with LargestTensors(batch["input_ids"].shape[1] - 1, widths) as seen:
        aux, final, lm_head = module.source.features(batch)  # the teacher head's norm of the dumped final hidden
        out = ttt_loss(
            module.draft, shift_left(batch["input_ids"]), batch["attention_mask"], shift_left(batch["loss_mask"]),
            aux, final_hidden=shift_left(final), lm_head_weight=lm_head, ttt_steps=MODULE["ttt_steps"],
            loss_backend=backend, loss_chunk=LOSS_CHUNK,
        )  # fmt: skip
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in module.draft.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, seen


def _check_long_rows(tmp_path: Path, min_tokens: int, max_tokens: int, max_length: int, token_chunk: int):
    corpus = write_long_corpus(tmp_path / "long.jsonl", 4, seed=0, min_tokens=min_tokens, max_tokens=max_tokens)
    budget = 2 * max_tokens  # two rows per shard at most: the 4 rows in >= 2 shards of different sizes
    vocab = eagle_module(**MODULE).target_spec.config.vocab_size
    with LargestTensors(min_tokens, {vocab}) as seen:
        chunked = _dump(corpus, max_length, tmp_path / "chunked", shard_tokens=budget, target_token_chunk=token_chunk)
    # no [T,T] ([C,T] at most) and no [T,V] logits: the dump keeps hidden states only
    assert seen.long_dims == 1 and seen.vocab_rows < min_tokens, (seen.long_shape, seen.vocab_rows)
    with LargestTensors(min_tokens, {vocab}) as seen:
        plain = _dump(corpus, max_length, tmp_path / "plain")
    assert seen.long_dims == 2, seen.long_shape  # the unchunked twin's [T,T] attention: the check above can fail
    other = rf"holds a dump of other features .shard_tokens: {budget} there, {budget + 1} now"
    with pytest.raises(ValueError, match=other):  # resuming needs the same shards
        _dump(corpus, max_length, chunked, shard_tokens=budget + 1)
    manifest = json.loads((chunked / fmt.MANIFEST_NAME).read_text())
    assert manifest["shard_tokens"] == budget and len(manifest["shards"]) >= 2
    assert all(s["tokens"] <= budget for s in manifest["shards"])
    assert len(json.loads((plain / fmt.MANIFEST_NAME).read_text())["shards"]) == 1
    got, want = _rows(chunked), _rows(plain)
    assert len(got) == len(want) == 4 and min(r["input_ids"].numel() for r in got) >= min_tokens
    for i, (a, b) in enumerate(zip(got, want)):
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a[key], b[key]), (i, key)
        for key in ("aux_hidden_states", "hidden_states"):
            torch.testing.assert_close(a[key], b[key], **TOL, msg=f"row {i} {key}")

    single = HiddenStateDataModule(str(chunked), batch_size=1, shuffle=False)
    single.setup("fit")
    one = next(iter(single.train_dataloader()))  # a batch of one row: its states as read, nothing padded
    for key in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states"):
        assert torch.equal(one[key], got[0][key][None]), key

    data = HiddenStateDataModule(str(chunked), batch_size=2, bucket_batches=2)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    lengths = batch["attention_mask"].sum(-1)
    assert int(lengths.min()) >= min_tokens and batch["input_ids"].shape[1] == int(lengths.max())
    module = _offline_module(chunked, data)
    loss, grads, seen = _step(module, batch, "chunked")
    ref_loss, ref_grads, ref_seen = _step(module, batch, "plain")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    B, T = batch["input_ids"].shape
    # chunked: vocabulary-wide tensors of at most one chunk of rows (the teacher's scan: its seq chunk); no [T,T]
    assert seen.vocab_rows <= max(LOSS_CHUNK, module.objective.teacher_seq_chunk), seen.vocab_rows
    assert seen.long_dims <= 1, seen.long_shape
    assert ref_seen.vocab_rows >= B * (T - 1)  # the plain twin's [B,T,N_d]: the check above can fail
    return loss


def test_long_rows_small_dump_chunked_equals_unchunked_and_trains_chunked(tmp_path):
    """The same path at 1K-1.5K-token rows (fast tier)."""
    loss = _check_long_rows(tmp_path, min_tokens=1024, max_tokens=1536, max_length=2048, token_chunk=256)
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_8k_rows_dump_with_token_chunks_at_max_length_16384_and_train_chunked(tmp_path):
    loss = _check_long_rows(tmp_path, min_tokens=8192, max_tokens=8192 + 512, max_length=16384, token_chunk=2048)
    assert torch.isfinite(loss)


def test_shard_bounds_by_rows_and_by_tokens():
    assert fmt.plan_shard_bounds([5] * 7, shard_rows=3) == [0, 3, 6, 7]
    # a row over the budget is a shard of its own; a row that would overflow the current shard starts the next one
    assert fmt.plan_shard_bounds([5, 5, 5, 20, 5], shard_rows=3, shard_tokens=12) == [0, 2, 3, 4, 5]
    assert fmt.plan_shard_bounds([4, 4, 4, 4], shard_rows=3, shard_tokens=100) == [0, 3, 4]
    assert fmt.plan_shard_bounds([], shard_rows=3, shard_tokens=10) == [0, 0]
    manifest = {"shards": [{"rows": 2}, {"rows": 1}, {"rows": 1}, {"rows": 1}]}
    assert fmt.shard_bounds(manifest) == [0, 2, 3, 4, 5]


def test_dump_batches_are_longest_first_within_a_shard():
    dumper = SimpleNamespace(bounds=[0, 6, 8], row_lengths=[100, 9000, 120, 8800, 130, 8900, 7, 9],
                             data=SimpleNamespace(batch_size=2))  # fmt: skip
    dumper.shard_rows_of = lambda k: FeatureDumper.shard_rows_of(dumper, k)
    assert FeatureDumper.shard_batches(dumper, 0) == [[1, 5], [3, 4], [2, 0]]  # never [100, 9000] in one batch
    assert FeatureDumper.shard_batches(dumper, 1) == [[7, 6]]


def test_dump_settings_are_refused_by_name(tmp_path):
    spec = eagle_module(**MODULE).target_spec
    # the target's token chunk is model.target.token_chunk, refused where it is made (tests/test_run_settings.py)
    for name, value in (("shard_tokens", 0), ("shard_rows", 0)):
        kw = {"shard_rows": 4, name: value}
        with pytest.raises(ValueError, match=rf"dump\.{name} must be an integer > 0, got {value}"):
            FeatureDumper(spec, None, tmp_path, dtype="float32", hidden_states="prenorm", **kw)


def test_shard_buffer_in_any_row_order_writes_the_concatenated_shard(tmp_path):
    gen = torch.Generator().manual_seed(0)
    lengths, row_ids = [3, 5, 2], [10, 11, 12]
    rows = [(torch.randint(0, 500, (n,), generator=gen), torch.randint(0, 2, (n,), generator=gen),
             torch.randn(n, 6, generator=gen), torch.randn(n, 2, generator=gen)) for n in lengths]  # fmt: skip
    buffer = fmt.ShardBuffer(row_ids, lengths, torch.bfloat16)
    for i in (2, 0, 1):  # longest-first batches arrive out of row order
        assert not buffer.complete
        buffer.put(row_ids[i], *rows[i])
    with pytest.raises(RuntimeError, match="row 11 has 4 tokens, the dump's plan counted 5"):
        buffer.put(11, *(t[:4] for t in rows[1]))
    ordered = fmt.ShardRows(*([r[j] for r in rows] for j in range(4)), row_ids=row_ids)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    info_a = fmt.write_shard(a, 0, buffer, torch.bfloat16)
    info_b = fmt.write_shard(b, 0, ordered, torch.bfloat16)
    assert info_a == info_b and info_a["rows"] == 3 and info_a["tokens"] == 10  # byte-identical files
    with pytest.raises(RuntimeError, match="shard 1 is written before all its rows arrived"):
        fmt.write_shard(a, 1, fmt.ShardBuffer([0], [4], torch.float32), torch.float32)


def test_dump_command_passes_the_runs_target_token_chunk_and_shard_tokens(tmp_path, monkeypatch):
    from lightning_eagle.commands import dump as dump_command

    calls = []
    monkeypatch.setattr(dump_command, "dump_features", lambda *args, **kw: calls.append((args, kw)))
    monkeypatch.setenv("LIGHTNING_EAGLE_CACHE", str(tmp_path / "cache"))
    config = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
    words = ["--config", str(config), "--trainer.default_root_dir", str(tmp_path), "--trainer.logger", "false"]
    dump_command.main([*words, "--model.target.token_chunk", "4096", "--shard-tokens", "262144"])
    dump_command.main(words)
    (args, kw), (_, default) = calls
    assert kw["target_token_chunk"] == 4096 and kw["shard_tokens"] == 262144 and args[2] == tmp_path / "features"
    assert default["target_token_chunk"] is None and default["shard_tokens"] is None
