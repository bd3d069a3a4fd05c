"""experiments.serve as a user runs it, checked with the `openai` client: one server process
over a tiny random Llama with a BPE tokenizer and a ChatML template (hf:DIR), on a free
port. Completions (text and token-id prompts, streamed and not; slow: equal to the library's
greedy generation); chat completions go through the template; /v1/models, errors in OpenAI's form;
SIGTERM lets an in-flight stream finish and the process exit 0 with its JSON line."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import openai
import pytest

from llm import chat
from llm import tokenizer as T
from llm import weights as W
from llm.config import LlamaConfig
from tests import cpu_env
from tests.llm.test_tokenizer import train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_checkpoint(d: str):
  """A tiny random Llama (hf: layout) whose tokenizer has ChatML specials and a template."""
  from tokenizers import Tokenizer
  path = train_bpe(d, config={"bos_token": "<s>", "eos_token": "</s>"})
  raw = Tokenizer.from_file(path)
  raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
  raw.save(path)
  with open(os.path.join(d, "chat_template.jinja"), "w") as fh:
    fh.write(TEMPLATE)
  tok = T.load_tokenizer(d)
  cfg = LlamaConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                    ffn_dim=64, rope_theta=10000.0, max_seq_len=96)
  rng = np.random.default_rng(2)
  w = {n: np.ones(s) if "norm" in n else 0.2 * rng.standard_normal(s)
       for n, s in W.param_shapes(cfg).items()}
  W.save_hf(d, cfg, w)
  return tok


class ServerProcess:
  """`python -m experiments.serve ...` with its stdout read line by line on a thread."""

  def __init__(self, args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_env.xla_flags(1))
    self.proc = subprocess.Popen([sys.executable, "-m", "experiments.serve", *args], cwd=REPO,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True)
    self.lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    self.stdout: list[str] = []

  def _read(self):
    for line in self.proc.stdout:
      self.lines.put(line.rstrip("\n"))
    self.lines.put(None)

  def wait_for(self, prefix: str, timeout: float = 180) -> str:
    end = time.time() + timeout
    while time.time() < end:
      try:
        line = self.lines.get(timeout=1)
      except queue.Empty:
        continue
      if line is None:
        break
      self.stdout.append(line)
      if line.startswith(prefix):
        return line
    self.proc.kill()
    raise AssertionError(f"no {prefix!r} line; stdout {self.stdout}, stderr "
                         f"{self.proc.stderr.read()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("serve") / "hf")
  tok = make_checkpoint(d)
  server = ServerProcess([f"--checkpoint=hf:{d}", "--served_model_name=tiny", "--max_slots=2",
                          "--block_size=8", "--prefill_chunk=16", "--max_model_len=48",
                          "--drain_s=60"])
  port = int(server.wait_for("listening on http://").rsplit(":", 1)[1])
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0, timeout=120)
  yield server, client, tok, d
  if server.proc.poll() is None:
    server.proc.kill()


def _greedy(d, prompt, n, stop):
  from llm import generate as G
  from llm.checkpoints import load_model
  return G.generate(load_model(f"hf:{d}")[1], [prompt], n, stop_tokens=stop)[0]


def test_models_completions_and_chat(served):
  server, client, tok, d = served
  assert [m.id for m in client.models.list().data] == ["tiny"]
  out = client.completions.create(model="tiny", prompt="the park", max_tokens=8, temperature=0)
  text = out.choices[0].text
  assert out.usage.prompt_tokens == len(tok.encode("the park")) == 3
  assert out.usage.completion_tokens == 8 or out.choices[0].finish_reason == "stop"
  # Token ids as the prompt, two prompts as two choices, and streamed.
  ids = client.completions.create(model="tiny", prompt=[tok.encode("the park"), [5, 6]],
                                  max_tokens=8, temperature=0)
  assert [c.index for c in ids.choices] == [0, 1] and ids.choices[0].text == text
  chunks = list(client.completions.create(model="tiny", prompt="the park", max_tokens=8,
                                          temperature=0, stream=True))
  assert "".join(c.choices[0].text for c in chunks) == text
  assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
  # Chat: the template's prompt; the reply ends at <|im_end|> at the latest.
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
  reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                         temperature=0)
  assert reply.usage.prompt_tokens == len(chat.encode_chat(tok, messages))
  assert reply.choices[0].message.role == "assistant"
  streamed = list(client.chat.completions.create(
      model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
      stream_options={"include_usage": True}))
  assert streamed[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == (
      reply.choices[0].message.content)
  assert streamed[-1].usage.completion_tokens == reply.usage.completion_tokens
  # Sampling with a seed is reproducible.
  a, b = (client.completions.create(model="tiny", prompt="a", max_tokens=6, temperature=1.0,
                                    seed=3).choices[0].text for _ in range(2))
  assert a == b


# 4 s of compiling generate in this process; the engine's greedy rows equal generate's in
# tests/llm/serving/test_engine.py, and the text and token-id prompts agree above.
@pytest.mark.slow
def test_completion_equals_the_librarys_greedy_generation(served):
  _, client, tok, d = served
  want = _greedy(d, tok.encode("the park"), 8, tok.stop_ids)
  out = client.completions.create(model="tiny", prompt="the park", max_tokens=8, temperature=0)
  assert out.choices[0].text == tok.decode(want)
  assert out.usage.completion_tokens == len(want)
  assert out.choices[0].finish_reason == ("stop" if want[-1] in tok.stop_ids else "length")


def test_serve_bench_http_driver_with_ignore_eos(served):
  """experiments.serve_bench's HTTP driver on this server: text prompts, ignore_eos, exactly
  max_tokens each, counted by the streamed usage; ignore_eos must be a boolean."""
  from experiments.benchmarks import serving as S
  _, client, tok, _ = served
  runner = S.HTTPRunner(client.base_url.scheme + "://" + client.base_url.host + ":"
                        + str(client.base_url.port), "tiny", tok.decode, {"ignore_eos": True})
  reqs = [(tok.encode("the park"), 30), (tok.encode("a"), 12)]
  recs = S.run_closed(runner, reqs, 2)
  assert all(r.error is None and r.tokens == r.max_tokens for r in recs), recs
  assert all(r.events <= r.tokens and r.first <= r.last for r in recs)
  with pytest.raises(RuntimeError, match="HTTP 400.*ignore_eos"):
    runner.post("/v1/completions", {"model": "tiny", "prompt": "a", "ignore_eos": "maybe"})


def test_errors_in_openai_form(served):
  _, client, _, _ = served
  with pytest.raises(openai.BadRequestError, match="beyond the model's context of 48"):
    client.completions.create(model="tiny", prompt="the park", max_tokens=200)
  with pytest.raises(openai.NotFoundError, match="does not exist"):
    client.completions.create(model="nope", prompt="x")
  with pytest.raises(openai.BadRequestError, match="entry 0 .* lacks"):
    client.chat.completions.create(model="tiny", messages=[{"role": "user"}])


def test_bad_flags_refused_before_the_model_loads(served, tmp_path):
  """One line naming the flags and what was expected, before the engine line: checked only
  after the weights load, each would fail late (an address in use or a host that does not
  resolve: a traceback after every program compiled), or name the engine's arguments
  (draft=, speculative_tree=, mesh=, num_blocks=) rather than the flags."""
  from tests.experiments.entry import run_refused
  _, client, _, d = served
  port = client.base_url.port   # the served fixture's, in use
  nodraft = tmp_path / "nodraft"
  nodraft.mkdir()
  for args, line in (
      (["--decode_vocab=5"], "--decode_vocab=5: no --draft; expected --decode_vocab=0 without a "
       "draft head"),
      (["--speculative_tree=2:4:5"], "--draft='' and --speculative_tree='2:4:5': one without "
       "the other; expected both (a speculative engine) or neither"),
      (["--speculative_tree=2:4", "--draft=random"], "--speculative_tree=2:4: tree shape "
       "'2:4'; expected TOP_K:DEPTH:BUDGET of integers >= 1 (e.g. 2:4:5) or chain:DEPTH"),
      (["--speculative_tree=0:4:5", "--draft=random"], "--speculative_tree=0:4:5: top_k=0; "
       "expected TOP_K:DEPTH:BUDGET of integers >= 1 (e.g. 2:4:5) or chain:DEPTH"),
      ([f"--draft={nodraft}", "--speculative_tree=2:4:5"], f"--draft={nodraft}: no "
       "checkpoints/ directory in it; expected a draft-head run's workdir "
       "(experiments.spec_decode's <workdir>/draft) or 'random'"),
      (["--cp_prefill_min=32"], "--cp_prefill_min=32 and --mesh='': one without the other; "
       "expected both (--mesh with a cp axis of 2 or more devices, e.g. --mesh=cp:2) or "
       "neither"),
      (["--max_model_len=97"], "--max_model_len=97: beyond the model's context (96); expected "
       "at most 96"),
      (["--num_blocks=4"], "--num_blocks=4: 3 pages of 16 slots besides the padding page, "
       "fewer than one request of 96 tokens (--max_model_len) takes; expected at least 7"),
      (["--paged_attention=pallas", "--block_size=8"], "--block_size=8: not a power of two "
       ">= 16; expected a power of two >= 16 with the Pallas kernel (--paged_attention=pallas)"),
      ([f"--port={port}"], f"--host=127.0.0.1 --port={port}: Address already in use; expected "
       "an address this machine can listen on (a free --port, a local --host)")):
    out = run_refused("experiments.serve", [f"--checkpoint=hf:{d}", *args])
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == "error: " + line
    assert "engine:" not in out.stdout
  assert os.listdir(nodraft) == []


def test_sigterm_lets_the_stream_finish_and_exits_0(served):
  server, client, tok, _ = served
  stream = client.completions.create(model="tiny", prompt="the park", max_tokens=40,
                                     temperature=0, stream=True)
  it = iter(stream)
  first = next(it)
  server.proc.send_signal(signal.SIGTERM)
  rest = list(it)
  assert rest[-1].choices[0].finish_reason in ("length", "stop")
  text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
  assert len(tok.encode(text)) > 1
  summary = json.loads(server.wait_for("{", timeout=60))
  assert server.proc.wait(timeout=60) == 0
  assert summary["model"] == "tiny" and summary["pages_used"] == 0
  assert any(line.startswith("stopping: 1 requests in flight") for line in server.stdout)
