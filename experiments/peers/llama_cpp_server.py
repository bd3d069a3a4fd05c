"""llama.cpp's OpenAI-compatible HTTP server (llama-cpp-python's `llama_cpp.server`) on one GGUF
file, set up for a side-by-side serving benchmark.

Runs in the Python 3.11 peer environment (`pip install "llama-cpp-python[server]"`;
experiments/peers/README.md) and imports nothing from the project. The same as
  python -m llama_cpp.server --model FILE --n_threads 2 --n_threads_batch 2 --host 127.0.0.1 \
      --port 8001 --n_ctx 2048 --interrupt_requests False --disable_ping_events True \
      --logits_all False
with the settings a benchmark needs spelled out: `interrupt_requests` off (its default, on,
ends a streaming completion early, with `data: [DONE]`, as soon as another request arrives),
no SSE ping comments, and `logits_all` off (the server's default, on, has llama.cpp compute the
logits of every prompt position and copies them into Python, work our engine does not do: a
256-token SmolLM2 Q4_1 prompt's evaluation took about 15% longer with it, 1 thread, best of 6;
only `logprobs` requests need it: llama-cpp-python raises on them without it); and, unless
--extra_bufts, llama.cpp's extra weight buffers off (AMX and repacked layouts: on the VM here
a -DGGML_NATIVE=ON build faults with SIGILL in the AMX kernels on the first quantized product;
llama_cpp_gguf.py says more). One model, one sequence at a time: concurrent requests queue
behind a lock (no batching across requests).

  python llama_cpp_server.py --gguf_file M.gguf --port 8001 [--threads 2] [--n_ctx 2048]

`python -m experiments.serve_bench --targets=...,llama_cpp` runs it beside our server (its
request fields: experiments/peers/README.md). Serves POST /v1/completions,
/v1/chat/completions, POST /extras/tokenize, GET /v1/models; the `model` field of a
request may be omitted or be --model_alias (default: the file's base name). Prints one JSON line
(url, model) to stdout when the model is loaded, then serves until SIGINT / SIGTERM.
"""

import argparse
import json
import os

import uvicorn
from llama_cpp.server.app import create_app
from llama_cpp.server.settings import ModelSettings, ServerSettings

# The sibling script (this directory is sys.path[0] when run as a script): one copy of the
# extra-buffer switch and its check.
from llama_cpp_gguf import model_params_without_extra_bufts


def settings(argv=None):
  """(ServerSettings, ModelSettings) of the command line; unless --extra_bufts, every model
  loads without llama.cpp's extra buffer types from here on."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--gguf_file", required=True)
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=8001)
  ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--n_ctx", type=int, default=2048)
  ap.add_argument("--model_alias", default=None)
  ap.add_argument("--extra_bufts", action="store_true",
                  help="keep llama.cpp's extra weight buffers (AMX, repacked layouts)")
  args = ap.parse_args(argv)
  if not args.extra_bufts:
    model_params_without_extra_bufts()
  alias = args.model_alias or os.path.basename(args.gguf_file)
  server = ServerSettings(host=args.host, port=args.port, interrupt_requests=False,
                          disable_ping_events=True)
  model = ModelSettings(model=args.gguf_file, model_alias=alias, n_threads=args.threads,
                        n_threads_batch=args.threads, n_ctx=args.n_ctx, logits_all=False,
                        verbose=False)
  return server, model


def main():
  server, model = settings()
  app = create_app(server_settings=server, model_settings=[model])
  print(json.dumps({"url": f"http://{server.host}:{server.port}/v1",
                    "model": model.model_alias}), flush=True)
  uvicorn.run(app, host=server.host, port=server.port, log_level="warning")


if __name__ == "__main__":
  main()
