r"""Serve a Llama checkpoint over an OpenAI-compatible HTTP API (continuous batching over a
paged KV cache: llm/serving).

  python -m experiments.serve --checkpoint=gguf:.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --port=8000 --max_slots=8 --max_model_len=2048
  curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \
      -d '{"model": "SmolLM2-135M-Instruct.Q4_1", "messages": [{"role": "user", "content": "Hi"}]}'

  from openai import OpenAI
  client = OpenAI(base_url="http://localhost:8000/v1", api_key="none")
  client.completions.create(model=..., prompt="Paris is", max_tokens=16)
  for chunk in client.chat.completions.create(model=..., messages=[...], stream=True): ...

--checkpoint takes llama2c:PATH | hf:DIR | gguf:FILE | workdir:DIR (as experiments.generate;
--dtype, --weights), the tokenizer is the checkpoint's own or --tokenizer, and the model's
name in requests is --served_model_name (default: the checkpoint file or directory's name,
without .gguf / .bin). Routes: /v1/completions, /v1/chat/completions (the checkpoint's chat
template), both streaming with "stream": true; /v1/models; /health. At most --max_queue
requests wait for a slot; more get HTTP 429. SIGTERM (or Ctrl-C) stops taking requests,
lets in-flight ones finish for up to --drain_s seconds (cancelling the rest), and exits 0
after printing a one-line JSON summary. --port unset: a free port; the line
"listening on http://HOST:PORT" is printed once the socket listens. --warmup_tables=all
compiles every program before the port opens (else wider block tables compile on first
use); --compilation_cache_dir keeps them across runs. EAGLE rounds inside the batch:
--speculative_tree=2:4:5 --draft=RUN/draft (a draft head distilled by experiments.
spec_decode; --decode_vocab=N drafts from its N most frequent tokens); long prompts
prefilled context parallel: --cp_prefill_min=N --mesh=cp:K (ring attention over K devices).
"""

from __future__ import annotations

import os
import time

from absl import flags
from core import cli
from core import config
from core import results as results_lib
from core import settings  # the shared settings by name
from llm import settings as lm_settings  # noqa: F401  (the LM settings by name)
from llm.serving.config import DRAFT, EngineConfig

FLAGS = flags.FLAGS

HOST = config.setting("host", "string", "Address the server listens on.")
PORT = config.setting("port", "integer", "TCP port (default: a free one, printed).",
                      lower=1, upper=65535, none_ok=True)
MAX_QUEUE = config.setting(
    "max_queue", "integer", "Requests that may wait for a free engine slot; more are "
    "refused with HTTP 429.", lower=1)
SERVED_MODEL_NAME = config.setting(
    "served_model_name", "string", "The model's name in requests and /v1/models (default: "
    "the checkpoint's file or directory name).", none_ok=True)
WARMUP_TABLES = config.setting(
    "warmup_tables", "enum", "Programs compiled before the port opens: first (every step "
    "shape at the narrowest block-table width; wider tables compile on first use) or all "
    "(every width: no request waits on a compile; serve_bench's setting).",
    choices=("first", "all"))
DRAIN_S = config.setting(
    "drain_s", "float", "On SIGTERM, seconds in-flight requests may take to finish before "
    "they are cancelled.", lower=0)


def define_flags() -> None:
  config.define_flags(EngineConfig)
  config.define_flags(
      None, "checkpoint", "tokenizer", "dtype", "weights", DRAFT, "decode_vocab", HOST, PORT,
      MAX_QUEUE, SERVED_MODEL_NAME, DRAIN_S, WARMUP_TABLES, "compilation_cache_dir", "mesh",
      checkpoint=None, tokenizer=None, draft="", decode_vocab=0, dtype="float32",
      weights="float32", host="127.0.0.1", port=None, max_queue=64, served_model_name=None,
      drain_s=30.0, warmup_tables="first", compilation_cache_dir="",
      mesh="")   # mesh '': none; a cp axis for --cp_prefill_min
  flags.mark_flag_as_required("checkpoint")


def model_name(spec: str) -> str:
  path = spec.split(":", 1)[-1].rstrip("/")
  name = os.path.basename(path)
  for ext in (".gguf", ".bin"):
    if name.endswith(ext):
      name = name[:-len(ext)]
  return name


def main(argv):
  del argv
  cli.quiet_library_logs()
  from llm.checkpoints import find_tokenizer, load_config, load_model
  from llm.serving.cp_prefill import mesh_for
  from llm.serving.engine import Engine, load_draft
  from llm.serving.runner import EngineRunner
  from llm.serving import server as server_lib
  engine_config = config.from_flags(EngineConfig)
  settings.use_compilation_cache(FLAGS.compilation_cache_dir)
  cfg = load_config(FLAGS.checkpoint)
  tok = find_tokenizer(FLAGS.checkpoint, FLAGS.tokenizer, cfg.vocab_size)
  if tok is None:
    raise ValueError(f"--checkpoint={FLAGS.checkpoint}: no tokenizer beside it; the server "
                     "takes and returns text: pass --tokenizer=PATH")
  cfg, model = load_model(FLAGS.checkpoint, FLAGS.dtype, FLAGS.weights)
  draft, vocab = load_draft(FLAGS.draft, model, FLAGS.decode_vocab)
  engine = Engine(model, engine_config, tok, draft=draft, draft_vocab=vocab,
                  mesh=mesh_for(FLAGS.mesh))
  name = FLAGS.served_model_name or model_name(FLAGS.checkpoint)
  t0 = time.time()
  programs = engine.warmup(widths=None if FLAGS.warmup_tables == "all" else engine.widths[:1])
  print(f"engine: {engine_config.max_slots} slots, {engine.pool.num_blocks} pages of "
        f"{engine_config.block_size} tokens ({engine.cache.nbytes() / 2 ** 20:.0f} MiB), "
        f"context {engine.max_len}, paged attention {engine.impl}; {programs} programs "
        f"compiled in {time.time() - t0:.1f} s", flush=True)
  runner = EngineRunner(engine, max_queue=FLAGS.max_queue).start()
  app = server_lib.make_app(runner, tok, name)
  started = time.time()

  def on_listen(port):
    print(f"serving {name} ({FLAGS.checkpoint})", flush=True)
    print(f"listening on http://{FLAGS.host}:{port}", flush=True)

  server_lib.serve(app, runner, FLAGS.host, FLAGS.port or 0, drain_s=FLAGS.drain_s,
                   on_listen=on_listen)
  runner.shutdown(drain_s=0)
  results_lib.print_summary({"checkpoint": FLAGS.checkpoint, "model": name,
                             "seconds": round(time.time() - started, 1), **engine.stats()})


if __name__ == "__main__":
  define_flags()
  cli.run(main)
