"""Weight-only int8 / int4 Llama (llm/quantized.py): a quantized model's logits and greedy
ids against a float32 model holding the dequantized weights, the memory it holds, and GGUF
Q8_0 / Q4_0 / Q4_1 blocks taken directly against `gguf.quants.dequantize`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from core.quant import groupwise
from llm import model as model_lib
from llm import quantized
from llm.config import get_config
from llm.generate import generate
from llm.weights import _from_contract, _to_contract, half_to_interleaved, param_shapes


def _model(cfg, weights):
  m = nnx.eval_shape(lambda: model_lib.Llama(cfg, nnx.Rngs(0)))
  model_lib.load_weights(m, weights)
  return m


def _dequantized(params):
  return {k: np.asarray(v.value()) if isinstance(v, quantized.QuantizedParam) else v
          for k, v in params.items()}


_CONFIGS = {"untied": get_config("tiny"), "tied": get_config("tiny").replace(tie_embeddings=True)}


def _weights(cfg, seed=0):
  """Random float32 contract weights (numpy: no model init to compile)."""
  rng = np.random.default_rng(seed)
  return {k: (rng.standard_normal(shape) * (0.3 if len(shape) > 1 else 0.1)
              + (len(shape) == 1)).astype(np.float32)
          for k, shape in param_shapes(cfg).items()}


@pytest.fixture(scope="module")
def float_model():
  cfg = _CONFIGS["tied"]
  return cfg, _weights(cfg, 3)


@pytest.mark.parametrize("config,mode", [("untied", "int8"), ("tied", "int4")])
def test_logits_equal_the_dequantized_float_model(config, mode):
  cfg = _CONFIGS[config]
  w = _weights(cfg, 3)
  params, forms = quantized.quantize(cfg, mode, weights=w)
  assert {f for k, f in forms.items() if k.rsplit(".", 1)[-1] in quantized.MATRICES} == {mode}
  ref = _dequantized(params)
  # The contract layout is right: each value is within half a step of the float weight.
  for k, p in params.items():
    if isinstance(p, quantized.QuantizedParam):
      step = float(np.max(np.asarray(p.rows.scale, np.float32)))
      assert np.max(np.abs(ref[k] - w[k])) <= step / 2 + 1e-6, k
  qm, fm = _model(cfg, params), _model(cfg, ref)
  # Memory holds the codes: int8 / packed uint8 leaves, a quarter (int8) or less of fp32.
  leaves = jax.tree.leaves(nnx.state(qm, nnx.Param))
  assert {str(x.dtype) for x in leaves} == {"int8" if mode == "int8" else "uint8", "float16",
                                            "float32"}
  held = sum(x.nbytes for x in leaves)
  full = sum(x.nbytes for x in jax.tree.leaves(nnx.state(fm, nnx.Param)))
  assert held < full * (0.3 if mode == "int8" else 0.2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
  jitted = jax.jit(lambda graphdef, state: nnx.merge(graphdef, state)(tokens)[0],
                   static_argnums=0)
  logits = lambda m: np.asarray(jitted(*nnx.split(m)))
  lq, lf = logits(qm), logits(fm)
  # Same weights, the same arithmetic up to float32 summation order (the quantized model
  # contracts its [out, in] rows): differences of float32 rounding only ...
  tol = 1e-5 * np.max(np.abs(lf))
  assert np.max(np.abs(lq - lf)) <= tol, (np.max(np.abs(lq - lf)), tol)
  # ... far below what the quantization itself changes (the model of the original weights).
  lo = logits(_model(cfg, w))
  assert np.max(np.abs(lo - lf)) > 100 * tol


@pytest.mark.slow
def test_greedy_decode_equals_the_dequantized_float_model():
  """Prefill and KV-cache decode steps (embedding rows taken from the int4 codes, the tied
  output projection dequantized whole): the same greedy ids."""
  cfg = _CONFIGS["tied"]
  w = _weights(cfg, 4)
  params, _ = quantized.quantize(cfg, "int4", weights=w)
  prompts = [[5, 17, 99], [250, 3]]
  assert (generate(_model(cfg, params), prompts, 12)
          == generate(_model(cfg, _dequantized(params)), prompts, 12))


def test_matrices_not_a_multiple_of_the_group_stay_float():
  cfg = get_config("tiny").replace(ffn_dim=80)
  w = _weights(cfg)
  params, forms = quantized.quantize(cfg, "int8", weights=w)
  assert forms["layers.0.w_down"] == "float32 (in 80 not a multiple of 32)"
  assert forms["layers.0.w_up"] == "int8"
  np.testing.assert_array_equal(params["layers.1.w_down"], w["layers.1.w_down"])


class _Stored:
  """A GGUF tensor as `llm.gguf.StoredTensor` holds it (its interface), built here from
  ggml blocks that `gguf.quants.quantize` makes, q / k rows in llama.cpp's interleaved
  order."""

  def __init__(self, gguf, cfg, name, w, qtype):
    from llm.gguf import StoredTensor
    rows = np.ascontiguousarray(_from_contract(name, w), np.float32)
    short = name.rsplit(".", 1)[-1]
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads}.get(short)
    if heads:
      rows = half_to_interleaved(rows, heads)
    if rows.ndim == 1:
      qtype = "F32"
    data = rows if qtype == "F32" else gguf.quants.quantize(rows, gguf.GGMLQuantizationType[qtype])
    self.t = StoredTensor(f"gguf.{name}", name, qtype, rows.shape, data, heads)


@pytest.mark.parametrize("qtype,mode,form", [
    ("Q8_0", "int8", "int8 Q8_0 blocks"), ("Q4_0", "int4", "int4 Q4_0 blocks"),
    ("Q4_1", "int4", "int4 Q4_1 blocks"), ("Q4_1", "gguf", "int4 Q4_1 blocks"),
    ("Q8_0", "int4", "int4 (requantized from Q8_0)"),
    ("Q4_1", "int8", "int8 (requantized from Q4_1)")])
def test_gguf_blocks_taken_directly(float_model, qtype, mode, form):
  gguf = pytest.importorskip("gguf")
  cfg, w = float_model
  stored = {k: _Stored(gguf, cfg, k, v, qtype).t for k, v in w.items()}
  params, forms = quantized.quantize(cfg, mode, stored=stored)
  assert forms["layers.1.wq"] == form and forms["embed"] == form
  assert forms["final_norm"] == "float32"
  for k, t in stored.items():
    want = _to_contract(cfg, k, t.dequantize())            # gguf.quants.dequantize
    got = params[k]
    if not isinstance(got, quantized.QuantizedParam):
      np.testing.assert_array_equal(got, want)
      continue
    got = np.asarray(got.value())
    if form.endswith("blocks"):                            # the same numbers (Q4_0: +-0)
      np.testing.assert_array_equal(got, want)
    else:                                                  # requantized: within half a step
      step = float(np.max(np.asarray(params[k].rows.scale, np.float32)))
      assert np.max(np.abs(got - want)) <= step / 2 + 1e-6


def test_bad_mode_names_the_setting(float_model):
  cfg, w = float_model
  with pytest.raises(ValueError, match=r"weights='int3': expected one of float32, int8, int4"):
    quantized.quantize(cfg, "int3", weights=w)
  with pytest.raises(ValueError, match=r"--weights=gguf .* the checkpoint is llama2c"):
    quantized.check_mode("gguf", "llama2c")


def test_save_gguf_q8_0_round_trip(tmp_path):
  """A Q8_0 GGUF written by `llm.gguf.save_gguf` and read back: int8 takes its blocks."""
  pytest.importorskip("gguf")
  from llm import checkpoints
  cfg = _CONFIGS["tied"]
  w = _weights(cfg, 1)
  from llm.gguf import save_gguf
  path = save_gguf(str(tmp_path / "tiny.gguf"), cfg, w, qtype="Q8_0")
  _, flat = checkpoints.load_weights(f"gguf:{path}")
  _, params = checkpoints.load_weights(f"gguf:{path}", "int8")
  for k, v in params.items():
    got = np.asarray(v.value()) if isinstance(v, quantized.QuantizedParam) else v
    np.testing.assert_array_equal(got, flat[k])
  assert isinstance(params["layers.0.wq"].rows, groupwise.GroupQuantized)


@pytest.mark.models
@pytest.mark.slow   # the same blocks: test_smollm2.py's dequantization check and llm_quant's
# test_smollm2_gguf_blocks_score_as_their_dequantization (perplexity equal to float32's)
def test_smollm2_blocks_equal_gguf_dequantize():
  """SmolLM2-135M-Instruct's GGUF (Q4_1 layers, Q8_0 embedding): every block taken directly
  gives `gguf.quants.dequantize`'s numbers (`GGUFCheckpoint.weights`)."""
  from llm import checkpoints
  from tests.real_models import smollm2_gguf_or_skip
  ckpt = checkpoints.gguf_checkpoint(smollm2_gguf_or_skip())
  params, forms = quantized.quantize(ckpt.config, "gguf", stored=ckpt.tensors)
  assert quantized.summarize_forms(forms) == {"float32": 61, "int4 Q4_1 blocks": 210,
                                              "int8 Q8_0 blocks": 1}
  want = ckpt.weights()
  for k, p in params.items():
    got = np.asarray(p.value()) if isinstance(p, quantized.QuantizedParam) else p
    np.testing.assert_array_equal(got, want[k], err_msg=k)
  total = quantized.param_bytes(params)
  assert total < 0.2 * sum(w.nbytes for w in want.values())


@pytest.mark.parametrize("config,mode", [("untied", "int8"), ("tied", "int4")])
def test_output_rows_and_weight_equal_the_dequantized_model(config, mode):
  """The LM head's rows of some tokens (a speculative draft's reduced vocabulary) and the
  whole output weight, from quantized weights, equal the dequantized float model's."""
  cfg = _CONFIGS[config]
  params, _ = quantized.quantize(cfg, mode, weights=_weights(cfg, 4))
  qm, fm = _model(cfg, params), _model(cfg, _dequantized(params))
  ids = jnp.asarray([5, 0, cfg.vocab_size - 1, 17], jnp.int32)
  w, vocab_major = fm.output_weight()
  want = w[ids] if vocab_major else w[:, ids].T
  np.testing.assert_allclose(np.asarray(qm.output_rows(ids)), np.asarray(want), rtol=1e-6,
                             atol=1e-6)
  np.testing.assert_allclose(np.asarray(fm.output_rows(ids)), np.asarray(want), rtol=0, atol=0)
  qw, q_major = qm.output_weight()
  assert q_major == vocab_major
  np.testing.assert_allclose(np.asarray(qw), np.asarray(w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_random_params_hold_what_quantize_holds(mode):
  """random_params (for timing at sizes too large to quantize on the host): the forms and
  bytes `quantize` gives the same config, dequantized weights of a trained model's scale,
  and a model that decodes finite logits."""
  cfg = _CONFIGS["untied"]
  rand = quantized.random_params(cfg, mode, seed=1)
  ref, _ = quantized.quantize(cfg, mode, weights=_weights(cfg))
  assert set(rand) == set(ref)
  for name, v in ref.items():
    r = rand[name]
    assert type(r) is type(v) or not isinstance(v, quantized.QuantizedParam), name
    if isinstance(v, quantized.QuantizedParam):
      assert (r.shape, r.transposed, r.rows.bits, r.nbytes) == (
          v.shape, v.transposed, v.rows.bits, v.nbytes), name
      assert float(jnp.max(jnp.abs(r.value()))) < 0.03, name
  m = _model(cfg, rand)
  logits, _ = m(jnp.asarray([[1, 2, 3]], jnp.int32))
  assert np.all(np.isfinite(np.asarray(logits)))
  with pytest.raises(ValueError, match="mode='float32', expected one of"):
    quantized.random_params(cfg, "float32")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_matmul_follows_xla(mode, monkeypatch):
  """A bf16 model's weight-only products through the Pallas kernel (interpreted here; on a
  GPU "auto" takes it) give XLA's groupwise_matmul's logits within bf16 rounding."""
  from kernels import weight_only_matmul as wom
  from tests.kernels.attention_cases import rel_err
  cfg = _CONFIGS["untied"].replace(dtype="bfloat16", param_dtype="bfloat16")
  tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
  calls = []
  kernel = wom.weight_only_matmul
  monkeypatch.setattr(wom, "weight_only_matmul", lambda *a, **k: calls.append(1) or kernel(*a, **k))
  monkeypatch.setattr(quantized, "_kernel_backend", lambda: True)
  logits = {}
  for impl in ("xla", "auto"):
    logits[impl], _ = _model(cfg, quantized.random_params(cfg, mode, seed=2,
                                                            matmul_impl=impl))(tokens)
    # every matrix of the 2 layers and the output projection, only under "auto"
    assert len(calls) == (0 if impl == "xla" else 2 * 7 + 1)
  assert rel_err(logits["auto"], logits["xla"]) < 2e-2
