"""Smoke test of an installed optax_safefactor (the built wheel), run from outside the checkout.

    python .ci/smoke.py README.md

Imports the package as installed (and checks that it is not the checkout's source tree),
takes a few jitted steps, and runs the README's quickstart block as written. Uses only the
package's runtime dependencies: nothing from the test extra.
"""

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax

import optax_safefactor as osf


def main(readme: pathlib.Path) -> None:
  package = pathlib.Path(osf.__file__).resolve().parent
  checkout = readme.resolve().parent
  assert checkout not in package.parents, f"imported the source tree, not the wheel: {package}"
  assert (package / "py.typed").is_file(), "py.typed is missing from the installed package"
  print(f"optax_safefactor {osf.__version__} from {package}")

  # A few steps, one of them non-finite: it is skipped and counted, the params stay finite.
  params = {"w": jnp.full((64, 32), 0.1, jnp.bfloat16), "b": jnp.zeros((32,), jnp.bfloat16)}
  tx = osf.safefactor(learning_rate=1e-2, momentum=0.9)
  state = tx.init(params)
  update = jax.jit(tx.update)
  for step in range(4):
    grads = {name: jnp.full(p.shape, 0.01 * (step + 1), p.dtype) for name, p in params.items()}
    if step == 2:
      grads["w"] = grads["w"].at[0, 0].set(jnp.inf)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
  assert int(osf.skipped_steps(state)) == 1, osf.skipped_steps(state)
  print("4 steps, 1 skipped: ok")

  # The README's quickstart, as written; it prints the number of skipped steps.
  section = readme.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
  block = re.findall(r"```python\n(.*?)```", section, re.DOTALL)[0]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(block, str(readme), "exec"), {})
  assert out.getvalue().strip() == "0", out.getvalue()
  print("README quickstart: ok")

  # The command line answers --help without the demo extra installed.
  help_text = subprocess.run([sys.executable, "-m", "optax_safefactor", "--help"],
                             capture_output=True, text=True, check=True).stdout
  assert "usage:" in help_text, help_text
  print("python -m optax_safefactor --help: ok")
  # Each subcommand too: its module (optax_safefactor.benchmarks) came with the wheel.
  for subcommand in ("bench", "bench-rounding", "bench-accumulate"):
    help_text = subprocess.run([sys.executable, "-m", "optax_safefactor", subcommand, "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert help_text.startswith(f"usage: python -m optax_safefactor {subcommand} "), help_text
  print("python -m optax_safefactor SUBCOMMAND --help: ok")


if __name__ == "__main__":
  main(pathlib.Path(sys.argv[1]))
