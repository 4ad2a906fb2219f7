"""Hugging Face ``transformers.Trainer`` adapter.

    from rankwatch.producers.adapters.huggingface import RankwatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[RankwatchCallback()])

Per optimizer step (at ``state.global_step``, the step number Trainer logs with): ``loss`` (the
model output's loss, averaged over the step's micro-batches), ``grad_nonfinite``, ``lr``,
``param_norm`` / ``update_ratio``, ``step_time_s``, ``samples_per_s`` / ``tokens_per_s`` (counted
from the model's inputs), ``collective_time_s`` and ``step_skipped`` (from accelerate's optimizer).
Everything Trainer logs (``on_log``: ``grad_norm``, ``learning_rate``, ``epoch``, ``eval_*``, …)
is published too, names unchanged. Trainer clips gradients before the optimizer step, so the
pre-clip ``grad_norm`` comes from Trainer's logs (every ``logging_steps``), not from the hook.
On fast steps ``grad_nonfinite``, ``lr`` and the weight statistics come every few steps (the
hook's stride; ``RankwatchCallback(every=1)`` measures every step).

With ``evaluator=Evaluator(...)`` the callback schedules evaluations: when it fires after a step,
and after the last step (``Evaluator.final``: the final weights), Trainer runs its own evaluation
on its ``eval_dataset`` (which it then needs, as for ``eval_strategy``), and the ``eval_*`` numbers
it logs are published. ``evaluate=fn`` calls ``fn(step)`` instead (e.g. rankwatch's
``evaluate_shard`` over a sharded loader).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from rankwatch.producers.adapters import EvaluationSchedule, batch_size, guarded, publisher_from_env, release
from rankwatch.producers.publisher import RankPublisher
from rankwatch.producers.torch_hook import TrainerHook


class RankwatchCallback(TrainerCallback):
    """Publishes a Trainer's steps and logs. ``hook_options`` go to ``TrainerHook``.

    With no ``publisher``, one is made with ``RankPublisher.from_env()`` when training starts and
    closed when it ends (without ``RANKWATCH_RUN`` the run is ``args.run_name``, else a timestamp);
    a given publisher is flushed at the end and left open. Nothing here ever stops training: a
    failure is logged once and monitoring stops.
    """

    def __init__(self, publisher: RankPublisher | None = None, *, evaluator: Any = None,
                 evaluate: Callable[[int], Any] | None = None, **hook_options: Any):
        self.publisher = publisher
        self.evaluation = EvaluationSchedule(evaluator, evaluate)
        self.hook_options = hook_options
        self.hook: TrainerHook | None = None
        self._owns_publisher = publisher is None
        self._forward_handle = None
        self._loss_seen = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        # The evaluator's first check, before the first update, anchors its schedule. A firing here
        # (``eval_before_train``) runs ``evaluate``; Trainer's own evaluation cannot start at this
        # point (its ``eval_on_start=True`` does that).
        self.evaluation.after_step(state.global_step, int(state.epoch or 0))
        self._start(args, state, model, optimizer)

    @guarded
    def _start(self, args, state, model, optimizer) -> None:
        if self.publisher is None:
            self.publisher = publisher_from_env(args.run_name)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        self.hook = TrainerHook(
            model, inner, self.publisher, start_step=state.global_step + 1, attach=False,
            publish_grad_norm=False, **self.hook_options,
        )
        # The module inside DDP's wrapper: the hook finds the wrapper at the first forward.
        self._forward_handle = model.register_forward_hook(self._on_forward, with_kwargs=True)

    @guarded
    def _on_forward(self, module, args, kwargs, output) -> None:
        if not module.training or self.hook is None:
            return  # evaluation forwards are not training steps
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            return
        self._loss_seen = True
        samples = batch_size([*args, kwargs])
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        tokens = mask.sum() if isinstance(mask, torch.Tensor) else ids.numel() if isinstance(ids, torch.Tensor) else None
        self.hook.set_loss(loss, samples=samples, tokens=tokens)

    @guarded
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.before_step()

    @guarded
    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.hook is not None:
            self.hook.after_step()

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._publish_step(state, optimizer)
        # Trainer stops after this step (max_steps, or a callback said so): the final weights are due.
        last = control.should_training_stop or state.global_step >= state.max_steps
        if self.evaluation.after_step(state.global_step, int(state.epoch or 0), last=last) and self.evaluation.run is None:
            control.should_evaluate = True  # Trainer evaluates right after this event

    @guarded
    def _publish_step(self, state, optimizer) -> None:
        if self.hook is not None:
            skipped = getattr(optimizer, "step_was_skipped", None)
            self.hook.end_step(state.global_step, skipped=None if skipped is None else float(skipped))

    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.publisher is None or not logs:
            return
        # Trainer's "loss" is the mean of the per-step losses already published; the rest goes as is.
        skip = {"loss"} if self._loss_seen else set()
        numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float)) and k not in skip}
        if numbers:
            self.publisher.log(numbers, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self.evaluation.run is not None:  # stopped early without passing through on_step_end's "last"
            self.evaluation.at_end(state.global_step)
        self._end()

    @guarded
    def _end(self) -> None:
        self._switch_off()

    def _switch_off(self) -> None:
        """Let go of the model, the hook and a publisher we made (end of training, or a failure)."""
        if self._forward_handle is not None:
            self._forward_handle.remove()
            self._forward_handle = None
        hook, self.hook = self.hook, None
        publisher = self.publisher
        if self._owns_publisher:
            self.publisher = None
        release(hook, publisher, self._owns_publisher)
