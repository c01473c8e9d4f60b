"""The README's code examples run as written."""

import pathlib
import re

import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section_title):
  section = README.read_text().split(section_title, 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_quickstart_runs(capsys):
  exec(compile(_blocks("## Quickstart")[0], str(README), "exec"), {})
  assert capsys.readouterr().out.strip() == "0"


def test_sharding_examples_run():
  namespace = {}
  for block in _blocks("## Sharded training"):
    exec(compile(block, str(README), "exec"), namespace)
  moment = namespace["opt_state"].inner_state.second_moment["w"]
  assert moment.v_row.sharding.spec[0] == "data" and moment.v_col.sharding.spec[1] == "model"
  stacked = {"blocks": {"kernel": jnp.ones((4, 128, 256))}}
  state = namespace["tx"].init(stacked)
  moment = state.inner_state.second_moment["blocks"]["kernel"]
  assert moment.v_row.shape == (4, 128, 1) and moment.v_col.shape == (4, 1, 256)


def test_exactly_two_setup_commands_and_ci_runs_the_test_one():
  commands = re.findall(r"```bash\n(.*?)\n```", README.read_text(), re.DOTALL)
  assert len(commands) == 2
  assert commands[0].endswith("python -m optax_safefactor")
  assert commands[1].endswith("pytest")
  ci = (README.parent / ".ci" / "run").read_text()
  assert commands[1] in ci
