"""Frozen dataclasses of arrays and static fields, as pytrees that Flax's msgpack also saves.

The counters' :class:`LeafCounts` and :class:`HyperparamCounts` keep arrays and a static
part (the params' structure, the hyperparameters' names). JAX, and so orbax and pickle,
sees them through :func:`register`'s pytree registration. ``flax.serialization``
(``to_bytes``, ``to_state_dict``, ``flax.training.checkpoints``) does not walk pytrees: it
saves only the types in its own registry and fails on any other object, so each class is
registered there too, as a dict of its array fields; the static part comes back from the
restore's target, as a namedtuple's field names do.

Flax is optional and slow to import, so this module never imports it: the classes are
registered at once if ``flax.serialization`` is loaded, else by a finder on
``sys.meta_path`` when it first is. The finder only watches that one name; it wraps the
import's loader, so the module is loaded as it would be without it, and it leaves
``sys.meta_path`` once the classes are registered.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import jax

_FLAX_SERIALIZATION = "flax.serialization"

# Every registered class and its array fields, for flax.serialization whenever it loads.
_ARRAY_FIELDS: dict[type, tuple[str, ...]] = {}


# Per registered class, what its arrays' length counts in a given instance (the params'
# leaves, say), for the error when a saved array does not fit the restore's target.
_DESCRIBE: dict[type, Callable[[Any], str]] = {}


def register(cls: type, array_fields: tuple[str, ...],
             describe: Callable[[Any], str] | None = None) -> None:
  """Registers the frozen dataclass ``cls``: ``array_fields`` are its pytree's children, its
  other fields static (compared, not traced), and Flax's state dict is its array fields.
  ``describe(instance)`` says what the instance's arrays count, for a restore's errors."""
  static_fields = [field.name for field in dataclasses.fields(cls)
                   if field.name not in array_fields]
  jax.tree_util.register_dataclass(cls, data_fields=list(array_fields),
                                   meta_fields=static_fields)
  _ARRAY_FIELDS[cls] = tuple(array_fields)
  if describe is not None:
    _DESCRIBE[cls] = describe
  serialization = sys.modules.get(_FLAX_SERIALIZATION)
  if serialization is not None:
    _register_with_flax(serialization)
  elif not any(isinstance(finder, _RegisterOnImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterOnImport())


def _register_with_flax(serialization: ModuleType) -> None:
  # A class already in flax's registry keeps its handler (one a user added, say).
  for cls, array_fields in _ARRAY_FIELDS.items():
    if not serialization.is_serializable(cls):
      serialization.register_serialization_state(
          cls, _to_state_dict(serialization, array_fields),
          _from_state_dict(serialization, array_fields))


def _to_state_dict(serialization: ModuleType,
                   array_fields: tuple[str, ...]) -> Callable[[Any], dict[str, Any]]:
  def to_state_dict(instance: Any) -> dict[str, Any]:
    return {name: serialization.to_state_dict(getattr(instance, name)) for name in array_fields}

  return to_state_dict


def _from_state_dict(serialization: ModuleType,
                     array_fields: tuple[str, ...]) -> Callable[[Any, dict[str, Any]], Any]:
  def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
    if set(state) != set(array_fields):
      raise ValueError(
          f"a {type(target).__name__} restores from the fields {sorted(array_fields)}, but "
          f"the state dict has {sorted(state)} at path {serialization.current_path()}")
    for name in array_fields:
      _check_shape(target, name, state[name], serialization.current_path())
    return dataclasses.replace(target, **{
        name: serialization.from_state_dict(getattr(target, name), state[name], name=name)
        for name in array_fields})

  return from_state_dict


def _check_shape(target: Any, name: str, saved: Any, path: str) -> None:
  """A saved array must have its target's shape: flax returns a restored array as it was
  saved, and drops the dict keys its target lacks, so counts saved for a param since
  removed came back one too many under the target's names, and the reports failed on
  ``zip()`` far from the restore."""
  expected = getattr(getattr(target, name), "shape", None)
  found = getattr(saved, "shape", None)
  if expected is None or found is None or tuple(expected) == tuple(found):
    return
  describe = _DESCRIBE.get(type(target))
  counted = f" ({describe(target)})" if describe is not None else ""
  raise ValueError(
      f"{path}/{name}: the saved {type(target).__name__} has shape {tuple(found)}, but the "
      f"restore's target has {tuple(expected)}{counted}: the checkpoint was written for "
      "other params or by an optimizer of another configuration; build the target as the "
      "saved state was built (the same params and settings)")


class _RegisterOnImport(importlib.abc.MetaPathFinder):
  """Finds ``flax.serialization`` as the finders after it would, with a loader that
  registers the classes once the module has run."""

  def __init__(self) -> None:
    self._finding = False

  def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
    if fullname != _FLAX_SERIALIZATION or self._finding:
      return None
    self._finding = True  # find_spec below asks every finder again, this one included
    try:
      spec = importlib.util.find_spec(fullname)
    finally:
      self._finding = False
    if spec is not None and hasattr(spec.loader, "exec_module"):
      spec.loader = _RegisterAfterLoading(spec.loader, self)
    return spec


class _RegisterAfterLoading(importlib.abc.Loader):
  """``loader``, which then registers the classes and takes ``finder`` off the path."""

  def __init__(self, loader: Any, finder: _RegisterOnImport) -> None:
    self._loader = loader
    self._finder = finder

  def create_module(self, spec: Any) -> ModuleType | None:
    return self._loader.create_module(spec)

  def exec_module(self, module: ModuleType) -> None:
    # The module keeps its own loader, for reloads and source lookups.
    module.__loader__ = module.__spec__.loader = self._loader
    self._loader.exec_module(module)
    _register_with_flax(module)
    if self._finder in sys.meta_path:
      sys.meta_path.remove(self._finder)
