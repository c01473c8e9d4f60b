"""``python -m optax_safefactor``: the demo, with the benchmarks as subcommands.

A first argument named in :data:`SUBCOMMANDS` runs that module of
:mod:`optax_safefactor.benchmarks` on the arguments after it; anything else is the demo's
command line.
"""

import importlib
import os
import sys

from optax_safefactor.benchmarks.common import INTERRUPTED

# Subcommand -> module of optax_safefactor.benchmarks. Imported only when asked for.
SUBCOMMANDS = {"bench": "bench", "bench-rounding": "rounding", "bench-accumulate": "accumulate"}


def _main() -> int:
  name = SUBCOMMANDS.get(sys.argv[1]) if len(sys.argv) > 1 else None
  if name is None:
    from optax_safefactor.benchmarks.demo import main

    return main()
  try:
    return importlib.import_module(f"optax_safefactor.benchmarks.{name}").main(sys.argv[2:])
  except KeyboardInterrupt:
    # Ctrl-C: one line, not a traceback through JAX's compiler; the rows each benchmark
    # printed as it measured them stand.
    print(f"python -m optax_safefactor {sys.argv[1]}: interrupted", file=sys.stderr)
    return INTERRUPTED


if __name__ == "__main__":
  status = _main()
  if status == INTERRUPTED:
    # JAX's threads can still be compiling or running the interrupted step, and tearing
    # the interpreter down under them crashed it (SIGSEGV) in about half the tries.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
  sys.exit(status)
