"""The spawn/fork launcher of :class:`~lightning_eagle.parallel.strategy.ExpertParallelStrategy`.

ModelParallelStrategy always re-runs ``sys.argv`` in subprocesses (under pytest that re-runs pytest), so CPU tests and
notebooks use Lightning's ``_MultiProcessingLauncher`` instead, with two changes:

* before any process starts, the strategy validates the LightningModule's target config in the main process, so a
  layout error reaches the caller as its own type (from a worker it would arrive as ``ProcessRaisedException``);
* forked workers run with one intra-op thread: the parent's OpenMP (libgomp) thread pool does not survive ``fork``,
  and the first parallel op in a child (e.g. a ``torch.cat`` of a tokenized dataset) would hang forever;
* at the end of ``fit`` rank 0 ships the trained weights to the main process. Lightning saves
  ``module.state_dict()``, which fails to load back when the draft holds FSDP2 DTensors ("Callable map_location not
  supported with _rebuild_wrapper_subclass"); here every rank first gathers full plain tensors
  (``get_model_state_dict(full_state_dict=True)``, a collective), so a sharded draft comes back too.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn

from lightning_eagle.parallel.dense_shard import has_sharded_trainable_parameters


class _OneThreadAfterFork:
    def __init__(self, function) -> None:
        self.function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch.set_num_threads(1)
        return self.function(*args, **kwargs)


class ExpertParallelLauncher(_MultiProcessingLauncher):
    def launch(self, function, *args: Any, trainer=None, **kwargs: Any) -> Any:
        if trainer is not None and trainer.lightning_module is not None:
            self._strategy.validate_module(trainer.lightning_module)
        if self._start_method == "fork":
            function = _OneThreadAfterFork(function)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer, results: Any) -> _WorkerOutput | None:
        module = trainer.lightning_module
        if not has_sharded_trainable_parameters(module):
            return super()._collect_rank_zero_results(trainer, results)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # Collective: every rank must take part even though only rank 0 keeps the result.
        state_dict = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))
