"""The training entry points (train_rec, train_lm) and the LLM study entry points (cp_model,
wlb_packing, spec_decode, cp_prefill) refuse
count-like and out-of-range flags while parsing, with a message naming the flag, and refuse
flags that must agree with each other before any work; `wlb_packing --steps=0` (which used
to loop forever) exits at once."""

import json
import os
import subprocess
import sys
import types

import pytest

from tests.experiments.entry import REPO

# (entry point, bad flag): each must fail to parse with "flag --NAME=..." in the message.
BAD = {
    "experiments.wlb_packing.__main__": [
        "--steps=0", "--micro_batches=0", "--cp=0", "--cp_steps=0", "--fit_repeats=0",
        "--context=0", "--min_len=0", "--tile_q=0", "--tile_kv=0", "--measure_dim=0",
        "--measure_heads=0", "--measure_kv_heads=0", "--measure_head_dim=0", "--measure_ffn=0",
        "--windows=2,0", "--queues=-1", "--fit_lengths=16,0", "--fit_tokens=x",
        "--max_len_factor=0", "--tail_prob=2", "--doc_median=0", "--tail_alpha=0",
        "--outlier_fractions=0.5,0"],
    "experiments.cp_model.__main__": [
        "--tokens_128k=0", "--tokens_1m=0", "--curve_points=1", "--bf16_tflops=0",
        "--net_gbps=-1", "--gemm_eff=0", "--gemm_eff=1.5", "--calib_s=0", "--attn_eff=0",
        "--sendrecv_latency_us=-1"],
    "experiments.spec_decode.__main__": [
        "--num_sequences=1", "--eval_sequences=0", "--seq_len=1", "--draft_steps=0",
        "--draft_batch=0", "--prompt_len=0", "--max_new_tokens=0", "--repeats=0",
        "--gen_prompt_len=0", "--warmup_steps=-1", "--batch_sizes=1,0", "--batch_sizes=",
        "--trees=0:2:2", "--trees=4:5", "--draft_lr=0", "--draft_lr=nan",
        "--gen_temperature=0", "--temperature=-1", "--w_cls=-1", "--noise=-0.5"],
    "experiments.train_rec": [
        "--steps=-5", "--steps=0", "--check_every=0", "--eval_every=-1",
        "--checkpoint_every=-1", "--log_every=0", "--stop_at_step=0"],
    "experiments.train_lm": [
        "--seq_len=0", "--batch_size=0", "--steps=-1", "--warmup_steps=-1", "--eval_every=-1",
        "--eval_batches=0", "--checkpoint_every=-1", "--log_every=0", "--stop_at_step=0",
        "--check_every=0"],
    "experiments.cp_prefill": [
        "--batch=0", "--repeats=0", "--seq_len=0", "--cached_len=-2", "--peak_tflops=0",
        "--bandwidth_gbps=0", "--tol=-1"],
}

# Flags an entry point requires, given with every case so that the defaults parse.
REQUIRED = {"experiments.train_lm": ["--text=README.md"]}

# Each module's flags are defined, the arguments parsed, and the flags deleted again, so that
# entry points whose flags share names can be tried in one process.
_SCRIPT = r"""
import importlib, json, sys
from absl import flags
out = {"errors": {}, "names": {}}
required = json.loads(sys.argv[2])
for module, cases in json.loads(sys.argv[1]).items():
  mod = importlib.import_module(module)
  base = required.get(module, [])
  for args in [[]] + [[c] for c in cases]:
    before = set(flags.FLAGS)
    mod.define_flags()
    out["names"][module] = sorted(set(flags.FLAGS) - before)
    try:
      flags.FLAGS(["prog", *base, *args])
      err = None
    except flags.Error as e:
      err = str(e)
    finally:
      for name in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, name)
      flags.FLAGS.unparse_flags()
    out["errors"][module + " " + " ".join(args)] = err
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(BAD), json.dumps(REQUIRED)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(BAD))
def test_bad_flags_refused_while_parsing(parsed, module):
  assert parsed["errors"][module + " "] is None         # the defaults parse
  for case in BAD[module]:
    err = parsed["errors"][f"{module} {case}"]
    name = case.split("=")[0]
    assert err is not None and f"flag {name}=" in err, (module, case, err)


def test_wlb_packing_steps_0_exits_at_once(tmp_path):
  """The command of issue 31 item 1; it used to run until killed, memory growing."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.wlb_packing", "--cost_model=flops",
                        "--steps=0", f"--workdir={tmp_path}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode != 0 and "flag --steps=0: 0 is not a positive integer" in out.stderr
  assert not os.listdir(tmp_path)


def _flag_values(**kw):
  return types.SimpleNamespace(**kw)


def test_flags_that_must_agree():
  from experiments.spec_decode import __main__ as spec
  from experiments.wlb_packing import __main__ as wlb
  ok = dict(eval_sequences=8, num_sequences=16, prompt_len=4, seq_len=8, prompt_text=None,
            gen_prompt_len=8, batch_sizes=["1", "8"])
  spec.check_flags(_flag_values(**ok))
  for change, msg in (({"eval_sequences": 16}, "--eval_sequences=16: expected fewer than "
                       "--num_sequences=16"),
                      ({"prompt_len": 8}, "--prompt_len=8: expected < --seq_len=8"),
                      ({"prompt_text": "t.txt"}, "--gen_prompt_len=8: expected < --seq_len=8"),
                      ({"batch_sizes": ["1", "9"]}, "--batch_sizes up to 9 need as many")):
    with pytest.raises(ValueError, match=msg):
      spec.check_flags(_flag_values(**{**ok, **change}))
  base = dict(min_len=16, context=4096, windows=["1", "2"], steps=8, outlier_fractions=["0.25",
              "0.5"], queues=["1", "2"], max_len_factor=1.0, doc_median=128.0, doc_sigma=1.0,
              tail_prob=0.0, tail_min=1024.0, tail_alpha=1.0, micro_batches=4, cp=4,
              cp_steps=1, tile_q=32, tile_kv=32, seed=0)
  cfg = wlb.build_config(_flag_values(**base))
  assert cfg.thresholds(2) == (1024, 2048) and cfg.dist.context == 4096
  for change, msg in (({"min_len": 5000}, "--min_len=5000: expected at most --context=4096"),
                      ({"steps": 7}, r"--steps=7 is not a multiple of --windows \['2'\]"),
                      ({"queues": ["3"]}, "--queues=3: 3 queues need as many "
                       "--outlier_fractions, got 2"),
                      ({"outlier_fractions": ["0.5", "0.5001"]}, "--outlier_fractions=0.5,0.5001: "
                       r"thresholds \[2048, 2048\]"),
                      ({"max_len_factor": 1e-4}, "--max_len_factor=0.0001: a cap of 0 tokens")):
    with pytest.raises(ValueError, match=msg):
      wlb.build_config(_flag_values(**{**base, **change}))


def test_spec_decode_has_the_flags_its_resume_hint_names(parsed):
  """The hint of a draft-head resume error names --resume_allow, --overwrite, --workdir, and
  the flag of each setting that differs: all of them flags of spec_decode."""
  names = set(parsed["names"]["experiments.spec_decode.__main__"])
  assert {"resume_allow", "overwrite", "workdir", "draft_lr", "draft_batch"} <= names


def test_spec_decode_resume_hint(parsed, tmp_path):
  """A rerun with another --draft_lr is refused with a hint whose flags all exist, and
  following the hint (--resume_allow=distill.learning_rate) resumes. The draft head's run
  is a checkpoint holding the settings that spec_decode's loop config saves (no training:
  check_resume reads only the settings)."""
  import dataclasses
  import re

  import numpy as np

  from core import checkpoint as ckpt_lib
  from core import train as train_lib
  from experiments.spec_decode import __main__ as spec
  from llm.speculative import distill

  names = set(parsed["names"]["experiments.spec_decode.__main__"])
  wd, settings = str(tmp_path / "draft"), {"target": "llama2c:x", "dtype": "float32"}
  dcfg = distill.DistillConfig(steps=1)
  ckpt = ckpt_lib.Checkpointer(wd)
  ckpt.save(1, {"x": np.zeros(2, np.float32)},
            {"step": 1, "steps": 1,
             "settings": train_lib.run_settings(distill.loop_config(wd, dcfg, settings=settings))})
  ckpt.close()
  other = dataclasses.replace(dcfg, learning_rate=1e-3)
  with pytest.raises(train_lib.RunSettingsError) as e:
    train_lib.check_resume(distill.loop_config(wd, other, settings=settings))
  msg = spec.with_flag_names(e.value, names)
  assert "distill.learning_rate: 0.003 (checkpoint) -> 0.001 (now)" in msg
  assert "--resume_allow=distill.learning_rate" in msg
  assert msg.endswith("Flags of these settings: distill.learning_rate is --draft_lr")
  assert set(re.findall(r"--(\w+)", msg)) <= names, set(re.findall(r"--(\w+)", msg)) - names
  assert train_lib.check_resume(distill.loop_config(
      wd, other, settings=settings, resume_allow=("distill.learning_rate",))) == 1
