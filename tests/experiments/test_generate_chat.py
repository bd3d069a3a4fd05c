"""experiments.generate with the checkpoint's own tokenizer: BOS as the tokenizer adds it,
--chat / --chat_file through the chat template, gguf: checkpoints, and the errors."""

import json

import numpy as np
import pytest

from llm import chat
from llm import gguf as G
from llm import gguf_vocab as GV
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from tests.experiments.entry import run_refused
from tests.experiments.test_lm_entry import _greedy, _run, _tiny_weights
from tests.llm.test_tokenizer import train_bpe
from tests import forkserver

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


def _chat_dir(tmp_path, template=TEMPLATE):
  """A tiny random Llama whose tokenizer has ChatML specials, no BOS added, and `template`."""
  d = str(tmp_path / "hf")
  path = train_bpe(d, config={"bos_token": "<s>", "eos_token": "</s>"})
  from tokenizers import Tokenizer
  raw = Tokenizer.from_file(path)
  raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  raw.save(path)
  if template is not None:
    (tmp_path / "hf" / "chat_template.jinja").write_text(template)
  tok = T.load_tokenizer(d)
  cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, max_seq_len=96)
  w = _tiny_weights(cfg, seed=2)
  W.save_hf(d, cfg, w)
  return d, tok, cfg, w


def test_generate_chat(tmp_path):
  d, tok, cfg, w = _chat_dir(tmp_path)
  eot = tok.tokenizers.token_to_id("<|im_end|>")
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the park"}]
  (tmp_path / "m.json").write_text(json.dumps(messages))
  out = json.loads(_run("experiments.generate", [f"--checkpoint=hf:{d}", "--max_new_tokens=10",
                                                 f"--chat_file={tmp_path / 'm.json'}"])[-1])
  prompt = chat.encode_chat(tok, messages)
  assert out["chat"] and out["prompt_ids"] == prompt
  assert prompt.count(tok.tokenizers.token_to_id("<|im_start|>")) == 3 and tok.bos_id not in prompt
  assert out["stop_ids"] == [tok.eos_id, eot]
  assert out["generated_ids"] == _greedy(cfg, w, prompt, 10, stop=(tok.eos_id, eot))
  assert out["reply"] == tok.decode(out["generated_ids"])


@pytest.mark.slow   # two more entry-point runs; the library parts are tested in tests/llm
def test_generate_text_prompt_bos_as_the_tokenizer_adds_it(tmp_path):
  d, tok, _, _ = _chat_dir(tmp_path)
  # A text prompt gets no BOS: this tokenizer adds none (no post-processor, no add_bos_token);
  # --bos adds it anyway.
  out = json.loads(_run("experiments.generate", [f"--checkpoint=hf:{d}", "--max_new_tokens=2",
                                                 "--prompt=the park"])[-1])
  assert out["prompt_ids"] == tok.encode("the park") and out["stop_ids"] == [tok.eos_id]
  out = json.loads(_run("experiments.generate", [f"--checkpoint=hf:{d}", "--max_new_tokens=2",
                                                 "--prompt=the park", "--bos"])[-1])
  assert out["prompt_ids"] == [tok.bos_id] + tok.encode("the park")


@pytest.mark.slow
def test_generate_chat_errors(tmp_path):
  d, _, _, _ = _chat_dir(tmp_path, template=None)
  err = _run("experiments.generate", [f"--checkpoint=hf:{d}", "--chat=hi"], fails=True)
  assert "--chat: the checkpoint's tokenizer" in err and "has no chat template" in err
  (tmp_path / "hf" / "chat_template.jinja").write_text(TEMPLATE)
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps([{"role": "user", "content": "a"}, {"role": "user"}]))
  err = _run("experiments.generate", [f"--checkpoint=hf:{d}", f"--chat_file={bad}"], fails=True)
  assert f"{bad}: entry 1 {{'role': 'user'}} lacks ['content']" in err
  err = _run("experiments.generate", [f"--checkpoint=hf:{d}", "--chat=a", "--prompt=b"],
             fails=True)
  assert "--prompt and --chat: give one prompt" in err


@pytest.mark.slow
def test_generate_from_gguf(tmp_path):
  """A llama2.c-style model exported to GGUF (Q8_0) with its vocabulary: the CLI reads it
  back, starts with BOS as the GGUF says, and greedy-decodes what the library does."""
  from tests.llm.test_tokenizer import _TINY, _bin_pieces
  bin_path = str(tmp_path / "tok.bin")
  T.write_llama2c_tokenizer(bin_path, *_bin_pieces(_TINY))
  src = T.Llama2cTokenizer(bin_path)
  cfg = LlamaConfig(vocab_size=src.vocab_size, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, norm_eps=float(np.float32(1e-5)),
                    max_seq_len=32)
  path = G.save_gguf(str(tmp_path / "m.gguf"), cfg, _tiny_weights(cfg, seed=4), qtype="Q8_0",
                     vocab=GV.vocab_from_llama2c(src))
  out = json.loads(_run("experiments.generate", [f"--checkpoint=gguf:{path}", "--prompt=abc ab",
                                                 "--max_new_tokens=6"])[-1])
  prompt = src.encode("abc ab", bos=True)
  assert out["prompt_ids"] == prompt
  assert out["generated_ids"] == _greedy(*G.load_gguf(path), prompt, 6, stop=(2,))
  err = _run("experiments.generate", [f"--checkpoint=gguf:{path}", "--chat=hi"], fails=True)
  assert "has no chat template" in err


_CASES = """
import contextlib, importlib, io, json, sys
from absl import flags
from core import cli
module = importlib.import_module(sys.argv[1])
module.define_flags()
out = []
for args in json.loads(sys.argv[2]):
  flags.FLAGS.unparse_flags()
  err, code = io.StringIO(), 0
  with contextlib.redirect_stderr(err):
    try:
      cli.run(module.main, [sys.argv[1], *args])
    except SystemExit as e:
      code = e.code
  out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def run_cases(module: str, cases: list[list[str]]) -> list[tuple[int, str]]:
  """(exit status, stderr) of `python -m module *args` for each case, run one after another
  through core.cli.run in one process (one interpreter and jax start for all)."""
  import os
  import sys
  from tests import cpu_env
  from tests.experiments.entry import REPO
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
  out = forkserver.run([sys.executable, "-c", _CASES, module, json.dumps(cases)], fork=True, cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return [tuple(c) for c in json.loads(out.stdout.strip().splitlines()[-1])]


def test_generate_usage_errors_are_one_line_before_the_model_loads(tmp_path):
  """Each bad flag ends in one `error:` line with status 2 (no flag help), found from the
  checkpoint's config.json before the weights are read: this directory has none."""
  d = tmp_path / "hf"
  d.mkdir()
  cfg = LlamaConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                    rope_theta=10000.0, max_seq_len=16)
  (d / "config.json").write_text(json.dumps(W.config_to_hf(cfg)))
  ck = f"--checkpoint=hf:{d}"
  bad_chat = tmp_path / "chat.json"
  bad_chat.write_bytes(b'[{"role": "user", "content": "a"')
  cases = {
      "--prompt needs a tokenizer: hf:": [ck, "--prompt=hi"],
      "--max_new_tokens=20 with a 1-token prompt makes 21 tokens, beyond the model's "
      "max_seq_len=16": [ck, "--max_new_tokens=20"],
      "prompt ids: [40] outside the vocabulary; expected ids in [0, 40)": [ck, "--prompt_ids=1,40"],
      "--stop_ids: [-1] outside the vocabulary": [ck, "--prompt_ids=1", "--stop_ids=-1"],
      "--prompt_ids=1,x: 'x' is not an integer": [ck, "--prompt_ids=1,x"],
      f"--chat_file: {bad_chat}:1: not JSON": [ck, f"--chat_file={bad_chat}"],
      "--chat needs a tokenizer": [ck, "--chat=hi"],
      "error: --tokenizer=/nope/tokenizer.json: no such file or directory; expected a "
      "tokenizer.json, a directory holding one, a llama2.c tokenizer.bin or a GGUF file":
          [ck, "--tokenizer=/nope/tokenizer.json", "--prompt=hi"],
      f"error: --chat_file={tmp_path}/nope.json: No such file or directory; expected a UTF-8 "
      "JSON list": [ck, f"--chat_file={tmp_path}/nope.json"],
      "/nope.gguf: no such GGUF file": ["--checkpoint=gguf:/nope.gguf"],
      # Empty prompt flags are refused, not read as "no prompt" (a BOS-only prompt).
      "error: --prompt_ids='': empty; expected comma-separated token ids": [ck, "--prompt_ids="],
      "error: --chat='': empty; expected a user message": [ck, "--chat="],
      "error: --top_p=0.0: out of range; expected a number > 0 and <= 1": [ck, "--top_p=0"],
      # Flags that the prompt given would ignore.
      "error: --bos_id=5: given with --prompt_ids; expected no prompt flag":
          [ck, "--prompt_ids=1", "--bos_id=5"],
      "error: --bos: given with --prompt_ids; expected --prompt": [ck, "--prompt_ids=1", "--bos"],
      "error: --nobos: given with no prompt; expected --prompt": [ck, "--nobos"],
  }
  for (want, args), (code, err) in zip(cases.items(), run_cases("experiments.generate",
                                                                 list(cases.values()))):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, err)
    assert want in lines[0], (want, lines[0])
  # Bounds of the sampling flags, refused while the flags are parsed.
  for args, want in (("--temperature=-1", "flag --temperature=-1: -1.0 is not a non-negative"),
                     ("--top_p=1.5", "flag --top_p=1.5: 1.5 is not")):
    out = run_refused("experiments.generate", [ck, args], timeout=60)
    assert want in out.stderr, out.stderr
