"""A training rank that checkpoints, dies and is resumed: a real torch loop using rankwatch's public API.

Run as ``python tests/resume_loop.py RUN BOOTSTRAP CHECKPOINT SAVE_AT LAST STEP_S`` with RANK /
WORLD_SIZE set. It resumes from CHECKPOINT when the file is there (else starts at step 0), saves it
after step SAVE_AT, paces its steps to STEP_S seconds and after step LAST exits. Without a
checkpoint to resume from it dies there (``os._exit``, its publisher never closed, as a killed
process leaves it); resumed, it closes its publisher.
"""

import sys


def main(run: str, bootstrap: str, checkpoint: str, save_at: int, last: int, step_s: float) -> None:
    import os
    import time

    import torch

    from rankwatch.producers import RankPublisher, TrainerHook

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    resumed = os.path.exists(checkpoint)
    start = 0
    if resumed:
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"] + 1
    publisher = RankPublisher(run=run, bootstrap=bootstrap)  # rank and world size from the environment
    hook = TrainerHook(model, opt, publisher, start_step=start)
    x, y = torch.randn(64, 8), torch.randn(64, 1)
    for step in range(start, last + 1):
        began = time.monotonic()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        hook.set_loss(loss)
        opt.step()
        if step == save_at and not resumed:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, checkpoint)
        time.sleep(max(0.0, step_s - (time.monotonic() - began)))
    if not resumed:
        assert publisher.flush(timeout_s=60)  # what it logged is out; only the close is missing
        os._exit(0)
    publisher.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6]))
