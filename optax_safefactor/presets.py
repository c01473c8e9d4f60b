"""One-line equivalents of other Adafactor implementations, each built on ``safefactor``.

Each preset takes the other implementation's own argument names and defaults and
returns an optax transformation whose updates are that implementation's, computed by
:func:`optax_safefactor.safefactor` (with its floors, float32 statistics and non-finite
guard). Keyword arguments beyond the implementation's own (``**overrides``) go to
``safefactor``'s keyword arguments: ``state_dtype``, ``skip_spikes``,
``max_consecutive_skips`` and the like. An override that the preset already sets from
one of its own arguments, or that ``safefactor`` does not know, is a ``TypeError``
naming it. A value given to an argument that the preset's other arguments leave without
effect (T5X's ``epsilon2`` without the parameter scale, say) is dropped, as the original
drops it, with a ``UserWarning``.

Under ``optax.inject_hyperparams`` a preset's numbers become hyperparameters of the
state, to change between steps without compiling again; its switches stay static, and so
do the overrides (``inject_hyperparams`` hands them over gathered, as one argument):

>>> import jax.numpy as jnp, optax
>>> import optax_safefactor as osf
>>> tx = optax.inject_hyperparams(osf.presets.t5x)(learning_rate=1e-2)
>>> params = {"w": jnp.ones((4, 3))}
>>> state = tx.init(params)
>>> state.hyperparams["learning_rate"] = jnp.asarray(1e-3)
>>> updates, state = tx.update(params, state, params)
>>> updates["w"].shape
(4, 3)

The measured agreement of each preset with its implementation is in its docstring;
``tests/test_presets.py`` checks it step by step (against the real optimizers where
they install: ``torch`` and ``transformers``; against float64 restatements of their
sources for big_vision and T5X).
"""

from optax_safefactor._src.preset_google import big_vision as big_vision
from optax_safefactor._src.preset_google import t5x as t5x
from optax_safefactor._src.preset_pytorch import torch as torch
from optax_safefactor._src.preset_pytorch import transformers as transformers

__all__ = ("big_vision", "t5x", "torch", "transformers")
