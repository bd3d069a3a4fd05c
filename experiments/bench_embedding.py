r"""One embedding train step (lookup, backward, update) vs table size: sparse vs naive.

  python -m experiments.bench_embedding                  # R = 1e4 .. 1e7, P = 1 and 8
  python -m experiments.bench_embedding --rows=10000,1000000 --pooling=1 --repeats=3

sparse: `EmbeddingCollection` gather -> pool -> grads w.r.t. the gathered rows -> exact
        row-wise Adagrad on the rows the batch touched (dedup + scatter, buffers donated).
naive:  autodiff through a gather of the whole table, then optax Adagrad on the whole
        table (a dense [R, D] gradient and accumulator every step).

One table of R rows, dim 64, batch 4096, Zipf(1.05) ids, pooling factor P (fixed bag
length). Times are medians over repeats of the mean step time of `--steps` (sparse) or
`--naive_steps` steps (the naive path at R >= 1e7 runs half the --repeats, at least 2; each
result records its repeats). Prints
a table; writes results.json and a PNG to --workdir; the last stdout line is JSON with the
medians per R, P and path.
"""

from __future__ import annotations

from absl import flags

from core import cli
from core import config
from core import settings
from experiments.common.report import Report
from rec import settings as rec_settings

FLAGS = flags.FLAGS

POOLING = config.setting("pooling", "list", "Pooling factors (ids per bag).",
                         item=config.Setting("pooling", "integer", "Ids per bag.", lower=1))
PATHS = config.setting("paths", "list", "Which paths to time: sparse, naive.",
                       item=config.Setting("paths", "enum", "A path to time.",
                                           choices=("sparse", "naive")))
NAIVE_STEPS = config.setting("naive_steps", "integer", "Steps per timed repeat of the naive "
                             "path (slow at large R).", lower=1)


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  config.define_flags(
      None, rec_settings.ROWS.narrowed(lower=1).several(), POOLING, PATHS, rec_settings.DIM,
      settings.BATCH_SIZE, settings.STEPS, NAIVE_STEPS, settings.REPEATS,
      rec_settings.ZIPF_ALPHA, settings.WORKDIR,
      rows=["10000", "100000", "1000000", "10000000"], pooling=["1", "8"],
      paths=["sparse", "naive"], dim=64, batch_size=4096, steps=30, naive_steps=5, repeats=5,
      zipf_alpha=1.05, workdir="runs/bench_embedding")


def make_steps(num_rows: int, dim: int, batch: int, pooling: int, alpha: float, seed: int = 0):
  """Returns {path: (step_fn, initial_state)} for one table configuration."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax

  from core import mesh as mesh_lib
  from rec.data.synthetic import zipf_ids
  from rec.embedding import optimizers as opt_lib
  from rec.embedding.collection import EmbeddingCollection
  from rec.embedding.config import TableConfig
  from rec.embedding.planner import TablePlacement

  rng = np.random.default_rng(seed)
  ids = jnp.asarray(zipf_ids(rng, num_rows, (batch, 1, pooling), alpha))
  lengths = jnp.full((batch, 1), pooling, jnp.int32)
  target = jnp.asarray(rng.normal(size=(batch, 1, dim)).astype(np.float32))
  lr = 0.01

  def loss_of(emb_BFD, target):
    return 0.5 * jnp.mean(jnp.sum((emb_BFD - target) ** 2, axis=-1))

  mesh = mesh_lib.make_mesh("data:1", jax.devices()[:1])
  table = TableConfig("t", num_rows, dim, pooling_factor=pooling)
  sparse_opt = opt_lib.get_sparse_optimizer("rowwise_adagrad", lr)
  coll = EmbeddingCollection([table], {"t": TablePlacement("tw", (0,))}, mesh, sparse_opt)

  # The batch is an argument, as in training (a closed-over constant batch lets XLA fold
  # the id handling away and time something training never runs).
  def sparse_step(state, ids, lengths, target):
    emb_state, step = state
    lookup = coll.gather(emb_state, ids, lengths)
    g = jax.grad(lambda part: loss_of(coll.pool(lookup, part), target))(lookup.partial)
    return coll.apply_gradients(emb_state, lookup, g, step), step + 1

  out = {}
  full = coll.init_tables(jax.random.key(seed))["t"]
  if "sparse" in FLAGS.paths:
    fn = jax.jit(sparse_step, donate_argnums=0)
    out["sparse"] = (lambda st: fn(st, ids, lengths, target),
                     (coll.from_tables({"t": full}), jnp.int32(0)))
  if "naive" in FLAGS.paths:
    tx = optax.adagrad(lr)
    flat_ids = ids.reshape(batch, pooling)

    def naive_step(state, flat_ids, target):
      w, opt_state = state
      g = jax.grad(lambda w: loss_of(jnp.take(w, flat_ids, axis=0).sum(1)[:, None], target))(w)
      updates, opt_state = tx.update(g, opt_state, w)
      return optax.apply_updates(w, updates), opt_state

    w = jnp.asarray(full)
    nfn = jax.jit(naive_step, donate_argnums=0)
    out["naive"] = (lambda st: nfn(st, flat_ids, target), (w, tx.init(w)))
  return out


def run(rows, pooling, dim, batch, steps, naive_steps, repeats, alpha):
  import gc
  import jax
  from core import benchmark

  results = []
  for P in pooling:
    for R in rows:
      steps_fns = make_steps(R, dim, batch, P, alpha)
      for path, (fn, state) in list(steps_fns.items()):
        # The naive path at 1e7 rows and more is slow: half the repeats (at least 2).
        reps = repeats if not (path == "naive" and R >= 10**7) else min(repeats, max(2, repeats // 2))
        n = steps if path == "sparse" else naive_steps
        times, state = benchmark.time_steps(fn, state, n, reps, warmup=2)
        med = benchmark.median(times)
        results.append({"rows": R, "pooling": P, "path": path, "repeats": reps,
                        "median_ms": 1e3 * med,
                        "all_ms": [1e3 * t for t in times]})
        print(f"  R={R:>9,} P={P} {path:>6}: {1e3 * med:9.2f} ms/step "
              f"(repeats {', '.join(f'{1e3 * t:.1f}' for t in times)})", flush=True)
        del state, fn
        steps_fns.pop(path)
        gc.collect()
        jax.clear_caches()
  return results


def summarize(results):
  by = {(r["rows"], r["pooling"], r["path"]): r["median_ms"] for r in results}
  rows = sorted({r["rows"] for r in results})
  summary = {}
  for P in sorted({r["pooling"] for r in results}):
    s = {}
    if len(rows) > 1 and (rows[0], P, "sparse") in by and (rows[-1], P, "sparse") in by:
      s["sparse_largest_over_smallest"] = by[(rows[-1], P, "sparse")] / by[(rows[0], P, "sparse")]
    for R in rows:
      if (R, P, "sparse") in by and (R, P, "naive") in by:
        s[f"naive_over_sparse_R{R}"] = by[(R, P, "naive")] / by[(R, P, "sparse")]
    summary[f"P{P}"] = s
  return summary


def plot(results, dim, batch, path):
  from core import plot as plot_lib
  with plot_lib.figure(path, figsize=(6, 4)) as (fig, ax):
    for P in sorted({r["pooling"] for r in results}):
      for p, style in (("sparse", "o-"), ("naive", "s--")):
        pts = sorted((r["rows"], r["median_ms"]) for r in results if r["pooling"] == P and r["path"] == p)
        if pts:
          ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=f"{p}, pooling {P}")
    ax.set(xscale="log", yscale="log", xlabel="table rows R", ylabel="ms / train step",
           title=f"embedding train step vs table size (dim {dim}, batch {batch})")
    ax.grid(alpha=0.3, which="both")
    ax.legend()


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark
  from core import errors
  for name in ("rows", "pooling", "paths"):   # each value is checked while parsing
    values = FLAGS[name].value
    if not values:
      raise errors.expected(f"--{name}=", "nothing to time", "at least one value")
    if len(set(values)) != len(values):
      raise errors.expected(f"--{name}={','.join(values)}", "a value given twice",
                            "each value once")
  rows = [int(float(r)) for r in FLAGS.rows]
  pooling = [int(p) for p in FLAGS.pooling]
  report = Report(FLAGS.workdir)
  report.path()
  print(f"embedding step: dim {FLAGS.dim}, batch {FLAGS.batch_size}, Zipf({FLAGS.zipf_alpha}), "
        f"{FLAGS.steps} (sparse) / {FLAGS.naive_steps} (naive) steps x {FLAGS.repeats} repeats",
        flush=True)
  results = run(rows, pooling, FLAGS.dim, FLAGS.batch_size, FLAGS.steps, FLAGS.naive_steps,
                FLAGS.repeats, FLAGS.zipf_alpha)
  summary = summarize(results)
  print("\n     rows  P    sparse ms    naive ms   naive/sparse")
  by = {(r["rows"], r["pooling"], r["path"]): r["median_ms"] for r in results}
  for P in pooling:
    for R in rows:
      s, n = by.get((R, P, "sparse")), by.get((R, P, "naive"))
      ratio = f"{n / s:10.1f}x" if s and n else "         -"
      print(f"{R:>9,}  {P}  {s or float('nan'):11.2f} {n or float('nan'):11.2f}   {ratio}")
  for k, v in summary.items():
    print(k, {kk: round(vv, 2) for kk, vv in v.items()})
  out = {"config": {"rows": rows, "pooling": pooling, "dim": FLAGS.dim, "batch_size": FLAGS.batch_size,
                    "steps": FLAGS.steps, "naive_steps": FLAGS.naive_steps, "repeats": FLAGS.repeats, "zipf_alpha": FLAGS.zipf_alpha},
         "machine": benchmark.machine(), "results": results, "summary": summary}
  medians = {f"R{r['rows']}_P{r['pooling']}_{r['path']}": round(r["median_ms"], 3) for r in results}
  report.finish(out, {"median_ms": medians, "summary": summary},
                plots=[(plot, (results, FLAGS.dim, FLAGS.batch_size), "bench_embedding.png")])


if __name__ == "__main__":
  define_flags()
  cli.run(main)
