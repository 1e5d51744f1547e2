"""The producer of engine features (``cli.py extract``) against an engine that writes vLLM's files from our own K3
(id 0 = embeddings, id k = output of layer k - 1, id L = the pre-norm final hidden: the mixed stream's numbering):
its shards equal ``cli.py dump``'s, and the K3 stream rules refuse before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eagle_helpers import data_kwargs, eagle_module
from k3_engine import OurK3Engine
from safetensors.torch import load_file

from lightning_eagle import ChatDataModule
from lightning_eagle.features import HiddenStateDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features
from lightning_eagle.features.engine_ids import engine_ids
from lightning_eagle.features.extract import Producer
from lightning_eagle.training.dspark_data import anchor_rows

MODULE = {"target": "quickstart", "aux_layer_ids": [3, 1, 4], "aux_stream": "mixed", "target_dtype": "float32",
          "ttt_steps": 2, "draft": {"intermediate_size": 64}}  # fmt: skip
DATA = data_kwargs(batch_size=4, max_length=96)


def _producer(out: Path, **kw) -> Producer:
    spec = eagle_module(**MODULE).target_spec
    return Producer(spec, ChatDataModule(**DATA), out, dtype="float32", shard_rows=16, log=lambda line: None, **kw)


def test_numbering_and_refusals():
    assert engine_ids([3, 1, 5], 8) == ((2, 4, 6, 8), (1, 0, 2), 3)
    with pytest.raises(ValueError, match=r"lists layer\(s\) \[1\] more than once"):
        engine_ids([1, 1, 5], 8)
    with pytest.raises(ValueError, match=r"layer\(s\) \[8\] are outside the target's 8 layers"):
        engine_ids([1, 8], 8)
    spec = eagle_module(**{**MODULE, "aux_stream": "prefix"}).target_spec
    with pytest.raises(ValueError, match="only the open AttnRes block's partial sum"):
        Producer(spec, ChatDataModule(**DATA), Path("/nonexistent/never-written"))


@pytest.mark.slow
def test_extract_equals_dump(tmp_path):
    storage = tmp_path / "engine"
    storage.mkdir()
    producer = _producer(tmp_path / "extracted")
    producer.run(lambda capture: OurK3Engine(capture.ids, storage), progress_bar=False)
    assert not list(storage.iterdir())  # every engine file read and removed
    trainer_kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    import lightning.pytorch as pl

    dumped = dump_features(eagle_module(**MODULE).target_spec, ChatDataModule(**DATA), tmp_path / "dumped",
                           pl.Trainer(default_root_dir=str(tmp_path), **trainer_kw), dtype="float32",
                           shard_rows=16)  # fmt: skip
    manifest = fmt.read_json(tmp_path / "extracted" / fmt.MANIFEST_NAME)
    assert manifest["engine"]["ids"] == [2, 4, 5, 6] and len(manifest["shards"]) > 1
    for shard in manifest["shards"]:
        ours, theirs = load_file(str(tmp_path / "extracted" / shard["shard"])), load_file(str(dumped / shard["shard"]))
        for name in ("input_ids", "loss_mask", "offsets", "row_ids"):
            assert torch.equal(ours[name], theirs[name]), name
        for name in ("aux_hidden_states", "hidden_states"):
            torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-5)
    # the same folder read whole and streaming (shard by shard) gives every training row once
    whole = HiddenStateDataModule(str(tmp_path / "extracted"), batch_size=4)
    streaming = HiddenStateDataModule(str(tmp_path / "extracted"), batch_size=4, streaming=True)
    for data in (whole, streaming):
        data.setup("fit")
    rows = [r for b in streaming.train_dataloader() for r in b["input_ids"].sum(-1).tolist()]
    assert sorted(rows) == sorted(
        int(whole.train_dataset[i]["input_ids"].sum()) for i in range(len(whole.train_dataset))
    )
    # a DSpark run reads which rows hold an anchor from the shards' masks alone (tests/test_bad_inputs.py)
    masks = [whole.train_dataset[i]["loss_mask"].bool() for i in range(len(whole.train_dataset))]
    assert anchor_rows(whole.train_dataset).tolist() == [bool((m[:-1] & m[1:]).any()) for m in masks]
    # resumed: a finished folder is skipped shard by shard, nothing rewritten
    again = _producer(tmp_path / "extracted")
    assert again.pending == []
    # the stream the engine captured is the stream a draft trains on (and the one its export names)
    prefix = eagle_module(**{**MODULE, "aux_stream": "prefix"}, target_source="features")
    trainer = pl.Trainer(default_root_dir=str(tmp_path), **trainer_kw)
    trainer.datamodule, prefix._trainer = whole, trainer
    with pytest.raises(
        ValueError, match=r"tap layers \[3, 1, 4\] \(mixed stream\), this module trains on \[3, 1, 4\] \(prefix\)"
    ):
        prefix.setup("fit")


def test_streaming_fit_stops_when_the_producer_dies(tmp_path):
    """A reader waiting for a shard the producer will not write stops with the reason and the fix, not a hang."""
    from lightning_eagle.features import plan as features
    from lightning_eagle.features.progress import ProducerHeartbeat

    out = tmp_path / "extracted"
    producer = _producer(out)
    features.start_folder(out, producer.plan, producer.data)
    with pytest.raises(RuntimeError, match="engine gone"), ProducerHeartbeat(out, producer.made.num_shards):
        raise RuntimeError("engine gone")
    data = HiddenStateDataModule(str(out), batch_size=4, streaming=True, producer_timeout=5)
    data.setup("fit")
    with pytest.raises(RuntimeError, match=r"shard-00000.safetensors is not written and the producer .* failed: "
                       r"RuntimeError: engine gone: restart `lightning-eagle extract`"):  # fmt: skip
        data.train_dataset[0]


def _chats(folder: Path, rows: int) -> Path:
    from lightning_eagle.data.synthetic_corpus import bundled_sample_path

    path = folder / "chats.jsonl"
    path.write_text("".join(bundled_sample_path().read_text().splitlines(keepends=True)[:rows]))
    return path


def _extract_words(tmp_path: Path, *more: str) -> list[str]:
    return ["--config", "quickstart", "--model.target.aux_stream", "mixed", "--data.train_files",
            str(_chats(tmp_path, 12)), "--data.max_length", "96", "--trainer.default_root_dir", str(tmp_path / "run"),
            "--out", str(tmp_path / "features"), "--dtype", "float32", "--shard-rows", "4", "--no-progress",
            *more]  # fmt: skip


@pytest.mark.parametrize(
    ("reported", "served", "message"),
    [
        (
            {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": False},
            [],
            r"runs with VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0, this run trains on the 'mixed' stream",
        ),
        (None, [], r"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM is not reported\): start it with VLLM_SERVER_DEV_MODE=1"),
        (None, ["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0"], "runs with VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0"),
        ({"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": True}, [], None),
        (None, ["VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1"], None),
    ],
    ids=["reports-stream-0", "reports-nothing", "declared-stream-0", "reports-stream-1", "declared-stream-1"],
)
def test_cli_extract_from_a_server_checks_its_stream_before_any_request(tmp_path, reported, served, message):
    """``cli.py extract --vllm-url``: the stream the server captures must be the run's (reported at /server_info
    under VLLM_SERVER_DEV_MODE=1, or declared with --served-env), else nothing is asked of it."""
    from k3_engine import FakeVllmServer

    from lightning_eagle.commands.extract import main

    (tmp_path / "engine").mkdir()
    engine = OurK3Engine([2, 4, 5, 6], tmp_path / "engine", version="0.32.0")
    with FakeVllmServer(engine, reported_env=reported) as server:
        declared = [w for item in served for w in ("--served-env", item)]
        words = _extract_words(tmp_path, "--model.target.aux_layer_ids", "[3, 1, 4]", "--vllm-url", server.url,
                               "--concurrency", "2", *declared)  # fmt: skip
        if message is not None:
            with pytest.raises(ValueError, match=message):
                main(words)
            assert server.requests == 0 and not list((tmp_path / "features").glob("shard-*"))
            return
        main(words)
    manifest = fmt.read_json(tmp_path / "features" / fmt.MANIFEST_NAME)
    assert manifest["engine"]["env"] == {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}
    assert manifest["engine"]["ids"] == [2, 4, 5, 6]
    assert server.requests == sum(manifest["rows"].values()) == 9  # one request per row (9 of the 12 chats fit)
    assert not list((tmp_path / "engine").iterdir())  # every file read and removed
    data = HiddenStateDataModule(str(tmp_path / "features"), batch_size=4)
    data.setup("fit")
    assert next(iter(data.train_dataloader()))["aux_hidden_states"].shape[-1] == 3 * 128


def test_cli_extract_refuses_the_prefix_stream_and_prints_the_serve_line(tmp_path, capsys):
    from lightning_eagle.commands.extract import main

    words = ["--config", "quickstart", "--model.target.aux_layer_ids", "[3, 1, 4]",
             "--trainer.default_root_dir", str(tmp_path / "run")]  # fmt: skip
    with pytest.raises(ValueError, match=r"aux_stream 'prefix' extracts with VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0"):
        main([*words, "--vllm-url", "http://127.0.0.1:9"])  # refused before any connection
    main([*words, "--model.target.aux_stream", "mixed", "--print-serve-line", "--vllm-storage", "/data/hs"])
    line = capsys.readouterr().out.strip()
    assert line.startswith("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=1 VLLM_SERVER_DEV_MODE=1 vllm serve ")
    assert '"eagle_aux_hidden_state_layer_ids": [2, 4, 5, 6]' in line and '"shared_storage_path": "/data/hs"' in line
    main([*words, "--print-serve-line", "--final-id-is-output"])  # a vLLM with the fix: stream 0 allowed
    assert capsys.readouterr().out.startswith("VLLM_KIMI_K3_AUX_ATTN_RES_STREAM=0 ")
