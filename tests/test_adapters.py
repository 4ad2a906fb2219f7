"""The trainer adapters publish from real trainers: transformers' Trainer.train() and Lightning's Trainer.fit()."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICES, consume_json
from test_telemetry import read_series

from rankwatch import contract
from rankwatch.producers import RankPublisher

STEPS = 4


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences, a language-modelling dataset made here (nothing is downloaded)."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        mask = torch.ones(16, dtype=torch.long)
        mask[12:] = 0 if i % 2 else 1  # some padding, so tokens != samples x length
        return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.broker
@pytest.mark.parametrize("device", DEVICES)
def test_huggingface_trainer_publishes_every_step_and_its_logs(bootstrap, run_id, tmp_path, device):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from rankwatch.producers.adapters.huggingface import RankwatchCallback

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, logging_steps=2,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", disable_tqdm=True, learning_rate=1e-3,
        max_grad_norm=0.5,
    )
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap)
    trainer = Trainer(model=model, args=args, train_dataset=_Tokens(),
                      callbacks=[RankwatchCallback(publisher, weight_stats_every=1, every=1)])
    trainer.train()
    publisher.close()
    stats = publisher.stats()
    assert (stats.failed, stats.dropped, stats.invalid) == (0, 0, 0)

    got = read_series(bootstrap, run_id, stats.sent)
    steps = list(range(1, STEPS + 1))  # Trainer's global_step after each update
    for metric in ("loss", "lr", "grad_nonfinite", "param_norm", "update_ratio", "step_skipped"):
        assert [s for s, _ in got[(0, metric)]] == steps, metric
    logs = {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}
    assert sorted(logs) == [2, 4]
    per_step = dict(got[(0, "loss")])
    for step, entry in logs.items():
        # Trainer's logged loss is the mean of the per-step losses since its previous log.
        assert entry["loss"] == pytest.approx((per_step[step - 1] + per_step[step]) / 2, rel=1e-5)
        assert dict(got[(0, "grad_norm")])[step] == pytest.approx(entry["grad_norm"], rel=1e-6)  # pre-clip
        assert dict(got[(0, "learning_rate")])[step] == pytest.approx(entry["learning_rate"])
    assert dict(got[(0, "lr")])[1] == pytest.approx(1e-3)
    assert [v for _, v in got[(0, "step_skipped")]] == [0.0] * STEPS
    assert "train_runtime" in {name for _, name in got}  # the final summary log, name unchanged
    times = dict(got[(0, "step_time_s")])
    tokens = dict(got[(0, "tokens_per_s")])
    assert sorted(tokens) == steps[1:]
    # 4 sequences a step, each 16 tokens or 12 (padded); counted from the attention mask.
    assert all(48 <= tokens[s] * times[s] <= 64 for s in tokens)
    assert dict(got[(0, "samples_per_s")]) == pytest.approx({s: 4 / t for s, t in times.items()})


@pytest.mark.broker
@pytest.mark.filterwarnings("ignore:.*LeafSpec")  # raised inside lightning 2.6 under torch 2.13
@pytest.mark.parametrize("device", DEVICES)
def test_lightning_trainer_publishes_every_optimizer_step(bootstrap, run_id, device):
    import lightning.pytorch as L

    from rankwatch.producers.adapters.lightning import RankwatchCallback

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.losses: dict[int, float] = {}
            self.grad_norms: dict[int, float] = {}

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("train_mse", loss)
            self.losses[self.global_step] = loss.item()
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.grad_norms[self.global_step] = torch.nn.utils.get_total_norm(
                [p.grad for p in self.parameters()]).item()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    module = Regression()
    publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap)
    trainer = L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=STEPS, enable_checkpointing=False,
        logger=False, enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=0.01,
        callbacks=[RankwatchCallback(publisher, every=1)],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    publisher.close()
    stats = publisher.stats()
    assert (stats.failed, stats.dropped, stats.invalid) == (0, 0, 0)

    got = read_series(bootstrap, run_id, stats.sent)
    assert dict(got[(0, "loss")]) == pytest.approx(module.losses, rel=1e-6)
    assert dict(got[(0, "train_mse")]) == pytest.approx(module.losses, rel=1e-6)  # self.log values, names unchanged
    # Before clipping (clip value 0.01): the norm the module saw in its own hook.
    assert dict(got[(0, "grad_norm")]) == pytest.approx(module.grad_norms, rel=1e-6)
    assert all(v > 0.01 for v in module.grad_norms.values())
    assert [s for s, _ in got[(0, "param_norm")]] == [0]  # weight_stats_every=10
    assert [v for _, v in got[(0, "lr")]] == [0.1] * STEPS
    times = dict(got[(0, "step_time_s")])
    assert dict(got[(0, "samples_per_s")]) == pytest.approx({s: 8 / t for s, t in times.items()})


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


@pytest.mark.broker
def test_huggingface_trainer_without_a_run_id_trains_to_the_end_under_its_run_name(
        bootstrap, run_id, tmp_path, monkeypatch, caplog):
    from transformers import Trainer, TrainingArguments

    from rankwatch.producers.adapters.huggingface import RankwatchCallback

    monkeypatch.delenv("RANKWATCH_RUN", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("RANKWATCH_BOOTSTRAP", bootstrap)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True, run_name=run_id)
    callback = RankwatchCallback(every=1)
    trainer = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens(), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == STEPS
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("rankwatch")]
    assert len(warnings) == 1 and "RANKWATCH_RUN is not set" in warnings[0] and run_id in warnings[0]
    # Published under the trainer's run name. (Not read_series(…, 1): one poll may bring several batches.)
    batches = consume_json(bootstrap, contract.TELEMETRY, lambda b: b.get("run") == run_id,
                           until=lambda found: any("loss" in b["series"] for b in found))
    assert min(step for b in batches for step in b["series"].get("loss", {}).get("steps", [])) == 1


class _BrokenPublisher:
    """A publisher whose every call fails, as a bug in rankwatch would."""

    def __getattr__(self, name):
        raise RuntimeError(f"rankwatch bug in {name}")


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("trainer", ["huggingface", "lightning"])
def test_a_failing_rankwatch_never_stops_training(trainer, tmp_path, caplog):
    if trainer == "huggingface":
        from transformers import Trainer, TrainingArguments

        from rankwatch.producers.adapters.huggingface import RankwatchCallback

        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS,
                                 report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
        hf = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens(),
                     callbacks=[RankwatchCallback(_BrokenPublisher())])
        hf.train()
        steps = hf.state.global_step
    else:
        import lightning.pytorch as L

        from rankwatch.producers.adapters.lightning import RankwatchCallback

        class Regression(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
        pl = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, enable_checkpointing=False, logger=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[RankwatchCallback(_BrokenPublisher())])
        pl.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8))
        steps = pl.global_step
    assert steps == STEPS
    failures = [r for r in caplog.records if "monitoring is off" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None


@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("trainer", ["huggingface", "lightning"])
@pytest.mark.parametrize(("schedule", "expected"), [
    ({"freq_steps": 3}, [3, 6, 7]),  # the periodic firings, then the final weights (step 7)
    ({"freq_epochs": 1}, [7]),  # one epoch that ends with training: evaluated once, at the end
], ids=["steps", "epochs"])
def test_trainer_callbacks_evaluate_on_the_evaluator_s_schedule_and_the_final_weights(
        trainer, schedule, expected, tmp_path):
    from test_trainers_ddp import RecordingPublisher

    from rankwatch.producers import Evaluator

    evaluator = Evaluator(**schedule)
    if trainer == "huggingface":
        from transformers import Trainer, TrainingArguments

        from rankwatch.producers.adapters.huggingface import RankwatchCallback

        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=7,
                                 per_device_eval_batch_size=16, report_to=[], save_strategy="no", use_cpu=True,
                                 disable_tqdm=True, logging_steps=100)
        publisher = RecordingPublisher()
        hf = Trainer(model=_tiny_gpt2(), args=args, train_dataset=_Tokens(), eval_dataset=_Tokens(),
                     callbacks=[RankwatchCallback(publisher, evaluator=evaluator)])
        hf.train()
        # Trainer's own evaluation ran at those steps, and what it logged was published there.
        assert [e["step"] for e in hf.state.log_history if "eval_loss" in e] == expected
        assert sorted(s for s, point in publisher.points.items() if "eval_loss" in point) == expected
    else:
        import lightning.pytorch as L

        from rankwatch.producers.adapters.lightning import RankwatchCallback

        class Regression(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        evaluated: list[int] = []
        data = torch.utils.data.TensorDataset(torch.randn(56, 8), torch.randn(56, 1))  # 7 steps an epoch
        pl = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, enable_checkpointing=False, logger=False,
                       enable_progress_bar=False, enable_model_summary=False,
                       callbacks=[RankwatchCallback(RecordingPublisher(), evaluator=evaluator,
                                                    evaluate=evaluated.append)])
        pl.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=8))
        assert pl.global_step == 7 and evaluated == expected
    assert evaluator.last_triggers == ("final",)
