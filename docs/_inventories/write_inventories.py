"""Writes the intersphinx inventories of docs/_inventories/ (python, jax, optax, numpy, flax).

The site's build runs offline, so intersphinx cannot download each project's objects.inv.
These small inventories hold only the names the site references (in the docstrings, the
signatures and the guides), each with the URL of its page in that project's documentation.
A new reference to another project's name that is missing here fails the build (nitpicky
mode, warnings as errors): add it below, with its real page, and run

    python docs/_inventories/write_inventories.py
"""

import pathlib
import zlib

HERE = pathlib.Path(__file__).resolve().parent

# project -> (version, [(name, role, page relative to the project's base URL)]). The anchor
# is the name itself, as Sphinx writes it ("#$" in the inventory).
INVENTORIES = {
    "python": ("3", [
        ("None", "py:data", "library/constants.html"),
        ("bool", "py:class", "library/functions.html"),
        ("int", "py:class", "library/functions.html"),
        ("float", "py:class", "library/functions.html"),
        ("str", "py:class", "library/stdtypes.html"),
        ("dict", "py:class", "library/stdtypes.html"),
        ("typing.Any", "py:data", "library/typing.html"),
        ("collections.abc.Callable", "py:class", "library/collections.abc.html"),
        ("collections.abc.Mapping", "py:class", "library/collections.abc.html"),
        ("collections.abc.Sequence", "py:class", "library/collections.abc.html"),
        ("ValueError", "py:exception", "library/exceptions.html"),
        ("TypeError", "py:exception", "library/exceptions.html"),
        ("RuntimeError", "py:exception", "library/exceptions.html"),
    ]),
    "jax": ("latest", [
        ("jax.Array", "py:class", "_autosummary/jax.Array.html"),
        ("jax.jit", "py:function", "_autosummary/jax.jit.html"),
        ("jax.eval_shape", "py:function", "_autosummary/jax.eval_shape.html"),
        ("jax.make_mesh", "py:function", "_autosummary/jax.make_mesh.html"),
        ("jax.make_array_from_callback", "py:function",
         "_autosummary/jax.make_array_from_callback.html"),
        ("jax.distributed.initialize", "py:function",
         "_autosummary/jax.distributed.initialize.html"),
        ("jax.experimental.checkify.checkify", "py:function",
         "_autosummary/jax.experimental.checkify.checkify.html"),
        ("jax.errors.JaxRuntimeError", "py:class", "errors.html"),
        # A type alias, written py:class so that the signatures' class references find it.
        ("jax.typing.ArrayLike", "py:class", "_autosummary/jax.typing.ArrayLike.html"),
        ("jax.sharding.Mesh", "py:class", "jax.sharding.html"),
        ("jax.sharding.NamedSharding", "py:class", "jax.sharding.html"),
        ("jax.sharding.PartitionSpec", "py:class", "jax.sharding.html"),
    ]),
    "optax": ("latest", [
        ("optax.adafactor", "py:function", "api/optimizers.html"),
        ("optax.scale_by_factored_rms", "py:function", "api/transformations.html"),
        ("optax.GradientTransformation", "py:class", "api/transformations.html"),
        ("optax.GradientTransformationExtraArgs", "py:class", "api/transformations.html"),
        ("optax.apply_updates", "py:function", "api/apply_updates.html"),
        ("optax.MultiSteps", "py:class", "api/optimizer_wrappers.html"),
        ("optax.schedules.inject_hyperparams", "py:function", "api/optimizer_schedules.html"),
    ]),
    # jax.typing.ArrayLike, spelt out where a signature's annotations are evaluated.
    "numpy": ("stable", [
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html"),
        ("numpy.bool", "py:class", "reference/arrays.scalars.html"),
        ("numpy.number", "py:class", "reference/arrays.scalars.html"),
    ]),
    "flax": ("latest", [
        ("flax.nnx.optimizer.Optimizer", "py:class",
         "api_reference/flax.nnx/training/optimizer.html"),
        ("flax.nnx.with_partitioning", "py:function", "api_reference/flax.nnx/spmd.html"),
    ]),
}


def inventory(project: str, version: str, entries) -> bytes:
  """An objects.inv (version 2) holding ``entries``."""
  header = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
            "# The remainder of this file is compressed using zlib.\n")
  body = "".join(f"{name} {role} 1 {page}#$ -\n" for name, role, page in entries)
  return header.encode() + zlib.compress(body.encode(), 9)


def main() -> None:
  for project, (version, entries) in INVENTORIES.items():
    (HERE / f"{project}.inv").write_bytes(inventory(project, version, entries))
    print(f"docs/_inventories/{project}.inv: {len(entries)} names")


if __name__ == "__main__":
  main()
