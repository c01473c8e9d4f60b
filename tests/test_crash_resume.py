"""A run killed mid-way and resumed from its last orbax checkpoint continues exactly."""

import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import optax_safefactor as osf
from tests.crash_problem import POISONED_STEPS, TOTAL_STEPS, initial, train_step
from tests.helpers import assert_trees_equal

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Checkpoints are labelled with the number of steps taken and kept every 3 steps: the
# worker saves after 3 and 6 steps, takes steps 7 and 8 unsaved, and dies.
KILL_AT = 8


def test_killed_run_resumes_without_lost_or_doubled_steps(tmp_path):
  directory = tmp_path / "checkpoints"
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  try:
    worker = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "crash_worker.py"), str(directory), str(KILL_AT)],
        env=env, capture_output=True, text=True, timeout=240,
    )
  except subprocess.TimeoutExpired:
    pytest.fail("the crash worker did not die within 240 s")
  assert worker.returncode == -9, worker.stdout[-2000:] + worker.stderr[-2000:]

  manager = ocp.CheckpointManager(directory)
  last = manager.latest_step()
  assert last == 6
  params, state = initial()
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
  restored = manager.restore(last, args=ocp.args.StandardRestore(abstract))
  params, state = restored["params"], restored["opt_state"]
  for step in range(last, TOTAL_STEPS):
    params, state = train_step(params, state, step)

  expected_params, expected_state = initial()
  for step in range(TOTAL_STEPS):
    expected_params, expected_state = train_step(expected_params, expected_state, step)
  assert_trees_equal((params, state), (expected_params, expected_state))
  report = osf.nonfinite_report(state)
  assert report["steps"] == TOTAL_STEPS and report["skipped_steps"] == len(POISONED_STEPS)
  assert int(state.inner_state.count) == TOTAL_STEPS - len(POISONED_STEPS)
  assert np.all(np.isfinite(np.asarray(params["w"])))
