"""Offline (dumped features) vs online (target forward) training step on the quickstart, in the same run.

    python benchmarks/offline_step.py            # dumps the quickstart features to a temporary folder first

Reports: dump throughput (tokens/s) and bytes per token (bf16 and fp32) on the tiny target, the median
forward+backward step time of both paths on the same batches and their ratio, and the disk a realistic K3 dump
needs (100k chats × 2k tokens, 3 taps + the final hidden of width 7168 in bf16).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_eagle import ChatDataModule, Eagle3Module
from lightning_eagle.features import HiddenStateDataModule
from lightning_eagle.features import format as fmt
from lightning_eagle.features.dump import dump_features
from lightning_eagle.run_settings import DraftSettings, TargetSettings

TARGET = TargetSettings(path="quickstart", aux_layer_ids=(1, 3, 5), dtype="float32")
DRAFT = DraftSettings(config={"intermediate_size": 256})
DATA = {"tokenizer": "synthetic", "max_length": 256, "batch_size": 8, "thinking_effort": None, "draft_vocab_size": 320}


def _trainer(root: Path) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(root))  # fmt: skip


def _time_steps(module: Eagle3Module, batches: list[dict]) -> float:
    times = []
    for batch in batches:
        module.draft.zero_grad(set_to_none=True)
        start = time.perf_counter()
        module.shared_step(batch).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])  # the first step warms up


def main(steps: int = 12) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.perf_counter()
        spec = Eagle3Module(target=TARGET, draft=DRAFT).target_spec
        out = dump_features(spec, ChatDataModule(**DATA), root / "features", _trainer(root),
                            dtype="bfloat16")  # fmt: skip
        seconds = time.perf_counter() - start
        manifest = fmt.read_json(out / fmt.MANIFEST_NAME)
        print(f"dump: {manifest['tokens']} tokens in {seconds:.1f} s (incl. start-up) = "
              f"{manifest['tokens'] / seconds:.0f} tokens/s; {manifest['bytes_per_token']} bytes/token (bf16), "
              f"{fmt.bytes_per_token(128, 3, 'float32')} (fp32)")  # fmt: skip

        chats = ChatDataModule(**DATA)
        chats.setup("fit")
        online = Eagle3Module(target=TARGET, draft=DRAFT)
        online.configure_model(vocab_mapping=chats.vocab_mapping)
        features = HiddenStateDataModule(str(out), batch_size=DATA["batch_size"])
        features.setup("fit")
        offline = Eagle3Module(target=replace(TARGET, source="features"), draft=DRAFT)
        trainer = _trainer(root)
        trainer.datamodule, offline._trainer = features, trainer
        offline.configure_model(vocab_mapping=features.vocab_mapping)
        online_batches = [b for _, b in zip(range(steps), chats.train_dataloader())]
        offline_batches = [b for _, b in zip(range(steps), features.train_dataloader())]
        t_online, t_offline = _time_steps(online, online_batches), _time_steps(offline, offline_batches)
        print(f"train step (fwd+bwd, batch {DATA['batch_size']}, median of {steps - 1}): "
              f"online {t_online * 1e3:.1f} ms, offline {t_offline * 1e3:.1f} ms -> "
              f"offline is {t_online / t_offline:.2f}x faster")  # fmt: skip
    k3_bytes = fmt.bytes_per_token(7168, 3, "bfloat16")
    tokens = 100_000 * 2048
    print(f"real K3 dump estimate: {k3_bytes} bytes/token x {tokens:.3g} tokens (100k chats x 2k) = "
          f"{tokens * k3_bytes / 1e12:.1f} TB")  # fmt: skip


if __name__ == "__main__":
    main()
