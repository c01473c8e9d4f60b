"""The README's quickstart runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_quickstart_runs(capsys):
  section = README.read_text().split("## Quickstart", 1)[1]
  code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
  exec(compile(code, str(README), "exec"), {})
  assert capsys.readouterr().out.strip() == "0"
