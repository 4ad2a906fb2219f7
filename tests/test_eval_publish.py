"""evaluate_shard and ControlListener: chunking and evaluation semantics, then the real broker.

The broker tests evaluate a real torch model on two ranks and read ``rankwatch.eval-shards`` back;
the control test publishes ``stop_eval`` advice with plain kafka-python mid-evaluation.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICES, consume_json
from kafka import KafkaProducer
from torch.utils.data import TensorDataset

from rankwatch.producers import ControlListener, Evaluator, RankPublisher, evaluate_shard, shard_dataloader
from rankwatch import contract
from rankwatch.contract import Control, EvalShard


class Recorder:
    """Collects what evaluate_shard hands to a publisher (the broker tests below use a real one)."""

    run = "offline"

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size, self.events = rank, world_size, []

    def send(self, event) -> None:
        self.events.append(EvalShard.from_bytes(event.to_bytes()))  # what a consumer would decode


class StopAfter:
    """Advises stopping ``eval_id`` from the ``calls``-th question on."""

    def __init__(self, eval_id: str, calls: int):
        self.eval_id, self.calls, self.asked = eval_id, calls, 0

    def should_stop(self, eval_id: str) -> bool:
        self.asked += 1
        return eval_id == self.eval_id and self.asked >= self.calls


def identity_fn(batch):
    (x,) = batch
    return {"value": x, "double": 2 * x}


def numbers(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n, dtype=torch.float64))


@pytest.mark.parametrize(
    "n, world, rank, chunk, sizes",
    [
        (25, 1, 0, 10, [10, 10, 5]),
        (30, 1, 0, 10, [10, 10, 10]),  # an exact multiple: the third full chunk is the last
        (3, 4, 3, 10, [0]),  # an empty shard still closes with a last chunk
        (22, 2, 1, 4, [4, 4, 3]),
        (7, 1, 0, 100, [7]),
    ],
)
def test_chunks_cover_the_shard_in_order(n, world, rank, chunk, sizes):
    recorder = Recorder(rank, world)
    loader = shard_dataloader(numbers(n), rank, world, batch_size=3)
    result = evaluate_shard(identity_fn, loader, recorder, step=12, chunk_size=chunk)
    events = recorder.events
    assert [len(e.sample_ids) for e in events] == sizes
    assert [e.chunk for e in events] == list(range(len(sizes)))
    assert [e.last for e in events] == [False] * (len(sizes) - 1) + [True]
    assert {(e.eval_id, e.step, e.rank, e.world_size, e.dataset_size) for e in events} == {("step-12", 12, rank, world, n)}
    ids = np.concatenate([e.sample_ids for e in events])
    assert ids.tolist() == list(range(rank, n, world))
    doubled = [e.metrics.get("double", np.zeros(0)) for e in events]  # an empty shard never saw a metric name
    assert np.concatenate(doubled).tolist() == [2.0 * i for i in ids]
    assert result.sample_ids.tolist() == ids.tolist() and result.chunks == len(sizes)
    assert not result.stopped_early and result.n_evaluated == result.shard_size == len(ids)


def test_runs_in_eval_mode_without_grad_and_restores_train_mode():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.5))
    model.train()
    seen = []

    def eval_fn(batch):
        (x,) = batch
        seen.append((torch.is_grad_enabled(), model.training))
        return {"y": model(x).sum(1)}

    loader = shard_dataloader(TensorDataset(torch.randn(9, 3)), 0, 1, batch_size=4)
    evaluate_shard(eval_fn, loader, None, step=0, model=model)
    assert seen == [(False, False)] * 3
    assert model.training  # back to training
    model.eval()
    evaluate_shard(eval_fn, loader, None, step=0, model=model)
    assert not model.training  # and an eval-mode model stays in eval mode


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), (None, torch.float32)])
def test_autocast_on_the_model_device(precision, dtype, device):
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(device)
    x = torch.randn(40, 16, device=device)
    dtypes = set()

    def eval_fn(batch):
        out = model(batch[0])
        dtypes.add(out.dtype)
        return {"score": out[:, 0]}

    result = evaluate_shard(eval_fn, shard_dataloader(TensorDataset(x), 0, 1, batch_size=8), None, step=0,
                            model=model, autocast=precision)
    assert dtypes == {dtype}
    with torch.no_grad():
        exact = model(x)[:, 0].cpu().numpy()
    assert np.allclose(result.metrics["score"], exact, atol=0.05) and result.metrics["score"].dtype == np.float64


def test_unsupported_autocast_falls_back_to_full_precision(caplog):
    dtypes = set()

    def eval_fn(batch):
        out = torch.nn.functional.linear(batch[0], torch.ones(2, 2))
        dtypes.add(out.dtype)
        return {"v": out[:, 0]}

    loader = shard_dataloader(TensorDataset(torch.ones(4, 2)), 0, 1, batch_size=2)
    with caplog.at_level(logging.WARNING):
        result = evaluate_shard(eval_fn, loader, None, step=0, autocast="bf16", device_type="meta")
    assert dtypes == {torch.float32} and result.metrics["v"].tolist() == [2.0] * 4
    assert "full precision" in caplog.text
    with pytest.raises(ValueError, match="autocast"):
        evaluate_shard(eval_fn, loader, None, step=0, autocast="int8")


def test_stop_advice_ends_the_shard_with_a_last_chunk():
    recorder = Recorder(0, 1)
    loader = shard_dataloader(numbers(100), 0, 1, batch_size=10)
    result = evaluate_shard(identity_fn, loader, recorder, step=5, chunk_size=25, control=StopAfter("step-5", 4))
    assert result.stopped_early and result.n_evaluated == 40  # asked after each of 4 batches
    assert [(len(e.sample_ids), e.last) for e in recorder.events] == [(25, False), (15, True)]
    other = evaluate_shard(identity_fn, loader, None, step=6, control=StopAfter("step-5", 1))
    assert not other.stopped_early and other.n_evaluated == 100  # advice for another evaluation


@pytest.mark.parametrize(
    "eval_fn, match",
    [
        (lambda batch: {"mean": batch[0].mean()}, "one value per sample"),
        (lambda batch: {"v": batch[0][:, None]}, "one value per sample"),
        (lambda batch: [batch[0]], "dict"),
    ],
)
def test_eval_fn_must_return_per_sample_values(eval_fn, match):
    loader = shard_dataloader(numbers(8), 0, 1, batch_size=4)
    with pytest.raises((ValueError, TypeError), match=match):
        evaluate_shard(eval_fn, loader, None, step=0)


def test_metric_names_must_not_change_between_batches():
    calls = []

    def eval_fn(batch):
        calls.append(1)
        return {"a" if len(calls) == 1 else "b": batch[0]}

    with pytest.raises(ValueError, match="earlier batches"):
        evaluate_shard(eval_fn, shard_dataloader(numbers(8), 0, 1, batch_size=4), None, step=0)


def test_loader_and_publisher_must_match_the_shard():
    plain = torch.utils.data.DataLoader(numbers(8), batch_size=4)
    with pytest.raises(TypeError, match="shard_dataloader"):
        evaluate_shard(identity_fn, plain, None, step=0)
    with pytest.raises(ValueError, match="rank 1/2"):
        evaluate_shard(identity_fn, shard_dataloader(numbers(8), 0, 2), Recorder(1, 2), step=0)


def test_no_broker_blocks_neither_evaluation_nor_advice():
    listener = ControlListener(run="r", bootstrap="127.0.0.1:1", connect_timeout_s=0.1, max_backoff_s=0.01)
    publisher = RankPublisher(run="r", rank=0, world_size=1, bootstrap="127.0.0.1:1", connect_timeout_s=0.1,
                              drain_s=0)
    try:
        loader = shard_dataloader(numbers(50), 0, 1, batch_size=5)
        result = evaluate_shard(identity_fn, loader, publisher, step=1, chunk_size=10, control=listener)
        assert result.n_evaluated == 50 and not result.stopped_early
        deadline = time.monotonic() + 10
        while listener.errors < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert listener.errors >= 3 and listener.eval_interval() is None  # it kept trying, and said so
        # kafka-python leaks an IO thread per failed consumer unless it is stopped: no thread pile-up
        assert sum(t.name == "kafka-io-rankwatch-control-r" for t in threading.enumerate()) <= 1
    finally:
        listener.close()
        publisher.close(timeout_s=1.0)
    assert not listener._thread.is_alive()


# -- the real broker ---------------------------------------------------------------------------


def _model_and_data(n: int):
    torch.manual_seed(3)
    x, y = torch.randn(n, 6), torch.randint(0, 3, (n,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    return model, TensorDataset(x, y)


@pytest.mark.broker
def test_two_ranks_publish_every_sample_once_with_its_values(bootstrap, run_id):
    n, world, chunk = 103, 2, 10
    model, dataset = _model_and_data(n)

    def eval_fn(batch):
        x, y = batch
        logits = model(x)
        return {"correct": logits.argmax(1) == y, "loss": F.cross_entropy(logits, y, reduction="none")}

    results = []
    for rank in range(world):
        publisher = RankPublisher(run=run_id, rank=rank, world_size=world, bootstrap=bootstrap)
        loader = shard_dataloader(dataset, rank, world, batch_size=8)
        results.append(evaluate_shard(eval_fn, loader, publisher, step=40, model=model, chunk_size=chunk))
        publisher.close()
        assert results[-1].chunks == 6 and publisher.stats().failed == 0

    found = consume_json(bootstrap, contract.EVAL_SHARDS, lambda o: o.get("run") == run_id, count=12)
    shards = [EvalShard.from_bytes(json.dumps(obj).encode()) for obj in found]
    assert len(shards) == 12
    for rank, sizes in ((0, [10] * 5 + [2]), (1, [10] * 5 + [1])):
        mine = sorted((s for s in shards if s.rank == rank), key=lambda s: s.chunk)
        assert [len(s.sample_ids) for s in mine] == sizes
        assert [s.chunk for s in mine] == list(range(6)) and [s.last for s in mine] == [False] * 5 + [True]
        assert {(s.eval_id, s.step, s.world_size, s.dataset_size) for s in mine} == {("step-40", 40, world, n)}

    ids = np.concatenate([s.sample_ids for s in shards])
    assert sorted(ids.tolist()) == list(range(n))  # every sample exactly once across the ranks
    got_correct = np.concatenate([s.metrics["correct"] for s in shards])
    got_loss = np.concatenate([s.metrics["loss"] for s in shards])
    with torch.no_grad():
        logits = model(dataset.tensors[0])
        correct = (logits.argmax(1) == dataset.tensors[1]).double().numpy()
        loss = F.cross_entropy(logits, dataset.tensors[1], reduction="none").double().numpy()
    assert np.array_equal(got_correct, correct[ids]) and np.allclose(got_loss, loss[ids], rtol=1e-6)
    assert 0 < correct.sum() < n  # a real mix of right and wrong answers


@pytest.mark.broker
def test_stop_eval_advice_on_the_broker_stops_evaluation_early(bootstrap, run_id):
    eval_id = "step-7"
    with ControlListener(run=run_id, bootstrap=bootstrap) as listener:
        assert listener.wait_ready(30)
        producer = KafkaProducer(bootstrap_servers=bootstrap)

        def advise() -> None:
            now = time.time()
            # All on one partition, so the real advice arrives after the decoys.
            interval = Control(run=run_id, action="set_eval_interval", eval_id=None, value=12, reason="stable", ts=now)
            partition = producer.send(contract.CONTROL, interval.to_bytes(), key=interval.key).get(10).partition
            decoy = Control(run=run_id + "-other", action="stop_eval", eval_id=eval_id, value=None, reason="x", ts=now)
            producer.send(contract.CONTROL, decoy.to_bytes(), key=decoy.key, partition=partition)
            producer.send(contract.CONTROL, b"not json", partition=partition)
            stop = Control(run=run_id, action="stop_eval", eval_id=eval_id, value=None, reason="ci tight", ts=now)
            producer.send(contract.CONTROL, stop.to_bytes(), key=stop.key)
            producer.flush()

        batches = []

        def eval_fn(batch):
            batches.append(batch)
            if len(batches) == 3:  # mid-evaluation: advise, and wait until the listener has heard it
                advise()
                deadline = time.monotonic() + 30
                while not listener.should_stop(eval_id) and time.monotonic() < deadline:
                    time.sleep(0.02)
            return identity_fn(batch)

        publisher = RankPublisher(run=run_id, rank=0, world_size=1, bootstrap=bootstrap)
        loader = shard_dataloader(numbers(200), 0, 1, batch_size=10)
        result = evaluate_shard(eval_fn, loader, publisher, step=7, chunk_size=25, control=listener)
        publisher.close()
        producer.close()

        assert result.stopped_early and result.n_evaluated == 30 and result.shard_size == 200
        assert listener.received == 2  # the interval and the stop; the other run's and the garbage ignored
        assert listener.latest("stop_eval", eval_id).reason == "ci tight"
        assert listener.eval_interval() == 12
        evaluator = Evaluator(control=listener, interval_bounds=(2, 50))
        assert [s for s in range(40) if evaluator.should_evaluate(step=s)] == [12, 24, 36]

    found = consume_json(bootstrap, contract.EVAL_SHARDS, lambda o: o.get("run") == run_id, count=2)
    assert sorted((o["chunk"], len(o["sample_ids"]), o["last"]) for o in found) == [(0, 25, False), (1, 5, True)]
    assert sorted(i for o in found for i in o["sample_ids"]) == list(range(30))
