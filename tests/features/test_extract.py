"""The producer of engine features (``cli.py extract``) against an engine that writes vLLM's files from our own K3
(id 0 = embeddings, id k = output of layer k - 1, id L = the pre-norm final hidden: the mixed stream's numbering):
its shards equal ``cli.py dump``'s, and the K3 stream rules refuse before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from eagle_helpers import data_kwargs, eagle_module
from safetensors.torch import load_file, save_file

from lightning_eagle import ChatDataModule
from lightning_eagle.features import HiddenStateDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features
from lightning_eagle.features.engine_client import FeatureEngine
from lightning_eagle.features.engine_ids import engine_ids
from lightning_eagle.features.extract import Producer
from lightning_eagle.k3.model import KimiK3ForCausalLM

MODULE = {"target": "quickstart", "aux_layer_ids": [3, 1, 4], "aux_stream": "mixed", "target_dtype": "float32",
          "ttt_steps": 2, "draft": {"intermediate_size": 64}}  # fmt: skip
DATA = data_kwargs(batch_size=4, max_length=96)


class OurK3Engine(FeatureEngine):
    """vLLM's file contract, computed by our K3 (stream mixed)."""

    def __init__(self, ids, storage: Path) -> None:
        self.ids, self.storage, self.version, self.where = list(ids), storage, "test", "our K3"
        self.env = {"VLLM_KIMI_K3_AUX_ATTN_RES_STREAM": "1"}
        self.model = KimiK3ForCausalLM.from_pretrained("quickstart", dtype=torch.float32)
        self.count = 0

    def capture(self, prompts):
        paths = []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            L = self.model.config.num_hidden_layers
            taps = [i - 1 for i in self.ids if 0 < i < L]
            cap = self.model.capture(ids, aux_layer_ids=taps, aux_stream="mixed", return_prenorm=True)
            H = cap.final_prenorm.shape[-1]
            columns = list(cap.aux_hidden_states[0].reshape(len(prompt), len(taps), H).unbind(1))
            if L in self.ids:
                columns.append(cap.final_prenorm[0])
            path = self.storage / f"req-{self.count}.safetensors"
            self.count += 1
            save_file({"hidden_states": torch.stack(columns, 1).contiguous(), "token_ids": ids[0]}, str(path))
            paths.append(path)
        return paths


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
    # resumed: a finished folder is skipped shard by shard, nothing rewritten
    again = _producer(tmp_path / "extracted")
    assert again.pending == []


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
