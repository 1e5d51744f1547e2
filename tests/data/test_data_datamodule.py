"""ChatDataModule: defaults on the bundled corpus, batches, deterministic split/shuffle, vocab map, resume, CLI."""

from __future__ import annotations

import pytest
import torch

from lightning_eagle.data import ChatDataModule
from lightning_eagle.data.sampler import EpochShuffleSampler

CHAT = {"messages": [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture(scope="module")
def default_dm(tmp_path_factory):
    dm = ChatDataModule(cache_dir=str(tmp_path_factory.mktemp("cache")), draft_vocab_size=96)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_defaults_use_bundled_corpus_and_synthetic_tokenizer(default_dm):
    dm = default_dm
    assert dm.train_files[0].endswith("lightning_eagle/assets/data/synthetic_chat.jsonl")
    assert (dm.vocab_size, dm.bos_token_id, dm.eos_token_id, dm.pad_token_id) == (512, 256, 258, 511)
    assert dm.recovery.name == "kimi_k3"
    summary = dm.summary["train"]
    assert summary["rows_read"] == 400 and summary["rows_kept"] == 400 and summary["rows_bad_skipped"] == 0
    assert dm.summary["split"] == {"train_rows": 380, "val_rows": 20}


def test_batches(default_dm):
    batch = next(iter(default_dm.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert all(t.dtype == torch.long and t.shape == batch["input_ids"].shape for t in batch.values())
    assert batch["input_ids"].shape[0] == default_dm.batch_size
    lengths = batch["attention_mask"].sum(1)
    for row, n in enumerate(lengths.tolist()):
        assert batch["attention_mask"][row, :n].all() and not batch["attention_mask"][row, n:].any()
        assert (batch["input_ids"][row, n:] == 511).all()
        assert batch["loss_mask"][row].sum() > 0
        assert batch["input_ids"][row, n - 1] == 258  # every row ends with <|end_of_msg|> (no generation prompt)
    assert not (batch["loss_mask"].bool() & ~batch["attention_mask"].bool()).any()
    val = next(iter(default_dm.val_dataloader()))
    assert val["input_ids"].shape[0] == default_dm.batch_size


def test_split_is_deterministic_and_disjoint(default_dm, tmp_path):
    train = set(default_dm.train_dataset.indices)
    val = set(default_dm.val_dataset.indices)
    assert not train & val and len(train | val) == 400
    other = ChatDataModule(cache_dir=default_dm.cache_dir, seed=1)
    other.setup()
    assert set(other.val_dataset.indices) != val
    same = ChatDataModule(cache_dir=default_dm.cache_dir)
    same.setup()
    assert set(same.val_dataset.indices) == val and same._train_data.from_cache


def test_shuffle_depends_only_on_seed_and_epoch():
    a, b = EpochShuffleSampler(50, seed=7), EpochShuffleSampler(50, seed=7)
    torch.manual_seed(123)
    first = list(a)
    torch.manual_seed(999)
    assert list(b) == first and sorted(first) == list(range(50))
    second = list(a)  # a plain loop advances the epoch by itself
    assert second != first and second == a.order(1)
    a.set_epoch(0)  # Lightning sets it explicitly (resume restores the epoch)
    assert list(a) == first
    assert list(EpochShuffleSampler(50, seed=8)) != first
    assert list(EpochShuffleSampler(5, seed=7, shuffle=False)) == [0, 1, 2, 3, 4]


def test_repeated_train_dataloader_calls_advance_the_order(default_dm):
    first = [b["input_ids"] for b in default_dm.train_dataloader()]
    again = [b["input_ids"] for b in default_dm.train_dataloader()]
    assert len(first) == len(again) == 48  # 380 rows / 8, last batch partial
    assert not all(torch.equal(x, y) for x, y in zip(first, again))


def test_vocab_mapping_exposed(default_dm):
    mapping = default_dm.vocab_mapping
    assert mapping.draft_vocab_size == 96 and mapping.target_vocab_size == 512
    assert torch.equal(torch.nonzero(mapping.t2d).flatten(), mapping.selected)
    assert torch.equal(torch.arange(96) + mapping.d2t, mapping.selected)
    assert {256, 257, 258, 259, 260, 261, 510, 511} <= set(mapping.selected.tolist())
    # Every token the draft will be asked to predict on the training split is covered here (small vocab).
    assert mapping.coverage == 1.0


def test_vocab_map_cache_reused_and_keyed_on_options(default_dm):
    again = ChatDataModule(cache_dir=default_dm.cache_dir, draft_vocab_size=96)
    again.setup()
    assert again.vocab_mapping.fingerprint == default_dm.vocab_mapping.fingerprint
    assert list(default_dm.cache_dir.rglob("vocab_map_96_*.safetensors"))
    trailer = ChatDataModule(cache_dir=default_dm.cache_dir, draft_vocab_size=96, include_trailer=True)
    trailer.setup()
    assert trailer.vocab_mapping.fingerprint != default_dm.vocab_mapping.fingerprint
    assert trailer._train_data.key != default_dm._train_data.key
    assert trailer.summary["train"]["supervised_tokens"] > default_dm.summary["train"]["supervised_tokens"]


def test_identity_map_by_default(tmp_path, jsonl_writer):
    dm = ChatDataModule(train_files=str(jsonl_writer("a.jsonl", [CHAT] * 3)), cache_dir=str(tmp_path / "c"))
    dm.setup()
    assert dm.vocab_mapping.is_identity and dm.vocab_mapping.d2t.abs().sum() == 0
    assert dm.val_dataset is not None and len(dm.train_dataset) == 2


def test_state_dict_round_trip_and_mismatch(default_dm):
    state = default_dm.state_dict()
    assert state["seed"] == 0 and state["dataset_key"] == default_dm._train_data.key
    default_dm.load_state_dict(state)
    with pytest.raises(ValueError, match="different dataset_key"):
        default_dm.load_state_dict({**state, "dataset_key": "0" * 64})
    with pytest.raises(ValueError, match="different vocab_map_fingerprint"):
        default_dm.load_state_dict({**state, "vocab_map_fingerprint": "f" * 64})
    with pytest.raises(ValueError, match="data seed 5"):
        default_dm.load_state_dict({**state, "seed": 5})


def test_no_recovery_raises(tmp_path, jsonl_writer):
    from lightning_eagle.data.synthetic_tokenizer import byte_ranks
    from lightning_eagle.data.tokenizer import KimiTokenizer
    from lightning_eagle.data.tokenizer_files import save_tokenizer_dir

    plain = KimiTokenizer(byte_ranks(), {0: "[BOS]", 1: "[EOS]", 254: "[UNK]", 255: "[PAD]"})
    directory = save_tokenizer_dir(plain, tmp_path / "plain")
    with pytest.raises(RuntimeError, match="no loss-mask recovery detects tokenizer"):
        ChatDataModule(train_files=str(jsonl_writer("a.jsonl", [CHAT])), tokenizer=str(directory))


def test_option_errors_raise_at_construction(jsonl_writer):
    path = str(jsonl_writer("a.jsonl", [CHAT]))
    with pytest.raises(ValueError, match="thinking_effort"):
        ChatDataModule(train_files=path, thinking_effort="extreme")
    with pytest.raises(ValueError, match="on_bad_row"):
        ChatDataModule(train_files=path, on_bad_row="ignore")
    with pytest.raises(ValueError, match=r"does not support \['include_trailer'\]"):
        ChatDataModule(train_files=path, tokenizer="synthetic-k2", include_trailer=True)
    with pytest.raises(KeyError, match="no loss-mask recovery named 'nope'"):
        ChatDataModule(train_files=path, loss_mask_recovery="nope")


def test_skip_bad_rows_and_explicit_val_files(tmp_path, jsonl_writer, caplog):
    train = jsonl_writer("train.jsonl", [CHAT, {"messages": []}, CHAT])
    val = jsonl_writer("val.jsonl", [CHAT])
    dm = ChatDataModule(train_files=[str(train)], val_files=str(val), on_bad_row="skip", cache_dir=str(tmp_path / "c"))
    with caplog.at_level("WARNING"):
        dm.setup()
    assert dm.summary["train"]["rows_bad_skipped"] == 1 and len(dm.train_dataset) == 2 and len(dm.val_dataset) == 1
    assert "train.jsonl:2: messages: expected a non-empty list" in caplog.text
    strict = ChatDataModule(train_files=[str(train)], cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"train.jsonl:2: messages: expected a non-empty list of messages"):
        strict.setup()


def test_k2_data_through_kimi_recovery(tmp_path, jsonl_writer):
    # Pre-tokenized K2 rows: the "kimi" recovery masks the assistant content.
    from lightning_eagle.data import render_k2_chat, synthetic_k2_tokenizer

    ids = render_k2_chat(CHAT["messages"], synthetic_k2_tokenizer())
    dm = ChatDataModule(
        train_files=str(jsonl_writer("k2.jsonl", [{"input_ids": ids}])),
        tokenizer="synthetic-k2",
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    dm.setup()
    assert dm.recovery.name == "kimi" and dm.eos_token_id == dm.tokenizer.eos_token_id
    row = dm.train_dataset[0]
    assert dm.tokenizer.decode(row["input_ids"][row["loss_mask"] == 1]) == "4"
    # Chat rows with a K2 tokenizer are rendered in the K2 format.
    chat = ChatDataModule(
        train_files=str(jsonl_writer("k2chat.jsonl", [CHAT])),
        tokenizer="synthetic-k2",
        thinking=False,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "c"),
    )
    chat.setup()
    assert chat.train_dataset[0]["input_ids"].tolist() == ids


def test_trainer_fit_and_checkpoint_state(tmp_path, jsonl_writer):
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(512, 8)
            self.head = torch.nn.Linear(8, 512)

        def training_step(self, batch, _):
            logits = self.head(self.embed(batch["input_ids"]))[:, :-1]
            target, gate = batch["input_ids"][:, 1:], batch["loss_mask"][:, :-1].bool()
            return torch.nn.functional.cross_entropy(logits[gate], target[gate])

        def validation_step(self, batch, _):
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = ChatDataModule(
        train_files=str(jsonl_writer("a.jsonl", [CHAT] * 10)), batch_size=2, cache_dir=str(tmp_path / "c")
    )
    trainer = pl.Trainer(
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Tiny(), datamodule=dm)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert ckpt["ChatDataModule"]["dataset_key"] == dm._train_data.key


def test_cli_signature_parses(tmp_path):
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(ChatDataModule, "data")
    cfg = parser.parse_args(
        [
            "--data.train_files=[a.jsonl,b.jsonl]",
            "--data.draft_vocab_size=32000",
            "--data.on_bad_row=skip",
            "--data.thinking_effort=null",
        ]
    )
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"] and cfg.data.draft_vocab_size == 32000
    assert cfg.data.on_bad_row == "skip" and cfg.data.thinking_effort is None
