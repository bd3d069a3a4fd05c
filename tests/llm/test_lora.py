"""llm.lora: adapters on the Llama projections, against the merged weights they stand for."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from llm import lora
from llm import model as model_lib
from llm import quantized
from llm.config import get_config
from llm.weights import param_shapes

CFG = get_config("tiny", n_layers=2, attention_impl="xla")
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 12)), jnp.int32)


def _model(weights):
  m = nnx.eval_shape(lambda: model_lib.Llama(CFG, nnx.Rngs(0)))
  model_lib.load_weights(m, weights)
  return m


def _base():
  return model_lib.weights_from_model(model_lib.Llama(CFG, nnx.Rngs(1)))


def _adapters(cfg, seed=2, zero_b=False):
  ad = lora.init_adapters(param_shapes(CFG), cfg, jax.random.key(seed))
  if not zero_b:
    keys = jax.random.split(jax.random.key(seed + 1), len(ad))
    ad = {n: {"a": ab["a"], "b": 0.05 * jax.random.normal(k, ab["b"].shape)}
          for (n, ab), k in zip(ad.items(), keys)}
  return ad


def _logits(model):
  return np.asarray(model(TOKENS)[0])


def test_targets_and_errors():
  assert lora.expand_targets("attention,w_up") == ("wq", "wk", "wv", "wo", "w_up")
  assert lora.LoraConfig(4, 8.0, "mlp").targets == ("w_gate", "w_up", "w_down")
  with pytest.raises(ValueError, match=r"--lora_targets: 'q_proj'; expected projections"):
    lora.LoraConfig(targets=("q_proj",))
  with pytest.raises(ValueError, match=r"--lora_rank=0: expected an integer >= 1"):
    lora.LoraConfig(rank=0)


def test_a_fresh_adapter_is_the_base_model_exactly():
  base = _base()
  cfg = lora.LoraConfig(4, 8.0)
  ad = _adapters(cfg, zero_b=True)
  assert set(ad) == {f"layers.{i}.{p}" for i in range(2) for p in lora.PROJECTIONS}
  plain = _logits(_model(base))
  with_ad = _logits(lora.with_adapters(_model(base), ad, cfg))
  np.testing.assert_array_equal(with_ad, plain)


@pytest.mark.parametrize("targets", ["all", "attention"])
def test_adapters_equal_their_merged_weights(targets):
  base = _base()
  cfg = lora.LoraConfig(4, 16.0, targets)
  ad = _adapters(cfg)
  with_ad = _logits(lora.with_adapters(_model(base), ad, cfg))
  merged = _logits(_model(lora.merge(base, ad, cfg)))
  assert np.abs(_logits(_model(base)) - merged).max() > 1e-3   # the adapters change the model
  np.testing.assert_allclose(with_ad, merged, rtol=2e-5, atol=2e-5)


def test_adapter_gradients_equal_those_through_the_merged_weights():
  base = _base()
  cfg = lora.LoraConfig(2, 4.0, ("wq", "w_down"))
  ad = _adapters(cfg)
  graphdef, state = nnx.split(_model(base))
  state = nnx.to_pure_dict(state)

  def loss_factored(ad):
    m = lora.with_adapters(nnx.merge(graphdef, state), ad, cfg)
    return jnp.mean(m(TOKENS)[0] ** 2)

  def loss_merged(ad):
    m = nnx.merge(graphdef, state)
    for name, var in model_lib._flat_params(m).items():
      if name in ad:
        a, b = ad[name]["a"], ad[name]["b"]
        d = (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)).reshape(var.shape)
        var.set_value(var.get_value() + cfg.scale * d)
    return jnp.mean(m(TOKENS)[0] ** 2)

  g1 = jax.grad(loss_factored)(ad)
  g2 = jax.grad(loss_merged)(ad)
  for name in ad:
    for k in ("a", "b"):
      np.testing.assert_allclose(g1[name][k], g2[name][k], rtol=1e-4, atol=1e-6)


def test_on_a_quantized_base():
  base = _base()
  cfg = lora.LoraConfig(4, 8.0, "all")
  ad = _adapters(cfg)
  q, _ = quantized.quantize(CFG, "int8", weights=base)
  with_ad = _logits(lora.with_adapters(_model(q), ad, cfg))
  merged = _logits(_model(lora.merge(q, ad, cfg)))
  np.testing.assert_allclose(with_ad, merged, rtol=1e-4, atol=1e-4)


def test_peft_directory_round_trip(tmp_path):
  cfg = lora.LoraConfig(4, 8.0, ("wq", "wo", "w_up"))
  ad = _adapters(cfg)
  lora.save_peft(str(tmp_path), ad, cfg, base="hf:/some/base")
  conf = __import__("json").loads((tmp_path / "adapter_config.json").read_text())
  assert conf["target_modules"] == ["o_proj", "q_proj", "up_proj"] and conf["r"] == 4
  from safetensors.numpy import load_file
  t = load_file(str(tmp_path / "adapter_model.safetensors"))
  # HF layout: lora_A [r, in], lora_B [out, r]; o_proj's in is heads x head_dim
  assert t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
  assert t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].shape == (64, 4)
  assert t["base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight"].shape == (4, 64)
  back, cfg2 = lora.load_peft(str(tmp_path), param_shapes(CFG))
  assert cfg2 == cfg and set(back) == set(ad)
  for n in ad:
    np.testing.assert_array_equal(back[n]["a"], np.asarray(ad[n]["a"]))
    np.testing.assert_array_equal(back[n]["b"], np.asarray(ad[n]["b"]))
  del t["base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"]
  from safetensors.numpy import save_file
  save_file(t, str(tmp_path / "adapter_model.safetensors"))
  with pytest.raises(ValueError, match=r"no base_model\.model\.model\.layers\.1\.mlp\.up_proj\.lora_B"):
    lora.load_peft(str(tmp_path), param_shapes(CFG))


def _rewrite(tmp_path, **changes):
  import json
  path = tmp_path / "adapter_config.json"
  conf = {**json.loads(path.read_text()), **changes}
  path.write_text(json.dumps(conf))


def test_peft_target_modules_as_peft_matches_them(tmp_path):
  cfg = lora.LoraConfig(4, 8.0, ("wq", "wo", "w_up"))
  ad = _adapters(cfg)
  lora.save_peft(str(tmp_path), ad, cfg)
  # a dotted suffix, or a regular expression the whole module name matches (peft's rules)
  for modules in (["self_attn.q_proj", "o_proj", "mlp.up_proj"],
                  r"model\.layers\.\d+\.(self_attn\.(q|o)_proj|mlp\.up_proj)"):
    _rewrite(tmp_path, target_modules=modules)
    back, cfg2 = lora.load_peft(str(tmp_path), param_shapes(CFG))
    assert cfg2 == cfg and set(back) == set(ad), modules
  # a string is not split into characters: it adapts what it matches, here nothing
  _rewrite(tmp_path, target_modules="q_proj")
  with pytest.raises(ValueError, match=r"adapter_config\.json: target_modules='q_proj'; "
                                       r"expected at least one of the Llama projections"):
    lora.load_peft(str(tmp_path), param_shapes(CFG))
  _rewrite(tmp_path, target_modules=r"model\.layers\.1\.self_attn\.q_proj")
  with pytest.raises(ValueError, match=r"adapts self_attn\.q_proj in layers \[1\] of 2; "
                                       r"expected the same projections in every layer"):
    lora.load_peft(str(tmp_path), param_shapes(CFG))
  full = lora.LoraConfig(2, 4.0, "all")
  lora.save_peft(str(tmp_path / "all"), _adapters(full), full)
  _rewrite(tmp_path / "all", target_modules="all-linear")
  assert lora.load_peft(str(tmp_path / "all"), param_shapes(CFG))[1] == full


@pytest.mark.parametrize("key,value", [
    ("alpha_pattern", {"q_proj": 64}), ("rank_pattern", {"o_proj": 2}),
    ("layers_to_transform", [0]), ("modules_to_save", ["lm_head"]), ("use_rslora", True),
    ("use_dora", True), ("bias", "all"), ("lora_alpha", 0), ("r", 4.5)])
def test_peft_settings_not_read_are_refused_naming_them(tmp_path, key, value):
  cfg = lora.LoraConfig(4, 8.0, ("wq", "w_up"))
  lora.save_peft(str(tmp_path), _adapters(cfg), cfg)
  _rewrite(tmp_path, **{key: value})
  with pytest.raises(ValueError, match=rf"adapter_config\.json: {key}="):
    lora.load_peft(str(tmp_path), param_shapes(CFG))


def test_peft_tensors_no_target_reads_are_refused(tmp_path):
  from safetensors.numpy import load_file, save_file
  cfg = lora.LoraConfig(4, 8.0, ("wq", "w_up"))
  lora.save_peft(str(tmp_path), _adapters(cfg), cfg)
  # peft adapts lm_head too when target_modules names it: that update must not be dropped
  _rewrite(tmp_path, target_modules=["q_proj", "up_proj", "lm_head"])
  path = str(tmp_path / "adapter_model.safetensors")
  t = load_file(path)
  t["base_model.model.lm_head.lora_A.weight"] = np.ones((4, 64), np.float32)
  t["base_model.model.lm_head.lora_B.weight"] = np.ones((256, 4), np.float32)
  save_file(t, path)
  with pytest.raises(ValueError, match=r"adapter_model\.safetensors: tensor 'base_model\."
                                       r"model\.lm_head\.lora_A\.weight' \(2 not read\)"):
    lora.load_peft(str(tmp_path), param_shapes(CFG))


def test_merge_refuses_adapters_of_other_parameters():
  cfg = lora.LoraConfig(2, 4.0, "wq")
  one_layer = param_shapes(get_config("tiny", n_layers=1))
  w = {n: np.zeros(s, np.float32) for n, s in one_layer.items()}
  with pytest.raises(ValueError, match=r"merge: adapters \['layers\.1\.wq'\] \(1\) are not "
                                       r"among the weights"):
    lora.merge(w, _adapters(cfg), cfg)


@pytest.mark.parametrize("alpha,rank", [(16.0, 12), (0.8, 8)])
def test_bfloat16_low_rank_product_keeps_the_exact_scale(alpha, rank):
  """In bfloat16 the update is alpha / r times x A B as the merged weights have it: a scale
  rounded to bfloat16 (16 / 12 -> 1.3359, 0.1 -> 0.10010) would bias every update by the
  same factor (0.19%, 0.10%). Each bfloat16 rounding is off by up to 2^-9 relative with
  either sign, so the least-squares factor over 16384 outputs is within ~1e-4 of 1."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((64, 256)).astype(np.float32)
  a = (rng.standard_normal((256, rank)) / 16).astype(np.float32)
  b = rng.standard_normal((rank, 256)).astype(np.float32)
  cfg = lora.LoraConfig(rank, alpha, "wq")
  w = lora.LoraWeight(None, jnp.asarray(a), jnp.asarray(b), cfg.scale)
  y = np.asarray(w.low_rank(jnp.asarray(x, jnp.bfloat16), jnp.bfloat16), np.float64)
  ref = cfg.scale * (x.astype(np.float64) @ a @ b)
  assert abs((y * ref).sum() / (ref * ref).sum() - 1) < 5e-4
