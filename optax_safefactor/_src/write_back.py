"""The write-back policy: how a wide update lands on a narrow param, and a wide value in state.

``optax.apply_updates`` adds an update to a bfloat16 param in bfloat16 and rounds
to nearest, so an update below half an ulp (``lr = 1e-3`` with an update relative
to the param's scale, say) vanishes. The write-back chooses the update so that
``apply_updates`` lands on a better value ``target`` of ``param + exact_update``:

* ``"nearest"``: the update is cast to the gradient's dtype under the one clamping
  rule (:func:`rounding.saturate`); small updates to narrow params vanish.
* ``"stochastic"``: ``target`` is rounded up with probability equal to the
  fraction of the ulp, so it is unbiased; the bits come from
  :mod:`bit_streams`, keyed by ``(seed, step, leaf path, stream, element index)``.
* ``"kahan"``: ``target`` is rounded to nearest and a compensation buffer in the
  param dtype carries what the rounding lost into the next step.

The mode is read in this module only: :func:`rounding_for` turns it into a
:class:`Rounding` (``None`` for ``"nearest"``), and :func:`write_back` and :func:`store`
dispatch on that, for safefactor's kernel and for :func:`with_param_rounding` alike.
float32 and float64 params are left alone by every mode.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from optax_safefactor._src import bit_streams, manual_axes, numerics, xla_hints
from optax_safefactor._src.rounding import (
    exact_cast,
    needs_rounding,
    on_grid,
    round_to_nearest,
    saturating_cast,
    stochastic_round,
)

DTypeLike = Any

ROUNDING_MODES = ("nearest", "stochastic", "kahan")


def check_rounding_mode(mode: str, name: str = "param_rounding") -> str:
  """``mode`` if it is one of :data:`ROUNDING_MODES`, else a ``ValueError`` listing them.

  >>> check_rounding_mode("kahan")
  'kahan'
  >>> check_rounding_mode("up")
  Traceback (most recent call last):
  ...
  ValueError: param_rounding must be one of 'nearest', 'stochastic' or 'kahan', got 'up'
  """
  if not isinstance(mode, str) or mode not in ROUNDING_MODES:
    raise ValueError(
        f"{name} must be one of 'nearest', 'stochastic' or 'kahan', got {mode!r}"
    )
  return mode


def unused_seed(mode: str, seed: Any, mode_name: str = "param_rounding",
                seed_name: str = "rounding_seed") -> str | None:
  """What to tell a user who gave a seed other than 0 to a mode that draws no bits, else
  ``None`` (a traced seed is not judged). A warning, not an error: a sweep over the modes
  with one seed per run is a fair use.

  >>> print(unused_seed("kahan", 7))
  rounding_seed=7 seeds stochastic rounding's bits, which param_rounding='kahan' does not \
draw: it has no effect
  """
  if draws_bits(mode) or isinstance(seed, jax.core.Tracer) or int(np.asarray(seed)) == 0:
    return None
  # As a number: optax.inject_hyperparams hands it over as an array.
  return (f"{seed_name}={int(np.asarray(seed))} seeds stochastic rounding's bits, which "
          f"{mode_name}={mode!r} does not draw: it has no effect")


def nothing_to_round(mode: str, stored: list[tuple[Any, Any]],
                     mode_name: str = "param_rounding", *, state_too: bool = False
                     ) -> str | None:
  """What to tell a user whose rounding ``mode`` finds nothing to round, else ``None``.
  ``stored`` pairs each array the mode would write (a param; with ``state_too``, which
  safefactor's stochastic rounding has, its momentum and statistics) with the dtype it is
  computed in. An empty tree is not judged. A warning, not an error: a sweep over params'
  dtypes with one mode is a fair use.

  >>> print(nothing_to_round("kahan", [(jnp.float32, jnp.float32)]))
  param_rounding='kahan' rounds what is stored narrower than it is computed (bfloat16 and \
float16 params), and nothing here is: it has no effect
  >>> nothing_to_round("stochastic", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32)])
  >>> print(nothing_to_round("stochastic", [(jnp.float64, jnp.float64)], state_too=True))
  param_rounding='stochastic' rounds what is stored narrower than it is computed (bfloat16 \
and float16 params, momentum and statistics), and nothing here is: it has no effect
  """
  if not rounds_onto_params(mode) or not stored or any(
      needs_rounding(dtype, wide) for dtype, wide in stored):
    return None
  what = "bfloat16 and float16 params" + (", momentum and statistics" if state_too else "")
  return (f"{mode_name}={mode!r} rounds what is stored narrower than it is computed ({what}), "
          "and nothing here is: it has no effect")


def draws_bits(mode: str) -> bool:
  """Whether ``mode`` draws random bits, keyed by a seed (``"stochastic"``)."""
  return mode == "stochastic"


def rounds_onto_params(mode: str) -> bool:
  """Whether ``mode`` rounds the final update onto the params, so it reads them (all but
  ``"nearest"``)."""
  return mode != "nearest"


def keeps_compensation(mode: str) -> bool:
  """Whether ``mode`` keeps a compensation buffer per narrow param (``"kahan"``)."""
  return mode == "kahan"


def is_narrow(dtype: DTypeLike) -> bool:
  """Whether params of ``dtype`` are rounded on write-back (bfloat16 and float16)."""
  return needs_rounding(dtype, numerics.compute_dtype(dtype))


class Rounding(NamedTuple):
  """How one leaf writes wide values into narrow params and state this step.

  Attributes:
    stochastic: True for ``"stochastic"``, False for ``"kahan"``.
    seed: the stochastic rounding's seed.
    step: the applied-step count: a skipped step does not advance it, so it
      consumes no bits.
    path_hash: the leaf's stable path hash; with the element's global index and a
      stream it picks each element's bits. For leaves packed as the rows of one array,
      a uint32 array of their hashes, one per row.
    keys: ``(stream, key)`` pairs computed beforehand (:func:`with_stream_keys`); a
      stream not among them hashes its key where its bits are drawn.
  """

  stochastic: bool
  seed: Any
  step: jax.Array
  path_hash: Any
  keys: tuple[tuple[int, jax.Array], ...] = ()

  def bits(self, rounded: jax.Array, stream: int) -> jax.Array:
    """The bits, one per element, that round ``rounded`` (or what it is written onto)."""
    key = dict(self.keys).get(stream)
    if key is None:
      key = bit_streams.stream_key(self.seed, self.step, self.path_hash, stream)
    if isinstance(rounded, jax.core.Tracer):  # (only a traced value can differ between devices)
      axes = manual_axes.varying_axes(rounded)
      if axes:
        # Inside jax.shard_map a device holds a shard, whose elements' indices are the
        # same from shard to shard: its position among the devices keys its own bits.
        key = bit_streams.absorb(key, jax.lax.axis_index(axes).astype(jnp.uint32))
    if isinstance(self.path_hash, np.ndarray):  # packed rows: a key per row
      return bit_streams.row_bits_from_keys(key, rounded.shape)
    return bit_streams.bits_from_key(key, rounded.shape)


def rounding_for(mode: str, seed: Any, step: jax.Array, path: Any) -> Rounding | None:
  """One leaf's :class:`Rounding` in ``mode`` at ``step``; ``None`` for ``"nearest"``."""
  if mode == "nearest":
    return None
  return Rounding(mode == "stochastic", seed, step, bit_streams.path_hash(path))


def streams_to_round(param: Any = None, momentum: Any = None,
                     statistics: tuple[Any, ...] = ()) -> tuple[int, ...]:
  """The bit streams that one unit's stochastic rounding draws from: the params' for a
  narrow ``param``, the momentum's for a narrow ``momentum``, and the statistics' (a full
  one's or the rows', then the columns') for narrow ``statistics``. Each is ``None`` (or
  left out) where the unit has none; the values they are rounded from are always wider.

  >>> streams_to_round(jnp.zeros(2, jnp.bfloat16), jnp.zeros(2, jnp.float32))
  (0,)
  """
  streams = [stream for stream, value in ((bit_streams.STREAM_PARAMS, param),
                                          (bit_streams.STREAM_MOMENTUM, momentum))
             if value is not None and is_narrow(value.dtype)]
  statistics_streams = (bit_streams.STREAM_STATISTICS, bit_streams.STREAM_COLUMN_STATISTICS)
  streams += [stream for stream, value in zip(statistics_streams, statistics, strict=False)
              if is_narrow(value.dtype)]
  return tuple(streams)


def with_stream_keys(roundings: list[Rounding | None],
                     streams: list[tuple[int, ...]]) -> list[Rounding | None]:
  """``roundings`` (one per unit the kernel steps) with the keys of the bit streams each
  one draws from (``streams``, one tuple per unit, e.g. from :func:`streams_to_round`).

  A stochastically rounded unit's array (its narrow param, momentum or statistics) draws
  its bits from the key of ``(seed, step, its path, its stream)``; leaves packed as rows
  have one per row. Computed here for every unit and stream at once, as one vector, each
  update reads its keys from that vector rather than hashing paths in its own kernel: a
  path hash was a constant of the leaf's, so no two leaves of one shape could share a
  compiled kernel (XLA:GPU compiled one per leaf), and a packed group hashed every row's
  path element by element. The keys, and so the bits, are the same as
  :func:`bit_streams.random_bits` and :func:`bit_streams.row_bits` draw.
  """
  chosen = [(index, stream)
            for index, (how, unit_streams) in enumerate(zip(roundings, streams, strict=True))
            if how is not None and how.stochastic for stream in unit_streams]
  if not chosen:
    return roundings
  first = roundings[chosen[0][0]]
  hashes = [np.ravel(np.asarray(roundings[index].path_hash, np.uint32)) for index, _ in chosen]
  stream_ids = np.concatenate([np.full(unit_hashes.size, stream, np.uint32)
                               for unit_hashes, (_, stream) in zip(hashes, chosen, strict=True)])
  keys = bit_streams.stream_key(first.seed, first.step, np.concatenate(hashes), stream_ids)
  stops = np.cumsum([unit_hashes.size for unit_hashes in hashes]).tolist()
  pieces = xla_hints.pieces_apart(keys, [(stop - unit_hashes.size, stop) for stop, unit_hashes
                                         in zip(stops, hashes, strict=True)])
  keyed = list(roundings)
  for (index, stream), piece in zip(chosen, pieces, strict=True):
    rows = isinstance(roundings[index].path_hash, np.ndarray)
    keyed[index] = keyed[index]._replace(
        keys=(*keyed[index].keys, (stream, piece if rows else piece.reshape(()))))
  return keyed


def _landing_update_wide(param_wide: jax.Array, target_wide: jax.Array, dtype: DTypeLike):
  update = on_grid(target_wide - param_wide, dtype)
  # At a tie the difference rounds to its even neighbour, away from zero half the time,
  # and param + update can then be a tie just past the largest value, which rounds to Inf
  # (a float16 param of 30000 sent to 65504 gets 35520: 65520 is Inf). Only a difference
  # in the top binade gets there, and no update lands such a param on the largest value:
  # one ulp of the top binade nearer zero lands it an ulp below (65472).
  info = jnp.finfo(dtype)
  top_ulp = float(info.eps) * 2.0 ** (info.maxexp - 1)
  past = jnp.abs(param_wide + update) >= jnp.asarray(float(info.max) + top_ulp / 2, update.dtype)
  # A select on the sign, not copysign: that reads the bit pattern (no such reads on TPUs
  # and GPUs, tests/test_accelerators.py).
  step_back = jnp.where(update < 0, jnp.asarray(-top_ulp, update.dtype), top_ulp)
  return jnp.where(past, update - step_back, update)


def _landed_wide(param_wide: jax.Array, update_wide: jax.Array, dtype: DTypeLike):
  return on_grid(param_wide + update_wide, dtype, saturating=False)


def landing_update(param: jax.Array, target: jax.Array) -> jax.Array:
  """The update in ``param.dtype`` that moves ``param`` onto ``target`` under ``apply_updates``.

  ``update = nearest(target - param)`` (computed wide, saturated at the largest
  finite value; bfloat16 shares float32's range, so opposite-sign values so large
  that their difference overflows float32 give Inf).
  ``optax.apply_updates`` computes ``(param + update)`` in the param dtype, which
  equals ``target`` whenever ``target - param`` is representable there; by
  Sterbenz's lemma ``|target - param| <= |param| / 2`` (with ``target`` of the same
  sign) suffices. Otherwise (sign changes, targets near zero, jumps beyond twice
  the param) the param lands within one ulp of the larger of ``|param|`` and
  ``|target|``: see :func:`landed`; where that would be past the largest finite value
  (Inf), the update is an ulp nearer zero and the param lands an ulp below the largest
  value. Inside jit XLA flushes float32 subnormals, so a
  bfloat16 difference below the smallest normal (about 1.2e-38) becomes 0.

  >>> import jax.numpy as jnp, optax
  >>> param = jnp.array([1.0, 3.0], jnp.bfloat16)
  >>> target = jnp.array([1.0078125, 2.984375], jnp.bfloat16)
  >>> bool(jnp.all(optax.apply_updates(param, landing_update(param, target)) == target))
  True
  """
  wide = numerics.compute_dtype(param.dtype)
  update = _landing_update_wide(param.astype(wide), target.astype(wide), param.dtype)
  return exact_cast(update, param.dtype)


def landed(param: jax.Array, update: jax.Array) -> jax.Array:
  """Where ``optax.apply_updates`` puts ``param``: ``(param + update)`` in the param dtype.

  The sum of two bfloat16 (or float16) values is exact in float32 unless they are
  more than 16 binades apart, and then the update is far below half an ulp and
  both roundings give ``param``; so rounding the wide sum once (with
  :func:`on_grid`, which no compiler skips) equals the narrow addition.
  """
  wide = numerics.compute_dtype(param.dtype)
  return exact_cast(_landed_wide(param.astype(wide), update.astype(wide), param.dtype),
                    param.dtype)


def stochastic_write_back(param: jax.Array, exact_update: jax.Array, bits: jax.Array) -> jax.Array:
  """Update that lands ``param`` on ``stochastic_round(param + exact_update)``.

  ``target = stochastic_round(param_wide + exact_update, param.dtype, bits)``, then
  :func:`landing_update`. The wide sum is itself rounded to nearest in float32
  first: a bias below 2**-24 relative, far under the 2**-8 of a bfloat16 ulp.

  Args:
    param: the (narrow) param.
    exact_update: the update in float32 (or float64).
    bits: uint32 random bits of the param's shape (stream :data:`STREAM_PARAMS`).

  Returns:
    The update, in ``param.dtype``.
  """
  wide = numerics.compute_dtype(exact_update.dtype)
  exact = param.astype(wide) + exact_update.astype(wide)
  return landing_update(param, stochastic_round(exact, param.dtype, bits))


def kahan_write_back(
    param: jax.Array, exact_update: jax.Array, compensation: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Compensated write-back: round to nearest and carry what was lost into the next step.

  With ``y = exact_update + compensation`` (wide) and ``exact = param + y``:
  ``target = nearest(exact)`` (saturated), ``update = landing_update(param, target)``
  and ``new_compensation = exact - landed(param, update)``, in the param dtype; where
  ``exact_update`` is zero, no update and the compensation as it was. The
  compensation holds the true remainder even where the landing misses the target
  (near zero, on a sign change), so nothing is lost but the rounding of the
  compensation itself: a bfloat16 buffer keeps about 8 more bits, so updates below
  about 2**-17 of the param still vanish, and after thousands of equal small
  steps the param can drift by about an ulp from the exact sum.

  >>> import jax.numpy as jnp, optax
  >>> param, comp = jnp.array(1.0, jnp.bfloat16), jnp.zeros([], jnp.bfloat16)
  >>> for _ in range(100):
  ...   update, comp = kahan_write_back(param, jnp.array(1e-4), comp)
  ...   param = optax.apply_updates(param, update)
  >>> float(param), round(float(param) + float(comp), 4)  # exact: 1.01
  (1.0078125, 1.0103)

  Args:
    param: the (narrow) param.
    exact_update: the update in float32 (or float64).
    compensation: last step's remainder, in ``param.dtype``.

  Returns:
    ``(update, new_compensation)``, both in ``param.dtype``.
  """
  wide = numerics.compute_dtype(exact_update.dtype)
  dtype = param.dtype
  param_wide = param.astype(wide)
  exact = param_wide + (exact_update.astype(wide) + compensation.astype(wide))
  # Everything stays wide, on the param dtype's grid, until it is stored: one
  # rounding per step of the formula and no conversion pair for a compiler to drop.
  update = _landing_update_wide(param_wide, on_grid(exact, dtype), dtype)
  remainder = exact - _landed_wide(param_wide, update, dtype)
  # Where the narrow dtype has the wide one's range (bfloat16 in float32) a finite
  # remainder is far inside it, so it needs no clamp: the landing misses the target by at
  # most an ulp of the larger of param and target (or, where the update saturates, by what
  # the difference passed the largest value), and the target misses ``exact`` by half an
  # ulp (or by what ``exact`` passed the largest value), each under 2**-7 of that value.
  # float16's range is smaller than a float32 ``exact`` can be: there it is clamped.
  same_range = jnp.finfo(dtype).maxexp == jnp.finfo(wide).maxexp
  update = exact_cast(update, dtype)
  remainder = round_to_nearest(remainder, dtype, saturating=not same_range)
  # A zero update leaves param and compensation as they are. Rounded to nearest, a
  # compensation can be half an ulp exactly: added to nothing it is a tie, which could
  # move the param by an ulp on a step that has nothing to add (one a guard skipped, a
  # micro-batch of an accumulation, a dead unit's).
  still = exact_update == 0
  return (jnp.where(still, jnp.zeros((), dtype), update),
          jnp.where(still, compensation, remainder))


def store(values: tuple[jax.Array, ...], dtype: DTypeLike, how: Rounding | None,
          streams: tuple[int, ...]) -> tuple[jax.Array, ...]:
  r"""Wide ``values`` written into state of ``dtype``, each with the bits of its stream.

  Finite real values past ``dtype``'s range saturate at its largest value, NaN and Inf pass
  (:func:`rounding.saturate`, in every mode). Rounded to nearest, or stochastically
  (:math:`\mathbb{E}[\mathrm{store}(x)] = x`) with ``"stochastic"`` rounding when
  ``dtype`` is narrower than the values, so that a bfloat16 moving average keeps moving.
  The arrays of one leaf are stored together (its row and column statistics, say), each
  drawing from its own stream.
  """
  # The one cast rule (rounding.saturate) in every mode, as stochastic_round keeps it: a
  # finite value past a narrower state dtype's range is stored as its largest value, not
  # Inf. A float16 momentum pushed past 65504 was stored as Inf after the guard had passed
  # its step, and every later step was skipped for it. Written out here, not through
  # rounding.saturating_cast, to keep the update's path short.
  stochastic = how is not None and how.stochastic
  largest = float(jnp.finfo(dtype).max)
  return tuple([
      stochastic_round(x, dtype, how.bits(x, stream))
      if stochastic and needs_rounding(dtype, x.dtype)
      else jnp.where(jnp.isfinite(x), jnp.clip(x, -largest, largest), x).astype(dtype)
      # Real values only, as rounding.saturating_cast: a complex momentum is cast as it is.
      if jnp.issubdtype(x.dtype, jnp.floating) and largest < jnp.finfo(x.dtype).max
      else x.astype(dtype)
      for x, stream in zip(values, streams, strict=True)
  ])


def write_back(
    update: jax.Array, param: jax.Array | None, dtype: DTypeLike, how: Rounding | None,
    compensation: jax.Array | None,
) -> tuple[jax.Array, jax.Array | None]:
  r"""The update :math:`\Delta` that ``optax.apply_updates`` adds, and the new compensation.

  ``"nearest"`` (and every wide param): :math:`\Delta = \mathrm{cast}(u)` to ``dtype``
  (the gradient's), finite values clamped to its range. ``"stochastic"``: :math:`\Delta`
  lands the param on :math:`\mathrm{round}_{\mathrm{stoch}}(p + u)`. ``"kahan"``: it
  lands on :math:`\mathrm{round}(p + u + c)`, and :math:`c` keeps what that rounding
  lost. A narrow param's update is in the param's dtype.
  """
  if how is None or not needs_rounding(param.dtype, update.dtype):
    return saturating_cast(update, dtype), compensation
  if how.stochastic:
    bits = how.bits(param, bit_streams.STREAM_PARAMS)
    return stochastic_write_back(param, update, bits), compensation
  return kahan_write_back(param, update, compensation)
