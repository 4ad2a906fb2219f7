"""Producer side: what a training rank imports.

``RankPublisher`` publishes any metrics without ever blocking training; ``TrainerHook`` attaches to
a torch optimizer and publishes loss, grad norm, step time and non-finite flags each step. torch is
imported only when ``TrainerHook`` is used, so the publisher works in torch-free processes.
"""

from producers.publisher import PublisherStats, RankPublisher

__all__ = ["RankPublisher", "PublisherStats", "TrainerHook"]


def __getattr__(name: str):
    if name == "TrainerHook":
        from producers.torch_hook import TrainerHook

        return TrainerHook
    raise AttributeError(name)
