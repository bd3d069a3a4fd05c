"""experiments/dmt/study.py: the all-to-all volume model against the bytes the compiled
SPTT and flat lookups move (read from their HLO on 8 devices); the comparison runs end to
end at a toy size."""

import jax
import numpy as np
import pytest
from flax import nnx

from core import hlo
from core import mesh as mesh_lib
from experiments.dmt import study
from rec.embedding import optimizers as opt_lib
from rec.embedding import planner as planner_lib
from rec.embedding.collection import EmbeddingCollection
from rec.models.dmt import DMTConfig, DMTModel
from tests.experiments.entry import run_entry

N, T, G = 8, 2, 4
B, L, D, K = 16, 2, 4, 2


@pytest.mark.devices(8)
def test_comm_volume_matches_the_compiled_collectives():
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=((0, 2, 5, 7), (1, 3, 4, 6)),
                  tower_k=K, bottom_mlp=(8, D), top_mlp=(8, 1),
                  rows_per_feature=(20, 9, 33, 12, 8, 40, 16, 24))
  tables, F = cfg.tables(), cfg.num_sparse
  mesh = mesh_lib.make_mesh("data:2,model:4")
  sgd = opt_lib.get_sparse_optimizer("sgd", 0.1)
  sptt = EmbeddingCollection(tables, planner_lib.tower_plan(tables, cfg.towers, N), mesh, sgd)
  flat = EmbeddingCollection(tables, planner_lib.uniform_plan(tables, "tw", N), mesh, sgd)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: DMTModel(cfg, nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(DMTModel(cfg, nnx.Rngs(0))))()
  model = nnx.merge(graphdef, params)
  ids = np.zeros((B, F, L), np.int32)
  lengths = np.ones((B, F), np.int32)
  weights = np.ones((B, F, L), np.float32)

  def moved(coll, **kw):
    """{(kind, axes): bytes over all devices} of the compiled forward lookup."""
    fn = jax.jit(lambda s, i, l, w: coll.lookup(s, i, l, w, **kw))
    text = fn.lower(coll.init(jax.random.key(0)), ids, lengths, weights).compile().as_text()
    return {k: N * v for k, v in hlo.collective_bytes(text).items()}

  want = study.comm_volume(B, F, D, T, K, bag=L, group_size=G)
  got = moved(sptt, towers=model.tower_transform())
  assert got == {("all-to-all", ("data",)): want["sptt"]["global_total"],
                 ("all-gather", ("model",)): want["sptt"]["intra_group_ids"],
                 ("reduce-scatter", ("model",)): want["sptt"]["intra_group_embeddings"]}, got
  got = moved(flat)
  assert got == {("all-to-all", ("data", "model")): want["flat"]["global_total"]}, got
  # Here: 16 bags x 8 features of 2 ids, 2 weights and a length (20 bytes) each, and
  # 16 x 8 pooled or 16 x 2 x 3 compressed vectors of 4 floats.
  assert want["flat"]["global_total"] == 16 * 8 * 20 + 16 * 8 * 16
  assert want["sptt"]["global_total"] == 16 * 8 * 20 + 16 * 2 * 3 * 16


def test_collective_bytes_reads_mesh_axes_and_tuples():
  text = """
  %a = (f32[1,18]{1,0}, s32[1,18]{1,0}) all-to-all(%x, %y), channel_id=1, replica_groups=mesh['data'=2,'model'=4] {'data'}, metadata={}
  %b = f32[16,3,3]{2,1,0} all-gather(%z), channel_id=2, replica_groups=mesh['data'=2,'model'=4] {'model'}, dimensions={0}
  %c = bf16[4]{0} all-reduce(%w), channel_id=3, replica_groups={{0,1},{2,3}}, to_apply=%add
  %d = f32[4]{0} add(%c, %c)
  """
  assert hlo.collective_bytes(text) == {("all-to-all", ("data",)): 2 * 18 * 4,
                                        ("all-gather", ("model",)): 16 * 9 * 4,
                                        ("all-reduce", "{{0,1},{2,3}}"): 8}


@pytest.mark.slow   # five short trainings in a fresh process
def test_study_runs_end_to_end(tmp_path):
  out = run_entry("experiments.dmt", ["--steps=8", "--towers=2", "--num_rows=200",
                                      "--eval_batches=2", "--batch_size=128",
                                      f"--workdir={tmp_path}"])[1]
  assert set(out) == {"flat DLRM", "DMT T=2 (similarity)", "DMT T=2 (random)", "wall_seconds"}
  assert all(0.3 < r["auc"] < 1 for k, r in out.items() if k != "wall_seconds")
  v = study.comm_volume(65536, 26, 16, 2, 2)
  assert out["DMT T=2 (random)"]["a2a_reduction"] == round(v["global_reduction"], 2)
  assert (tmp_path / "results.json").exists() and (tmp_path / "dmt.png").exists()
