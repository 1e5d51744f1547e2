"""ExpertParallelStrategy without worker processes: refusals (before any checkpoint file is opened), launcher choice,
sampler, state-dict guard, gradient-averaging hook. The multi-process behaviour is in ``test_parallel_trainer.py``."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from unittest.mock import MagicMock

import lightning as L
import pytest
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch import nn

import lightning_eagle.k3.loader as loader
from lightning_eagle.k3 import KimiK3ForCausalLM, config_from_name
from lightning_eagle.k3.target_spec import TargetSpec
from lightning_eagle.parallel.launcher import ExpertParallelLauncher
from lightning_eagle.parallel.layout import LAYOUT_SETTINGS, RUN_TIME_FACTS, HasTargetSpec, ParallelLayout
from lightning_eagle.parallel.strategy import ExpertParallelStrategy


@pytest.fixture
def opened(monkeypatch):
    """Every safetensors file the loader opens (the loader's only way to read tensor bytes)."""
    calls: list[str] = []
    original = loader.safe_open

    def recording_safe_open(path, *args, **kwargs):
        calls.append(str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(loader, "safe_open", recording_safe_open)
    return calls


def _trainer(strategy, devices=2, **kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=False, **kwargs)


# ---- the layout settings are ParallelLayout's fields ----------------------------------------------------------------


def test_layout_keywords_are_the_layouts_fields():
    """LightningCLI types ``--trainer.strategy.init_args.*`` from the strategy's signature, so the layout settings
    are spelled out there; they must be exactly ParallelLayout's settings: names, order, annotations, defaults."""
    fields = [f for f in dataclasses.fields(ParallelLayout) if f.name not in RUN_TIME_FACTS]
    assert tuple(f.name for f in fields) == LAYOUT_SETTINGS
    params = inspect.signature(ExpertParallelStrategy.__init__).parameters
    layout_params = [p for name, p in params.items() if name in LAYOUT_SETTINGS]
    assert [p.name for p in layout_params] == list(LAYOUT_SETTINGS)
    assert [p.annotation for p in layout_params] == [f.type for f in fields]
    assert [p.default for p in layout_params] == [f.default for f in fields]
    own = {"self", "start_method", "save_distributed_checkpoint", "process_group_backend", "timeout"}
    assert set(params) - set(LAYOUT_SETTINGS) == own  # no layout setting outside ParallelLayout
    assert not set(RUN_TIME_FACTS) & set(params)  # facts are learnt at run time, never configured


def test_every_layout_keyword_reaches_the_layout():
    values = {"expert_parallel_size": 2, "target_dispatcher": "torch", "target_shard_dense": True}
    assert ExpertParallelStrategy(**values).layout == ParallelLayout(**values)


# ---- construction-time refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tensor_parallel_size", "context_parallel_size", "pipeline_parallel_size"])
def test_other_parallelisms_raise_value_error_naming_the_setting(name):
    with pytest.raises(ValueError, match=name):
        ExpertParallelStrategy(expert_parallel_size=2, **{name: 2})


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        ({"sequence_packing": True}, NotImplementedError, "Sequence packing"),
        ({"target_backend": "remote"}, NotImplementedError, "requires target_model_backend='colocated'"),
        ({"p_eagle": True}, NotImplementedError, "Parallel drafting"),
        ({"target_force_hf": True}, ValueError, "target_force_hf"),
        ({"expert_parallel_size": 0}, ValueError, "expert_parallel_size must be a positive int"),
        ({"target_dispatcher": "alltoall"}, ValueError, "target_dispatcher='alltoall' is unknown"),
        ({"start_method": "forkserver"}, ValueError, "start_method='forkserver' is unknown"),
    ],
)
def test_static_refusals_at_construction(kwargs, exc, fragment):
    with pytest.raises(exc, match=fragment):
        ExpertParallelStrategy(**kwargs)


@pytest.mark.parametrize("name", ["deepep", "hybridep"])
def test_gpu_dispatcher_without_its_library_fails_at_construction(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "deep_ep", None)
    with pytest.raises(ImportError, match="`deep_ep` package.*pip install"):
        ExpertParallelStrategy(expert_parallel_size=2, target_dispatcher=name)


def test_top_level_export():
    from lightning_eagle import ExpertParallelStrategy as exported

    assert exported is ExpertParallelStrategy


# ---- Trainer(...)-time refusals: world layout and precision ---------------------------------------------------------


def test_ep_must_divide_the_world_size(opened):
    with pytest.raises(ValueError, match=r"expert_parallel_size \(2\) must divide the world size \(3\)"):
        _trainer(ExpertParallelStrategy(expert_parallel_size=2, start_method="fork"), devices=3)
    assert opened == []


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_plugins_are_refused(precision, opened):
    with pytest.raises(ValueError, match=f"precision='{precision}'.*precision='32-true'"):
        _trainer(ExpertParallelStrategy(expert_parallel_size=2, start_method="fork"), precision=precision)
    assert opened == []


class NamesItsTarget(L.LightningModule):
    """Declares its target (``target_spec``, :class:`HasTargetSpec`) so the strategy can gate it against the layout
    before any process starts."""

    def __init__(self, target_spec: TargetSpec | None):
        super().__init__()
        self.target_spec = target_spec
        self.draft = nn.Linear(2, 2)

    def configure_model(self):
        raise AssertionError("no process may start for an invalid layout")


@pytest.mark.parametrize(
    ("aux_layer_ids", "ep", "devices", "fragment"),
    [
        (None, 3, 3, r"num_experts \(8\) is not divisible by expert_parallel_size \(3\)"),
        ([1, 3, 9], 2, 2, r"aux_layer_ids \[1, 3, 9\] for a 8-layer target"),
    ],
)
def test_target_gates_fire_in_the_main_process_before_any_weight_is_read(
    golden_dir, opened, aux_layer_ids, ep, devices, fragment
):
    """The spec's gates (aux ids) fire when the module declares its target, the layout's (expert count) when the
    strategy launches: both in the main process, before any weight is read."""
    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=ep, start_method="fork"), devices=devices)
    with pytest.raises(ValueError, match=fragment):
        spec = TargetSpec.from_checkpoint(golden_dir / "target", aux_layer_ids=aux_layer_ids)
        trainer.fit(NamesItsTarget(spec))
    assert opened == []


def test_non_k3_target_is_refused_before_any_weight_is_read(tmp_path, opened):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "model.safetensors").write_bytes(b"never read")
    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=2, start_method="fork"))
    with pytest.raises(ValueError, match="not a Kimi K3 model"):
        trainer.strategy.validate_target(str(tmp_path))
    with pytest.raises(ValueError, match="model_type must be 'kimi_linear'.*'llama'"):
        trainer.fit(NamesItsTarget(TargetSpec.from_checkpoint(tmp_path)))
    assert opened == []


def test_only_a_module_that_declares_its_target_is_gated_in_the_main_process():
    """The contract is declared (:class:`HasTargetSpec`), not guessed from attribute names: a module without a
    ``target_spec`` (or with ``None``) is left to :meth:`expert_range`; the layout learns no expert count."""
    strategy = ExpertParallelStrategy(expert_parallel_size=2)
    undeclared = L.LightningModule()
    undeclared.target_path, undeclared.aux_layer_ids = "no/such/dir", [1, 3, 9]  # the old duck-typed names
    assert not isinstance(undeclared, HasTargetSpec)
    strategy.validate_module(undeclared)
    strategy.validate_module(NamesItsTarget(None))
    assert strategy.layout.num_experts is None
    strategy.validate_module(
        NamesItsTarget(TargetSpec.from_config(config_from_name("k3-tiny"), aux_layer_ids=[1, 3, 5]))
    )
    assert strategy.layout.num_experts == 8


def _fake_mesh(ep_size, ep_rank):
    ep = MagicMock()
    ep.size.return_value, ep.get_local_rank.return_value = ep_size, ep_rank
    mesh = MagicMock()
    mesh.__getitem__.side_effect = lambda name: {"expert_parallel": ep}[name]
    return mesh


def test_expert_range_gates_the_expert_count_before_reading_weights(golden_dir, opened):
    """The module's loading path (`load_frozen_target`) asks `expert_range` first: an unsplittable count stops it."""
    from lightning_eagle.parallel.frozen_target import load_frozen_target

    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=3, start_method="fork"), devices=3)
    trainer.strategy._device_mesh = _fake_mesh(3, 0)
    owner = MagicMock(_trainer=trainer)
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by expert_parallel_size \(3\)"):
        load_frozen_target(owner, TargetSpec.from_checkpoint(golden_dir / "target", dtype="float32"))
    assert opened == []


def test_validate_target_accepts_config_objects_and_dicts():
    strategy = _trainer(ExpertParallelStrategy(expert_parallel_size=4, start_method="fork"), devices=4).strategy
    assert strategy.validate_target(config_from_name("k3-tiny")).num_experts == 8
    outer = {"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "num_experts": 6}}
    with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by expert_parallel_size \(4\)"):
        strategy.validate_target(outer)
    with pytest.raises(ValueError, match="no integer num_experts"):
        strategy.validate_target({"model_type": "kimi_linear"})


def test_expert_range_follows_the_mesh():
    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=4, start_method="fork"), devices=8)
    trainer.strategy._device_mesh = _fake_mesh(4, 3)
    assert trainer.strategy.expert_range(896) == (672, 224)


def test_mesh_api_before_setup_is_an_error():
    with pytest.raises(RuntimeError, match="device mesh before processes have initialized"):
        ExpertParallelStrategy(expert_parallel_size=2).ep_rank


# ---- launcher and sampler -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("start_method", "launcher"),
    [("popen", _SubprocessScriptLauncher), ("fork", ExpertParallelLauncher), ("spawn", ExpertParallelLauncher)],
)
def test_launcher_choice(start_method, launcher):
    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=2, start_method=start_method))
    assert type(trainer.strategy.launcher) is launcher
    if launcher is ExpertParallelLauncher:
        assert trainer.strategy.launcher._start_method == start_method


def test_sampler_shards_over_the_whole_world_not_only_data_parallel():
    trainer = _trainer(ExpertParallelStrategy(expert_parallel_size=2, start_method="fork"), devices=4)
    trainer.strategy.cluster_environment.set_global_rank(3)
    # dp = 2, but EP ranks are data-parallel for the draft: 4 replicas
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 4, "rank": 3}


# ---- checkpoints hold only the draft ---------------------------------------------------------------------------------


class WithTarget(L.LightningModule):
    def __init__(self, drop_target: bool):
        super().__init__()
        self.drop_target = drop_target
        self.draft = nn.Linear(4, 4)
        self.target = KimiK3ForCausalLM(config_from_name("k3-tiny-fast", num_hidden_layers=2)).freeze()

    def state_dict(self, *args, **kwargs):
        state = super().state_dict(*args, **kwargs)
        return {k: v for k, v in state.items() if not (self.drop_target and k.startswith("target."))}


def test_state_dict_with_the_target_is_refused():
    strategy = ExpertParallelStrategy()
    strategy.connect(WithTarget(drop_target=False))
    with pytest.raises(RuntimeError, match="frozen-target tensor.*'target.model.embed_tokens.weight'"):
        strategy.lightning_module_state_dict()


def test_state_dict_is_the_modules_own():
    strategy = ExpertParallelStrategy()
    strategy.connect(WithTarget(drop_target=True))
    assert sorted(strategy.lightning_module_state_dict()) == ["draft.bias", "draft.weight"]
    assert strategy.lightning_restore_optimizer  # replicated draft: plain optimizer.state_dict() round trip


# ---- gradient averaging hook ---------------------------------------------------------------------------------------


def test_gradients_are_averaged_after_backward_and_before_the_step(monkeypatch):
    strategy = ExpertParallelStrategy()
    events: list[str] = []
    monkeypatch.setattr(strategy, "reduce_gradients", lambda: events.append("average"))

    def precision_step(optimizer, model, closure, **kwargs):  # Precision.optimizer_step: closure, hooks, step
        closure()
        events.append("clip+step")

    strategy._precision_plugin = MagicMock(optimizer_step=precision_step)
    model = NamesItsTarget(None)
    strategy.optimizer_step(MagicMock(), closure=lambda: events.append("forward+backward"), model=model)
    assert events == ["forward+backward", "average", "clip+step"]
