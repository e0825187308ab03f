"""Worker script of tests/test_scheduler.py, run under torchrun: ``dist_job.py MODE PARAMS OUT``.

Modes:
    check     two RL steps; rank 0 writes OUT/check.json with every rank's policy digest, drafter digest and the
              target's digest before and after each drafter sync.
    job       the train-grpo job (rljob.run_job) with a reward that can kill or hang rank 1 at a given step,
              driven by the environment: DIST_KILL_STEP (SIGKILL on the first attempt), DIST_HANG_STEP; and
              DIST_HANG_ROLLOUT_STEP: rank 1's rollout of that step never ends.
    mismatch  rank 1 gets another learning rate (the start-up config check must refuse it).
"""
import json
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from tltlib.rl.grpo import accuracy_reward

MODE, PARAMS, OUT = sys.argv[1], sys.argv[2], Path(sys.argv[3])
RANK = int(os.environ["RANK"])
CALLS = [0]


def faulty_reward(prompts, completions, answer, **columns):
    """accuracy_reward, except that rank 1 dies (or hangs) when computing the rewards of the given step."""
    CALLS[0] += 1
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if RANK == 1 and first_attempt and str(CALLS[0]) == os.environ.get("DIST_KILL_STEP"):
        os.kill(os.getpid(), signal.SIGKILL)
    if RANK == 1 and str(CALLS[0]) == os.environ.get("DIST_HANG_STEP"):
        time.sleep(3600)
    return accuracy_reward(prompts, completions, answer, **columns)


faulty_reward.__name__ = "accuracy_reward"       # the same name in metrics as the plain run


def digest(tensors) -> str:
    import hashlib
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()[:16]


if MODE == "job":
    from tltlib.lab.rljob import run_job
    from tltlib.rl.trainer import GRPOTrainer
    rollout = GRPOTrainer.rollout

    def hanging_rollout(self, problems, clock=None):
        """Rank 1's rollout of step DIST_HANG_ROLLOUT_STEP never ends."""
        if RANK == 1 and str(self.step_count + 1) == os.environ.get("DIST_HANG_ROLLOUT_STEP"):
            time.sleep(3600)
        return rollout(self, problems, clock)

    GRPOTrainer.rollout = hanging_rollout
    run_job(PARAMS, output_dir=OUT, progress=False, reward_funcs=(faulty_reward,), out=open(os.devnull, "w"))
    sys.exit(0)

from tltlib.lab.rljob import build, read_job  # noqa: E402
from tltlib.rl.world import DistributedWorld  # noqa: E402

job = read_job(PARAMS)
if MODE == "mismatch" and RANK == 1:
    job = replace(job, grpo=replace(job.grpo, learning_rate=job.grpo.learning_rate * 2))
world = DistributedWorld("cpu", job.scheduler.hang_timeout_s)
trainer, held = build(job, world=world)
syncs = []
sync = trainer.spot.sync


def checked_sync(steps, version):
    before = trainer.weights_digest()
    sync(steps, version)
    syncs.append({"steps": steps, "target_unchanged": trainer.weights_digest() == before})


trainer.spot.sync = checked_sync
metrics = [trainer.step() for _ in range(2)]
mine = {"rank": RANK, "policy": trainer.weights_digest(),
        "drafter": digest([p for p in trainer.drafter.parameters() if p.requires_grad]),
        "drafter_version": trainer.drafter.version, "syncs": syncs, "buffer_sequences": len(trainer.buffer),
        "problems": [p.prompt for p in trainer.next_problems()]}
every = world.gather_objects(mine)
if RANK == 0:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "check.json").write_text(json.dumps({"ranks": every, "metrics": metrics}, default=float))
world.close()
