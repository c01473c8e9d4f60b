"""The factoring plan: the optax heuristic, and reading it back off the state's shapes."""

from hypothesis import given
from hypothesis import strategies as st

from optax_safefactor._src.plan import FactorPlan, default_plan, plan_from_stat_shapes


def test_heuristic_matches_optax_choice():
  assert default_plan((300, 200), True, 128) == FactorPlan((1,), (0,))
  assert default_plan((200, 300), True, 128) == FactorPlan((0,), (1,))
  assert default_plan((128, 128), True, 128) == FactorPlan((0,), (1,))
  assert default_plan((127, 300), True, 128) is None
  assert default_plan((300, 200), False, 128) is None
  assert default_plan((300,), True, 1) is None
  assert default_plan((), True, 1) is None
  assert default_plan((0, 300), True, 1) is None


@given(shape=st.lists(st.integers(0, 300), min_size=0, max_size=4), min_size=st.integers(1, 200))
def test_plan_round_trips_through_the_stat_shapes(shape, min_size):
  plan = default_plan(shape, True, min_size)
  if plan is None:
    return
  assert min(shape[plan.row_axes[0]], shape[plan.col_axes[0]]) >= min_size
  read_back = plan_from_stat_shapes(shape, plan.row_stat_shape(shape), plan.col_stat_shape(shape))
  # Axes of size 1 carry no role; every other factored axis is read back exactly.
  assert read_back.row_axes == tuple(a for a in plan.row_axes if shape[a] != 1)
  assert read_back.col_axes == tuple(a for a in plan.col_axes if shape[a] != 1)
