"""A training rank for the end-to-end tests: a real torch loop using only rankwatch's public API.

Run as ``python tests/rank_loop.py RUN BOOTSTRAP STEPS NAN_STEP`` with RANK / WORLD_SIZE set.
"""

import sys


def main(run: str, bootstrap: str, steps: int, nan_step: int) -> None:
    import os

    import torch

    from rankwatch.producers import RankPublisher, TrainerHook

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    publisher = RankPublisher(run=run, bootstrap=bootstrap)  # rank and world size from the environment
    hook = TrainerHook(model, opt, publisher)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(steps):
        xb = x.clone()
        if step == nan_step and int(os.environ["RANK"]) == int(os.environ.get("NAN_RANK", 0)):
            xb[0, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(xb), y)
        opt.zero_grad()
        loss.backward()
        hook.set_loss(loss)
        opt.step()
    publisher.close()
    assert publisher.stats().failed == 0, publisher.stats()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
