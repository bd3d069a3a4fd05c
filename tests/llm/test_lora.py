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
