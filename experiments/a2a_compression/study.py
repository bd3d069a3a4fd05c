"""Error-bounded lossy compression of DLRM's embedding exchange (arXiv 2407.04272): the
training runs, the bytes on the wire, the entropy-coded estimate and the H100 step model.

Runs (one `rec.runs.train_run` each, same data, seed and steps): the uncompressed
baseline, a fixed bound, and the dual-level adaptive bound (table-wise factors from each
table's measured sensitivity, and an iteration-wise schedule). Bytes per step come from the
train step's HLO (`rec.embedding.a2a_report.step_exchange_bytes`: the uint8 payload sent, vs the
float32 exchange of the baseline); the entropy-coded size from zstandard over the payloads
of real batches at the end of training.

Step-time model (H100 hosts, `core.hardware`): a step spends a fraction f of its time in
the embedding exchange at float32 over the inter-host link (Hardware.net_bytes_per_s,
RDMA 400 Gb/s per GPU); compressed, that time becomes payload / link + codec, the codec
costed as memory-bound on H100 HBM: its time measured here (encode + decode of the
exchanged rows) in units of this machine's copy time for the same float32 bytes, times
the H100 copy time (Hardware.hbm_bytes_per_s * Efficiency.hbm). speedup(f) =
1 / (1 - f + f * (t_compressed / t_float32)). The paper's 1.38x is printed beside it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from core import config
from core import hardware
from rec import runs
from rec import configs
from rec.embedding import a2a_compression as ac
from rec.embedding import a2a_report

# The study's own settings (its entry point's flags).
DATASETS = config.setting("datasets", "list", "Datasets (rec.data.sources specs); a "
                          "criteo:DIR whose DIR is absent is skipped with a line.")
CRITEO_EPOCHS = config.setting("criteo_epochs", "float", "Passes over a criteo:DIR sample's "
                               "train file per run (more overfit the 7,200-line sample).",
                               lower=0.01)

PAPER_SPEEDUP = 1.38     # arXiv 2407.04272, abstract: "1.38x training speedup"


def _batches(task, src, n):
  out = []
  for i, b in enumerate(src.batches(0)):
    if i >= n:
      break
    out.append(task.device_batch(b))
  return out


def sensitivity(task, state, batches) -> dict[str, float]:
  """Per table: the first-order bound on the loss change that an error of at most 1 in
  every value of the table's pooled embeddings can cause, sum |dL / d emb_t| (mean over
  `batches`); an error bound eb scales it by eb. Measured on a trained state."""
  coll = task.collection
  names = [t.name for t in coll.tables]

  @jax.jit
  def grads(state, batch):
    lookup = task.gather(state["emb"], batch)
    emb = coll.pool(lookup)

    def loss(emb):
      logits = task.logits(state["params"], batch.dense, emb)
      per = jnp.logaddexp(0.0, logits) - batch.labels * logits
      return jnp.sum(per * batch.mask) / jnp.maximum(jnp.sum(batch.mask), 1.0)

    return jnp.sum(jnp.abs(jax.grad(loss)(emb)), axis=(0, 2))          # [F]

  g = np.mean([np.asarray(grads(state, b)) for b in batches], axis=0)
  return {n: float(v) for n, v in zip(names, g)}



def payload_sizes(task, state, batches, comp: ac.A2ACompression, step: int) -> dict[str, float]:
  """Rows, fixed-rate payload bytes, zstd bytes and the rows that would fall back, over the
  forward and backward exchange rows of table-wise (a2a) groups on real batches."""
  coll = task.collection
  names = [t.name for t in coll.tables]
  fac = np.append(comp.factors(names), 1.0)
  scale = float(comp.schedule.factor(step))
  N = coll.num_devices

  @jax.jit
  def encode_all(state, batch):
    out_ = task.loss_and_grads(state, batch)
    lookup, g_partial = out_[2], out_[4]
    out = []
    for name, g in coll.groups.items():
      if g.comm != "a2a":
        continue
      feat = g.maps["feat"]                                         # [N, S]
      rows_fac = jnp.asarray(fac[feat])
      for arr, b in ((lookup.partial[name], comp.bound), (g_partial[name], comp.grad_bound)):
        if b is None:
          continue
        x = arr.reshape(N, -1, feat.shape[1], arr.shape[-1])        # [N_dev, rows, S, W]
        eb = jnp.broadcast_to((b * scale * rows_fac)[:, None, :], x.shape[:-1])
        out.append(ac.encode(x.reshape(-1, x.shape[-1]), eb.reshape(-1), comp.mode, comp.bits))
    return out

  rows = fixed = zstd = bad = exchanges = fallbacks = 0
  for batch in batches:
    for payload, ok in encode_all(state, batch):
      p, ok = np.asarray(payload), np.asarray(ok)
      rows += len(p)
      fixed += p.size
      zstd += ac.entropy_bytes(p)
      bad += int((~ok).sum())
      exchanges += 1
      fallbacks += int(not ok.all())        # one row not ok: the exchange goes float32
  return {"rows": rows, "fixed_bytes": fixed, "zstd_bytes": zstd, "rows_not_ok": bad,
          "exchanges": exchanges, "fallback_exchanges": fallbacks}


def codec_cost(width: int, bits: int, rows: int = 1 << 16, repeats: int = 5) -> dict[str, float]:
  """Seconds of encode + decode of `rows` rows here, and of a float32 copy of them."""
  x = jax.random.normal(jax.random.key(0), (rows, width), jnp.float32) * 0.1
  eb = jnp.full((rows,), 0.05, jnp.float32)
  enc = jax.jit(lambda x: ac.decode(ac.encode(x, eb, "rel", bits)[0], width, bits))
  copy = jax.jit(lambda x: x * 1.0001)
  from core import benchmark
  t_codec = benchmark.time_call(lambda: enc(x), repeats)
  t_copy = benchmark.time_call(lambda: copy(x), repeats)
  return {"codec_s": t_codec, "copy_s": t_copy, "codec_in_copies": t_codec / t_copy}


def h100_speedup(ratio: float, codec_in_copies: float, fractions=(0.2, 0.4, 0.6, 0.8)
                 ) -> dict[str, Any]:
  """The step model above for a compression ratio (float32 bytes / payload bytes)."""
  hw, eff = hardware.Hardware(), hardware.Efficiency()
  link = hw.net_bytes_per_s * eff.all2all
  hbm = hw.hbm_bytes_per_s * eff.hbm
  per_byte_f32 = 1.0 / link
  # A copy moves 2 bytes (read + write) per float32 byte; the codec costs codec_in_copies of it.
  per_byte_comp = 1.0 / (link * ratio) + codec_in_copies * 2.0 / hbm
  r = per_byte_comp / per_byte_f32
  out = {"time_ratio_exchange": r, "by_comm_fraction": {
      str(f): 1.0 / (1.0 - f + f * r) for f in fractions}}
  # The exchange fraction at which the model reaches the paper's 1.38x (None: never).
  need = (1.0 - 1.0 / PAPER_SPEEDUP) / (1.0 - r) if r < 1 else None
  out["comm_fraction_for_paper_speedup"] = need if need is not None and need <= 1 else None
  return out


def run_dirs(workdir: str, variants) -> list[str]:
  """The run directories of `run_dataset` in `workdir`: the baseline's and each variant's."""
  return [f"{workdir}/{name}" for name in ("baseline", *variants)]


def run_dataset(cfg: configs.RecRunConfig, steps: int, eval_batches: int, variants: dict,
                workdir: str, log, epochs: float | None = None) -> dict[str, Any]:
  """Baseline + every variant on one dataset: metrics, bytes, sizes. `epochs`: train that
  many passes over the train files instead of `steps` (small real samples). An earlier
  run in any of `run_dirs` is refused before the baseline trains (rec.runs.check_fresh)."""
  runs.check_fresh(run_dirs(workdir, variants), resume_flag=False)
  if epochs is not None:
    steps = configs.steps_for(epochs, configs.build_run(cfg)[1])
  out = {"runs": {}, "steps": steps}
  log(f"[{cfg.data.data}] baseline: {steps} steps")
  base = runs.train_run(cfg, f"{workdir}/baseline", steps=steps)
  task0 = base.task
  probe = _batches(task0, base.train_src, eval_batches)
  out["runs"]["baseline"] = {"eval": base.eval, "train_seconds": base.train_seconds,
                             "bytes": a2a_report.step_exchange_bytes(task0, base.state, probe[0])}
  sens = None
  for name, comp in variants.items():
    if comp == "adaptive":
      if sens is None:
        sens = sensitivity(task0, base.state, probe)
        out["sensitivity"] = sens
      fixed = variants["fixed"]
      comp = dataclasses.replace(fixed, table_factors=ac.table_factors_from_sensitivity(sens),
                                 schedule=ac.Schedule("linear", 2.0, 0.5, steps))
    log(f"[{cfg.data.data}] {name}: {comp}")
    r = runs.train_run(cfg, f"{workdir}/{name}", steps=steps,
                       built=configs.build_run(cfg, a2a_compression=comp))
    sizes = payload_sizes(r.task, r.state, _batches(r.task, r.train_src, eval_batches), comp, steps)
    out["runs"][name] = {"eval": r.eval, "train_seconds": r.train_seconds,
                         "bytes": a2a_report.step_exchange_bytes(r.task, r.state, probe[0]), "sizes": sizes,
                         "setting": {"mode": comp.mode, "bound": comp.bound,
                                     "grad_bound": comp.grad_bound, "bits": comp.bits,
                                     "table_factors": dict(comp.table_factors),
                                     "schedule": dataclasses.asdict(comp.schedule)}}
  return out


def summarize(res: dict[str, Any], codec: dict[str, float]) -> list[dict[str, Any]]:
  """One row per (dataset, run): metrics against the baseline, bytes, ratios, model."""
  rows = []
  for data, d in res.items():
    base = d["runs"]["baseline"]
    f32 = base["bytes"]["float32"]
    for name, r in d["runs"].items():
      row = {"data": data, "run": name, "auc": r["eval"].get("auc", math.nan),
             "logloss": r["eval"].get("logloss", math.nan),
             "d_auc": r["eval"].get("auc", math.nan) - base["eval"].get("auc", math.nan),
             "d_logloss": r["eval"].get("logloss", math.nan) - base["eval"].get("logloss", math.nan),
             "float32_bytes": f32}
      if name != "baseline":
        s = r["sizes"]
        fb = s["fallback_exchanges"] / max(s["exchanges"], 1)
        row.update({"payload_bytes": r["bytes"]["payload"], "fallback_share": fb,
                    # Sent on average: the payload, or float32 in exchanges that fall back.
                    "effective_ratio": 1.0 / ((1 - fb) * s["fixed_bytes"] / _f32_rows_bytes(s, r)
                                              + fb),
                    "hlo_ratio": f32 / max(r["bytes"]["payload"], 1),
                    "fixed_ratio": _f32_rows_bytes(s, r) / max(s["fixed_bytes"], 1),
                    "zstd_ratio": _f32_rows_bytes(s, r) / max(s["zstd_bytes"], 1),
                    "rows_not_ok": s["rows_not_ok"], "rows": s["rows"]})
        row["h100"] = h100_speedup(row["effective_ratio"], codec["codec_in_copies"])
        row["h100_zstd"] = h100_speedup(row["zstd_ratio"], codec["codec_in_copies"])
      rows.append(row)
  return rows


def _f32_rows_bytes(sizes, r) -> float:
  """float32 bytes of the rows measured: width * 4 per row (the payload has header + codes)."""
  bits = r["setting"]["bits"]
  per_row = sizes["fixed_bytes"] / sizes["rows"]                    # = payload_bytes(W, bits)
  width = (per_row - ac.HEADER_BYTES) * 8 / bits
  return sizes["rows"] * width * 4.0


def plot(rows, path: str) -> None:
  from core import plot as plot_lib
  comp = [r for r in rows if r["run"] != "baseline"]
  with plot_lib.figure(path, 1, 2, figsize=(10, 4), dpi=120) as (fig, axes):
    labels = [f"{r['data'].split(':')[0]}\n{r['run']}" for r in comp]
    x = np.arange(len(comp))
    axes[0].bar(x - 0.2, [r["fixed_ratio"] for r in comp], 0.4, label="fixed-rate (sent)")
    axes[0].bar(x + 0.2, [r["zstd_ratio"] for r in comp], 0.4, label="zstd estimate")
    axes[0].set_xticks(x, labels, fontsize=7)
    axes[0].set_ylabel("compression ratio (float32 / bytes)")
    axes[0].legend()
    for r, lab in zip(comp, labels):
      fr = r["h100"]["by_comm_fraction"]
      axes[1].plot([float(k) for k in fr], list(fr.values()), marker="o", label=lab.replace("\n", " "))
    axes[1].axhline(PAPER_SPEEDUP, color="k", ls="--", label="paper 1.38x")
    axes[1].set_xlabel("exchange fraction of the float32 step (H100 model)")
    axes[1].set_ylabel("modelled step speedup (payload, fallbacks float32)")
    axes[1].legend(fontsize=7)
