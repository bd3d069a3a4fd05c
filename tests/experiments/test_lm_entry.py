"""experiments.train_lm / generate / bench_llm end to end (tiny sizes, 8 simulated devices)."""

import json
import os
import re
import sys

import numpy as np
import pytest

from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from tests.llm.test_tokenizer import _TINY, _bin_pieces, train_bpe
from tests import cpu_env
from tests import forkserver

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.environ.get("LLM_DATA_DIR", os.path.join(os.path.dirname(REPO), "shared", "data"))
STORIES = os.path.join(DATA, "llama2c", "stories260K.bin")
EXPECTED = [461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435, 299, 362, 409, 283, 264, 283,
            452, 288, 13, 431, 431, 431, 431, 431, 431, 431, 431, 431, 431, 431, 431, 431, 293,
            430, 417, 363, 416, 315, 342]


def _run(module, args, fails=False):
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  out = forkserver.run([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  if fails:
    assert out.returncode != 0, out.stdout[-3000:]
    return out.stderr
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.strip().splitlines()


def _tiny_weights(cfg, seed=0):
  rng = np.random.default_rng(seed)
  return {n: (1.0 if "norm" in n else 0.2) * (np.ones(s) if "norm" in n else rng.standard_normal(s))
          for n, s in W.param_shapes(cfg).items()}


def _greedy(cfg, weights, prompt, n, stop=()):
  """The library's greedy continuation, in this process (the reference for the CLI)."""
  from flax import nnx

  from llm import generate as G
  from llm import model as M
  model = nnx.eval_shape(lambda: M.Llama(cfg, nnx.Rngs(0)))   # no random init: loaded next
  M.load_weights(model, weights)
  return G.generate(model, [prompt], n, stop_tokens=stop)[0]


def test_train_lm_then_generate_from_workdir(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  wd = tmp_path / "run"
  lines = _run("experiments.train_lm", [f"--text={text}", "--steps=30", "--seq_len=32",
                                        "--batch_size=8", "--mesh=fsdp:4,tp:2", "--eval_every=0",
                                        "--log_every=10", f"--workdir={wd}"])
  summary = json.loads(lines[-1])
  assert summary["steps"] == 30 and summary["mesh"] == {"fsdp": 4, "tp": 2}
  assert summary["eval_loss"] < 3.0          # from ln(256) = 5.55 at init: it learned something
  assert (wd / "results.json").exists() and (wd / "curves.png").exists()
  out = json.loads(_run("experiments.generate", [f"--checkpoint=workdir:{wd}", "--prompt=the ",
                                                 "--max_new_tokens=8"])[-1])
  assert out["prompt_ids"] == list(b"the ") and len(out["generated_ids"]) == 8


@pytest.mark.skipif(not os.path.exists(STORIES), reason="stories260K.bin not found (LLM_DATA_DIR)")
def test_generate_stories260k_matches_llama2c():
  out = json.loads(_run("experiments.generate", [f"--checkpoint=llama2c:{STORIES}",
                                                 "--max_new_tokens=40"])[-1])
  assert out["prompt_ids"] == [1] and out["generated_ids"] == EXPECTED


def _hf_dir(tmp_path, weights_fn=None):
  """A random tiny Llama with a BPE tokenizer trained in the test (BOS <s>, which its
  tokenizer_config.json says to add, EOS </s>)."""
  d = str(tmp_path / "hf")
  tok = T.load_tokenizer(train_bpe(d, config={"bos_token": "<s>", "eos_token": "</s>",
                                               "add_bos_token": True}))
  cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, max_seq_len=64)
  w = _tiny_weights(cfg)
  if weights_fn is not None:
    weights_fn(w)
  W.save_hf(d, cfg, w)
  return d, tok, cfg, w


def test_generate_hf_prompt_text(tmp_path):
  d, tok, cfg, w = _hf_dir(tmp_path)
  out = json.loads(_run("experiments.generate", [f"--checkpoint=hf:{d}", "--max_new_tokens=12",
                                                 "--prompt=Once upon a time"])[-1])
  prompt = [tok.bos_id] + tok.encode("Once upon a time")
  assert out["prompt_ids"] == prompt
  assert out["generated_ids"] == _greedy(cfg, w, prompt, 12, stop=(tok.eos_id,))
  assert out["text"] == tok.decode(prompt + out["generated_ids"])
  assert out["text"].startswith("Once upon a time")
  # Beyond the model's 64 positions: a flag error naming the limit, before any generation.
  err = _run("experiments.generate", [f"--checkpoint=hf:{d}", "--max_new_tokens=60",
                                      "--prompt=Once upon a time"], fails=True)
  assert (f"--max_new_tokens=60 with a {len(prompt)}-token prompt makes {len(prompt) + 60} "
          f"tokens, beyond the model's max_seq_len=64") in err


def test_generate_refuses_non_finite_weights(tmp_path):
  def poison(w):
    w["layers.1.w_down"][2, 3] = np.nan
  d, _, _, _ = _hf_dir(tmp_path, poison)
  err = _run("experiments.generate", [f"--checkpoint=hf:{d}", "--prompt_ids=1,2"], fails=True)
  assert (f"{d}/model.safetensors: tensor 'model.layers.1.mlp.down_proj.weight' (32, 64) holds "
          "1 non-finite values (NaN or Inf), the first at index (3, 2)") in err


def test_generate_llama2c_with_tokenizer_bin(tmp_path):
  tok_path = str(tmp_path / "tokenizer.bin")
  T.write_llama2c_tokenizer(tok_path, *_bin_pieces(_TINY))
  tok = T.Llama2cTokenizer(tok_path)
  cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=32,
                    tie_embeddings=True)
  w = _tiny_weights(cfg, seed=1)
  model_path = str(tmp_path / "model.bin")
  W.save_llama2c(model_path, cfg, w)
  out = json.loads(_run("experiments.generate", [
      f"--checkpoint=llama2c:{model_path}", f"--tokenizer={tok_path}", "--prompt=abc ab",
      "--max_new_tokens=10"])[-1])
  prompt = tok.encode("abc ab", bos=True)
  assert out["prompt_ids"] == prompt and prompt[0] == 1
  assert out["generated_ids"] == _greedy(cfg, W.load_llama2c(model_path)[1], prompt, 10,
                                         stop=(2, 1))
  assert out["text"] == tok.decode(prompt + out["generated_ids"])
  # Without a tokenizer, text prompts are refused with the way out.
  err = _run("experiments.generate", [f"--checkpoint=llama2c:{model_path}", "--prompt=abc"],
             fails=True)
  assert "--prompt needs a tokenizer" in err and "--tokenizer=PATH" in err


@pytest.mark.slow   # an entry point end to end; CI's default suite keeps to its time
def test_train_lm_with_tokenizer_then_generate(tmp_path):
  tok_path = train_bpe(str(tmp_path / "tok"), config={"bos_token": "<s>", "eos_token": "</s>"})
  tok = T.load_tokenizer(tok_path)
  text = tmp_path / "text.txt"
  text.write_text(" ".join(["the quick brown fox jumps over the lazy dog."] * 300))
  wd = tmp_path / "run"
  summary = json.loads(_run("experiments.train_lm", [
      f"--text={text}", f"--tokenizer={tok_path}", "--steps=30", "--seq_len=32",
      "--batch_size=8", "--mesh=fsdp:8", "--eval_every=0", f"--workdir={wd}"])[-1])
  assert summary["tokenizer"] == tok_path and summary["eval_bits_per_byte"] is None
  # A 10-token cycle: far below log2(vocab) = 8.5 bits per token once learned.
  assert summary["eval_bits_per_token"] < 4.0
  cfg = json.loads((wd / "model_config.json").read_text())
  assert cfg["vocab_size"] == tok.vocab_size
  assert (wd / "tokenizer.json").read_bytes() == open(tok_path, "rb").read()
  out = json.loads(_run("experiments.generate", [f"--checkpoint=workdir:{wd}",
                                                 "--prompt=the quick", "--max_new_tokens=8"])[-1])
  assert out["prompt_ids"] == tok.encode("the quick")       # no BOS: training had none
  assert out["text"] == tok.decode(out["prompt_ids"] + out["generated_ids"])


def test_bench_llm_runs_ours_only(tmp_path):
  out = json.loads(_run("experiments.bench_llm", ["--preset=tiny", "--prompt_len=16",
                                                  "--new_tokens=4", "--rounds=1", "--repeats=1",
                                                  "--copy_mb=16",
                                                  f"--workdir={tmp_path}"])[-1])
  assert out["ours"]["prefill_tokens_per_s"] > 0 and out["peer"] is None
  assert (tmp_path / "hf_model" / "config.json").exists()


@pytest.mark.parametrize("args, want", [
    (["--new_tokens=1"], "error: --new_tokens=1: no decode step to time; expected at least 2"),
    (["--preset=nope"], "error: --preset=nope: Llama preset 'nope': expected one of"),
    (["--prompt_len=500", "--new_tokens=13"],
     "error: --prompt_len=500 + --new_tokens=13: 513 tokens, beyond the max_seq_len of "
     "--preset=tiny; expected at most 512"),
    (["--prompt=hi"], "error: --prompt: given with --preset=tiny, which has no tokenizer"),
    (["--weights=gguf"], "error: --weights=gguf takes the blocks a GGUF file stores"),
    (["--peers=llama_cpp"], "error: --peers=llama_cpp: given without --peer_python"),
    (["--peer_python=/nope/python"],
     "error: --peer_python=/nope/python: no such executable; expected the Python of the peer"),
    (["--peer_python=" + sys.executable, "--peers=transformers,nope"],
     "error: --peers=transformers,nope: 'nope' is not a peer; expected peers among "),
    ([f"--checkpoint=llama2c:{STORIES}"],
     f"error: --preset=tiny: given with --checkpoint=llama2c:{STORIES}; expected one of them"),
])
def test_bench_llm_refuses_before_the_workdir_is_written(tmp_path, args, want):
  """Each bad setting ends in one line naming its flag, before a model is built, a peer
  runs or the workdir gets a file (the default run times a 100M-parameter model)."""
  err = _run("experiments.bench_llm", ["--preset=tiny", *args, f"--workdir={tmp_path / 'w'}"],
             fails=True)
  assert err.strip().splitlines()[-1].startswith(want), err[-3000:]
  left = os.listdir(tmp_path / "w") if (tmp_path / "w").exists() else []
  assert left == [], left


def test_train_lm_packing_flags_name_the_flag():
  from types import SimpleNamespace

  from experiments import train_lm
  ok = dict(packing="wlb", cp_sharding="doc", seq_len=64, doc_context=131072,
            context_parallel="pass_kv", mesh="data:2,cp:4")
  train_lm.check_packing_flags(SimpleNamespace(**ok), cp_ranks=4)
  train_lm.check_packing_flags(SimpleNamespace(**{**ok, "packing": "none", "cp_sharding": "seq"}),
                               cp_ranks=1)
  for change, ranks, match in [
      ({"packing": "none"}, 4, "--cp_sharding=doc needs documents: set --packing"),
      ({"cp_sharding": "adaptive", "context_parallel": "none"}, 1,
       "--cp_sharding=adaptive needs context parallelism: --context_parallel"),
      ({"seq_len": 36}, 4, "--seq_len=36 with --cp_sharding=doc: expected a multiple of 2 x 4"),
      ({"doc_context": 32}, 4, "--doc_context=32: expected 0 or at least --seq_len=64")]:
    with pytest.raises(ValueError, match=match):
      train_lm.check_packing_flags(SimpleNamespace(**{**ok, **change}), cp_ranks=ranks)


def _lm_flags(**change):
  from types import SimpleNamespace
  ok = dict(attention_impl="cudnn", dtype="bfloat16", preset="tiny", packing="none",
            cp_sharding="seq", seq_len=64, doc_context=131072, context_parallel="pass_kv",
            mesh="data:2,cp:4")
  f = SimpleNamespace(**{**ok, **change})
  from llm.config import get_config
  return f, get_config(f.preset, dtype=f.dtype, attention_impl=f.attention_impl,
                       context_parallel=f.context_parallel)


H100 = dict(backend="gpu", compute_capability="9.0", cuda_runtime=12080, cudnn=True)


@pytest.mark.parametrize("change,ranks,match", [
    # cuDNN takes one document per row and no segment ids on ring blocks: no packing ...
    ({"packing": "wlb", "context_parallel": "none", "mesh": "data:8"}, 1,
     "--attention_impl=cudnn with --packing=wlb --cp_sharding=seq --context_parallel=none: "
     "packed rows hold several documents"),
    ({"packing": "original"}, 4,
     "--attention_impl=cudnn with --packing=original --cp_sharding=seq "
     "--context_parallel=pass_kv: packed rows"),
    # ... so neither per-document nor adaptive CP sharding (which need packed documents)
    ({"packing": "fixed", "cp_sharding": "doc"}, 4,
     "--attention_impl=cudnn with --packing=fixed --cp_sharding=doc --context_parallel=pass_kv"),
    ({"packing": "wlb", "cp_sharding": "adaptive", "context_parallel": "pass_q"}, 4,
     "--attention_impl=cudnn with --packing=wlb --cp_sharding=adaptive --context_parallel=pass_q"),
    ({"cp_sharding": "doc"}, 4,
     "--attention_impl=cudnn with --packing=none --cp_sharding=doc"),
    # cuDNN's dtypes, and a device that has it
    ({"dtype": "float32"}, 4, "--attention_impl=cudnn with --dtype=float32 --preset=tiny "
                              r"\(head dim \d+\): dtype float32: cuDNN flash attention takes "
                              "bfloat16 or float16"),
    ({"device": dict(backend="cpu", compute_capability=None, cuda_runtime=None, cudnn=False)},
     4, "--attention_impl=cudnn: no GPU with cuDNN flash attention here .backend cpu"),
    ({"device": dict(H100, compute_capability="7.5", cudnn=False)}, 4,
     "compute capability 7.5; it needs sm 8.0 or newer"),
])
def test_train_lm_refuses_what_cudnn_cannot_run(change, ranks, match):
  from experiments import train_lm
  from llm.attention.choose import DeviceInfo
  device = DeviceInfo(**change.pop("device", H100))
  f, cfg = _lm_flags(**change)
  with pytest.raises(ValueError, match=match) as e:
    train_lm.check_flags(f, cfg, cp_ranks=ranks, device=device)
  assert "expected --attention_impl=auto" in str(e.value)


def test_train_lm_accepts_what_the_library_runs():
  from experiments import train_lm
  from llm.attention.choose import DeviceInfo
  # cuDNN blocks inside ring attention (pass-KV, pass-Q) on a GPU with cuDNN, no packing.
  for cp in ("pass_kv", "pass_q", "auto"):
    f, cfg = _lm_flags(context_parallel=cp)
    train_lm.check_flags(f, cfg, cp_ranks=4, device=DeviceInfo(**H100))
  # Every other implementation takes packed documents under any CP sharding (no device needed).
  for impl in ("auto", "xla", "pallas"):
    f, cfg = _lm_flags(attention_impl=impl, packing="wlb", cp_sharding="adaptive")
    train_lm.check_flags(f, cfg, cp_ranks=4, device=DeviceInfo("cpu"))


@pytest.mark.slow   # an entry point end to end on 8 simulated devices
def test_train_lm_packing_logs_the_measured_work(tmp_path):
  """train_lm --packing=wlb --cp_sharding=adaptive over data:2,cp:4: every step's logged
  imbalance numbers equal an independent count over the same batches (rebuilt here from the
  library's source with the run's settings), and a bad combination stops naming the flag."""
  from llm.config import get_config
  from llm.data import TextSource
  from llm.packing import cost as C
  from llm.packing.cp_shard import TileModel
  from llm.packing.lengths import CorpusLengths
  from llm.packing.source import PackedSource, PackingSpec
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
  wd = tmp_path / "run"
  summary = json.loads(_run("experiments.train_lm", [
      f"--text={text}", "--steps=3", "--seq_len=64", "--batch_size=4", "--mesh=data:2,cp:4",
      "--context_parallel=pass_kv", "--packing=wlb", "--cp_sharding=adaptive",
      "--doc_context=4096", "--eval_every=0", "--eval_batches=1", "--log_every=1",
      f"--workdir={wd}"])[-1])
  assert summary["packing"] == "wlb" and summary["cp_sharding"] == "adaptive"
  logged = [json.loads(l) for l in (wd / "metrics.jsonl").read_text().splitlines()]
  logged = [r for r in logged if r.get("split", "train") == "train" and "pack_tokens" in r]
  assert len(logged) == 3
  cfg = get_config("tiny")
  src = PackedSource(TextSource(str(text), 64, 4).tokens, CorpusLengths(4096, scale=64 / 4096),
                     PackingSpec(packing="wlb", layout="adaptive"), seq_len=64, batch_size=4,
                     cp=4, cost=C.flop_cost_model(C.Shape.from_config(cfg)).scaled(1e-9, 1e-9),
                     n_layers=cfg.n_layers, tile_model=TileModel(2, 2))
  for rec, batch in zip(logged, src.batches(0)):
    # Independent count: the model's entry balancing by chunk index, then pos + 1 per token.
    c = 64 // 8
    order = [k for i in range(4) for k in (i, 7 - i)]
    slots = np.concatenate([np.arange(k * c, (k + 1) * c) for k in order])
    w = np.where(batch.segment_ids != 0, batch.positions + 1, 0)[:, slots].reshape(4, 4, 16)
    per = w.sum(-1)                                     # [rows, ranks]
    assert rec["pack_imbalance_mb"] == pytest.approx(per.sum(1).max() / per.sum(1).mean())
    assert rec["pack_imbalance_cp"] == pytest.approx(per.sum(0).max() / per.sum(0).mean())
    assert rec["pack_tokens"] == float(np.sum(batch.segment_ids != 0))
  res = json.loads((wd / "results.json").read_text())
  assert len(res["packing"]["steps"]) == 3
  err = _run("experiments.train_lm", [f"--text={text}", "--packing=none", "--cp_sharding=doc",
                                      f"--workdir={tmp_path / 'bad'}"], fails=True)
  assert "error: --cp_sharding=doc needs documents" in err


def test_train_lm_refuses_405b_in_seconds_naming_estimate_and_memory(tmp_path):
  """Llama 3.1 405B's training state alone (16 bytes per parameter, 5.9 TiB) is over any
  host's RAM: refused by llm.memory's estimate before the model is built or compiled
  (compiling it first takes minutes and ends in RESOURCE_EXHAUSTED)."""
  import time
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(8), JAX_PLATFORMS="cpu")
  t0 = time.monotonic()
  out = forkserver.run([sys.executable, "-m", "experiments.train_lm", f"--text={text}",
                        "--preset=llama3_405b", "--batch_size=8", "--seq_len=32",
                        f"--workdir={tmp_path / 'run'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
  took = time.monotonic() - t0
  assert out.returncode == 2, out.stderr[-3000:]
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert len(errors) == 1 and out.stderr.strip().splitlines()[-1] == errors[0], out.stderr
  line = errors[0]
  for part in ("--preset=llama3_405b", "training needs at least", "params ", "optimizer ",
               "gradients ", "activations ", "TiB", "on each of 8 devices",
               "of available RAM shared by 8 CPU devices", "--nomemory_check"):
    assert part in line, (part, line)
  assert "Traceback" not in out.stderr
  assert took < 30, took


def test_train_lm_default_workdir_is_new_per_run(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
  env = dict(os.environ, XLA_FLAGS=cpu_env.xla_flags(1), JAX_PLATFORMS="cpu",
             PYTHONPATH=cpu_env.python_path(REPO))
  args = [sys.executable, "-m", "experiments.train_lm", f"--text={text}", "--seq_len=16",
          "--batch_size=2", "--eval_every=0", "--eval_batches=1", "--log_every=1"]
  out = forkserver.run(args + ["--steps=2"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  runs = os.listdir(tmp_path / "runs")
  assert len(runs) == 1 and re.fullmatch(r"train_lm_tiny_\d{8}-\d{6}", runs[0]), runs
  assert json.loads(out.stdout.splitlines()[-1])["workdir"] == os.path.join("runs", runs[0])
  # The default warmup (30 steps) on a 2-step run is cut, and the run says so.
  assert ("--warmup_steps: the default 30 is not below --steps=2; warming up over 1 step"
          in out.stdout.splitlines())
  again = forkserver.run(args + ["--steps=2", "--resume"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
  assert again.returncode == 2
  assert again.stderr.strip().splitlines()[-1] == ("error: train_lm: --resume needs --workdir, "
                                                   "the run to continue")


# train_lm's refusals: each a line naming its flag, before the --init checkpoint's weights
# are read and before the workdir gets a file.
@pytest.mark.parametrize("args, want", [
    (["--preset=nope"], "error: --preset=nope: unknown; expected one of byte_small, "),
    (["--attention_impl=nope"], "error: --attention_impl='nope': expected one of "),
    (["--packing=wlb", "--seq_len=32", "--cost_model=fit"],
     "error: --cost_model=fit: no such file; expected 'flops' or a CostModel JSON file"),
    # settings no part of the run reads: refused, not ignored
    (["--packing=wlb", "--seq_len=32", "--fixed_window=3"],
     "error: --fixed_window=3: not read by this run; expected it only with --packing=fixed"),
    (["--lora_targets=mlp"], "error: --lora_targets=mlp: not read by this run; expected it "
                             "only with --lora_rank >= 1"),
    # the schedule would cut the warmup short, so the peak rate given is never reached
    (["--steps=20", "--warmup_steps=20"], "error: --warmup_steps=20: not below --steps=20; "
                                          "expected at most 19"),
])
def test_train_lm_names_the_flag_of_an_unknown_or_unread_setting(tmp_path, args, want):
  from tests.experiments.entry import run_refused
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
  out = run_refused("experiments.train_lm", [f"--text={text}", *args,
                                             f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1].startswith(want), out.stderr[-3000:]
  assert os.listdir(tmp_path / "w") == []


@pytest.mark.parametrize("args, want", [
    (["--learning_rate=0"], "error: --learning_rate=0.0: expected a finite learning rate > 0"),
    (["--text={d}/nope.txt"], "error: {d}/nope.txt: no such file (--text)"),
    (["--packing=wlb", "--cost_model={d}/nope.json"],
     "error: --cost_model={d}/nope.json: no such file; expected 'flops' or a CostModel JSON"),
])
def test_train_lm_refuses_before_reading_the_init_weights(tmp_path, args, want):
  """A checkpoint whose weights file is missing: the settings' and inputs' errors come
  first, not after every weight of --init is read."""
  from tests.experiments.entry import run_refused
  d, _, _, _ = _hf_dir(tmp_path)
  os.remove(os.path.join(d, "model.safetensors"))
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog. " * 50)
  out = run_refused("experiments.train_lm", [
      f"--init=hf:{d}", f"--text={text}", "--seq_len=32",
      *[a.format(d=tmp_path) for a in args], f"--workdir={tmp_path / 'w'}"])
  assert out.stderr.strip().splitlines()[-1].startswith(want.format(d=tmp_path)), \
      out.stderr[-3000:]
  assert os.listdir(tmp_path / "w") == []


@pytest.mark.parametrize("module, args", [
    ("experiments.generate", ["--prompt=hi"]),
    ("experiments.eval_lm", ["--text={d}/text.txt", "--workdir={d}/w"]),
    ("experiments.serve", []),
    ("experiments.llm_quant", ["--workdir={d}/w"]),
    ("experiments.train_lm", ["--init=hf:{d}/no_model", "--text={d}/text.txt", "--workdir={d}/w"]),
    ("experiments.train_lm", ["--text={d}/text.txt", "--workdir={d}/w"]),
])
@pytest.mark.parametrize("bad, found", [
    ("nope.json", "no such file or directory"),
    ("", "a directory without tokenizer.json"),
])
def test_missing_tokenizer_named_by_its_flag_before_the_checkpoint(tmp_path, module, args, bad,
                                                                   found):
  """--tokenizer naming nothing a loader reads: the flag, the value and what it takes, before
  the checkpoint is opened (here it does not exist either; read first, it would fail first,
  and a missing file named alone as 'expected a llama2.c tokenizer.bin' names no flag)."""
  from tests.experiments.entry import run_refused
  (tmp_path / "text.txt").write_text("the quick brown fox. " * 20)
  path = str(tmp_path / bad) if bad else str(tmp_path)
  ckpt = [] if module == "experiments.train_lm" else [f"--checkpoint=hf:{tmp_path}/no_model"]
  out = run_refused(module, [*ckpt, *[a.format(d=tmp_path) for a in args],
                             f"--tokenizer={path}"])
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --tokenizer={path}: {found}; expected a tokenizer.json, a directory holding "
      "one, a llama2.c tokenizer.bin or a GGUF file"), out.stderr[-3000:]
