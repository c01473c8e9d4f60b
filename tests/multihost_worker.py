"""One process of the multi-host test: 4 CPU devices of a global (2, 4) mesh over gloo.

Run by ``tests/test_multihost.py``; not a test module itself.
    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT OUTPUT.npz
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

import optax_safefactor as osf  # noqa: E402
from tests.sharded_problem import (  # noqa: E402
    POISONED_STEP,
    SPECS,
    STEPS,
    host_arrays,
    make_optimizer,
)


def main(process_id: int, num_processes: int, port: int, output: str) -> None:
  jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
      process_id=process_id, initialization_timeout=60,
  )
  assert jax.device_count() == 8 and jax.local_device_count() == 4
  mesh = jax.make_mesh((2, 4), ("data", "model"))

  def global_array(values, spec):
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])

  params_np, grads_np = host_arrays()
  params = {k: global_array(v, SPECS[k]) for k, v in params_np.items()}
  tx = make_optimizer()
  with jax.set_mesh(mesh):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step in range(STEPS):
      grads = {k: global_array(v[step], SPECS[k]) for k, v in grads_np.items()}
      updates, state = update(grads, state, params)
      params = optax.apply_updates(params, updates)
  gathered = multihost_utils.process_allgather(params, tiled=True)
  # The counter is replicated on every device: read this process's copy.
  skipped = int(osf.skipped_steps(state).addressable_data(0))
  spikes = int(osf.skipped_spikes(state).addressable_data(0))
  if process_id == 0:
    np.savez(output, skipped=skipped, spikes=spikes,
             **{k: saved(np.asarray(v)) for k, v in gathered.items()})
  with open(f"{output}.stop{process_id}.txt", "w") as stop:
    stop.write(_stop_message(mesh, global_array, params_np, grads_np))
  jax.distributed.shutdown()


def saved(array: np.ndarray) -> np.ndarray:
  """``array`` as np.savez keeps it: a bfloat16 array as its bits (uint16)."""
  return array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array


def _stop_message(mesh, global_array, params_np, grads_np) -> str:
  """What this process's jitted step raises with max_consecutive_skips=1 on the poisoned
  step's gradient; last, so that a process that does not stop finds no collective to
  wait in."""
  tx = osf.safefactor(0.05, max_consecutive_skips=1)
  params = {"w": global_array(params_np["w"], SPECS["w"])}
  grads = {"w": global_array(grads_np["w"][POISONED_STEP], SPECS["w"])}
  with jax.set_mesh(mesh):
    try:
      jax.block_until_ready(jax.jit(tx.update)(grads, tx.init(params), params))
    except jax.errors.JaxRuntimeError as error:
      return str(error)
  return "no error"


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
