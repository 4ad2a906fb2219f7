"""Producer side: what a training rank imports.

``RankPublisher`` publishes any metrics without ever blocking training; ``TrainerHook`` attaches to
a torch optimizer and publishes loss, optimisation and system metrics each step. torch is
imported only when ``TrainerHook`` is used, so the publisher works in torch-free processes.
Callbacks for Hugging Face's and Lightning's trainers are in ``producers.adapters``.

Distributed evaluation: ``Evaluator`` decides when to evaluate, ``shard_dataloader`` /
``EvalShardSampler`` / ``shard_indices`` give each rank its slice, ``evaluate_shard`` runs and
streams it, ``ControlListener`` hears the processors' advice. The torch-dependent ones are imported
on first use, like ``TrainerHook``.

Everything is imported on first use: the shipper process (``producers.shipper``) needs none of it,
and it starts beside every training process.
"""

__all__ = [
    "RankPublisher", "PublisherStats", "TrainerHook",
    "Evaluator", "ControlListener", "evaluate_shard", "ShardResult",
    "shard_indices", "EvalShardSampler", "shard_dataloader",
]

_LAZY = {
    "RankPublisher": "producers.publisher",
    "PublisherStats": "producers.publisher",
    "Evaluator": "producers.evaluation",
    "ControlListener": "producers.control",
    "TrainerHook": "producers.torch_hook",
    "evaluate_shard": "producers.eval_run",
    "ShardResult": "producers.eval_run",
    "shard_indices": "producers.sharding",
    "EvalShardSampler": "producers.sharding",
    "shard_dataloader": "producers.sharding",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
