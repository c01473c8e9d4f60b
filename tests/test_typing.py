"""The shipped type hints (``py.typed``) accept what the documentation shows a user doing.

A user's script, written as the README and the guides write their calls, is type-checked
with mypy against the package's own annotations. Hints narrower than the documented
arguments failed there while the calls ran: a dtype object for ``dtype_momentum`` or
``state_dtype`` (the hints said ``str``), an integer array for ``every_k``, ``None`` for
the T5X preset's momentum dtype. optax ships no hints, so its values are not checked here.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

USER_SCRIPT = '''
import jax
import jax.numpy as jnp
import numpy as np
import optax

import optax_safefactor as osf

params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
grads = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}

tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum=jnp.bfloat16)
tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum=np.float16)
tx = osf.safefactor(optax.linear_schedule(0.0, 1e-3, 100), state_dtype=np.dtype("float32"))
tx = osf.safefactor(1e-3, momentum=0.9, dtype_momentum="at_least_float32", state_dtype=None)
rms: optax.GradientTransformation = osf.scale_by_safe_factored_rms(state_dtype="bfloat16")
state = tx.init(params)
updates, state = tx.update(grads, state, params)
params = optax.apply_updates(params, updates)

guarded = osf.skip_nonfinite(optax.sgd(0.1), max_consecutive=10, skip_spikes=6.0)
rounded = osf.with_param_rounding(optax.sgd(0.1), "stochastic", seed=1)
accumulated = osf.accumulate_gradients(tx, every_k=4)
accumulated = osf.accumulate_gradients(tx, every_k=jnp.asarray(4))
accumulated = osf.accumulate_gradients(tx, every_k=lambda step: jnp.where(step < 10, 1, 4))

skipped: jax.Array = osf.skipped_steps(state)
report: dict = osf.nonfinite_report(state)
summary: str = osf.nonfinite_summary(state)

osf.presets.big_vision(1e-3, wd=1e-4, schedule=optax.linear_schedule(1.0, 0.0, 100))
osf.presets.big_vision(1e-3, dtype_momentum=None)
osf.presets.t5x(1e-3, beta1=0.9, dtype_momentum=None)
osf.presets.t5x(1e-3, beta1=0.9, dtype_momentum=jnp.float32)
osf.presets.transformers(lr=1e-3, relative_step=False, scale_parameter=False)
osf.presets.torch(lr=1e-2, weight_decay=1e-2)

migrated = osf.migrate_from_optax(optax.adafactor(1e-3, momentum=0.9).init(params), tx, params)
'''


def test_a_users_script_type_checks_against_the_shipped_hints(tmp_path):
  pytest.importorskip("mypy", reason="mypy (the test extra) is not installed")
  script = tmp_path / "user_script.py"
  script.write_text(textwrap.dedent(USER_SCRIPT))
  # The package is found from the checkout (an editable install hides it from mypy).
  environment = {**os.environ, "MYPYPATH": str(REPO)}
  result = subprocess.run(
      [sys.executable, "-m", "mypy", "--python-executable", sys.executable,
       "--ignore-missing-imports", "--follow-imports=silent", "--no-error-summary",
       "--cache-dir", str(tmp_path / "cache"), str(script)],
      capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=600, check=False)
  assert result.returncode == 0, result.stdout + result.stderr


def test_the_users_script_runs():
  # What it type-checks is what the package takes: the same calls, run.
  exec(compile(textwrap.dedent(USER_SCRIPT), "user_script.py", "exec"), {})
