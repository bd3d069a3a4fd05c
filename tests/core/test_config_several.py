"""core.config: one setting narrowed for an entry point (`Setting.narrowed`) and taken as a
list of its values (`Setting.several`), its flag checked while parsing."""

from __future__ import annotations

import pytest
from absl import flags

from core import config
from core import errors

ROWS = config.setting("test_several_rows", "integer", "Rows.", lower=0)
ALPHA = config.setting("test_several_alpha", "float", "An exponent.", lower=0)


def test_narrowed_bounds_the_flag_and_refuses_wider_bounds():
  fv = flags.FlagValues()
  config.define_flags(None, ROWS.narrowed(lower=1), flag_values=fv, test_several_rows=5)
  assert fv["test_several_rows"].parser.lower_bound == 1
  with pytest.raises(flags.IllegalFlagValueError, match="flag --test_several_rows=0"):
    fv(["prog", "--test_several_rows=0"])
  assert ROWS.lower == 0 and config.get("test_several_rows") is ROWS   # the setting stays
  with pytest.raises(ValueError, match="wider"):
    ROWS.narrowed(lower=-1)


def test_several_parses_each_value_as_the_setting_does():
  fv = flags.FlagValues()
  config.define_flags(None, ROWS.several(), ALPHA.several(), flag_values=fv,
                      test_several_rows=["10", "1e3"], test_several_alpha=["1", "0.5"])
  fv(["prog", "--test_several_rows=5,1e4", "--test_several_alpha=0"])
  assert fv.test_several_rows == ["5", "1e4"] and fv.test_several_alpha == ["0"]
  assert "Several, comma-separated" in fv["test_several_rows"].help
  for bad, want in (("--test_several_rows=5,-1", "-1: out of range; expected an integer >= 0"),
                    ("--test_several_rows=x", "'x': not a number; expected an integer >= 0"),
                    ("--test_several_rows=1.5", "1.5: not an integer; expected an integer >= 0"),
                    ("--test_several_alpha=-2", "-2.0: out of range; expected a number >= 0")):
    fv.unparse_flags()
    with pytest.raises(flags.IllegalFlagValueError) as e:
      fv(["prog", bad])
    assert str(e.value).startswith(f"flag {bad.split('=')[0]}=") and want in str(e.value)
  assert ROWS.several().check("1,2e3", "--test_several_rows") == (1, 2000)
  with pytest.raises(errors.UserError, match="--test_several_rows=-3: out of range; expected"):
    ROWS.several().check(["-3"], "--test_several_rows")
