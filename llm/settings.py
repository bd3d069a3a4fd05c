"""Settings shared by several LM entry points, each defined once (`core.config.setting`):
sequence and prompt lengths, the text and tokenizer, the attention implementation,
rematerialization, generation lengths, speculative decoding's draft settings, the serving
benchmarks' client counts and requests. An entry
point takes them in its typed config (`SEQ_LEN.field(128)`, llm/run_config.py) or as loose
flags (`core.config.define_flags(None, "seq_len", seq_len=512)`), with its own default.
Settings rec entry points share too are in core/settings.py; a setting of one entry point
lives in that entry point or its study package.
"""

from __future__ import annotations

from core import config

# Text and tokens.
TEXT = config.setting(
    "text", "string", "A text file: the training text (bytes are tokens unless "
    "--tokenizer), or the held-out text a model is scored on.", none_ok=True)
TOKENIZER = config.setting(
    "tokenizer", "string", "tokenizer.json, a directory holding one, a llama2.c "
    "tokenizer.bin or a GGUF file (its vocabulary) (default: the checkpoint's own; "
    "without one, UTF-8 bytes, vocab 256).", none_ok=True)
SEQ_LEN = config.setting(
    "seq_len", "integer", "Tokens per sequence: a training or benchmarked row, a prefill's "
    "new tokens, a generated sequence.", lower=1)
PROMPT = config.setting(
    "prompt", "string", "Prompt text (through the checkpoint's tokenizer, BOS as it adds "
    "it).", none_ok=True)
PROMPT_LEN = config.setting("prompt_len", "integer", "Prompt tokens per row.", lower=1)
NEW_TOKENS = config.setting("new_tokens", "integer", "Generated tokens per row of a timed "
                            "decode.", lower=1)
MAX_NEW_TOKENS = config.setting(
    "max_new_tokens", "integer", "Tokens to generate per prompt (at most; a stop token ends "
    "earlier); prompt + new tokens must fit in the model's max_seq_len.", lower=1)
BOS_ID = config.setting("bos_id", "integer", "Start token of a sequence without a prompt "
                        "(default: the tokenizer's BOS, else 1).", lower=0, none_ok=True)

# The model and how it runs.
TARGET = config.setting(
    "target", "string", "The model a study is about: a checkpoint (llama2c:PATH | hf:DIR | "
    "gguf:FILE | workdir:DIR; speculative decoding's target) or an llm.config preset "
    "(wlb_packing's cost model).", none_ok=True)
ATTENTION_IMPL = config.setting(
    "attention_impl", "string", "Attention implementation (llm.attention): xla, cudnn, "
    "pallas, pallas_mgpu, pallas_triton or auto.")
REMAT = config.setting(
    "remat", "enum", "Rematerialize each block in the backward pass: none, or a "
    "LlamaConfig.remat_policy (full, dots, attention); --remat alone: full.",
    choices=("none", "full", "dots", "attention"), switch=("full", "none"))
WEIGHTS = config.setting(
    "weights", "enum", "Weight-only quantization (llm.quantized): float32 (none), int8 / "
    "int4 (group-wise, ggml Q8_0 / Q4_0 layouts), gguf (a GGUF checkpoint's own stored "
    "blocks, served as they are).", choices=("float32", "int8", "int4", "gguf"))
WARMUP_STEPS = config.setting("warmup_steps", "integer", "Linear learning-rate warmup steps.",
                              lower=0)
COST_MODEL = config.setting(
    "cost_model", "string", "Packing's workload model (llm.packing.cost): 'flops' (the "
    "model's FLOP counts, GFLOP units), the path of a CostModel JSON (seconds), or 'fit' "
    "(measured on this machine; wlb_packing).")

# Speculative decoding.
HEADS = config.setting(
    "heads", "list", "Heads: spec_decode.heads' draft directories to compare; "
    "bench_kernels' query head count H (one integer).")
EVAL_SEQUENCES = config.setting(
    "eval_sequences", "integer", "Held-out sequences (the last ones): the draft head's eval "
    "and the benchmark's prompts.", lower=1)
DRAFT_VOCAB = config.setting(
    "draft_vocab", "integer", "Tokens the draft proposes from: the most frequent in the "
    "training sequences (EAGLE-3's reduced draft vocabulary; 0: the whole vocabulary). The "
    "target still scores every token.", lower=0)
DECODE_VOCAB = config.setting(
    "decode_vocab", "integer", "Tokens the draft proposes from while decoding: the most frequent "
    "of its training sequences, at most the draft vocabulary it trained on (0: that one, or the "
    "whole vocabulary for a head trained without one). A trained head's output rows are the "
    "target's, so fewer can be kept without retraining (FR-Spec, arXiv 2502.14856); a "
    "decoding setting, not one of the trained head.", lower=0)
TREES = config.setting("trees", "list", "Draft tree shapes TOP_K:DEPTH:BUDGET (or "
                       "chain:DEPTH).")
CONCURRENCY = config.setting(
    "concurrency", "list", "Closed-loop client counts to run (each client sends its next "
    "request when its last one finished); empty: none.")
NUM_REQUESTS = config.setting("num_requests", "integer", "Requests per rate or client count.",
                              lower=1)
