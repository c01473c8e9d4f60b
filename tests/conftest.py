"""Test session set-up: 8 CPU devices and strict promotion, before JAX starts its backend."""

import importlib.util
import os
import re
import shutil
import tempfile

# With the accel extra installed (libtpu and the CUDA plugin, for compiling to TPUs and GPUs
# without them: tests/test_accelerators.py), JAX would try to start both at every start, and
# the deviceless GPU compiler needs JAX on the CPU platform: the suite and the processes it
# starts run on the CPU there. Elsewhere (a GPU machine) JAX picks its platform as usual.
if importlib.util.find_spec("libtpu") is not None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Most of the suite's time is XLA compiling, and many tests compile the same programs (the
# same small trees through the same step, in this process, in the other workers and in the
# subprocesses they start). One compilation cache for the whole run, which the workers and
# subprocesses inherit through the environment, compiles each program once. It is made
# empty for each run and removed after it, so no run reads another's programs. Not with the
# accel extra: a program compiled for a TPU or GPU without one cannot be read back.
_OWN_CACHE = ("JAX_COMPILATION_CACHE_DIR" not in os.environ
              and importlib.util.find_spec("libtpu") is None)
if _OWN_CACHE:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="optax-safefactor-tests-")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Worker scripts run in subprocesses by test_multihost.py and test_crash_resume.py;
# importing them here would reconfigure JAX's devices or kill the test process. The Flax
# model module holds no tests or doctests and imports flax, which the runs on the version
# floors of the core dependencies do not install.
collect_ignore = ["multihost_worker.py", "crash_worker.py", "flax_models.py"]

settings.register_profile(
    "default",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
settings.load_profile("default")


@pytest.fixture
def rng():
  return np.random.default_rng(0)


@pytest.fixture
def x64():
  """Enable float64 for one test and restore the previous setting afterwards."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def pytest_unconfigure(config):
  if _OWN_CACHE:  # the process that made the cache: the controller, after its workers
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config, items):
  """Skip, with the reason, what the installed JAX cannot run (markers in pyproject.toml)."""
  if jax.__version_info__ < (0, 10, 2):
    reasons = {
        "xla_memory_layout": (
            "XLA's CPU memory analysis before JAX 0.10.2 reports the same temporaries for "
            "safefactor and optax.adafactor (2x the float32 params on 0.5.3-0.10.1), so it "
            "cannot tell the layouts apart"),
        "xla_cpu_kernels": (
            "the CPU kernel structure these tests pin (library kernels for reductions of "
            "4,096 elements or more, one kernel per distinct fused computation) was measured "
            "on the XLA of JAX 0.10.2"),
    }
    for item in items:
      for marker, reason in reasons.items():
        if marker in item.keywords:
          item.add_marker(pytest.mark.skip(reason=reason))


# .ci/run's core-floor venv has no flax extra on purpose (flax 0.12.4 needs a newer JAX than the
# core's floor), and sets this. There, and only there, a test that fails for want of flax or
# orbax, in this process or in a subprocess it runs (the README's sections), is reported as
# skipped, naming the module; anywhere else a missing module is an error.
_WITHOUT_FLAX = os.environ.get("OPTAX_SAFEFACTOR_WITHOUT_FLAX") == "1"
_NO_FLAX = re.compile(r"No module named '(flax|orbax)[.']")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  if not _WITHOUT_FLAX or call.excinfo is None:
    return
  missing = _NO_FLAX.search(str(call.excinfo.value))
  if missing:
    report = outcome.get_result()
    report.outcome = "skipped"
    report.longrepr = (str(item.path), item.location[1] or 0,
                       f"Skipped: needs the flax extra ({missing[1]} is not installed here)")
