"""experiments/dmt/study.py: the all-to-all volume model against the bytes the compiled
SPTT and flat lookups move (read from their HLO on 8 devices); the comparison runs end to
end at a toy size."""

import os

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
from tests.experiments.entry import run_entry, run_refused

N, T, G = 8, 2, 4
B, L, D, K = 16, 2, 4, 2


def _compiled_bytes(towers, rows_per_feature):
  """{"sptt": ..., "flat": ...}: {(kind, axes): bytes over all devices} of the compiled
  forward lookups of a DMT model's tower plan and of the flat table-wise plan, on a
  data:2,model:4 mesh."""
  cfg = DMTConfig(num_dense=3, embedding_dim=D, towers=towers, tower_k=K, bottom_mlp=(8, D),
                  top_mlp=(8, 1), rows_per_feature=rows_per_feature)
  tables, F = cfg.tables(), cfg.num_sparse
  mesh = mesh_lib.make_mesh("data:2,model:4")
  sgd = opt_lib.get_sparse_optimizer("sgd", 0.1)
  sptt = EmbeddingCollection(tables, planner_lib.tower_plan(tables, towers, N), mesh, sgd)
  flat = EmbeddingCollection(tables, planner_lib.uniform_plan(tables, "tw", N), mesh, sgd)
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: DMTModel(cfg, nnx.Rngs(0))))
  params = jax.jit(lambda: nnx.state(DMTModel(cfg, nnx.Rngs(0))))()
  model = nnx.merge(graphdef, params)
  ids = np.zeros((B, F, L), np.int32)
  lengths = np.ones((B, F), np.int32)
  weights = np.ones((B, F, L), np.float32)

  def moved(coll, **kw):
    fn = jax.jit(lambda s, i, l, w: coll.lookup(s, i, l, w, **kw))
    text = fn.lower(coll.init(jax.random.key(0)), ids, lengths, weights).compile().as_text()
    return {k: N * v for k, v in hlo.collective_bytes(text).items()}

  return {"sptt": moved(sptt, towers=model.tower_transform()), "flat": moved(flat)}


def _assert_matches(got, want):
  assert got["sptt"] == {("all-to-all", ("data",)): want["sptt"]["global_total"],
                         ("all-gather", ("model",)): want["sptt"]["intra_group_ids"],
                         ("reduce-scatter", ("model",)): want["sptt"]["intra_group_embeddings"]
                         }, got["sptt"]
  assert got["flat"] == {("all-to-all", ("data", "model")): want["flat"]["global_total"]
                         }, got["flat"]


@pytest.mark.devices(8)
def test_comm_volume_matches_the_compiled_collectives():
  F = 8
  got = _compiled_bytes(((0, 2, 5, 7), (1, 3, 4, 6)), (20, 9, 33, 12, 8, 40, 16, 24))
  want = study.comm_volume(B, F, D, T, K, bag=L, group_size=G)
  _assert_matches(got, want)
  # Here: 16 bags x 8 features of 2 ids, 2 weights and a length (20 bytes) each, and
  # 16 x 8 pooled or 16 x 2 x 3 compressed vectors of 4 floats.
  assert want["flat"]["global_total"] == 16 * 8 * 20 + 16 * 8 * 16
  assert want["sptt"]["global_total"] == 16 * 8 * 20 + 16 * 2 * 3 * 16


@pytest.mark.devices(8)
def test_comm_volume_counts_the_padded_slots_the_program_sends():
  """7 features: towers of 3 and 4 features send 4 slots each (8 in all), and the flat
  table-wise plan over 8 devices one slot per device (8 in all, one empty): the bytes of the
  compiled collectives, not those of 7 features."""
  towers = ((0, 2, 5), (1, 3, 4, 6))
  F = 7
  want = study.comm_volume(B, F, D, towers, K, bag=L, group_size=G)
  assert want["devices"] == N
  _assert_matches(_compiled_bytes(towers, (16,) * F), want)
  # 16 bags x 8 slots of 20 bytes, and 16 x 8 pooled (flat) or 16 x 2 x 3 compressed
  # vectors of 4 floats (SPTT).
  assert want["flat"]["global_total"] == 16 * 8 * 20 + 16 * 8 * 16
  assert want["sptt"]["global_total"] == 16 * 8 * 20 + 16 * 2 * 3 * 16
  # A tower count deals the features evenly: 7 over 2 towers is 4 slots a tower too.
  assert study.comm_volume(B, F, D, 2, K, bag=L, group_size=G) == want
  # A batch that N does not divide is padded to N equal blocks.
  assert study.comm_volume(B - 3, F, D, towers, K, bag=L, group_size=G) == want
  with pytest.raises(ValueError, match="a partition of the 7 features"):
    study.comm_volume(B, F, D, ((0, 1), (2, 3)), K)


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


def test_h100_step_model_matches_a_hand_computation():
  """2 hosts of 8 GPUs, b = 1000, F = 8, D = 10, K = 1, 12 bytes per bag, 4 per value, on
  round link numbers: NIC 1 GB/s + 10 us per all-to-all, NVLink 10 GB/s + 1 us per message,
  0.5 TFLOP/s achieved. Table slots as the static all-to-alls send them: flat 16 (8 tables
  over 16 GPUs, one slot each), SPTT 2 towers x 4, table-wise in the host 2 x 8 x 1: the
  padded slots the programs send, not the 8 tables."""
  from core import hardware
  hw = hardware.Hardware(bf16_flops=1e12, net_bytes_per_s=1e9, nvlink_bytes_per_s=1e10)
  eff = hardware.Efficiency(gemm=0.5, nvlink=1.0, nvlink_latency_s=1e-6, all2all=1.0,
                            all2all_latency_s=1e-5)
  r = study.h100_step_model(12, 4, hosts=2, local_batch=1000, num_features=8, dim=10,
                            tower_k=1, flops_flat=1e4, flops_dmt=5e3, hw=hw, eff=eff)
  bags, pooled = 1000 * 8 * 12, 1000 * 8 * 10 * 4          # 96 KB, 320 KB per GPU (8 slots)
  compressed = 1000 * 2 * 2 * 10 * 4                       # 2 towers x (K + 1) vectors
  # Flat over 16 GPUs (16 slots): half of each all-to-all leaves the host (the NIC is the
  # slower path).
  flat_comm = (1e-5 + 2 * bags / 2 / 1e9) + 2 * (1e-5 + 2 * pooled / 2 / 1e9)
  # SPTT: half of the global exchange leaves the host; inside it, rings of 8 over NVLink
  # (7 steps of an eighth of the gathered buffer each).
  sptt_global = (1e-5 + bags / 2 / 1e9) + 2 * (1e-5 + compressed / 2 / 1e9)
  rw_intra = 7 * (1e-6 + bags / 1e10) + 2 * 7 * (1e-6 + pooled / 1e10)
  tw_intra = (1e-6 + 2 * bags * 7 / 8 / 1e10) + 2 * (1e-6 + 2 * pooled * 7 / 8 / 1e10)
  flat_compute, dmt_compute = 3 * 1e4 * 1000 / 5e11, 3 * 5e3 * 1000 / 5e11
  assert r["slots"] == {"flat": 16, "sptt": 8, "sptt_tw": 16}
  assert r["flat"]["comm_s"] == pytest.approx(flat_comm, rel=1e-12)
  assert r["sptt"]["global_s"] == pytest.approx(sptt_global, rel=1e-12)
  assert r["sptt"]["intra_s"] == pytest.approx(rw_intra, rel=1e-12)
  assert r["sptt_tw"]["intra_s"] == pytest.approx(tw_intra, rel=1e-12)
  assert r["speedup_serial"] == pytest.approx(
      (flat_compute + flat_comm) / (dmt_compute + sptt_global + rw_intra), rel=1e-12)
  assert r["speedup_overlap_tw"] == pytest.approx(
      max(flat_compute, flat_comm) / max(dmt_compute, sptt_global + tw_intra), rel=1e-12)
  # Without padding (per-peer split sizes) every exchange carries the 8 tables: the flat
  # all-to-alls half of the above, SPTT's table-wise hosts half, its rw rings as they were.
  u = study.h100_step_model(12, 4, hosts=2, local_batch=1000, num_features=8, dim=10,
                            tower_k=1, flops_flat=1e4, flops_dmt=5e3, hw=hw, eff=eff,
                            padded=False)
  assert u["slots"] == {"flat": 8, "sptt": 8, "sptt_tw": 8}
  assert u["flat"]["comm_s"] == pytest.approx(
      (1e-5 + bags / 2 / 1e9) + 2 * (1e-5 + pooled / 2 / 1e9), rel=1e-12)
  assert u["sptt"]["intra_s"] == pytest.approx(rw_intra, rel=1e-12)
  assert u["sptt_tw"]["intra_s"] == pytest.approx(
      (1e-6 + bags * 7 / 8 / 1e10) + 2 * (1e-6 + pooled * 7 / 8 / 1e10), rel=1e-12)
  # One host: no inter-host traffic; SPTT with table-wise tables is the flat layout.
  one = study.h100_step_model(12, 4, 1, 1000, 8, 10, 1, 1e4, 1e4, hw=hw, eff=eff)
  assert one["sptt"]["global_s"] == 0 and one["speedup_serial_tw"] == pytest.approx(1.0)
  with pytest.raises(ValueError, match="hosts=0"):
    study.h100_step_model(12, 4, 0, 1000, 8, 10, 1, 1e4, 1e4)


@pytest.mark.slow   # four compiled lookups on 8 devices
@pytest.mark.devices(8)
def test_hlo_unit_bytes_are_the_collections_message_sizes():
  """Bytes per bag (an id, a weight, a length) and per pooled float32 value, from the
  compiled flat program; the SPTT program's collectives agree (checked inside)."""
  u = study.hlo_unit_bytes(bag=1)
  assert (u["bag_bytes"], u["value_bytes"]) == (12, 4)
  u = study.hlo_unit_bytes(bag=2)
  assert (u["bag_bytes"], u["value_bytes"]) == (2 * 4 + 2 * 4 + 4, 4)


def test_an_earlier_runs_models_are_refused_before_training(tmp_path):
  """A rerun into a --workdir that holds an earlier run's models is refused before the flat
  model trains, by one error that names the model directory holding one (training again
  would overwrite it)."""
  from core.errors import UserError
  old = tmp_path / "dmt_t2_random"
  old.mkdir()
  (old / "metrics.jsonl").write_text("{}\n")
  with pytest.raises(UserError) as e:
    study.run([2], 2, steps=1, batch_size=64, eval_batches=1, num_rows=50, dim=4,
              teacher="linear", comm_batch=64, seed=0, workdir=str(tmp_path), log=print)
  assert str(e.value).startswith(f"{old}: holds an earlier run (metrics.jsonl); expected a "
                                 "fresh run directory")
  assert sorted(os.listdir(tmp_path)) == ["dmt_t2_random"]


@pytest.mark.slow   # five short trainings in a fresh process
def test_study_runs_end_to_end(tmp_path):
  out = run_entry("experiments.dmt", ["--steps=8", "--towers=2", "--num_rows=200",
                                      "--eval_batches=2", "--batch_size=128",
                                      "--h100_hosts=1,2", f"--workdir={tmp_path}"])[1]
  assert set(out) == {"flat DLRM", "DMT T=2 (similarity)", "DMT T=2 (random)", "wall_seconds",
                      "h100_1_hosts", "h100_2_hosts"}
  assert out["h100_1_hosts"]["x_tw"] == 1.0
  assert all(0.3 < r["auc"] < 1 for k, r in out.items() if k.startswith(("flat", "DMT")))
  assert (tmp_path / "dmt_h100.png").exists()
  v = study.comm_volume(65536, 26, 16, 2, 2)
  assert out["DMT T=2 (random)"]["a2a_reduction"] == round(v["global_reduction"], 2)
  assert (tmp_path / "results.json").exists() and (tmp_path / "dmt.png").exists()


@pytest.mark.parametrize("flag, error", [
    ("--towers=2,x", "flag --towers=['2', 'x']: 'x': not a number; expected an integer >= 1 "
                     "and <= 26"),
    ("--towers=2,40", "flag --towers=['2', '40']: 40: out of range; expected an integer >= 1 "
                      "and <= 26"),
    ("--h100_hosts=0", "flag --h100_hosts=['0']: 0: out of range"),
    ("--towers=", "error: --towers=: no counts; expected at least one")])
def test_entry_point_refuses_bad_counts_before_work(tmp_path, flag, error):
  """A bad tower or host count names its flag before the H100 model's compiles and any
  training, not in partition() after the flat DLRM trained."""
  out = run_refused("experiments.dmt", [flag, f"--workdir={tmp_path}"])
  assert error in out.stderr
  assert "H100 step model" not in out.stdout and "flat DLRM" not in out.stdout


def test_table_prints_bytes_in_the_unit_it_names():
  """The study's volumes are bytes / 2^20 (the docstring's 123.5 MiB flat at B = 65,536):
  the header names MiB, not MB (1e6 bytes, 4.9% fewer per unit)."""
  v = study.comm_volume(65536, 26, 16, 2, 2)
  row = {"model": "DMT T=2 (random)", "auc": 0.7, "logloss": 0.5,
         "global_bytes": v["sptt"]["global_total"], "global_reduction": v["global_reduction"],
         "intra_group_bytes": v["sptt"]["intra_group_embeddings"]}
  head, line = study.format_table([row]).splitlines()
  assert "MiB" in head and " MB" not in head
  # The in-group column is the reduce-scatter of pooled partial sums only (not the bags).
  assert "intra pooled MiB" in head
  assert f"{v['sptt']['global_total'] / 2**20:.1f}" == "43.5" and " 43.5 " in line
  assert f"{v['sptt']['intra_group_embeddings'] / 2**20:.1f}" in line
