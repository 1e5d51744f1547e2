"""What training refuses under draft sequence parallelism, with the setting's name (no processes): one check
(``run_settings.check_draft_sequence_parallel``) that the module's ``setup`` and the memory plan both call."""

import lightning.pytorch as pl
import pytest
from eagle_helpers import module_kwargs

from lightning_eagle import Eagle3Module
from lightning_eagle.parallel.strategy import ExpertParallelStrategy
from lightning_eagle.run_settings import DraftSettings, check_draft_sequence_parallel

SETTING = r"trainer.strategy.init_args.draft_sequence_parallel_size=2"
OK = {"num_attention_heads": 4, "draft": DraftSettings(), "target_source": "online", "stage": "fit"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"draft": DraftSettings(shard=True)}, SETTING + " with model.draft.shard=true is not supported"),
        ({"draft": DraftSettings(kv_cache="latent")}, SETTING + " with model.draft.kv_cache='latent'"),
        ({"target_source": "features"}, SETTING + " with model.target.source='features' is not supported"),
        ({"stage": "predict"}, SETTING + " with predict is not supported: predict returns whole-sequence"),
        ({"num_attention_heads": 3}, SETTING + " must divide the draft's num_attention_heads"),
    ],
)
def test_unsupported_combinations_are_refused(change, message):
    check_draft_sequence_parallel(2, **OK)
    check_draft_sequence_parallel(1, **(OK | change))  # without sequence parallelism all of them are fine
    with pytest.raises(ValueError, match=message):
        check_draft_sequence_parallel(2, **(OK | change))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"draft_shard": True}, "model.draft.shard=true"),
        ({"kv_cache": "latent"}, "model.draft.kv_cache='latent'"),
    ],
)
def test_the_module_refuses_them_in_setup_before_any_weight(target_dir, tmp_path, settings, message):
    """The refusals hold in ``fit`` itself, not only in the memory plan (a 2-process fit with the latent cache and
    SP 2 used to crash on both ranks with a reshape error)."""
    module = Eagle3Module(**module_kwargs(target_dir, **settings))
    assert module.placement.draft_sequence_parallel_size == 1 and module.placement.sequence_shard(7) is None
    strategy = ExpertParallelStrategy(draft_sequence_parallel_size=2, start_method="fork")
    module.trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False,
                                default_root_dir=str(tmp_path))  # fmt: skip
    assert module.placement.draft_sequence_parallel_size == 2
    with pytest.raises(ValueError, match=SETTING + " with " + message):
        module.setup("fit")
    assert module.target is None and module.draft is None
