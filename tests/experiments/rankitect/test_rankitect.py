"""Rankitect study (experiments/rankitect): Gumbel-softmax against a hand computation, a
supernet path against the stand-alone model with the same weights, the FLOPs table against
XLA's count of whole models, Pareto fronts; tiny searches of every method (slow)."""

import itertools
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from core import flops as flops_lib
from core.errors import UserError
from rec import configs
from rec.models import searched
from experiments.rankitect import study as study_lib
from experiments.rankitect import supernet as supernet_lib
from experiments.rankitect.space import Space
from tests.experiments.entry import run_entry, run_refused

ND, NS, ROWS = 3, 4, (10,) * 4
SPACE = Space(num_layers=2, width=4, embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,),
              names=("skip", "wukong", "attention", "dcn", "dhen"))
FLOPS_LK = [[float(k + 10 * l) for k in range(len(SPACE.names))] for l in range(2)]


def test_gumbel_softmax_equals_hand_computation():
  logits = np.array([[0.5, -1.0, 2.0], [0.0, 0.3, -0.2]], np.float32)
  key, tau = jax.random.key(7), 0.7
  got = np.asarray(supernet_lib.gumbel_softmax(logits, key, tau))
  # The same uniform draws, then -log(-log u) and a softmax written out in float64.
  u = np.asarray(jax.random.uniform(key, logits.shape, minval=np.finfo(np.float32).tiny,
                                    maxval=1.0), np.float64)
  z = (logits + -np.log(-np.log(u))) / tau
  want = np.exp(z - z.max(-1, keepdims=True))
  want /= want.sum(-1, keepdims=True)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Low temperature: close to one-hot at argmax(logits + g).
  hard = np.asarray(supernet_lib.gumbel_softmax(logits, key, 1e-3))
  np.testing.assert_array_equal(hard.argmax(-1), z.argmax(-1))


@pytest.fixture(scope="module")
def net():
  return supernet_lib.Supernet(SPACE, ND, NS, ROWS, nnx.Rngs(0), mode="gumbel", flops_LK=FLOPS_LK)


@pytest.mark.parametrize("choices", [("wukong", "dcn"), ("skip", "attention"), ("dhen", "skip")])
def test_supernet_path_equals_standalone(net, choices):
  r = np.random.default_rng(0)
  dense = r.normal(size=(5, ND)).astype(np.float32)
  emb = r.normal(size=(5, NS, SPACE.embedding_dim)).astype(np.float32)
  model = supernet_lib.standalone(net, choices, ND, NS, ROWS)
  want = np.asarray(model(dense, emb))
  idx = [SPACE.names.index(c) for c in choices]
  onehot = np.zeros((2, len(SPACE.names)), np.float32)
  onehot[[0, 1], idx] = 1.0
  # One-hot mixing: the same ops in the same order, bit for bit.
  np.testing.assert_array_equal(np.asarray(net(dense, emb, weights_LK=onehot)), want)
  # A path through lax.switch runs only the chosen branches (compiled: float rounding).
  np.testing.assert_allclose(np.asarray(net(dense, emb, path_L=np.array(idx))), want,
                             rtol=1e-5, atol=1e-5)
  # The stand-alone model is the architecture train_rec builds from the JSON file.
  assert model.config == searched.SearchedConfig.from_arch(SPACE.arch(choices), ND, NS, ROWS)


def test_inherit_puts_the_standalone_weights_on_the_path(net):
  choices = ("dcn", "wukong")
  path = [SPACE.names.index(c) for c in choices]
  sn = nnx.to_pure_dict(nnx.state(net))
  cfg = supernet_lib.arch_config(SPACE, choices, ND, NS, ROWS)
  mine = nnx.to_pure_dict(nnx.state(searched.SearchedModel(cfg, nnx.Rngs(5))))
  got = supernet_lib.inherit(sn, mine, path)
  # Copied back out by `standalone` (the inverse): the same leaves, bit for bit.
  other = supernet_lib.Supernet(SPACE, ND, NS, ROWS, nnx.Rngs(0), mode="gumbel",
                                flops_LK=FLOPS_LK)
  nnx.update(other, got)
  back = nnx.to_pure_dict(nnx.state(supernet_lib.standalone(other, choices, ND, NS, ROWS)))
  for (p, a), b in zip(jax.tree_util.tree_leaves_with_path(mine), jax.tree.leaves(back)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(p))
  # Candidates off the path keep the supernet's own values.
  off = SPACE.names.index("attention")
  for a, b in zip(jax.tree.leaves(sn["candidates"][0][off]), jax.tree.leaves(got["candidates"][0][off])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match="inherit: .*(no place|shape)"):
    supernet_lib.inherit(sn, mine, [SPACE.names.index("skip"), path[1]])


def test_gumbel_cost_is_the_expected_flops(net):
  key = jax.random.key(3)
  _, cost = net.sample(np.zeros((2, ND), np.float32),
                            np.zeros((2, NS, SPACE.embedding_dim), np.float32), key)
  w = np.asarray(supernet_lib.gumbel_softmax(np.zeros((2, len(SPACE.names)), np.float32), key, 1.0))
  f = np.array(FLOPS_LK)
  np.testing.assert_allclose(float(cost), (w * f).sum() / f.max(axis=1).sum(), rtol=1e-6)


@pytest.mark.slow
def test_flops_table_adds_up_to_xla_count():
  sp = Space(num_layers=2, width=4, embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,),
             names=("skip", "fmb", "dhen"))
  data = type("Spec", (), {"num_dense": ND, "sparse_features": tuple(f"C{i}" for i in range(NS)),
                           "rows_per_feature": ROWS})
  base, table = study_lib.candidate_flops(sp, data)
  assert all(min(row) == 0.0 for row in table)
  for choices in (("fmb", "dhen"), ("dhen", "dhen")):
    cfg = supernet_lib.arch_config(sp, choices, ND, NS, ROWS)
    whole = flops_lib.model_flops_per_example(lambda r: searched.SearchedModel(cfg, r), cfg, batch=8)
    parts = base + sum(table[l][sp.names.index(c)] for l, c in enumerate(choices))
    # Additive up to XLA's own simplifications of the whole graph (under 1% here).
    assert parts == pytest.approx(whole, rel=1e-2)


SMALL = Space(num_layers=2, width=4, embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,),
              names=("skip", "lcb", "dcn"))


def small_run(tmp_path, space, choices):
  base = configs.make_run(data="synthetic_deep", num_rows=20, batch_size=64,
                              eval_batch_size=64, eval_batches=1, dense_optimizer="adam",
                              learning_rate=1e-2, embedding_learning_rate=0.1, mesh="-1")
  path = searched.save_arch(space.arch(choices), str(tmp_path / f"{'-'.join(choices)}.json"))
  return configs.build_run(configs.replace_run(base, model="searched:" + path))


@pytest.mark.slow
def test_candidate_task_trains_like_the_standalone_model(tmp_path):
  """A candidate trained through the shared supernet program is the training train_rec does
  on its JSON file: same initial weights (to one ulp), same losses and eval logits."""
  steps = 4
  runs_ = []
  for choices in (("dcn", "lcb"), ("lcb", "skip")):
    task0, train_src, eval_src, _, _ = small_run(tmp_path, SMALL, choices)
    spec = train_src.spec
    nd, ns, rows = spec.num_dense, len(spec.sparse_features), tuple(spec.rows_per_feature)
    cfg = supernet_lib.arch_config(SMALL, choices, nd, ns, rows)
    task = supernet_lib.CandidateTask(
        lambda r: supernet_lib.Supernet(SMALL, nd, ns, rows, r, mode="path"), task0.collection,
        task0.dense_tx, task0.mesh, choices=choices,
        standalone_fn=lambda r, cfg=cfg: searched.SearchedModel(cfg, r),
        program=runs_[0][0] if runs_ else None)
    runs_.append((task, task0, train_src, eval_src, choices))
  # The second candidate calls the first one's jitted step (one trace, one executable).
  assert runs_[1][0].train_step is runs_[0][0].train_step
  for task, task0, train_src, eval_src, choices in runs_:
    mine, ref = task.init_state(3), task0.init_state(3)
    k = [SMALL.names.index(c) for c in choices]
    got = supernet_lib.standalone(nnx.merge(task.graphdef, mine["params"]), choices,
                                  *_shape(train_src))
    for a, b in zip(jax.tree.leaves(nnx.to_pure_dict(nnx.state(got))),
                    jax.tree.leaves(ref["params"])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(mine["path"]), k)
    off = [leaf.copy() for leaf in jax.tree.leaves(jax.device_get(
        mine["params"]["candidates"][0][[i for i in range(3) if i != k[0]][0]]))]
    step_ref = jax.jit(task0.train_step)
    for b in itertools.islice(train_src.batches(0), steps):
      mine, m1 = task.train_step(mine, task.device_batch(b))
      ref, m2 = step_ref(ref, task0.device_batch(b))
      np.testing.assert_allclose(float(m1["loss"]), float(m2["loss"]), rtol=2e-5)
    b = next(iter(eval_src.batches(0)))
    np.testing.assert_allclose(np.asarray(task.eval_step(mine, task.device_batch(b))["logits"]),
                               np.asarray(jax.jit(task0.eval_step)(ref, task0.device_batch(b))
                                          ["logits"]), rtol=1e-4, atol=1e-4)
    # Off the path nothing moved: those parameters never reach the logits.
    for a, b in zip(off, jax.tree.leaves(jax.device_get(
        mine["params"]["candidates"][0][[i for i in range(3) if i != k[0]][0]]))):
      np.testing.assert_array_equal(a, b)


def _shape(src):
  s = src.spec
  return s.num_dense, len(s.sparse_features), tuple(s.rows_per_feature)


def test_pareto_front():
  rows = [{"mflops": 1, "ne": 0.9}, {"mflops": 2, "ne": 0.8}, {"mflops": 3, "ne": 0.85},
          {"mflops": 2, "ne": 0.95}, {"mflops": 5, "ne": 0.7}]
  assert [(r["mflops"], r["ne"]) for r in study_lib.pareto(rows)] == [(1, 0.9), (2, 0.8), (5, 0.7)]


def test_trial_log_survives_a_cut_last_line(tmp_path):
  path = tmp_path / "trials.jsonl"
  path.write_text(json.dumps({"label": "a", "ne": 1.0}) + "\n" + '{"label": "b", "n')
  log = study_lib.TrialLog(str(path))
  assert [r["label"] for r in log.rows] == ["a"]
  # The cut line is dropped, so the next row is a line of its own (appended to the cut
  # line, it would be lost, and the log unreadable once another row followed).
  log.add({"label": "c"})
  assert [r["label"] for r in study_lib.TrialLog(str(path)).rows] == ["a", "c"]
  path.write_text(json.dumps({"label": "a"}))   # whole, but cut before its newline
  study_lib.TrialLog(str(path)).add({"label": "c"})
  assert [r["label"] for r in study_lib.TrialLog(str(path)).rows] == ["a", "c"]
  path.write_text('{"label": "b", "n\n' + json.dumps({"label": "a"}) + "\n")
  with pytest.raises(ValueError, match=":1:"):
    study_lib.TrialLog(str(path))


@pytest.mark.parametrize("args,line", [
    (["--data=criteo:{empty}"], "error: --data=criteo:{empty}: '{empty}' has neither train.txt"),
    (["--method=dnas", "--dnas_cost_weights=0.1,nan"],
     "error: --dnas_cost_weights=0.1,nan: 'nan' is out of range; expected one or more "
     "distinct finite numbers >= 0"),
    (["--method=dnas", "--dnas_cost_weights=0.1,0.10"],
     "error: --dnas_cost_weights=0.1,0.10: '0.10' twice; expected one or more distinct "
     "finite numbers >= 0"),
], ids=["data_without_files", "nan_cost_weight", "cost_weight_twice"])
def test_bad_settings_are_refused_before_the_workdir_records_them(tmp_path, args, line):
  """Refused in one line before settings.json is written (else a --data directory without
  its files is recorded there, so the corrected command is refused in that workdir; a NaN
  cost weight trains, a repeated one trains its supernet twice)."""
  empty = tmp_path / "empty"
  empty.mkdir()
  wd = tmp_path / "wd"
  out = run_refused("experiments.rankitect", [
      "--method=random", "--trials=1", "--nobaselines", "--steps=1", "--layers=1",
      f"--workdir={wd}", *[a.format(empty=empty) for a in args]])
  assert out.stderr.strip().splitlines()[-1].startswith(line.format(empty=empty))
  assert "Traceback" not in out.stderr and os.listdir(wd) == []


def tiny_study(workdir):
  base = configs.make_run(data="synthetic_deep", num_rows=20, batch_size=64,
                              eval_batch_size=64, eval_batches=1, dense_optimizer="adam",
                              learning_rate=1e-3, embedding_learning_rate=0.1, mesh="-1")
  sp = Space(num_layers=1, width=4, embedding_dim=8, bottom_mlp=(8,), top_mlp=(8,),
             names=("skip", "lcb", "fmb"))
  return study_lib.Study(str(workdir), sp, base, steps=3)


@pytest.mark.slow
def test_sampling_searches_resume(tmp_path):
  import optuna
  st = tiny_study(tmp_path)
  rows = study_lib.sampling_search(st, "random", 1)
  assert len(rows) == 1 and rows[0]["method"] == "random"
  # A trial left running by a kill is failed and its budget trained again.
  storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(
      str(tmp_path / "optuna.journal")))
  optuna.load_study(study_name="random", storage=storage).ask()
  st2 = tiny_study(tmp_path)
  rows = study_lib.sampling_search(st2, "random", 2)
  assert len(rows) == 2 and len([r for r in st2.log.rows if r["method"] == "random"]) <= 2
  evo = study_lib.sampling_search(st2, "evolution", 2)
  assert len(evo) == 2
  for r in rows + evo:   # each found architecture trains again from its file
    cfg = configs.model_config(configs.make_run(model="searched:" + r["arch_file"]),
                               runs_spec())
    assert isinstance(cfg, searched.SearchedConfig)


def runs_spec():
  return type("Spec", (), {"num_dense": 13, "sparse_features": tuple(f"C{i + 1}" for i in range(26)),
                           "rows_per_feature": (20,) * 26})


@pytest.mark.slow
def test_oneshot_and_dnas(tmp_path):
  st = tiny_study(tmp_path)
  out = study_lib.oneshot_search(st, supernet_steps=4, num_candidates=10, retrain=1)
  assert out["candidates_evaluated"] == 3 and len(out["rows"]) == 1
  assert all(np.isfinite(s["ne"]) for s in out["scored"])
  d = study_lib.dnas_search(st, supernet_steps=4, cost_weights=[1.0])
  assert len(d["rows"]) == 1 and np.asarray(d["alpha"]["1"]).shape == (1, 3)
  b = study_lib.baselines(st, [("dlrm", "w64")])
  assert b[0]["method"] == "hand-designed"
  costs = {m: study_lib.cost_of(m, st.log.rows) for m in ("oneshot", "dnas")}
  assert costs["oneshot"]["candidates_trained"] == 1
  assert os.path.exists(study_lib.plot(st.log.rows, str(tmp_path / "p.png")))


@pytest.mark.slow
def test_entry_point_and_train_rec_retrains_the_found_arch(tmp_path):
  """The found architecture's file, trained by train_rec with the search's settings (its
  own defaults for data, rows, optimizers and learning rates, given explicitly), is the
  search's model: the same NE. --noshared_program trains each candidate as the stand-alone
  program train_rec compiles (the shared supernet program matches it up to float rounding)."""
  wd = str(tmp_path / "rk")
  run = ["--steps=3", "--batch_size=32", "--eval_batch_size=64", "--eval_batches=1"]
  _, summary = run_entry("experiments.rankitect", [
      "--method=random", "--trials=1", "--nobaselines", "--noshared_program",
      "--workdir=" + wd, "--layers=1", "--width=4", "--embedding_dim=8", *run])
  assert summary["candidates_trained"] == 1 and os.path.exists(summary["best_file"])
  with open(os.path.join(wd, "trials.jsonl")) as f:
    (row,) = [json.loads(line) for line in f]
  assert row["program"] == "standalone" and row["ne"] == summary["best_ne"]
  _, again = run_entry("experiments.train_rec", [
      "--model=searched:" + summary["best_file"], "--data=synthetic_deep", "--num_rows=20",
      "--dense_optimizer=adam", "--learning_rate=1e-3", "--embedding_learning_rate=0.1",
      "--seed=0", *run, "--workdir=" + str(tmp_path / "tr")])
  assert again["steps"] == 3
  assert again["test_ne"] == pytest.approx(row["ne"], rel=1e-5), (again["test_ne"], row["ne"])
  assert again["test_auc"] == pytest.approx(row["auc"], rel=1e-5)


class ScoredStudy(study_lib.Study):
  """A Study whose candidates are scored by a fixed function of their choices instead of
  trained: what the searcher proposes, without the training cost."""

  def train_arch(self, choices, label, method, extra=None):
    done = self.log.get(label)
    if done is not None:
      return done
    k = [self.space.names.index(c) for c in choices]
    return self.log.add({"label": label, "method": method, "choices": list(choices),
                         "ne": 0.8 + 0.01 * ((3 * k[0] + 5 * k[1]) % 7),
                         "mflops": 0.1 * (1 + k[0] + k[1]), "wall_s": 0.0})


@pytest.mark.parametrize("method", ["random", "evolution"])
def test_search_seed_draws_the_proposals_apart_from_the_data(tmp_path, method):
  """Two search seeds on the same data (one --seed) propose different candidates; the same
  search seed proposes the same ones again; a workdir keeps its search seed."""
  base = configs.make_run(data="synthetic_deep", seed=0)

  def proposals(name, search_seed):
    st = ScoredStudy(str(tmp_path / name), SPACE, base, steps=3, search_seed=search_seed)
    assert st.base.seed == 0 and st.search_seed == (0 if search_seed is None else search_seed)
    return [r["label"] for r in study_lib.sampling_search(st, method, 8)]

  first, again, other = proposals("a", None), proposals("b", 0), proposals("c", 1)
  assert first == again and len(first) == 8
  assert first != other
  with pytest.raises(ValueError, match=r"settings.json: .*search_seed: 1 -> 2"):
    ScoredStudy(str(tmp_path / "c"), SPACE, base, steps=3, search_seed=2)


def test_a_workdir_saved_without_the_a2a_settings_resumes(tmp_path):
  """settings.json written before the a2a run settings and group_by existed (float32, one
  bound, no groups) is the same search as today's defaults."""
  base = configs.make_run(data="synthetic_deep")
  study_lib.Study(str(tmp_path), SPACE, base, steps=3)
  path = tmp_path / "settings.json"
  saved = json.loads(path.read_text())
  assert "run.group_by" in saved
  path.write_text(json.dumps({k: v for k, v in saved.items()
                              if not k.startswith("run.a2a_") and k != "run.group_by"}))
  study_lib.Study(str(tmp_path), SPACE, base, steps=3)
  with pytest.raises(ValueError, match=r"run.a2a_schedule: 'constant' -> 'step:1:2:3'"):
    study_lib.Study(str(tmp_path), SPACE, configs.replace_run(base, a2a_schedule="step:1:2:3"),
                    steps=3)


def test_a_workdir_keeps_its_space_and_budget(tmp_path):
  base = configs.make_run(data="synthetic_deep")
  study_lib.Study(str(tmp_path), SPACE, base, steps=3)
  study_lib.Study(str(tmp_path), SPACE, base, steps=3)   # the same settings: resumes
  with pytest.raises(ValueError, match=r"settings.json: .*space.width: 4 -> 6; steps: 3 -> 5"):
    study_lib.Study(str(tmp_path), Space(num_layers=2, width=6, embedding_dim=8,
                                         bottom_mlp=(8,), top_mlp=(8,), names=SPACE.names),
                    base, steps=5)


@pytest.mark.slow
def test_supernet_time_counts_every_run_that_trained_it(tmp_path):
  """A supernet's wall time is kept in its workdir: a rerun of a finished supernet (which
  only restores it) reports the time that trained it, and a run that trains further adds its
  part (cost_<method>.json gets that time, not the restore's fraction of a second)."""
  st = tiny_study(tmp_path)
  run = lambda steps: study_lib._supernet_run(st, "supernet_oneshot", "path", steps, 0.0, None,
                                              st.search_seed)[3]
  first = run(2)
  with open(tmp_path / "supernet_oneshot" / "wall.json") as f:
    assert json.load(f) == {"wall_s": first, "step": 2}
  assert run(2) == first            # finished: restored, nothing trained, nothing added
  more = run(3)                     # one step more: its run's time added
  assert more > first
  with open(tmp_path / "supernet_oneshot" / "wall.json") as f:
    assert json.load(f) == {"wall_s": more, "step": 3}
  # A smaller budget in the same workdir would reuse the 3-step supernet under its name.
  with pytest.raises(UserError, match=r"supernet_oneshot: a supernet trained for 3 steps; "
                     r"expected at most --supernet_steps=2 "):
    run(2)
