"""``python -m optax_safefactor``: the demo, with the benchmarks as subcommands.

A first argument named in :data:`SUBCOMMANDS` runs that module of
:mod:`optax_safefactor.benchmarks` on the arguments after it; anything else is the demo's
command line.
"""

import importlib
import sys

# Subcommand -> module of optax_safefactor.benchmarks. Imported only when asked for.
SUBCOMMANDS = {"bench": "bench", "bench-rounding": "rounding", "bench-accumulate": "accumulate"}


def _main() -> int:
  name = SUBCOMMANDS.get(sys.argv[1]) if len(sys.argv) > 1 else None
  if name is None:
    from optax_safefactor.benchmarks.demo import main

    return main()
  return importlib.import_module(f"optax_safefactor.benchmarks.{name}").main(sys.argv[2:])


if __name__ == "__main__":
  sys.exit(_main())
