"""``python -m optax_safefactor``: the demo; ``python -m optax_safefactor bench``: the benchmark."""

import sys


def _main() -> int:
  if sys.argv[1:2] == ["bench"]:
    from optax_safefactor.bench import main

    return main(sys.argv[2:])
  from optax_safefactor.demo import main

  return main()


if __name__ == "__main__":
  sys.exit(_main())
