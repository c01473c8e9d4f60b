"""Two processes with 4 CPU devices each, on one global (2, 4) mesh, equal one process with 8."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import optax_safefactor as osf
from tests.helpers import assert_trees_close
from tests.sharded_problem import NARROW, SPECS, STEPS, host_arrays, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _run_workers(output: pathlib.Path) -> None:
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
  workers = [
      subprocess.Popen(
          [sys.executable, str(ROOT / "tests" / "multihost_worker.py"), str(pid), "2", str(port),
           str(output)],
          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      )
      for pid in range(2)
  ]
  logs = []
  try:
    for worker in workers:
      logs.append(worker.communicate(timeout=TIMEOUT_S)[0])
  except subprocess.TimeoutExpired:
    for worker in workers:
      worker.kill()
    pytest.fail(f"multi-host workers did not finish within {TIMEOUT_S} s")
  finally:
    for worker in workers:
      if worker.poll() is None:
        worker.kill()
  for worker, log in zip(workers, logs, strict=True):
    assert worker.returncode == 0, log[-3000:]


def test_two_processes_equal_one_process_with_eight_devices(tmp_path):
  output = tmp_path / "multihost.npz"
  _run_workers(output)
  result = np.load(output)

  mesh = jax.make_mesh((2, 4), ("data", "model"))
  params_np, grads_np = host_arrays()
  tx = make_optimizer()
  with jax.set_mesh(mesh):
    params = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params_np.items()}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(STEPS):
      grads = {k: jax.device_put(v[step], NamedSharding(mesh, SPECS[k]))
               for k, v in grads_np.items()}
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
  assert int(result["skipped"]) == int(osf.skipped_steps(state)) == 2
  assert int(result["spikes"]) == int(osf.skipped_spikes(state)) == 1
  wide = [k for k in SPECS if k != NARROW]
  assert_trees_close({k: result[k] for k in wide}, {k: np.asarray(params[k]) for k in wide},
                     rtol=1e-6)
  # The stochastic write-back's bits depend on each element's global index, not on the
  # process that holds it: the bfloat16 leaf is the one process's, bit for bit.
  np.testing.assert_array_equal(result[NARROW], np.asarray(params[NARROW]).view(np.uint16))
  # max_consecutive_skips stops every process: its callback ran on one device of the
  # program, so only process 0 raised and process 1 stepped on, to wait in the next
  # collective for ever.
  for pid in range(2):
    stop = pathlib.Path(f"{output}.stop{pid}.txt").read_text()
    assert "NonFiniteStepsError: 1 optimizer step" in stop and "params['w']" in stop, (pid, stop)
