"""Up-front refusals: every one fires in the module's constructor, before any target weight is read. (Layout
refusals — tensor/context/pipeline parallel, packing, P-EAGLE, remote targets — belong to the strategy's
``ParallelLayout``: ``tests/parallel/test_parallel_layout.py``.)"""

import json

import pytest
import safetensors
from eagle_helpers import module_kwargs

from lightning_eagle import Eagle3Module


@pytest.fixture
def no_weight_reads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a target weight file was opened")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr("lightning_eagle.k3.loader.safe_open", refuse)


@pytest.mark.parametrize(
    "overrides, exc, fragment",
    [
        ({"aux_layer_ids": [1, 3, 3]}, ValueError, "distinct"),
        ({"aux_layer_ids": None}, ValueError, "pass aux_layer_ids"),
        ({"draft": {"num_key_value_heads": 2}}, ValueError, "one K/V head per query head"),
        ({"draft": {"mla_use_nope": False}}, ValueError, "mla_use_nope"),
        # One source of truth: a module argument repeated inside `draft` is an error naming both spellings.
        (
            {"draft": {"ttt_steps": 4}},
            ValueError,
            "config.ttt_steps: set model.objective.ttt_steps",
        ),
        (
            {"draft": {"aux_layer_ids": [1, 2, 3]}},
            ValueError,
            "config.aux_layer_ids: set model.target.aux_layer_ids",
        ),
        (
            {"draft": {"step_decay": 0.5}},
            ValueError,
            "config.step_decay: set model.objective.step_decay",
        ),
        (
            {"draft": {"aux_stream": "mixed"}},
            ValueError,
            "config.aux_stream: set model.target.aux_stream",
        ),
        (
            {"draft": {"draft_vocab_size": 64}},
            ValueError,
            "config.draft_vocab_size: set data.draft_vocab_size",
        ),
    ],
)
def test_refusals_before_any_weight_is_read(target_dir, no_weight_reads, overrides, exc, fragment):
    with pytest.raises(exc, match=fragment.replace("[", r"\[").replace("(", r"\(")):
        Eagle3Module(**module_kwargs(target_dir, **overrides))


def test_non_k3_target_is_refused(tmp_path, target_dir, no_weight_reads):
    config = json.loads((target_dir / "config.json").read_text())
    config["text_config"]["model_type"] = "deepseek_v3"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="kimi_linear"):
        Eagle3Module(**module_kwargs(tmp_path))


def test_missing_target_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere' does not exist .expected a K3 checkpoint folder"):
        Eagle3Module(**module_kwargs(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        Eagle3Module(**module_kwargs(tmp_path))


def test_ttt_steps_reaches_the_metrics_and_stays_out_of_the_draft_config(target_dir):
    """A training setting: the unroll and its metrics get it, the draft's architecture record does not hold it."""
    module = Eagle3Module(**module_kwargs(target_dir, ttt_steps=4))
    assert module.train_metrics.ttt_steps == module.val_metrics.ttt_steps == 4
    assert "ttt_steps" not in module.draft_config.to_dict() and "step_decay" not in module.draft_config.to_dict()


def test_layout_settings_are_not_module_arguments():
    """One home: a layout setting on the module is an unknown argument, not a second copy of the strategy's."""
    with pytest.raises(TypeError, match="tensor_parallel_size"):
        Eagle3Module(tensor_parallel_size=2)
