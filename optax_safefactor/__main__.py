"""``python -m optax_safefactor``: the demo (see ``optax_safefactor.demo``)."""

import sys

from optax_safefactor.demo import main

if __name__ == "__main__":
  sys.exit(main())
