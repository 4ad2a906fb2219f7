"""rankwatch: a streaming monitor for distributed training, outside the training job, over Kafka.

What a training script imports::

    from rankwatch import RankPublisher, TrainerHook, Evaluator

The package has one subpackage per stage of the data flow: ``rankwatch.producers`` (what a rank
runs), ``rankwatch.stream_processors`` (the Faust workers), ``rankwatch.sinks`` (where alerts and
reports go), and ``rankwatch.contract``, the wire contract they all share.

Names are imported on first use, so ``import rankwatch`` stays cheap in the shipper process that
starts beside every rank, and torch is imported only by what needs it.
"""

__all__ = [
    # A training rank
    "RankPublisher", "PublisherStats", "TrainerHook",
    # Distributed evaluation
    "Evaluator", "ControlListener", "evaluate_shard", "ShardResult",
    "shard_indices", "EvalShardSampler", "shard_dataloader",
    # Reading what the monitor says
    "Alert", "EvalReport", "Rollup", "read_topic",
    # Configuration and errors
    "Settings", "RankwatchError", "SchemaError",
]

_LAZY = {
    "RankPublisher": "rankwatch.producers.publisher",
    "PublisherStats": "rankwatch.producers.publisher",
    "TrainerHook": "rankwatch.producers.torch_hook",
    "Evaluator": "rankwatch.producers.evaluation",
    "ControlListener": "rankwatch.producers.control",
    "evaluate_shard": "rankwatch.producers.eval_run",
    "ShardResult": "rankwatch.producers.eval_run",
    "shard_indices": "rankwatch.producers.sharding",
    "EvalShardSampler": "rankwatch.producers.sharding",
    "shard_dataloader": "rankwatch.producers.sharding",
    "Alert": "rankwatch.contract",
    "EvalReport": "rankwatch.contract",
    "Rollup": "rankwatch.contract",
    "read_topic": "rankwatch.sinks.reader",
    "Settings": "rankwatch.settings",
    "RankwatchError": "rankwatch.errors",
    "SchemaError": "rankwatch.errors",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rankwatch' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
