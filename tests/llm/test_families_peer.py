"""Llama, Qwen2 / Qwen2.5 and Mistral against transformers itself (marker `peer`).

experiments/peers/hf_families.py runs in the Python 3.11 peer environment (torch CPU +
transformers; experiments/peers/README.md) and imports nothing from the project; arrays
travel as .npz / .json files in tmp_path. Checked:
  (a) checkpoints transformers writes (`save_pretrained` of random weights: Llama with
      Llama 3 RoPE scaling, Qwen2 with q / k / v biases tied and untied, Qwen2 with
      use_sliding_window in every layer, in the layers from max_window_layers on, and in
      those layer_types marks, Qwen2 with YaRN RoPE scaling (defaults, and betas, mscale and
      mscale_all_dim set), Mistral with a head_dim of its own and a sliding window shorter
      than the sequences) read by our HF loader: logits of two 24-token rows within 1e-4
      of transformers' float32 forward, and greedy ids equal (ragged prompts batched
      through `llm.generate`, whose cache is a rolling one of the window's size for a
      window in every layer, against transformers' generate, one prompt at a time, through
      its own KV cache);
  (b) our HF export (`llm.weights.save_hf` of each family's random model, and
      `experiments.export --to=hf` of the transformers-written Mistral) loads in
      transformers with the same logits and greedy ids; so do our Qwen2 and Llama GGUF
      files through transformers' GGUF loader (skipped without gguf / accelerate there);
  (c) `experiments.eval_lm --text` gives transformers' mean token loss on the same file and
      weights within 1e-4 relative (Qwen2 and Mistral, windows of 16 tokens > the window);
  (d) transformers' Qwen2Tokenizer built from a small byte-level BPE's vocab and merges:
      our loader of the tokenizer.json it saves and our GGUF vocabulary of it
      (tokenizer.ggml.pre "qwen2") give its ids on texts with digits, contractions,
      newlines, non-NFC and non-Latin characters;
  (e) where a directory leaves a choice (model.safetensors beside a shard index, no
      sliding_window key, a tied config with a differing lm_head.weight), ours is
      transformers' or a refusal.

The peer Python: HF_PEER_PYTHON, else bin/python of the peer environment beside the checkout
(../peer311, the other peer tests' default, or ../peer). Alone:
  .venv/bin/python -m pytest -q -s -m peer tests/llm/test_families_peer.py
(-s prints the max logit difference per family).
"""

from __future__ import annotations

import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm import checkpoints as C
from llm import generate as G
from llm import gguf_vocab as GV
from llm import model as M
from llm import tokenizer as T
from llm import weights as W
from llm.config import YarnScaling, get_config
from tests.experiments.entry import run_entry
from tests.peer_env import RUN_CODE, peer_python
from tests.llm.test_families import family_weights
from tests.llm.test_tokenizer import SENTENCES, train_bpe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "experiments", "peers", "hf_families.py")


PEER = peer_python("HF_PEER_PYTHON")
pytestmark = [pytest.mark.peer,
              pytest.mark.skipif(not os.path.exists(PEER),
                                 reason=f"transformers peer environment absent ({PEER})")]

V = 320          # the test tokenizer has 300 tokens
_BASE = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
# transformers-written checkpoints: name -> (family, config kwargs).
FAMILIES = {
    "llama_rope_scaled": ("llama", {"rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                                    "rope_parameters": {"rope_type": "llama3",
                                                        "rope_theta": 500000.0, "factor": 8.0,
                                                        "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 16}}),
    "qwen2_untied": ("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                               "tie_word_embeddings": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2_window": ("qwen2", {"tie_word_embeddings": True, "use_sliding_window": True,
                               "max_window_layers": 0, "sliding_window": 5}),
    "qwen2_window_from_layer1": ("qwen2", {"tie_word_embeddings": False,
                                           "use_sliding_window": True, "max_window_layers": 1,
                                           "sliding_window": 5}),
    "qwen2_yarn": ("qwen2", {"tie_word_embeddings": True, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "qwen2_layer_types_yarn": ("qwen2", {
        "use_sliding_window": True, "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                            "original_max_position_embeddings": 32, "beta_fast": 8.0,
                            "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 0.5}}),
    "mistral_window": ("mistral", {"head_dim": 32, "sliding_window": 6,
                                   "rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 1e6}}),
}
# Our random models exported with save_hf: name -> config.
OURS = {"ours_qwen2": get_config("tiny_qwen2", vocab_size=V),
        "ours_qwen2_window": get_config("tiny_qwen2", vocab_size=V, sliding_window=5,
                                        tie_embeddings=False),
        "ours_qwen2_layer1_yarn": get_config(
            "tiny_qwen2", vocab_size=V, sliding_window=5, window_layers=(1,),
            rope_theta=10000.0, rope_scaling=YarnScaling(factor=4.0, original_max_position=16)),
        "ours_mistral": get_config("tiny_mistral", vocab_size=V, sliding_window=6),
        "ours_llama": get_config("tiny_tied", vocab_size=V)}
IDS = np.random.default_rng(0).integers(0, 300, (2, 24)).tolist()
PROMPTS = [[5, 77, 123, 9, 250], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
N_NEW = 16
SEQ_LEN = 16
# Texts for the Qwen2 tokenizer: digits one by one, contractions in either case, newlines,
# NFD (composed by NFC first), non-Latin letters, runs of spaces.
TOKENIZER_TEXTS = ["Once upon a time, in 1999, there was a little girl named Lily.",
                   "She'll say: \"DON'T worry, we've 3.14159 reasons!\"\n\n  Indented\tline",
                   "cafe\u0301 na\u00efve \u65e5\u672c\u8a9e \u0645\u0631\u062d\u0628\u0627 "
                   "\U0001f999  x", "   ", "<|endoftext|>"]


def run_peer(job: dict, d) -> dict[str, np.ndarray]:
  job_path, out = os.path.join(d, "job.json"), os.path.join(d, "out.npz")
  with open(job_path, "w") as f:
    json.dump(job, f)
  r = subprocess.run([PEER, SCRIPT, "--job", job_path, "--out", out], capture_output=True,
                     text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return dict(np.load(out))


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  d = tmp_path_factory.mktemp("families")
  tokenizer = train_bpe(str(d / "tok"), vocab_size=300)
  text = str(d / "text.txt")
  with open(text, "w") as f:
    f.write(" ".join(SENTENCES * 3))
  dirs = {name: str(d / name) for name in [*FAMILIES, *OURS]}
  for name, cfg in OURS.items():
    W.save_hf(dirs[name], cfg, family_weights(cfg, seed=7))
  job = {"write": [{"name": n, "family": fam, "config": {**_BASE, **kw}, "dir": dirs[n],
                    "seed": i, "copy": [tokenizer]}
                   for i, (n, (fam, kw)) in enumerate(FAMILIES.items())],
         "read": [{"name": n, "dir": dirs[n]} for n in OURS],
         "ids": IDS, "prompts": PROMPTS, "new_tokens": N_NEW,
         "eval": [{"name": n, "dir": dirs[n], "text": text, "seq_len": SEQ_LEN}
                  for n in ("qwen2_tied", "mistral_window")],
         "qwen2_tokenizer": [{"name": "qwen2_tok", "tokenizer_json": tokenizer,
                              "dir": str(d / "qwen2_tok"), "texts": TOKENIZER_TEXTS}]}
  return {"dir": d, "dirs": dirs, "text": text, "peer": run_peer(job, str(d)),
          "qwen2_tok": str(d / "qwen2_tok")}


@nnx.jit
def _logits(model, ids):
  return model(ids)[0]


def _ours(spec):
  cfg, model = C.load_model(spec)
  with jax.default_matmul_precision("float32"):
    logits = np.asarray(_logits(model, jnp.asarray(IDS, jnp.int32)))
    greedy = G.generate(model, PROMPTS, N_NEW)
  return cfg, model, logits, greedy


def _check(name, peer, logits, greedy):
  diff = float(np.abs(logits - peer[f"{name}.logits"]).max())
  print(f"\n{name}: max |logit diff| {diff:.2e} (logits up to "
        f"{np.abs(logits).max():.1f}); greedy ids equal: "
        f"{all(greedy[i] == peer[f'{name}.greedy_{i}'].tolist() for i in range(len(PROMPTS)))}")
  assert diff <= 1e-4, (name, diff)
  for i in range(len(PROMPTS)):
    assert greedy[i] == peer[f"{name}.greedy_{i}"].tolist(), (name, i)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_checkpoints_read_by_our_loader(work, name):
  cfg, model, logits, greedy = _ours(f"hf:{work['dirs'][name]}")
  fam, kw = FAMILIES[name]
  assert cfg.qkv_bias == (fam == "qwen2")
  assert cfg.sliding_window == kw.get("sliding_window")
  assert cfg.window_layers == {"qwen2_window_from_layer1": (1,),
                               "qwen2_layer_types_yarn": (0,)}.get(name)
  assert isinstance(cfg.rope_scaling, YarnScaling) == ("yarn" in name)
  _check(name, work["peer"], logits, greedy)
  if "yarn" in name:
    # The comparison can fail: the same weights with plain RoPE are far off.
    _far(model, cfg.replace(rope_scaling=None), work["peer"][f"{name}.logits"])
  if cfg.sliding_window is not None:
    # The comparison can fail: the same weights without the window are far off.
    _far(model, cfg.replace(sliding_window=None, window_layers=None),
         work["peer"][f"{name}.logits"])


def _far(model, cfg, peer_logits):
  """`model`'s weights under `cfg` give logits more than 1e-2 from transformers'."""
  other = nnx.eval_shape(lambda: M.Llama(cfg, nnx.Rngs(0)))
  M.load_weights(other, M.weights_from_model(model))
  far = np.abs(np.asarray(_logits(other, jnp.asarray(IDS, jnp.int32))) - peer_logits).max()
  assert far > 1e-2, far


@pytest.mark.parametrize("name", list(OURS))
def test_our_export_loads_in_transformers(work, name):
  cfg, _, logits, greedy = _ours(f"hf:{work['dirs'][name]}")
  assert cfg == OURS[name].replace(max_seq_len=cfg.max_seq_len)
  _check(name, work["peer"], logits, greedy)


def test_export_entry_point_round_trip_loads_in_transformers(work, tmp_path):
  """experiments.export reads the transformers-written Mistral through our loader and writes
  it back (config, window, tokenizer); transformers' greedy ids on it are the original's."""
  out = str(tmp_path / "exported")
  _, summary = run_entry("experiments.export", [
      f"--checkpoint=hf:{work['dirs']['mistral_window']}", "--to=hf", f"--out={out}"])
  assert summary["to"] == "hf"
  with open(os.path.join(out, "config.json")) as f:
    hf = json.load(f)
  assert (hf["architectures"], hf["sliding_window"], hf["head_dim"]) == (
      ["MistralForCausalLM"], 6, 32)
  peer = run_peer({"read": [{"name": "exported", "dir": out}], "ids": IDS,
                   "prompts": PROMPTS, "new_tokens": N_NEW}, str(tmp_path))
  orig = work["peer"]
  np.testing.assert_allclose(peer["exported.logits"], orig["mistral_window.logits"],
                             rtol=0, atol=1e-5)
  for i in range(len(PROMPTS)):
    assert peer[f"exported.greedy_{i}"].tolist() == orig[f"mistral_window.greedy_{i}"].tolist()


def test_our_gguf_export_loads_in_transformers(tmp_path):
  """`llm.gguf.save_gguf` of a Qwen2 (arch qwen2: biases, q / k rows as they are) and of a
  Llama (arch llama: q / k rows permuted as llama.cpp's converter does), read by
  transformers' own GGUF loader: the logits and greedy ids of our model. (transformers'
  GGUF loader ignores rope_freqs.weight, so the Llama here has no RoPE scaling; it ignores
  attention.sliding_window too, as llama.cpp does for these architectures.)"""
  r = subprocess.run([PEER, *RUN_CODE, "import gguf, accelerate"], capture_output=True, text=True)
  if r.returncode:
    pytest.skip(f"{PEER} lacks gguf / accelerate (transformers' GGUF loader needs both)")
  from llm import gguf as GG
  cfgs = {"gguf_qwen2": get_config("tiny_qwen2", vocab_size=V,
                                   norm_eps=float(np.float32(1e-6))),
          "gguf_llama": get_config("tiny", vocab_size=V, norm_eps=float(np.float32(1e-5)))}
  ours, files = {}, []
  for name, cfg in cfgs.items():
    w = family_weights(cfg, seed=11)
    path = str(tmp_path / f"{name}.gguf")
    GG.save_gguf(path, cfg, w, "F32")
    files.append({"name": name, "file": path})
    ours[name] = _ours(f"gguf:{path}")
  peer = run_peer({"gguf": files, "ids": IDS, "prompts": PROMPTS, "new_tokens": N_NEW},
                  str(tmp_path))
  for name, (cfg, _, logits, greedy) in ours.items():
    assert cfg.qkv_bias == (name == "gguf_qwen2")
    _check(name, peer, logits, greedy)


@pytest.mark.parametrize("name", ["qwen2_tied", "mistral_window"])
def test_eval_lm_loss_equals_transformers(work, name):
  _, summary = run_entry("experiments.eval_lm", [
      f"--checkpoint=hf:{work['dirs'][name]}", f"--text={work['text']}",
      f"--seq_len={SEQ_LEN}", "--batch_size=4",
      f"--workdir={os.path.join(work['dir'], 'eval_' + name)}"])
  peer_loss = float(work["peer"][f"{name}.loss"])
  rel = abs(summary["loss"] - peer_loss) / peer_loss
  print(f"\n{name}: eval_lm loss {summary['loss']:.6f}, transformers {peer_loss:.6f} "
        f"(rel {rel:.1e}) over {summary['num_tokens']} tokens")
  assert summary["num_tokens"] == int(work["peer"][f"{name}.tokens"])
  assert rel <= 1e-4, (summary["loss"], peer_loss)


def test_qwen2_tokenizer_equals_transformers(work, tmp_path):
  """transformers' Qwen2Tokenizer (NFC, Qwen2's regex, byte-level BPE) on our trained
  vocabulary: the tokenizer.json it saved, read by `llm.tokenizer`, and the same vocabulary
  as GGUF metadata with tokenizer.ggml.pre "qwen2", read by `llm.gguf_vocab`, give its ids."""
  from tests.llm.test_gguf import _bpe_vocab
  hf = T.load_tokenizer(work["qwen2_tok"])
  v = _bpe_vocab(os.path.join(work["qwen2_tok"], "tokenizer.json"), "qwen2")
  gguf_tok = GV.vocab_tokenizer(v, "qwen2_tok.gguf")
  for i, text in enumerate(TOKENIZER_TEXTS):
    want = work["peer"][f"qwen2_tok.ids_{i}"].tolist()
    assert hf.encode(text) == want, text
    assert gguf_tok.encode(text) == want, text
  digits = work["peer"]["qwen2_tok.ids_0"].tolist()
  assert [hf.decode([i]) for i in digits].count("9") == 3     # "1999": one token per digit


_CHOICES = r"""
import json, sys
import numpy as np
import transformers as T
out = {}
for name, d in json.loads(sys.argv[1]).items():
  if name.startswith("config"):
    c = T.AutoConfig.from_pretrained(d)
    out[name] = {"sliding_window": c.sliding_window,
                 "layer_types": getattr(c, "layer_types", None)}
  else:
    m = T.AutoModelForCausalLM.from_pretrained(d, dtype="float32")
    out[name] = {"embed": m.model.embed_tokens.weight.detach().numpy().ravel()[:8].tolist(),
                 "head": m.lm_head.weight.detach().numpy().ravel()[:8].tolist()}
print(json.dumps(out))
"""


def test_loader_choices_are_transformers(tmp_path):
  """Where a directory leaves transformers a choice, our loader makes the one transformers
  makes or refuses: model.safetensors over a shard index beside it; an absent sliding_window
  is 4096 (Mistral, and Qwen2 with use_sliding_window); a tied config's lm_head.weight that
  differs from the embedding (transformers 5 reads it untied, 4.x ties it) is refused."""
  from safetensors.numpy import load_file, save_file
  cfg = get_config("tiny", vocab_size=V)
  both = str(tmp_path / "both")
  W.save_hf(both, cfg, family_weights(cfg, seed=1), max_shard_bytes=20000)
  W.save_hf(str(tmp_path / "one"), cfg, single := family_weights(cfg, seed=2))
  os.rename(str(tmp_path / "one" / "model.safetensors"), os.path.join(both, "model.safetensors"))
  tied = str(tmp_path / "tied")
  tied_cfg = cfg.replace(tie_embeddings=True)
  W.save_hf(tied, tied_cfg, family_weights(tied_cfg, seed=3))
  t = load_file(os.path.join(tied, "model.safetensors"))
  t["lm_head.weight"] = family_weights(cfg, seed=4)["lm_head"].T.copy()
  save_file(t, os.path.join(tied, "model.safetensors"), metadata={"format": "pt"})
  configs = {}   # config.json files without a sliding_window key
  for name, cfg_dict in {
      "config_mistral": W.config_to_hf(get_config("tiny_mistral")),
      "config_qwen2": {**W.config_to_hf(get_config("tiny_qwen2")), "use_sliding_window": True,
                       "max_window_layers": 1}}.items():
    os.makedirs(configs.setdefault(name, str(tmp_path / name)))
    with open(os.path.join(configs[name], "config.json"), "w") as f:
      json.dump({k: v for k, v in cfg_dict.items() if k not in ("sliding_window", "layer_types")},
                f)
  r = subprocess.run([PEER, *RUN_CODE, _CHOICES,
                      json.dumps({"both": both, "tied": tied, **configs})],
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  peer = json.loads(r.stdout.strip().splitlines()[-1])
  _, w = W.load_hf(both)
  np.testing.assert_array_equal(w["embed"].ravel()[:8], np.float32(peer["both"]["embed"]))
  np.testing.assert_array_equal(single["embed"].ravel()[:8], w["embed"].ravel()[:8])
  # transformers 5 does not tie a differing lm_head.weight: the refusal is not pedantry.
  assert peer["tied"]["head"] != peer["tied"]["embed"]
  with pytest.raises(ValueError, match="differs from 'model.embed_tokens.weight'"):
    W.load_hf(tied)
  m = W.hf_config(configs["config_mistral"])
  assert m.sliding_window == peer["config_mistral"]["sliding_window"] == 4096
  q = W.hf_config(configs["config_qwen2"])
  assert q.sliding_window == peer["config_qwen2"]["sliding_window"] == 4096
  assert [q.layer_window(i) is not None for i in range(q.n_layers)] == [
      t == "sliding_attention" for t in peer["config_qwen2"]["layer_types"]] == [False, True]


_TOKENS = """
import json, sys, transformers
d, texts = sys.argv[1], json.loads(sys.argv[2])
tok = transformers.AutoTokenizer.from_pretrained(d)
gen = transformers.GenerationConfig.from_pretrained(d)
print(json.dumps({"ids": [tok(t)["input_ids"] for t in texts], "eos": gen.eos_token_id}))
"""


def test_export_entry_point_tokens_and_stop_ids_in_transformers(tmp_path):
  """A tokenizer that adds a BOS by add_bos_token (no post-processor: as a GGUF or llama2.c
  vocabulary is exported) and stops at two ids: transformers' tokenizer on the export gives
  our ids, BOS included, and its generation config our stop ids."""
  src = str(tmp_path / "src")
  train_bpe(src, vocab_size=300, config={"bos_token": "<s>", "eos_token": "</s>",
                                         "add_bos_token": True})
  with open(os.path.join(src, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [2, 0]}, f)
  cfg = get_config("tiny_tied", vocab_size=V)
  W.save_hf(src, cfg, family_weights(cfg, seed=3))
  tok = C.find_tokenizer(f"hf:{src}", None, V)
  assert tok.add_bos and tok.stop_ids == (2, 0)
  out = str(tmp_path / "exported")
  run_entry("experiments.export", [f"--checkpoint=hf:{src}", "--to=hf", f"--out={out}"])
  texts = SENTENCES[:3] + [" leading space", "wörds 🦙"]
  r = subprocess.run([PEER, *RUN_CODE, _TOKENS, out, json.dumps(texts)], capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  peer = json.loads(r.stdout.strip().splitlines()[-1])
  assert peer["ids"] == [tok.encode(t, bos=True) for t in texts]
  assert peer["eos"] == [2, 0]
