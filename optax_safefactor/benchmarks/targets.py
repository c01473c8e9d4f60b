"""Accelerator compilers without the accelerator: deviceless devices and traffic counts.

XLA:TPU (through libtpu's topologies) and XLA:GPU (through the CUDA plugin and a
description of the GPU) compile a program on this CPU-only machine, without running it.
:func:`device` gives a device of a named target to place abstract arguments on;
:func:`traffic_bytes` reads off the compiled program the bytes it moves to and from
device memory. Both need the ``accel`` extra (libtpu and the CUDA plugin) and, for the
GPU targets, JAX running on the CPU platform (``JAX_PLATFORMS=cpu``): the plugin's
deviceless topology is refused once JAX has tried to start a CUDA backend.

How the bytes are counted:

* TPU: from the optimised HLO's memory spaces. Each top-level instruction of the entry
  computation that moves data counts its operands and results that live in device
  memory (HBM: layouts without an ``S(n)`` memory space). An asynchronous copy or slice
  into on-chip memory counts what it brings on chip once; reads of the on-chip copy count
  nothing. XLA:TPU's own cost model counts on-chip traffic too (a leaf that fits on chip
  looks like ten passes where HBM sees four), so it is not used. Work inside a loop or a
  conditional would be counted only by its operands and results: :func:`control_flow`
  says whether a program has any.
* GPU: XLA's HloCostAnalysis ("bytes accessed") of the GPU-optimised module.

Calibration: ``p - 0.1 * g`` moves 3.00 passes over the params' bytes on both.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any, NamedTuple


class Target(NamedTuple):
  """A compiler to compile for.

  Attributes:
    name: the name on the command line.
    platform: JAX's platform name: ``cpu``, ``tpu`` or ``cuda``.
    topology: the TPU topology (``v5e:2x2``), or the GPU's description (a key of
      :data:`GPUS`); ``None`` for this machine's default device.
    label: how the benchmark's tables name it.
  """

  name: str
  platform: str
  topology: str | None
  label: str


TARGETS: dict[str, Target] = {target.name: target for target in (
    Target("cpu", "cpu", None, "this machine's default device (measured)"),
    Target("tpu-v5e", "tpu", "v5e:2x2", "TPU v5e (compiled only)"),
    Target("tpu-v6e", "tpu", "v6e:2x2", "TPU v6e (compiled only)"),
    Target("tpu-v5p", "tpu", "v5p:2x2x1", "TPU v5p (compiled only)"),
    Target("tpu-v4", "tpu", "v4:2x2x1", "TPU v4 (compiled only)"),
    Target("h100", "cuda", "h100", "H100 SXM (compiled only)"),
    Target("a100", "cuda", "a100", "A100 SXM 80 GB (compiled only)"),
)}

#: What XLA:GPU needs to know of a GPU to compile for it (the fields of its
#: ``GpuTargetConfigProto``), from the vendor's published figures.
GPUS: dict[str, dict[str, Any]] = {
    "h100": dict(
        name="NVIDIA H100 80GB HBM3", compute_capability=9, cores=132, fpus_per_core=128,
        shared_memory_per_core=233472, shared_memory_per_block_optin=232448,
        memory_bandwidth=3352320000000, l2_cache_size=52428800, clock_rate_ghz=1.98,
        device_memory_size=84929347584, dnn=(9, 7), cuda=(12, 8)),
    "a100": dict(
        name="NVIDIA A100-SXM4-80GB", compute_capability=8, cores=108, fpus_per_core=64,
        shared_memory_per_core=167936, shared_memory_per_block_optin=166912,
        memory_bandwidth=2039040000000, l2_cache_size=41943040, clock_rate_ghz=1.41,
        device_memory_size=85100068864, dnn=(8, 9), cuda=(12, 8)),
}


def gpu_target_config(gpu: str) -> str:
  """The ``GpuTargetConfigProto`` text of a GPU in :data:`GPUS`."""
  spec = GPUS[gpu]
  return "\n".join([
      "gpu_device_info {",
      "  threads_per_block_limit: 1024",
      "  threads_per_warp: 32",
      "  shared_memory_per_block: 49152",
      f"  shared_memory_per_core: {spec['shared_memory_per_core']}",
      "  threads_per_core_limit: 2048",
      f"  core_count: {spec['cores']}",
      f"  fpus_per_core: {spec['fpus_per_core']}",
      "  block_dim_limit_x: 2147483647",
      "  block_dim_limit_y: 65535",
      "  block_dim_limit_z: 65535",
      f"  memory_bandwidth: {spec['memory_bandwidth']}",
      f"  l2_cache_size: {spec['l2_cache_size']}",
      f"  clock_rate_ghz: {spec['clock_rate_ghz']}",
      f"  device_memory_size: {spec['device_memory_size']}",
      f"  shared_memory_per_block_optin: {spec['shared_memory_per_block_optin']}",
      f"  cuda_compute_capability {{ major: {spec['compute_capability']} }}",
      "  registers_per_core_limit: 65536",
      "  registers_per_block_limit: 65536",
      "}",
      'platform_name: "CUDA"',
      f"dnn_version_info {{ major: {spec['dnn'][0]} minor: {spec['dnn'][1]} }}",
      f"runtime_version {{ major: {spec['cuda'][0]} minor: {spec['cuda'][1]} }}",
      f'device_description_str: "{spec["name"]}"',
  ])


class MissingCompilerError(RuntimeError):
  """The compiler of a target is not installed, or cannot start in this process."""


def _installed(module: str) -> bool:
  import importlib.util

  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package is not there either
    return False


def missing_compiler(target: Target) -> str | None:
  """Why ``target`` cannot be compiled for here, or ``None`` when it can."""
  import jax

  if target.platform == "tpu" and not _installed("libtpu"):
    return "libtpu is not installed: pip install 'optax-safefactor[accel]'"
  if target.platform == "cuda":
    if not _installed("jax_plugins.xla_cuda12"):
      return "the CUDA plugin is not installed: pip install 'optax-safefactor[accel]'"
    if jax.config.jax_platforms != "cpu":
      return ("compiling for a GPU without one needs JAX on the CPU platform: set "
              "JAX_PLATFORMS=cpu before JAX starts")
  return None


@functools.cache
def devices(name: str) -> tuple[Any, ...]:
  """The devices of target ``name`` (a key of :data:`TARGETS`): deviceless ones for an
  accelerator, which programs are compiled for but never run on.

  Raises:
    MissingCompilerError: the target's compiler is not installed or cannot start here.
  """
  import jax
  from jax.experimental import topologies

  target = TARGETS[name]
  if target.platform == "cpu":
    return tuple(jax.devices("cpu"))
  problem = missing_compiler(target)
  if problem is not None:
    raise MissingCompilerError(f"cannot compile for {name}: {problem}")
  # libtpu takes a lock per process unless told that other processes (test workers, a
  # benchmark beside them) may load it too; no device is opened, so nothing is shared.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if target.platform == "tpu":
    topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
  else:
    topology = topologies.get_topology_desc(
        platform="cuda", target_config=gpu_target_config(target.topology), topology="1x1x1")
  return tuple(topology.devices)


# Bytes per element of the dtypes an optimizer step holds, by their HLO names.
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                  "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                  "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"\s*(?:ROOT )?(%?[\w.\-]+) = (.*?) ([\w\-]+)\((.*)$")
# Instructions that name or regroup buffers without moving their bytes.
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
               "partition-id", "replica-id", "copy-done", "opt-barrier"}


def _arrays(shape_text: str) -> list[tuple[int, bool]]:
  """(bytes, in device memory) of each array in an HLO shape."""
  found = []
  for dtype, dims, layout in _ARRAY.findall(shape_text):
    if dtype not in _ELEMENT_BYTES:
      continue
    size = math.prod(int(d) for d in dims.split(",") if d)
    memory_space = re.search(r"S\((\d+)\)", layout or "")
    found.append((size * _ELEMENT_BYTES[dtype], memory_space is None or memory_space[1] == "0"))
  return found


def _entry(hlo_text: str) -> str:
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  return entry[:entry.index("\n}")]


def tpu_hbm_bytes(hlo_text: str) -> int:
  """Bytes a compiled XLA:TPU program moves to and from HBM (see the module's docstring)."""
  shapes, total = {}, 0
  for line in _entry(hlo_text).splitlines()[1:]:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, shape_text, opcode, rest = match.groups()
    shapes[name] = shape_text
    if opcode in _NO_TRAFFIC or opcode.endswith("-done"):
      continue
    operand_text = rest.split("),")[0]
    operands = re.findall(r"(%[\w.\-]+)", operand_text)
    if opcode.endswith("-start"):
      # The result tuple names the source as well as the destination: count the side
      # that is in HBM once (a read when the source is, else a write).
      source_in_hbm = bool(operands) and any(
          hbm for _, hbm in _arrays(shapes.get(operands[0], "")))
      total += sum(size for size, hbm in _arrays(shape_text) if hbm != source_in_hbm)
      continue
    reads = sum(size for operand in operands
                for size, hbm in _arrays(shapes.get(operand, "")) if hbm)
    writes = sum(size for size, hbm in _arrays(shape_text) if hbm)
    total += reads + writes
  return total


def gpu_bytes_accessed(compiled: Any) -> int:
  """XLA's HloCostAnalysis "bytes accessed" of a compiled XLA:GPU program's module.

  The deviceless executable has no cost analysis of its own; the analysis is run on its
  optimised module by the CPU client, which reads the module's instructions, not the
  machine."""
  import jax
  from jax._src.lib import _jax

  module = compiled.runtime_executable().hlo_modules()[0]
  return int(_jax.hlo_module_cost_analysis(jax.devices("cpu")[0].client,
                                           module)["bytes accessed"])


def traffic_bytes(target: Target, compiled: Any) -> int:
  """Bytes the compiled program moves to and from device memory on ``target``."""
  if target.platform == "tpu":
    return tpu_hbm_bytes(compiled.as_text())
  if target.platform == "cuda":
    return gpu_bytes_accessed(compiled)
  raise ValueError(f"no traffic count for {target.name}: its steps are timed instead")


def fusions(hlo_text: str) -> int:
  """How many fused kernels a compiled program launches (its ``fusion`` instructions)."""
  return len(re.findall(r"= \S+ fusion\(", hlo_text))


def control_flow(hlo_text: str) -> bool:
  """Whether the program's entry runs a loop or a conditional, whose bodies a TPU count
  does not read."""
  return bool(re.search(r"= \S+ (while|conditional)\(", _entry(hlo_text)))
