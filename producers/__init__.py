"""Producer side: what a training rank imports.

``RankPublisher`` publishes any metrics without ever blocking training; ``TrainerHook`` attaches to
a torch optimizer and publishes loss, optimisation and system metrics each step. torch is
imported only when ``TrainerHook`` is used, so the publisher works in torch-free processes.
Callbacks for Hugging Face's and Lightning's trainers are in ``rankwatch.producers.adapters``.

Distributed evaluation: ``Evaluator`` decides when to evaluate, ``shard_dataloader`` /
``EvalShardSampler`` / ``shard_indices`` give each rank its slice, ``evaluate_shard`` runs and
streams it, ``ControlListener`` hears the processors' advice. The torch-dependent ones are imported
on first use, like ``TrainerHook``.

Everything is imported on first use: the shipper process (``rankwatch.producers.shipper``) needs none of it,
and it starts beside every training process.
"""

__all__ = [
    "RankPublisher", "PublisherStats", "TrainerHook",
    "Evaluator", "ControlListener", "evaluate_shard", "ShardResult",
    "shard_indices", "EvalShardSampler", "shard_dataloader",
]

_LAZY = {
    "RankPublisher": "rankwatch.producers.publisher",
    "PublisherStats": "rankwatch.producers.publisher",
    "Evaluator": "rankwatch.producers.evaluation",
    "ControlListener": "rankwatch.producers.control",
    "TrainerHook": "rankwatch.producers.torch_hook",
    "evaluate_shard": "rankwatch.producers.eval_run",
    "ShardResult": "rankwatch.producers.eval_run",
    "shard_indices": "rankwatch.producers.sharding",
    "EvalShardSampler": "rankwatch.producers.sharding",
    "shard_dataloader": "rankwatch.producers.sharding",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
