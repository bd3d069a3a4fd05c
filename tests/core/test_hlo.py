"""core.hlo: bytes per collective read from HLO text, against the shapes' own arithmetic."""

from __future__ import annotations

import pytest

from core import hlo


@pytest.mark.parametrize("text,want", [
    ("f32[2,8]{1,0}", 2 * 8 * 4),
    ("f32[]", 4),
    # FP8 element types (letters after digits) are one byte each, not skipped
    ("f8e4m3fn[4,4]{1,0}", 16),
    ("(f8e5m2[4]{0}, bf16[2]{0})", 4 + 2 * 2),
    ("(f32[2]{0}, /*index=1*/pred[3]{0})", 8 + 3),
    ("s4[7]{0}", 4),          # 28 bits fill 4 bytes
])
def test_shape_bytes(text, want):
  assert hlo.shape_bytes(text) == want


def test_unknown_or_dynamic_shapes_are_refused():
  with pytest.raises(ValueError, match="unknown element type 'f7'"):
    hlo.shape_bytes("f7[4]{0}")
  with pytest.raises(ValueError, match=r"dimensions \[<=4\] of 'f32'"):
    hlo.shape_bytes("f32[<=4]{0}")


def test_collectives_keyed_by_mesh_axes_or_group_text():
  """GSPMD prints its own collectives' groups in XLA's iota form: two different groupings
  stay two keys (not both keyed '' and summed)."""
  text = "\n".join([
      "%a = f32[8]{0} all-reduce(%p), channel_id=1, replica_groups=[2,4]<=[8], to_apply=%r",
      "%b = f32[8]{0} all-reduce(%p), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
      "use_global_device_ids=true, to_apply=%r",
      "%c = f8e4m3fn[16,8]{1,0} all-gather(%q), channel_id=3, "
      "replica_groups=mesh['data'=2,'model'=4] {'data'}, dimensions={0}",
      "%d = bf16[4]{0} all-to-all(%s), replica_groups={{0,1},{2,3}}",
      "%e = f32[2]{0} add(%a, %b)",
  ])
  assert hlo.collective_bytes(text) == {
      ("all-reduce", "[2,4]<=[8]"): 32, ("all-reduce", "[4,2]<=[2,4]T(1,0)"): 32,
      ("all-gather", ("data",)): 128, ("all-to-all", "{{0,1},{2,3}}"): 8}
