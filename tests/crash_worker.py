"""Train with orbax checkpoints every few steps, then die hard mid-run (SIGKILL).

Run by ``tests/test_crash_resume.py``; not a test module itself.
    python tests/crash_worker.py CHECKPOINT_DIR KILL_AT_STEP
"""

import os
import signal
import sys

import orbax.checkpoint as ocp

from tests.crash_problem import SAVE_EVERY, initial, train_step


def main(directory: str, kill_at: int) -> None:
  params, state = initial()
  manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
      save_interval_steps=SAVE_EVERY, max_to_keep=2))
  for step in range(kill_at + 1):
    if step == kill_at:
      os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no final save
    params, state = train_step(params, state, step)
    manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt_state": state}))
    manager.wait_until_finished()


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
