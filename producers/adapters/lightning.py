"""Lightning adapter (``lightning.pytorch``, or the older ``pytorch_lightning`` package).

    from rankwatch.producers.adapters.lightning import RankwatchCallback
    trainer = L.Trainer(callbacks=[RankwatchCallback()])

Per optimizer step: ``loss`` (what ``training_step`` returned, averaged over accumulated
micro-batches), ``grad_norm`` (before clipping: Lightning calls ``on_before_optimizer_step``
first), ``grad_nonfinite``, ``lr``, ``param_norm`` / ``update_ratio``, ``step_time_s``,
``samples_per_s`` (from the batch), ``collective_time_s``, and the step values the module logs
with ``self.log`` (``trainer.callback_metrics``), names unchanged. Only the first optimizer is
watched. On fast steps the gradient statistics, ``lr`` and the weight statistics come every few
steps (the hook's stride; ``RankwatchCallback(every=1)`` measures every step).

With ``evaluator=Evaluator(...)`` and ``evaluate=fn``, ``fn(step)`` runs on every rank when the
evaluator fires after an optimizer step and, at the end of training, for the final weights
(``Evaluator.final``). ``step`` is ``trainer.global_step``: the number of updates the weights have
seen (Lightning counts from 0, so the first update's telemetry is step 0 and its weights step 1).
Lightning cannot start its own validation loop from a callback, hence the function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package, same API
    from pytorch_lightning import Callback

from rankwatch.producers.adapters import EvaluationSchedule, batch_size, guarded, publisher_from_env, release
from rankwatch.producers.publisher import RankPublisher
from rankwatch.producers.torch_hook import TrainerHook


class RankwatchCallback(Callback):
    """Publishes a Lightning Trainer's optimizer steps. ``hook_options`` go to ``TrainerHook``.

    With no ``publisher``, one is made with ``RankPublisher.from_env()`` (rank, world size and
    local rank from the Trainer; without ``RANKWATCH_RUN``, a timestamp run id) when training
    starts and closed when it ends; a given publisher is flushed at the end and left open.
    Nothing here ever stops training: a failure is logged once and monitoring stops.
    """

    def __init__(self, publisher: RankPublisher | None = None, *, evaluator: Any = None,
                 evaluate: Callable[[int], Any] | None = None, **hook_options: Any):
        if evaluator is not None and evaluate is None:
            raise ValueError("evaluator= needs evaluate=fn: fn(step) evaluates the weights after `step` updates")
        self.publisher = publisher
        self.evaluation = EvaluationSchedule(evaluator, evaluate)
        self.hook_options = hook_options
        self.hook: TrainerHook | None = None
        self._owns_publisher = publisher is None
        self._stepped = False
        self._asked_at: int | None = None  # the global step the evaluator was last asked at

    def on_train_start(self, trainer, pl_module) -> None:
        # The evaluator's first check, before the first update: it anchors the schedule there (and
        # fires for ``eval_before_train``).
        self._asked_at = trainer.global_step
        self.evaluation.after_step(trainer.global_step, trainer.current_epoch)
        self._start(trainer, pl_module)

    @guarded
    def _start(self, trainer, pl_module) -> None:
        if self.publisher is None:
            self.publisher = publisher_from_env(
                rank=trainer.global_rank, world_size=trainer.world_size, local_rank=trainer.local_rank
            )
        # Under DDP the strategy's model is the wrapper: the hook times its gradient all-reduce there
        # (Lightning runs ``training_step``, not the module's forward, so the hook could not find it).
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = pl_module
        self.hook = TrainerHook(
            model, trainer.optimizers[0], self.publisher, start_step=trainer.global_step, attach=False,
            **self.hook_options,
        )

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.hook is not None and not self._stepped:
            self.hook.before_step()
            self._stepped = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._publish_batch(trainer, outputs, batch)
        if trainer.global_step != self._asked_at:  # the weights changed: ask (on every rank: it may broadcast)
            self._asked_at = trainer.global_step
            self.evaluation.after_step(trainer.global_step, trainer.current_epoch)

    @guarded
    def _publish_batch(self, trainer, outputs, batch) -> None:
        if self.hook is None:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.hook.set_loss(loss, samples=batch_size(batch))
        if self._stepped:  # the optimizer stepped in this batch (not an accumulation-only batch)
            self._stepped = False
            self.hook.after_step()
            metrics = trainer.callback_metrics
            self.hook.log_stats({k: v for k, v in metrics.items() if isinstance(v, (torch.Tensor, int, float))})
            self.hook.end_step()

    def on_train_end(self, trainer, pl_module) -> None:
        self.evaluation.at_end(trainer.global_step)
        self._end()

    @guarded
    def _end(self) -> None:
        self._switch_off()

    def _switch_off(self) -> None:
        """Let go of the hook and a publisher we made (end of training, or a failure)."""
        hook, self.hook = self.hook, None
        publisher = self.publisher
        if self._owns_publisher:
            self.publisher = None
        release(hook, publisher, self._owns_publisher)
