"""The state's layout changes only with the version's minor number.

A checkpoint holds the state's arrays under their paths, with their shapes and dtypes: a
release that lays them out otherwise (a field added, a statistic of another shape, an axis
read by other rules) cannot restore what the release before it wrote. The layout of a
fixed set of this package's states is recorded per minor version; a change in it must
come with a new minor version (and a changelog entry saying what a user's checkpoint
needs), never under the old number.
"""

import hashlib

import jax
import jax.numpy as jnp

import optax_safefactor as osf

# The fingerprint of _layout() for each minor version. 0.4: a param named by a list of
# axis names is factored by its names (0.3 left it to the heuristic), and a guard that
# checks no hyperparameter keeps no counts for them (0.3: zero-size arrays).
LAYOUTS = {
    "0.3": "d1803f8effa3c074",
    "0.4": "e969091164151e6e",
}

_PARAMS = {
    "bias": jax.ShapeDtypeStruct((256,), jnp.bfloat16),
    "kernel": jax.ShapeDtypeStruct((256, 128), jnp.bfloat16),
    "stack": jax.ShapeDtypeStruct((512, 256, 128), jnp.bfloat16),
}


def _optimizers():
  """The package's transformations, with each option that shapes the state."""
  named_by_list = osf.logical_factor_rules({"stack": ["layers", "embed", "mlp"]})
  named_by_tuple = osf.logical_factor_rules({"stack": ("layers", "embed", "mlp")})
  unguarded = osf.safefactor(0.1, skip_nonfinite_steps=False)
  return {
      "safefactor": osf.safefactor(0.1),
      "momentum": osf.safefactor(0.1, momentum=0.9, dtype_momentum="bfloat16"),
      "state_dtype": osf.safefactor(0.1, state_dtype="bfloat16"),
      "kahan": osf.safefactor(0.1, param_rounding="kahan"),
      "spikes": osf.safefactor(0.1, skip_spikes=6.0, spike_window=8),
      "unguarded": unguarded,
      "unfactored": osf.safefactor(0.1, factored=False),
      "names_by_list": osf.safefactor(0.1, factor_rules=named_by_list),
      "names_by_tuple": osf.safefactor(0.1, factor_rules=named_by_tuple),
      "skip_nonfinite": osf.skip_nonfinite(osf.scale_by_safe_factored_rms(), skip_spikes=6.0,
                                           spike_window=4),
      "with_param_rounding": osf.with_param_rounding(unguarded, "kahan"),
      "accumulate_gradients": osf.accumulate_gradients(osf.safefactor(0.1), 4),
  }


def _key_name(key) -> str:
  for attribute in ("name", "key", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _layout() -> list[str]:
  """Per optimizer, each state array's path, shape and dtype, as a checkpoint keeps them."""
  lines = []
  for name, tx in _optimizers().items():
    state = jax.eval_shape(tx.init, _PARAMS)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      lines.append(f"{name}/{'/'.join(_key_name(key) for key in path)} "
                   f"{tuple(leaf.shape)} {leaf.dtype}")
  return lines


def _fingerprint(lines: list[str]) -> str:
  return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def test_the_state_layout_is_the_one_of_this_minor_version():
  minor = ".".join(osf.__version__.split(".")[:2])
  lines = _layout()
  assert LAYOUTS.get(minor) == _fingerprint(lines), (
      f"the state's layout is not the one recorded for {minor} ({LAYOUTS.get(minor)}): a "
      "checkpoint written by that release no longer restores. Give the change a new minor "
      "version, record its fingerprint "
      f"{_fingerprint(lines)} in LAYOUTS and say in the changelog what a checkpoint needs. "
      "The layout now:\n" + "\n".join(lines))


def test_each_minor_version_has_its_own_layout():
  assert len(set(LAYOUTS.values())) == len(LAYOUTS)
