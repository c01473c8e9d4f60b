"""The developer tools' own logic, on made-up inputs (their runs need the ``accel`` extra)."""

import pathlib

from tests.helpers import load_module

ROOT = pathlib.Path(__file__).resolve().parent.parent

tpu_kernels = load_module(ROOT / "tools" / "tpu_kernels.py")

# Three fusions: the first two do the same arithmetic on operands placed apart (HBM and
# on chip), the third other arithmetic.
HLO = """\
HloModule step

%fused_add (param_0: f32[8,128], param_1: f32[8,128]) -> f32[8,128] {
  %param_0 = f32[8,128]{1,0:T(8,128)} parameter(0)
  %param_1 = f32[8,128]{1,0:T(8,128)} parameter(1)
  ROOT %add.1 = f32[8,128]{1,0:T(8,128)} add(%param_0, %param_1), metadata={op_name="a"}
}

%fused_add.1 (param_0.1: f32[8,128], param_1.1: f32[8,128]) -> f32[8,128] {
  %param_0.1 = f32[8,128]{1,0:T(8,128)S(1)} parameter(0)
  %param_1.1 = f32[8,128]{1,0:T(8,128)} parameter(1)
  ROOT %add.2 = f32[8,128]{1,0:T(8,128)S(1)} add(%param_0.1, %param_1.1), metadata={op_name="b"}
}

%fused_mul (param_0.2: f32[8,128], param_1.2: f32[8,128]) -> f32[8,128] {
  %param_0.2 = f32[8,128]{1,0:T(8,128)} parameter(0)
  %param_1.2 = f32[8,128]{1,0:T(8,128)} parameter(1)
  ROOT %mul.1 = f32[8,128]{1,0:T(8,128)} multiply(%param_0.2, %param_1.2)
}

ENTRY %main (p: f32[8,128], q: f32[8,128]) -> f32[8,128] {
  %p = f32[8,128]{1,0:T(8,128)} parameter(0)
  %q = f32[8,128]{1,0:T(8,128)} parameter(1)
  %add_f = f32[8,128]{1,0:T(8,128)} fusion(%p, %q), kind=kLoop, calls=%fused_add
  %add_f.1 = f32[8,128]{1,0:T(8,128)S(1)} fusion(%add_f, %q), kind=kLoop, calls=%fused_add.1
  ROOT %mul_f = f32[8,128]{1,0:T(8,128)} fusion(%add_f.1, %p), kind=kLoop, calls=%fused_mul
}
"""


def test_placement_variants_are_one_computation(tmp_path):
  for name, lines in [("add_f", 30), ("add_f.1", 40), ("mul_f", 50),
                      ("TLP", 7), ("<late-finalization>", 2)]:
    (tmp_path / f"1796-{name}-17-pre-cssa.txt").write_text("x\n" * lines)
  (tmp_path / "1796-add_f-05-post-GVN.txt").write_text("x\n" * 99)  # not a final program
  lines = tpu_kernels.kernel_lines(tmp_path)
  assert lines == {"add_f": 30, "add_f.1": 40, "mul_f": 50, "TLP": 7,
                   "<late-finalization>": 2}
  assert tpu_kernels.summary(HLO, lines, large=20) == {
      "kernels": 5, "lines": 129, "large": 3, "computations": 2, "one_each": 90}
  # A kernel at or under the threshold is not a large one.
  assert tpu_kernels.summary(HLO, lines, large=40)["large"] == 1
