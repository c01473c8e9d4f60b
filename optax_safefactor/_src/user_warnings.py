"""Warnings that point at the line the user wrote.

A warning's ``stacklevel`` counted by hand is right for one way of calling only: the same
``init`` is called by the user, by ``optax.chain``, by ``optax.inject_hyperparams``, by
``nnx.Optimizer`` or under ``jax.jit``, and a preset calls ``safefactor`` for the user.
Pointing into this package or those libraries tells the user nothing (and Python's default
filter shows a warning once per place, so every optimizer built through ``optax.chain``
would share one). :func:`warn` walks past their frames instead.
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import optax

# This package, and the libraries that call its code for the user (flax once imported).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CALLERS = tuple(os.path.dirname(module.__file__) + os.sep for module in (optax, jax))


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """Warn with ``message`` at the first frame outside this package and the libraries that
  call it (optax, JAX, Flax): the line of the user's code that led here.

  >>> import warnings
  >>> with warnings.catch_warnings(record=True) as caught:
  ...   warnings.simplefilter("always")
  ...   warn("a setting has no effect")
  >>> caught[0].filename.startswith("<doctest"), str(caught[0].message)
  (True, 'a setting has no effect')
  """
  flax = sys.modules.get("flax")
  inside = (_PACKAGE, *_CALLERS, *([os.path.dirname(flax.__file__) + os.sep] if flax else []))
  # stacklevel 1 is this function; 2 its caller, the first frame looked at.
  frame, level = sys._getframe(1), 2
  while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level)
