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


def check_flags(engine_config: EngineConfig) -> None:
  """The flag combinations the engine refuses, each named as its flags before the
  checkpoint is read (the engine would say so after the weights load)."""
  from core import errors
  from llm.speculative.tree import TreeShape
  tree = engine_config.speculative_tree
  if bool(FLAGS.draft) != bool(tree):
    raise errors.expected(f"--draft={FLAGS.draft!r} and --speculative_tree={tree!r}",
                          "one without the other", "both (a speculative engine) or neither")
  if FLAGS.decode_vocab and not FLAGS.draft:
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}", "no --draft",
                          "--decode_vocab=0 without a draft head")
  if tree:
    try:
      TreeShape.parse(tree)
    except ValueError as e:   # "tree shape '2:4': expected ..." or "TreeShape: top_k=0, ..."
      found = str(e).removeprefix("TreeShape: ").split("expected")[0].rstrip(" ,:;")
      raise errors.expected(f"--speculative_tree={tree}", found, "TOP_K:DEPTH:BUDGET of "
                            "integers >= 1 (e.g. 2:4:5) or chain:DEPTH") from None
  if (FLAGS.draft and FLAGS.draft != "random"
      and not os.path.isdir(os.path.join(FLAGS.draft, "checkpoints"))):
    raise errors.expected(f"--draft={FLAGS.draft}", "no checkpoints/ directory in it",
                          "a draft-head run's workdir (experiments.spec_decode's "
                          "<workdir>/draft) or 'random'")
  m = engine_config.cp_prefill_min
  if m and tree:
    raise errors.expected(f"--cp_prefill_min={m}", f"given with --speculative_tree={tree}",
                          "one of them (the context-parallel prefill does not feed the draft "
                          "head)")
  if bool(m) != bool(FLAGS.mesh):
    raise errors.expected(f"--cp_prefill_min={m} and --mesh={FLAGS.mesh!r}",
                          "one without the other", "both (--mesh with a cp axis of 2 or more "
                          "devices, e.g. --mesh=cp:2) or neither")
  if FLAGS.mesh:
    from core import mesh as mesh_lib
    from llm.model import CP_AXIS
    if dict(mesh_lib.parse_mesh(FLAGS.mesh)).get(CP_AXIS, 0) in (0, 1):
      raise errors.expected(f"--mesh={FLAGS.mesh}", f"no {CP_AXIS} axis of 2 or more devices",
                            f"a mesh such as {CP_AXIS}:2 (the context-parallel prefill's)")
  widths = engine_config.chunk_widths
  if widths and max(widths) < engine_config.prefill_chunk:
    raise errors.expected(f"--chunk_widths={','.join(map(str, widths))}",
                          f"none >= --prefill_chunk={engine_config.prefill_chunk}",
                          "the largest width at least --prefill_chunk")


def check_engine(engine_config: EngineConfig, cfg) -> None:
  """The engine's shapes against the model's config (read without its weights)."""
  from core import errors
  from llm.serving.paged import blocks_for, choose_paged_impl
  if (engine_config.max_model_len or 0) > cfg.max_seq_len:
    raise errors.expected(f"--max_model_len={engine_config.max_model_len}",
                          f"beyond the model's context ({cfg.max_seq_len})",
                          f"at most {cfg.max_seq_len}")
  bs = engine_config.block_size
  if choose_paged_impl(engine_config.paged_attention) == "pallas" and (bs < 16 or bs & (bs - 1)):
    raise errors.expected(f"--block_size={bs}", "not a power of two >= 16",
                          "a power of two >= 16 with the Pallas kernel "
                          f"(--paged_attention={engine_config.paged_attention})")
  max_len = min(engine_config.max_model_len or cfg.max_seq_len, cfg.max_seq_len)
  pages = blocks_for(max_len, bs)
  n = engine_config.num_blocks
  if n is not None and n - 1 < pages:
    raise errors.expected(f"--num_blocks={n}", f"{n - 1} pages of {bs} slots besides the "
                          f"padding page, fewer than one request of {max_len} tokens "
                          "(--max_model_len) takes", f"at least {pages + 1}")


def check_address(host: str, port: int | None) -> None:
  """--host / --port bound once and released: an address in use or a host that does not
  resolve is one line before the model loads and compiles, not a traceback after it."""
  import socket

  from core import errors
  try:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind((host, port or 0))
  except OSError as e:
    raise errors.expected(f"--host={host} --port={port if port else '(any free)'}",
                          e.strerror or str(e), "an address this machine can listen on "
                          "(a free --port, a local --host)") from None


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import errors
  from llm.checkpoints import find_tokenizer, load_config, load_model
  from llm.serving.cp_prefill import mesh_for
  from llm.serving.engine import Engine, load_draft
  from llm.serving.runner import EngineRunner
  from llm.serving import server as server_lib
  from llm import tokenizer as tok_lib
  engine_config = config.from_flags(EngineConfig)
  check_flags(engine_config)
  if FLAGS.tokenizer:
    tok_lib.check_path(FLAGS.tokenizer)
  check_address(FLAGS.host, FLAGS.port)
  mesh = mesh_for(FLAGS.mesh)
  settings.use_compilation_cache(FLAGS.compilation_cache_dir)
  cfg = load_config(FLAGS.checkpoint)
  check_engine(engine_config, cfg)
  if FLAGS.decode_vocab > cfg.vocab_size:
    raise errors.expected(f"--decode_vocab={FLAGS.decode_vocab}",
                          f"more tokens than the model's vocabulary of {cfg.vocab_size}",
                          f"at most {cfg.vocab_size}")
  tok = find_tokenizer(FLAGS.checkpoint, FLAGS.tokenizer, cfg.vocab_size)
  if tok is None:
    raise errors.expected(f"--checkpoint={FLAGS.checkpoint}", "no tokenizer beside it",
                          "--tokenizer=PATH (the server takes and returns text)")
  cfg, model = load_model(FLAGS.checkpoint, FLAGS.dtype, FLAGS.weights)
  draft, vocab = load_draft(FLAGS.draft, model, FLAGS.decode_vocab)
  engine = Engine(model, engine_config, tok, draft=draft, draft_vocab=vocab, mesh=mesh)
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
