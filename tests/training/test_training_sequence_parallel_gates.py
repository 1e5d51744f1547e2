"""What ``Eagle3Module`` refuses under draft sequence parallelism, with the setting's name (no processes)."""

import lightning.pytorch as pl
import pytest
from eagle_helpers import module_kwargs

from lightning_eagle import Eagle3Module
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.training.sequence_parallel_unroll import check_sequence_parallel_settings

SETTING = r"trainer.strategy.init_args.draft_sequence_parallel_size=2"
OK = {"num_attention_heads": 4, "draft_shard": False, "target_source": "online", "stage": "fit"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"draft_shard": True}, SETTING + " with model.draft_shard=True is not supported"),
        ({"target_source": "features"}, SETTING + " with model.target_source='features' is not supported"),
        ({"stage": "predict"}, SETTING + ": predict returns whole-sequence"),
        ({"num_attention_heads": 3}, "draft_sequence_parallel_size=2 must divide the draft's num_attention_heads"),
    ],
)
def test_unsupported_combinations_are_refused(change, message):
    check_sequence_parallel_settings(2, **OK)
    check_sequence_parallel_settings(1, **(OK | change))  # without sequence parallelism all of them are fine
    with pytest.raises(ValueError, match=message):
        check_sequence_parallel_settings(2, **(OK | change))


def test_the_module_reads_the_size_from_its_strategy(target_dir, tmp_path):
    module = Eagle3Module(**module_kwargs(target_dir, draft_shard=True))
    assert module._sequence_parallel_size() == 1 and module._sequence_shard(7) == (None, None)
    strategy = ExpertParallelStrategy(draft_sequence_parallel_size=2, start_method="fork")
    module.trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                                default_root_dir=str(tmp_path))  # fmt: skip
    assert module._sequence_parallel_size() == 2
    with pytest.raises(ValueError, match=SETTING + " with model.draft_shard=True"):
        module._check_sequence_parallel("fit")
