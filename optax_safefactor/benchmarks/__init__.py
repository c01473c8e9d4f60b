"""The demo and the benchmarks: command-line programs built on the public API only.

``python -m optax_safefactor`` runs :mod:`.demo`; its subcommands ``bench``,
``bench-rounding`` and ``bench-accumulate`` run :mod:`.bench`, :mod:`.rounding` and
:mod:`.accumulate`. Each also runs as ``python -m optax_safefactor.benchmarks.<name>``.
"""
