"""Print the floor pins of one dependency set in pyproject.toml, one per line.

    python3 .ci/floors.py core          # project.dependencies: jax==0.7.1, ...
    python3 .ci/floors.py flax          # the flax extra: flax==..., orbax-checkpoint==...
    python .ci/floors.py core --check   # in a venv: are these the installed versions?

Each ``name>=X`` becomes ``name==X``, so that the floor .ci/run installs is the one
declared; a requirement without a ``>=`` floor is an error, since it could not be tested.
The package's own extras (``optax-safefactor[...]``) are left out.
"""

import importlib.metadata
import pathlib
import re
import sys
import tomllib


def pins(group: str) -> list[str]:
  project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
  project = project["project"]
  requirements = (project["dependencies"] if group == "core"
                  else project["optional-dependencies"][group])
  result = []
  for requirement in requirements:
    if requirement.startswith("optax-safefactor["):
      continue
    match = re.fullmatch(r"([A-Za-z0-9_.\-]+)>=([0-9][0-9A-Za-z.]*)", requirement)
    if match is None:
      raise SystemExit(f"{group}: {requirement!r} has no plain '>=' floor to install")
    result.append(f"{match[1]}=={match[2]}")
  return result


def _release(version: str) -> tuple[int, ...]:
  numbers = [int(part) for part in version.split(".")]
  while numbers and numbers[-1] == 0:  # 1.26 and 1.26.0 are the same release
    numbers.pop()
  return tuple(numbers)


def check(group: str) -> None:
  """Fail unless each floor of ``group`` is the installed version; print what is installed."""
  wrong = []
  for pin in pins(group):
    name, floor = pin.split("==")
    installed = importlib.metadata.version(name)
    print(f"{name}=={installed}")
    if _release(installed) != _release(floor):
      wrong.append(f"{name} {installed} is installed, the declared floor is {floor}")
  if wrong:
    raise SystemExit("; ".join(wrong))


if __name__ == "__main__":
  if sys.argv[2:] == ["--check"]:
    check(sys.argv[1])
  else:
    print("\n".join(pins(sys.argv[1])))
