"""Searched architectures (rec/models/searched.py): the hand-designed models as points of the
space give their own logits with the same weights; the JSON form and its errors."""

import json
import types

import jax
import numpy as np
import pytest
from flax import nnx

from core.errors import UserError
from rec import configs
from rec.models import dcnv2, dhen, dlrm, searched, wukong

ND, NS, D, B = 4, 5, 8, 6


@nnx.jit
def run(model, dense, emb):
  """One compiled forward (eager ops would each compile on their own)."""
  return model(dense, emb)


def transfer(dst, src):
  """Copies src's parameters into dst after checking both hold the same shapes."""
  s, d = nnx.state(src), nnx.state(dst)
  shapes = lambda t: jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(t))
  assert shapes(s) == shapes(d)
  nnx.update(dst, s)


def inputs(seed=0):
  r = np.random.default_rng(seed)
  return (r.normal(size=(B, ND)).astype(np.float32),
          r.normal(size=(B, NS, D)).astype(np.float32))


def build(arch, num_dense=ND, seed=1):
  cfg = searched.SearchedConfig.from_arch(arch, num_dense=num_dense, num_sparse=NS,
                                          rows_per_feature=10)
  return searched.SearchedModel(cfg, nnx.Rngs(seed))


def test_dlrm_is_a_point():
  cfg = dlrm.DLRMConfig(num_dense=ND, num_sparse=NS, embedding_dim=D, bottom_mlp=(16, D),
                        top_mlp=(16, 1), rows_per_feature=10)
  ref = dlrm.DLRM(cfg, nnx.Rngs(0))
  model = build(searched.dlrm_arch(cfg))
  transfer(model.bottom_mlp, ref.bottom_mlp)
  transfer(model.top_mlp, ref.top_mlp)
  dense, emb = inputs()
  np.testing.assert_array_equal(np.asarray(run(model, dense, emb)), np.asarray(run(ref, dense, emb)))


@pytest.mark.parametrize("bottom", [(16, 12), pytest.param((), marks=pytest.mark.slow)])
def test_dcnv2_is_a_point(bottom):
  cfg = dcnv2.DCNv2Config(num_dense=ND, num_sparse=NS, embedding_dim=D, rows_per_feature=10,
                          bottom_mlp=bottom, num_cross_layers=2, cross_rank=8, deep_mlp=(16,))
  ref = dcnv2.DCNv2(cfg, nnx.Rngs(0))
  model = build(searched.dcnv2_arch(cfg))
  if bottom:
    transfer(model.bottom_mlp, ref.bottom_mlp)
  transfer(model.flat[0], ref.cross)
  transfer(model.flat[1], ref.deep_mlp)
  transfer(model.top_mlp, ref.top_mlp)
  dense, emb = inputs()
  np.testing.assert_array_equal(np.asarray(run(model, dense, emb)), np.asarray(run(ref, dense, emb)))


def test_wukong_is_a_point():
  cfg = wukong.WukongConfig(num_dense=ND, num_sparse=NS, embedding_dim=D, rows_per_feature=10,
                            bottom_mlp=(16, 2 * D), num_layers=2, num_fm=3, num_lcb=2,
                            fm_rank=4, fm_mlp=(16,), top_mlp=(16, 1))
  ref = wukong.Wukong(cfg, nnx.Rngs(0))
  model = build(searched.wukong_arch(cfg))
  transfer(model.bottom_mlp, ref.bottom_mlp)
  for mine, theirs in zip(model.layers, ref.layers):
    transfer(mine.blocks[0].inner, theirs.fmb)
    transfer(mine.blocks[1].inner, theirs.lcb)
    transfer(mine.shortcut, theirs.residual)
    transfer(mine.norm, theirs.norm)
  transfer(model.top_mlp, ref.top_mlp)
  dense, emb = inputs()
  np.testing.assert_array_equal(np.asarray(run(model, dense, emb)), np.asarray(run(ref, dense, emb)))


@pytest.mark.parametrize("ensemble", ["concat", pytest.param("sum", marks=pytest.mark.slow)])
def test_dhen_is_a_point(ensemble):
  cfg = dhen.DHENConfig(num_dense=ND, num_sparse=NS, embedding_dim=D, rows_per_feature=10,
                        bottom_mlp=(16, D),
                        layers=(("dot", "self_attention", "linear"), ("dcn", "linear")),
                        width=3, ensemble=ensemble, dcn_rank=4, top_mlp=(16, 1))
  ref = dhen.DHEN(cfg, nnx.Rngs(0))
  model = build(searched.dhen_arch(cfg))
  transfer(model.bottom_mlp, ref.bottom_mlp)
  for mine, theirs in zip(model.layers, ref.layers):
    for b, m in zip(mine.blocks, theirs.interactions):
      transfer(b.inner, m.inner)
      assert (b.fit is None) == (m.fit is None)
      if b.fit is not None:
        transfer(b.fit, m.fit)
    assert (mine.shortcut is None) == (theirs.shortcut is None)
    if mine.shortcut is not None:
      transfer(mine.shortcut, theirs.shortcut)
    transfer(mine.norm, theirs.norm)
  transfer(model.top_mlp, ref.top_mlp)
  dense, emb = inputs()
  np.testing.assert_allclose(np.asarray(run(model, dense, emb)), np.asarray(run(ref, dense, emb)),
                             rtol=1e-6, atol=1e-6)


ALL_BLOCKS = {
    "embedding_dim": D, "bottom_mlp": [16, D], "bottom_relu_last": False,
    "layers": [{"blocks": [{"type": t, "num_out": 3, **extra} for t, extra in (
                   ("lcb", {}), ("fmb", {"rank": 2, "sizes": [8]}), ("dot", {}),
                   ("attention", {"heads": 2}), ("dcn", {"rank": 4}), ("mlp", {"sizes": [8]}),
                   ("identity", {}))], "combine": "sum"},
               {"blocks": [], "residual": True, "norm": False}],
    "head": ["dense", "flatten", "dot", "fm"],
    "flat": [{"type": "cross", "layers": 1, "rank": 0}, {"type": "mlp", "sizes": [8]}],
    "top_mlp": [8, 1]}


def test_the_json_form_round_trips():
  cfg = searched.SearchedConfig.from_arch(ALL_BLOCKS, ND, NS, 10)
  assert cfg.stack_sizes() == [(NS + 1, 3), (3, 3)]
  assert cfg.head_width == D + 3 * D + 3 + 1   # dense, flatten, 3 pairs, FM
  again = searched.SearchedConfig.from_arch(json.loads(json.dumps(cfg.arch())), ND, NS, 10)
  assert again == cfg


@pytest.mark.slow
def test_every_block_builds_and_runs():
  model = build(ALL_BLOCKS)
  dense, emb = inputs()
  out = np.asarray(run(model, dense, emb))
  assert out.shape == (B,) and np.isfinite(out).all()
  # No dense features: the bottom MLP and the head's "dense" part drop out.
  assert np.asarray(run(build(ALL_BLOCKS, num_dense=0), None, emb)).shape == (B,)


def spec(num_dense=ND):
  return types.SimpleNamespace(sparse_features=tuple(f"C{i + 1}" for i in range(NS)),
                               rows_per_feature=(10,) * NS, num_dense=num_dense)


def test_train_rec_model_flag_reads_the_file(tmp_path):
  cfg = dlrm.DLRMConfig(num_dense=ND, num_sparse=NS, embedding_dim=D, bottom_mlp=(16, D),
                        top_mlp=(16, 1), rows_per_feature=10)
  path = searched.save_arch(searched.dlrm_arch(cfg), str(tmp_path / "dlrm.json"))
  mcfg = configs.model_config(configs.make_run(model="searched:" + path), spec())
  assert isinstance(mcfg, searched.SearchedConfig) and mcfg.head == ("dense", "dot")
  assert configs.MODELS[type(mcfg)] is searched.SearchedModel
  with pytest.raises(ValueError, match="--embedding_dim=32"):
    configs.model_config(configs.make_run(model="searched:" + path, embedding_dim=32), spec())


def test_unknown_block_names_block_file_and_choices(tmp_path):
  path = tmp_path / "bad.json"
  path.write_text(json.dumps({"embedding_dim": D, "top_mlp": [1], "layers": [
      {"blocks": [{"type": "lcb", "num_out": 2}, {"type": "transformer", "num_out": 2}]}]}))
  with pytest.raises(UserError) as e:
    configs.model_config(configs.make_run(model=f"searched:{path}"), spec())
  msg = str(e.value)
  assert "'transformer'" in msg and str(path) in msg and "layers[0].blocks[1]" in msg
  assert all(name in msg for name in searched.STACK_BLOCKS)


@pytest.mark.parametrize("text, needle", [
    ('{"embedding_dim": 8, "top_mlp": [1], "flat": [{"type": "fmb"}]}', "flat[0]: unknown block 'fmb'"),
    ('{"embedding_dim": 8, "top_mlp": [1], "widths": 3}', "unknown key(s) ['widths']"),
    ('{"embedding_dim": 8, "bottom_mlp": [8], "top_mlp": [4]}', "must end at 1"),
    ('{"embedding_dim": 8, "top_mlp": [1], "layers": [{"blocks": [{"type": "lcb"}]}]}',
     "needs \"num_out\""),
    ('{"embedding_dim": 8,\n "top_mlp": [1],,}', ":2:"),
])
def test_bad_files(tmp_path, text, needle):
  path = tmp_path / "arch.json"
  path.write_text(text)
  with pytest.raises(UserError) as e:
    configs.model_config(configs.make_run(model=f"searched:{path}"), spec())
  assert needle in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("data, needle", [
    (b'{"embedding_dim": 8,\n "top_mlp": [1],,}', ":2:17: Expecting property name enclosed in "
                                                  "double quotes; expected an architecture JSON"),
    (b"embedding_dim: 8\n", ":1:1: Expecting value; expected an architecture JSON object"),
    (b'{"embedding_dim": 8,\n\n "top_mlp": [1\xff]}', ":3: byte 0xff is not UTF-8 text; expected"),
    (b"[1, 2]", ": a JSON list; expected an architecture JSON object"),
    (b"[" * 100_000, ": JSON nested too deeply to read; expected an architecture JSON object"),
])
def test_file_that_is_not_an_architecture_json_is_one_line(tmp_path, data, needle):
  from core import cli
  path = tmp_path / "arch.json"
  path.write_bytes(data)
  with pytest.raises(UserError) as e:
    configs.model_config(configs.make_run(model=f"searched:{path}"), spec())
  assert cli.is_user_error(e.value) and "\n" not in str(e.value)
  assert str(e.value).startswith(f"{path}{needle}"), str(e.value)


def _np_mlp(mlp, x, activate_last):
  layers = list(mlp.layers)
  for i, layer in enumerate(layers):
    x = x @ np.asarray(layer.kernel[...]) + np.asarray(layer.bias[...])
    if i < len(layers) - 1 or activate_last:
      x = np.maximum(x, 0)
  return x


def test_identity_and_mlp_blocks_and_the_fm_head_against_numpy():
  """X_1 = concat(identity(X_0), MLP embeddings of X_0) with no residual or norm; head the FM
  sum over pairs and X_1 flattened; top a linear logit: against the same sums in numpy."""
  arch = {"embedding_dim": D, "top_mlp": [1], "layers": [
      {"blocks": [{"type": "identity"}, {"type": "mlp", "num_out": 2, "sizes": [8]}],
       "residual": False, "norm": False}], "head": ["fm", "flatten"]}
  model = build(arch, num_dense=0)
  assert model.config.stack_sizes() == [(NS, NS + 2)] and model.body_dim == 1 + (NS + 2) * D
  _, emb = inputs()
  x = emb.astype(np.float64)
  m = _np_mlp(model.layers[0].blocks[1].inner.mlp, x.reshape(B, -1), False).reshape(B, 2, D)
  x1 = np.concatenate([x, m], axis=1)
  fm = sum(np.sum(x1[:, f] * x1[:, g], axis=-1)
           for f in range(NS + 2) for g in range(f + 1, NS + 2))
  h = np.concatenate([fm[:, None], x1.reshape(B, -1)], axis=1)
  want = _np_mlp(model.top_mlp, h, False)[:, 0]
  np.testing.assert_allclose(np.asarray(nnx.jit(lambda m, e: m.body(None, e))(model, emb)), h,
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(run(model, None, emb)), want, rtol=1e-5, atol=1e-5)


BASE = {"embedding_dim": D, "top_mlp": [1], "bottom_mlp": [D]}


@pytest.mark.parametrize("arch, msg", [
    (dict(BASE, bottom_mlp=8), "bottom_mlp: 8; expected a list of layer widths"),
    (dict(BASE, embedding_dim=0), "embedding_dim: 0; expected an integer >= 1"),
    (dict(BASE, bottom_relu_last=1), "bottom_relu_last: 1; expected true or false"),
    (dict(BASE, layers={"blocks": []}), "layers: {'blocks': []}; expected a list of layers"),
    (dict(BASE, layers=[3]), "layers[0]: 3; expected an object"),
    (dict(BASE, layers=[{"blocks": {"type": "lcb"}}]),
     "layers[0].blocks: {'type': 'lcb'}; expected a list"),
    (dict(BASE, layers=[{"blocks": [], "norm": "yes"}]),
     "layers[0].norm: 'yes'; expected true or false"),
    (dict(BASE, layers=[{"blocks": [{"type": "fmb", "num_out": 2}]}]),
     "layers[0].blocks[0]: block 'fmb' needs \"rank\" >= 1 (FM projection)"),
    (dict(BASE, flat={"type": "mlp"}), "flat: {'type': 'mlp'}; expected a list of blocks"),
    (dict(BASE, flat=[{"type": "mlp"}]), "flat[0]: flat block 'mlp' needs non-empty \"sizes\""),
    (dict(BASE, head="flatten"),
     "head: 'flatten'; expected a list from ['dense', 'flatten', 'dot', 'fm']"),
    (dict(BASE, head=[]), "architecture: SearchedConfig: head=[]; expected a non-empty list "
                          "from ('dense', 'flatten', 'dot', 'fm')"),
    (dict(BASE, bottom_mlp=[12]), "architecture: SearchedConfig: dense_in_stack with a dense "
                                  "vector of 12 values (bottom_mlp=[12]); expected a multiple "
                                  "of embedding_dim=8"),
    (dict(BASE, layers=[{"blocks": [{"type": "lcb", "num_out": 2}], "combine": "max"}]),
     "architecture: SearchedConfig: layers[0].combine='max'; expected one of ('concat', 'sum')"),
    (dict(BASE, layers=[{"blocks": [], "residual": False}]),
     "architecture: SearchedConfig: layers[0] has no blocks and no residual; expected at least "
     "one"),
    (dict(BASE, layers=[{"blocks": [{"type": "lcb", "num_out": 2}, {"type": "lcb", "num_out": 3}],
                         "combine": "sum"}]),
     "architecture: SearchedConfig: layers[0] sums blocks of [2, 3] embeddings; expected equal "
     "num_out (or combine \"concat\")"),
    (dict(BASE, layers=[{"blocks": [{"type": "lcb", "num_out": 1}]},
                        {"blocks": [{"type": "dot", "num_out": 2}]}]),
     "architecture: SearchedConfig: layers[1].blocks[0] 'dot' on 1 embedding; expected >= 2"),
    (dict(BASE, layers=[{"blocks": [{"type": "lcb", "num_out": 1}]}], head=["dot"]),
     "architecture: SearchedConfig: head 'dot' on 1 embedding; pairwise products need >= 2"),
])
def test_bad_architectures_name_the_file_and_the_key(arch, msg):
  with pytest.raises(UserError) as e:
    searched.SearchedConfig.from_arch(arch, ND, NS, 10, where="a.json")
  assert str(e.value) == f"a.json: {msg}"


def test_data_without_sparse_features_and_a_missing_file():
  with pytest.raises(UserError) as e:
    searched.SearchedConfig.from_arch(BASE, ND, 0, (), where="a.json")
  assert str(e.value) == ("a.json: architecture: SearchedConfig: num_sparse=0, num_dense=4, "
                          "embedding_dim=8; expected >= 1, >= 0, >= 1")
  with pytest.raises(ValueError, match=r"^SearchedConfig: bottom_mlp=\(8,\) with num_dense=0; "
                     r"expected \[\]$"):
    searched.SearchedConfig(num_dense=0, num_sparse=NS, embedding_dim=D, rows_per_feature=10,
                            bottom_mlp=(8,))
  with pytest.raises(UserError) as e:
    configs.model_config(configs.make_run(model="searched:/no/such/arch.json"), spec())
  assert str(e.value) == ("--model=searched:/no/such/arch.json: no such file; expected an "
                          "architecture JSON file (rec/models/searched.py)")
  cfg = searched.SearchedConfig.from_arch(BASE, ND, 2, (10, 20), feature_names=("u", "v"))
  assert [(t.name, t.num_rows, t.dim) for t in cfg.tables()] == [("u", 10, D), ("v", 20, D)]


def test_hand_designed_configs_outside_the_space_are_refused():
  with pytest.raises(ValueError, match=r"^dlrm_arch: self_interaction=True has no point"):
    searched.dlrm_arch(types.SimpleNamespace(self_interaction=True))
  with pytest.raises(ValueError, match=r"^dcnv2_arch: structure='parallel'; the searched space "
                     r"has the stacked DCN-v2 only$"):
    searched.dcnv2_arch(types.SimpleNamespace(structure="parallel"))
  # Dropping the FMB's output ReLU would give a different model under the same weights.
  with pytest.raises(ValueError, match=r"^wukong_arch: fm_output_relu=True has no point"):
    searched.wukong_arch(types.SimpleNamespace(fm_output_relu=True))
  with pytest.raises(ValueError, match=r"^dhen_arch: ensemble='max'; expected one of "
                     r"\('concat', 'sum'\)$"):
    searched.dhen_arch(types.SimpleNamespace(ensemble="max", layers=()))
  with pytest.raises(ValueError, match=r"^dhen_arch: layer 1 interaction 'fm'; expected one of "
                     r"\['dcn', 'dot', 'linear', 'self_attention'\]$"):
    searched.dhen_arch(types.SimpleNamespace(ensemble="sum", layers=(("dot",), ("fm",)),
                                             width=2))
