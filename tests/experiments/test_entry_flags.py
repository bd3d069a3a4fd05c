"""Every entry point's flags are checked while parsing, with a message naming the flag:
every integer flag of every entry point (found as tests/experiments/test_entry_help.py finds
them, so a new one is covered) has a lower bound, >= 1 for counts (steps, batch sizes, rows,
repeats, lengths, layers, workers ...) and below 1 only where ALLOW_ZERO says what 0 (or -1)
means, and the value below the bound is refused; the other bad values of BAD too. Flags
that must agree with each other are refused before any work; `wlb_packing --steps=0`
exits at once rather than looping forever."""

import json
import os
import sys
import types

import pytest

from tests.experiments.entry import MODULES, REPO
from tests import forkserver

# Integer flags whose lower bound is below 1, with what the value at the bound means; any
# other integer flag must have lower_bound >= 1. "*": every entry point (a seed may be 0;
# the shared rec flags of rec.configs.define_run_flags mean the same everywhere).
ALLOW_ZERO = {
    "*": {"seed": "a seed", "data_seed": "a seed", "search_seed": "a seed",
          "embedding_dim": "0: the preset's",
          "dedup_capacity": "0: the next power of two that holds a batch's bags"},
    "core.cli": {"process_id": "process 0 of the job", "hang_timeout_s": "0: no hang watchdog"},
    "experiments.train_rec": {"eval_every": "0: evaluate only at the end",
                              "checkpoint_every": "0: only at the end",
                              "data_workers": "0: batches drawn in the training process"},
    "experiments.bench_pipeline": {"data_workers": "0: batches drawn in the training process"},
    "experiments.train_lm": {"warmup_steps": "0: no warmup", "eval_every": "0: only at the end",
                             "checkpoint_every": "0: only at the end",
                             "wlb_queues": "0: WLB-LLM without outlier queues",
                             "doc_context": "0: document lengths drawn at --seq_len, unscaled",
                             "cp_tile": "0: the kernel's 128, scaled like the documents",
                             "lora_rank": "0: full fine-tuning (no adapters)"},
    "experiments.finetune_lm.__main__": {"lora_rank": "0: full fine-tuning (no adapters)"},
    "experiments.wlb_packing.__main__": {"train_steps": "0: no training grid"},
    "experiments.spec_decode.__main__": {"warmup_steps": "0: no warmup", "bos_id": "a token id",
                                         "draft_vocab": "0: the whole vocabulary",
                                         "decode_vocab": "0: --draft_vocab's"},
    "experiments.serve": {"decode_vocab": "0: the head's own draft vocabulary",
                        "cp_prefill_min": "0: off (every prompt prefilled in chunks)"},
    "experiments.serve_bench": {"decode_vocab": "0: the head's own draft vocabulary",
                              "cp_prefill_min": "0: off (every prompt prefilled in chunks)"},
    "experiments.cp_prefill": {"cached_len": "0: nothing cached (plain prefill)"},
    "experiments.wukong_scaling.__main__": {"sizes": "0: every size of the grid"},
    "experiments.fp8_probe.__main__": {"timing_steps": "0: no timing"},
    "experiments.bench_kernels": {"kv_heads": "0: as many as --heads"},
    "experiments.bench_dlrm": {"rows": "--preset=mlperf: 0 keeps the reference's 204M rows"},
    "experiments.bench_lm_train": {"loss_chunk": "-1: automatic, 0: plain loss",
                                   "warmup": "0: no untimed steps"},
    "experiments.generate": {"bos_id": "a token id", "top_k": "0: every token"},
    "experiments.gpu_report.__main__": {"mlperf_rows": "0: the reference's 204M rows"},
    "experiments.predict": {"batch_size": "0: the run's --eval_batch_size"},
    "experiments.preprocess_criteo": {"workers": "0: one per CPU core"},
    "experiments.exfm.__main__": {"drift_features": "0: no feature drifts",
                                  "vertical_feature": "feature 0 (an index)"},
}

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
        "--gen_temperature=-1", "--temperatures=-1", "--w_cls=-1", "--noise=-0.5"],
    "experiments.train_rec": [
        "--steps=-5", "--steps=0", "--check_every=0", "--eval_every=-1",
        "--checkpoint_every=-1", "--log_every=0", "--stop_at_step=0",
        "--checkpoint_every_minutes=-1"],
    "experiments.train_lm": [
        "--seq_len=0", "--batch_size=0", "--steps=-1", "--warmup_steps=-1", "--eval_every=-1",
        "--eval_batches=0", "--checkpoint_every=-1", "--log_every=0", "--stop_at_step=0",
        "--check_every=0", "--checkpoint_every_minutes=-1"],
    "experiments.cp_prefill": [
        "--batch=0", "--repeats=0", "--seq_len=0", "--cached_len=-2", "--peak_tflops=0",
        "--bandwidth_gbps=0", "--tol=-1"],
    "experiments.mp_embedding.__main__": ["--seeds=0,x", "--seeds=-1", "--memory_dims=16,0",
                                          "--memory_dims=abc"],
    "experiments.compare_rec.__main__": ["--seeds=0,1.5"],
    "experiments.dmt.__main__": ["--towers=2,40", "--h100_hosts=x"],
}

# Each module's flags are defined (with those `cli.run` adds to every entry point), its
# integer flags' bounds read, the arguments parsed, and the flags deleted again, so that
# entry points whose flags share names can be tried in one process. A required flag
# (a string without a default) is given "x" in every case, so that the defaults parse.
_SCRIPT = r"""
import importlib, json, re, sys
from absl import flags
from core import cli
modules, bad = json.loads(sys.argv[1]), json.loads(sys.argv[2])
RUN_CONFIG_ENTRIES = {"experiments.train_rec", "experiments.compare_rec.__main__",
                      "experiments.wukong_scaling.__main__", "experiments.mp_embedding.__main__",
                      "experiments.fp8_probe.__main__", "experiments.a2a_compression.__main__"}
out = {"errors": {}, "names": {}, "bounds": {}, "configs": {}}
required = {}

def flags_of(define):
  before = set(flags.FLAGS)
  define()
  new = sorted(set(flags.FLAGS) - before)
  return new, {n: flags.FLAGS[n].parser.lower_bound for n in new
               if isinstance(flags.FLAGS[n].parser, flags.IntegerParser)}

def parse(module, define, args, then=None):
  new, _ = flags_of(define)
  try:
    flags.FLAGS(["prog", *required.get(module, []), *args])
    return then() if then else None
  except flags.Error as e:
    return str(e)
  finally:
    for name in new:
      delattr(flags.FLAGS, name)
    flags.FLAGS.unparse_flags()

for module in ["core.cli"] + modules:
  define = cli.define_flags if module == "core.cli" else importlib.import_module(module).define_flags
  new, bounds = flags_of(define)
  for name in new:
    delattr(flags.FLAGS, name)
  if module == "core.cli":
    cli.define_flags()     # every entry point has them: defined under the others
  out["names"][module], out["bounds"][module] = new, bounds
  while (err := parse(module, define, [])) and (
      m := re.search(r"Flag --(\w+) must have a value other than None", err)):
    if f"--{m[1]}=x" in required.get(module, []):
      break
    required.setdefault(module, []).append(f"--{m[1]}=x")
  mod = importlib.import_module(module)
  if module in RUN_CONFIG_ENTRIES:
    # the config from the default flags (settings without a flag at the config's defaults)
    from rec import configs
    def config():
      over = {} if "seed" in flags.FLAGS else {"seed": 0}
      try:
        cfg = configs.run_from_flags(**over)
        return {"config": cfg.flat_settings()}
      except ValueError as e:
        return {"config_error": str(e)}
    out["configs"][module] = parse(module, define, [], then=config)
  cases = [[]] + [[f"--{n}={b - 1}"] for n, b in bounds.items() if b is not None]
  for args in cases + [[c] for c in bad.get(module, [])]:
    out["errors"][module + " " + " ".join(args)] = parse(module, define, args)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def parsed():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-c", _SCRIPT, json.dumps(MODULES), json.dumps(BAD)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", ["core.cli"] + MODULES)
def test_integer_flags_bounded_and_refused_below(parsed, module):
  """Each integer flag has a lower bound (>= 1, or below 1 with its reason in ALLOW_ZERO),
  and the value under it is refused while parsing, naming the flag."""
  assert parsed["errors"][module + " "] is None, parsed["errors"][module + " "]  # defaults parse
  allowed = {**ALLOW_ZERO["*"], **ALLOW_ZERO.get(module, {})}
  stale = sorted(set(ALLOW_ZERO.get(module, {})) - set(parsed["bounds"][module]))
  assert not stale, f"{module}: ALLOW_ZERO names {stale}, not integer flags of it"
  for name, bound in parsed["bounds"][module].items():
    if name in allowed:
      assert bound is not None and bound <= 0, (
          f"{module} --{name}: listed in ALLOW_ZERO ({allowed[name]}) but bounded at {bound}")
    else:
      assert bound is not None and bound >= 1, (
          f"{module} --{name}: an integer flag without a lower bound >= 1; bound it where it "
          "is defined (lower_bound=1), or list it in ALLOW_ZERO with what 0 means")
    err = parsed["errors"][f"{module} --{name}={bound - 1}"]
    assert err is not None and f"flag --{name}={bound - 1}" in err, (module, name, err)


def test_rec_entry_points_build_their_config_from_flags(parsed):
  """Each entry point that builds a RecRunConfig with `rec.configs.run_from_flags` gets
  its config whole from its default flags, at its own defaults."""
  assert {"experiments.train_rec", "experiments.compare_rec.__main__",
          "experiments.wukong_scaling.__main__", "experiments.mp_embedding.__main__",
          "experiments.fp8_probe.__main__"} <= set(parsed["configs"])
  for module, got in parsed["configs"].items():
    assert "config" in got, (module, got)
  wukong = parsed["configs"]["experiments.wukong_scaling.__main__"]["config"]
  assert (wukong["data"], wukong["num_rows"], wukong["dense_optimizer"], wukong["batch_size"],
          wukong["learning_rate"]) == ("synthetic_deep", 20, "adam", 1024, 1e-3)
  assert parsed["configs"]["experiments.train_rec"]["config"]["batch_size"] == 2048


def test_count_flags_named_by_issue_31_are_counts(parsed):
  """The count flags issue 31 names, refused at 0 (or below) in the entry points it tried."""
  counts = {"experiments.train_rec": ["steps", "batch_size", "num_rows", "log_every"],
            "experiments.train_lm": ["seq_len", "batch_size", "steps"],
            "experiments.wlb_packing.__main__": ["steps", "micro_batches"],
            "experiments.preprocess_criteo": ["num_rows", "unit_mb", "min_count"],
            "experiments.bench_dlrm": ["batch_size", "steps", "repeats", "rounds"],
            "experiments.pvf.__main__": ["steps", "trials", "llama_len", "chunk"],
            "experiments.recd.__main__": ["batch_size", "steps", "repeats", "user_bag"]}
  for module, names in counts.items():
    for name in names:
      assert parsed["bounds"][module][name] >= 1, (module, name)


@pytest.mark.parametrize("module", sorted(BAD))
def test_bad_flags_refused_while_parsing(parsed, module):
  assert parsed["errors"][module + " "] is None         # the defaults parse
  for case in BAD[module]:
    err = parsed["errors"][f"{module} {case}"]
    name = case.split("=")[0]
    assert err is not None and f"flag {name}=" in err, (module, case, err)


def test_hang_timeout_read_from_its_flag():
  """--hang_timeout_s, defined for every entry point, is what the train loop's watchdog
  waits (core.train.TrainConfig.hang_timeout_s None); its default outside an entry point."""
  from absl import flags

  from core import distributed
  fv = flags.FlagValues()
  assert distributed.hang_timeout_s(fv) == distributed.HANG_TIMEOUT_S
  distributed.define_flags(fv)
  fv(["prog", "--hang_timeout_s=7"])
  assert distributed.hang_timeout_s(fv) == 7.0


def test_wlb_packing_steps_0_exits_at_once(tmp_path):
  """The command of issue 31 item 1 ends at once, not running until killed, memory growing."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-m", "experiments.wlb_packing", "--cost_model=flops",
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
            chat_prompts=False, gen_prompt_len=8, batch_sizes=["1", "8"], bench_prompts=8,
            gen_temperature=1.0, draft_vocab=64, decode_vocab=64)
  spec.check_flags(_flag_values(**ok))
  spec.check_flags(_flag_values(**{**ok, "draft_vocab": 0, "decode_vocab": 999}))
  for change, msg in (({"eval_sequences": 16}, "--eval_sequences=16: expected fewer than "
                       "--num_sequences=16"),
                      ({"prompt_len": 8}, "--prompt_len=8: expected < --seq_len=8"),
                      ({"prompt_text": "t.txt"}, "--gen_prompt_len=8: expected < --seq_len=8"),
                      ({"batch_sizes": ["1", "9"]}, "--batch_sizes up to 9 need as many"),
                      ({"bench_prompts": 9}, "--bench_prompts=9: expected at most "
                       "--eval_sequences=8"),
                      ({"gen_temperature": 0.0}, "--gen_temperature=0 .greedy. needs "
                       "--chat_prompts"),
                      ({"decode_vocab": 65}, "--decode_vocab=65: expected at most "
                       "--draft_vocab=64")):
    with pytest.raises(ValueError, match=msg):
      spec.check_flags(_flag_values(**{**ok, **change}))
  base = dict(min_len=16, context=4096, windows=["1", "2"], steps=8, outlier_fractions=["0.25",
              "0.5"], queues=["1", "2"], max_len_factor=1.0, doc_median=128.0, doc_sigma=1.0,
              tail_prob=0.0, tail_min=1024.0, tail_alpha=1.0, micro_batches=4, cp=4,
              cp_steps=1, tile_q=32, tile_kv=32, seed=0, train_steps=0)
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
