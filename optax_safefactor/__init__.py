"""optax_safefactor: a numerically safe Adafactor for optax, JAX and Flax."""

from optax_safefactor import presets as presets
from optax_safefactor._src.accumulate import AccumulationState as AccumulationState
from optax_safefactor._src.accumulate import accumulate_gradients as accumulate_gradients
from optax_safefactor._src.alias import safefactor as safefactor
from optax_safefactor._src.alias import scale_by_safe_factored_rms as scale_by_safe_factored_rms
from optax_safefactor._src.checked_mode import (
    CheckedWithoutCheckifyError as CheckedWithoutCheckifyError,
)
from optax_safefactor._src.counter_layout import migrate_from_0_2 as migrate_from_0_2
from optax_safefactor._src.counter_layout import state_in_0_2_layout as state_in_0_2_layout
from optax_safefactor._src.counters import HyperparamCounts as HyperparamCounts
from optax_safefactor._src.counters import LeafCounts as LeafCounts
from optax_safefactor._src.counters import MicroBatchCounters as MicroBatchCounters
from optax_safefactor._src.counters import SkipNonfiniteState as SkipNonfiniteState
from optax_safefactor._src.guard import skip_nonfinite as skip_nonfinite
from optax_safefactor._src.kernel import FactoredMoment as FactoredMoment
from optax_safefactor._src.kernel import FullMoment as FullMoment
from optax_safefactor._src.migrate import migrate_from_optax as migrate_from_optax
from optax_safefactor._src.param_rounding import ParamRoundingState as ParamRoundingState
from optax_safefactor._src.param_rounding import with_param_rounding as with_param_rounding
from optax_safefactor._src.placement import state_partition_specs as state_partition_specs
from optax_safefactor._src.plan import DEFAULT_LOGICAL_RULES as DEFAULT_LOGICAL_RULES
from optax_safefactor._src.plan import logical_factor_rules as logical_factor_rules
from optax_safefactor._src.reports import NonFiniteStepsError as NonFiniteStepsError
from optax_safefactor._src.reports import check_nonfinite_steps as check_nonfinite_steps
from optax_safefactor._src.reports import nonfinite_report as nonfinite_report
from optax_safefactor._src.reports import nonfinite_summary as nonfinite_summary
from optax_safefactor._src.reports import skipped_spikes as skipped_spikes
from optax_safefactor._src.reports import skipped_steps as skipped_steps
from optax_safefactor._src.spikes import SpikeHistory as SpikeHistory
from optax_safefactor._src.transform import AdafactorState as AdafactorState

__version__ = "0.4.0.dev0"

__all__ = (
    "DEFAULT_LOGICAL_RULES",
    "AccumulationState",
    "AdafactorState",
    "CheckedWithoutCheckifyError",
    "FactoredMoment",
    "FullMoment",
    "HyperparamCounts",
    "LeafCounts",
    "MicroBatchCounters",
    "NonFiniteStepsError",
    "ParamRoundingState",
    "SkipNonfiniteState",
    "SpikeHistory",
    "accumulate_gradients",
    "check_nonfinite_steps",
    "logical_factor_rules",
    "migrate_from_0_2",
    "migrate_from_optax",
    "nonfinite_report",
    "nonfinite_summary",
    "presets",
    "safefactor",
    "scale_by_safe_factored_rms",
    "skip_nonfinite",
    "skipped_spikes",
    "skipped_steps",
    "state_in_0_2_layout",
    "state_partition_specs",
    "with_param_rounding",
)
