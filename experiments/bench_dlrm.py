r"""DLRM training throughput (examples/s), side by side with TorchRec + FBGEMM on CPU.

  python -m experiments.bench_dlrm                                   # ours only
  python -m experiments.bench_dlrm --peer_python=$PEER_PYTHON       # + TorchRec, interleaved
  python -m experiments.bench_dlrm --model=dcnv2 --preset=mlperf --rows=100000 --batch_size=256
  python -m experiments.bench_dlrm --model=dcnv2 --preset=mlperf --show_plan   # plans only
  python -m experiments.bench_dlrm --model=dcnv2 --preset=mlperf --show_plan \
      --plan_storage=fp32 --host_memory_gb=256       # fp32 tables through the host tier
  python -m experiments.bench_dlrm --compare_host_prefetch=fp32_cache:lru:0.05@host

--model=dcnv2 --preset=mlperf times the MLPerf Training DLRM-DCNv2 model
(`rec.models.dcnv2.DCNv2Config.mlperf`) on synthetic data of its shapes: the reference's
26 tables (`MLPERF_ROWS`, each capped at --rows; --rows=0 keeps all 204M rows, which needs
a GPU with ~60 GB), multi-hot Zipf ids with the reference's bag sizes, Adagrad dense and
row-wise Adagrad sparse at lr 0.005 (`rec/mlperf.py`); the peer is not run for it. Reported per device
(examples/s over the mesh's devices); the reference point is NVIDIA's MLPerf Training
v4.0 result, 13.8M samples/s on 8 x H100 (~1.7M per GPU). The collection pads every bag
to the batch's L = 100 (the longest MLPerf bag), so the lookup reads ~11x the ids that
the bags hold (sum of bag sizes 227 of 26 x 100 slots): padded slots cost no row reads in
the Pallas kernel, but the XLA path gathers them. --show_plan prints the planner's plans
at the full reference rows for 1 and 8 devices of 80 GB (70 GiB each for the tables, or
--memory_budget_gb), without building anything; a timed run's planner budget is
--memory_budget_gb, by default the device's memory (rec.configs.plan_budget).
--plan_storage gives every table of those plans one storage (default: the preset's) and
--host_memory_gb (GiB per device; default 256, a DGX H100's 2 TB over its 8 GPUs; 0: none) the host
memory of the host tier, where the planner moves the tables the devices cannot hold
(rec/embedding/host_tier.py): per table its storage, tier, device and host bytes, then the
totals. A plan that fits neither is one `error:` line naming the table and the bytes.
--plan_storage and --host_memory_gb go with --show_plan only (the timed step keeps every
table on the devices); every flag combination is checked before anything is built or timed.

--compare_host_prefetch=STORAGE puts every table on the host tier in STORAGE (a
`*_cache...@host` --storage) and times the train step without and with --host_prefetch in
alternating rounds over one pool (`experiments.benchmarks.rec.host_prefetch_rates`): seconds
per step (medians) and the ids per step the lookups read from host memory.
The Criteo Kaggle architecture (arXiv 1906.00091): 26 tables of 100,000 rows, dim 16,
bottom 13-512-256-64-16, dot interaction, top 512-256-1; batch 2048; Zipf(1.05) one-hot
ids; row-wise Adagrad on embeddings, Adagrad on the dense part, both lr 0.1. Timed: the
full train step (forward, backward, dense and sparse updates) over a pool of 8 batches
generated before timing, as the peer script does. With --peer_python (a Python with
torch, torchrec and fbgemm-gpu-cpu; see experiments/peers/README.md) the rounds alternate:
ours, then TorchRec's `experiments/peers/torchrec_dlrm.py`, so both see the same machine
state. Reports medians over all repeats and their ratio; writes results.json and a PNG.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from absl import flags

from core import cli
from core import config
from core import errors
from core import results as results_lib
from core import settings
from experiments.benchmarks import rec as rec_bench
from rec import settings as rec_settings

FLAGS = flags.FLAGS
# --show_plan without --memory_budget_gb: what an 80 GB H100 of the MLPerf reference leaves
# the tables (the plans are for 1 and 8 of its GPUs, not for this machine).
MLPERF_GPU_GB = 70.0
MLPERF_HOST_GB = 256.0   # a DGX H100's 2 TB of host memory over its 8 GPUs


SHOW_PLAN = config.setting("show_plan", "bool", "Print the MLPerf preset's plans for 1 and 8 "
                           "devices, exit.")
PLAN_STORAGE = config.setting(
    "plan_storage", "string", "--show_plan: every table's storage (a --storage name, e.g. "
    "fp32), or 'preset' (bf16 big tables).")
COMPARE_HOST_PREFETCH = config.setting(
    "compare_host_prefetch", "string", "A *_cache...@host storage: time the step with every "
    "table there, without and with --host_prefetch, side by side (not with --peer_python).")


def define_flags() -> None:
  """The entry point's flags, defined when it runs as a script (tests import the
  module beside other entry points whose flags share names)."""
  from rec import configs
  config.define_flags(
      None, settings.BATCH_SIZE, settings.MESH, configs.MODEL, settings.PRESET,
      configs.MEMORY_BUDGET_GB, configs.SHARDING, rec_settings.ROWS, settings.STEPS,
      settings.REPEATS, settings.ROUNDS, settings.THREADS, settings.PEER_PYTHON,
      settings.WORKDIR, SHOW_PLAN, PLAN_STORAGE, configs.HOST_MEMORY_GB, COMPARE_HOST_PREFETCH,
      batch_size=2048, mesh="-1", model="dlrm", preset="kaggle", memory_budget_gb=None,
      sharding="tw", rows=100_000, steps=30, repeats=3, rounds=3, threads=2, peer_python="",
      workdir="runs/bench_dlrm", show_plan=False, plan_storage="preset", host_memory_gb=None,
      compare_host_prefetch="")


def run_peer(peer_python: str, batch_size: int, rows: int, steps: int, repeats: int, threads: int):
  script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "torchrec_dlrm.py")
  cmd = [peer_python, script, "--batch_size", str(batch_size), "--rows", str(rows),
         "--steps", str(steps), "--repeats", str(repeats), "--threads", str(threads), "--lr", "0.1"]
  out = subprocess.run(cmd, capture_output=True, text=True, check=False)
  if out.returncode:
    raise RuntimeError(f"peer run failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def compare_host_prefetch(storage: str) -> None:
  """--compare_host_prefetch: the step without and with --host_prefetch, side by side."""
  from core import benchmark
  out = rec_bench.host_prefetch_rates(FLAGS.batch_size, FLAGS.rows, FLAGS.mesh, FLAGS.sharding,
                                      storage, FLAGS.steps, FLAGS.repeats, FLAGS.rounds,
                                      FLAGS.model, FLAGS.preset)
  for name in ("plain", "prefetch"):
    r = out[name]
    print(f"{name:9} {r['seconds_per_step_median'] * 1e3:8.1f} ms/step  host-read ids per "
          f"step {r['host_ids_per_step']:,.0f} of {r['ids_per_step']:,.0f}")
  summary = {"storage": storage, "model": FLAGS.model, "preset": FLAGS.preset,
             "batch_size": FLAGS.batch_size, "rows": FLAGS.rows,
             "plain_over_prefetch": out["plain_over_prefetch"],
             **{f"{k}_ms_per_step": 1e3 * out[k]["seconds_per_step_median"]
                for k in ("plain", "prefetch")},
             **{f"{k}_host_ids_per_step": out[k]["host_ids_per_step"]
                for k in ("plain", "prefetch")}}
  results_lib.write_results(FLAGS.workdir, {"summary": summary, "host_prefetch": out,
                                            "machine": benchmark.machine()})
  results_lib.print_summary(summary)


def _storage(flag: str):
  """The StorageSpec of --<flag>, or one line naming it."""
  from rec.embedding.storage_spec import StorageSpec
  try:
    return StorageSpec.parse(FLAGS[flag].value, f"--{flag}")
  except ValueError as e:
    raise errors.UserError(str(e)) from None


def check_flags():
  """The flags' combinations, checked before anything is built, timed or written; returns
  --plan_storage's StorageSpec (None: the preset's)."""
  mlperf = rec_bench.is_mlperf(FLAGS.model, FLAGS.preset)
  what = f"--model={FLAGS.model} --preset={FLAGS.preset}"
  if FLAGS.show_plan and not mlperf:
    raise errors.UserError(f"--show_plan with {what}; expected --model=dcnv2 --preset=mlperf "
                           "(the plans are of the MLPerf tables)")
  if FLAGS.show_plan and FLAGS.compare_host_prefetch:
    raise errors.UserError("--compare_host_prefetch with --show_plan; expected one of them "
                           "(--show_plan prints plans and times nothing)")
  if not FLAGS.show_plan:
    for flag, unset in (("plan_storage", "preset"), ("host_memory_gb", None)):
      if FLAGS[flag].value != unset:
        raise errors.UserError(f"--{flag}={FLAGS[flag].value} without --show_plan; expected "
                               "it only with --show_plan (the timed step keeps every table "
                               "on the devices; --compare_host_prefetch puts them on the host)")
  if FLAGS.rows == 0 and not mlperf:
    raise errors.UserError(f"--rows=0 with {what}; expected an integer >= 1 (0, the "
                           "reference's full rows, is for --model=dcnv2 --preset=mlperf)")
  if FLAGS.compare_host_prefetch:
    if _storage("compare_host_prefetch").tier != "host":
      raise errors.UserError(
          f"--compare_host_prefetch={FLAGS.compare_host_prefetch}: not on the host tier; "
          "expected a *_cache...@host storage, e.g. fp32_cache:lru:0.05@host")
    if FLAGS.memory_budget_gb is not None:
      raise errors.UserError(f"--memory_budget_gb={FLAGS.memory_budget_gb:g} with "
                             "--compare_host_prefetch; expected no budget (every table is "
                             "on the host tier there)")
  if FLAGS["threads"].present and not (FLAGS.peer_python and not FLAGS.show_plan):
    raise errors.UserError(f"--threads={FLAGS.threads} without a timed peer; expected it with "
                           "--peer_python (the TorchRec peer's CPU threads) and without "
                           "--show_plan")
  if FLAGS.peer_python and not FLAGS.show_plan:
    if FLAGS.compare_host_prefetch:
      raise errors.UserError("--peer_python with --compare_host_prefetch; expected one of "
                             "them (--compare_host_prefetch times ours only)")
    if (FLAGS.model, FLAGS.preset) != ("dlrm", "kaggle"):
      raise errors.UserError(f"--peer_python with {what}; expected --model=dlrm "
                             "--preset=kaggle (the TorchRec peer is the Criteo Kaggle DLRM)")
    if shutil.which(FLAGS.peer_python) is None:
      raise errors.UserError(f"--peer_python={FLAGS.peer_python!r}: no such executable; "
                             "expected the peer environment's python "
                             "(experiments/peers/README.md)")
  return _storage("plan_storage") if FLAGS.plan_storage != "preset" else None


def main(argv):
  del argv
  cli.quiet_library_logs()
  from core import benchmark

  storage = check_flags()
  if FLAGS.peer_python and not FLAGS.show_plan:   # both sides on the same --threads cores
    benchmark.pin_cpus(FLAGS.threads)
  if FLAGS.show_plan:
    from rec import mlperf
    from rec.embedding import planner
    budget = MLPERF_GPU_GB if FLAGS.memory_budget_gb is None else FLAGS.memory_budget_gb
    host = MLPERF_HOST_GB if FLAGS.host_memory_gb is None else FLAGS.host_memory_gb
    try:
      texts = mlperf.plans(
          memory_budget_gb=budget, storage=storage, host_memory_gb=host or None,
          budget_source=("an 80 GB H100" if FLAGS.memory_budget_gb is None
                         else "--memory_budget_gb"),
          host_source=("a DGX H100's 2 TB / 8" if FLAGS.host_memory_gb is None
                       else "--host_memory_gb"))
    except planner.PlanError as e:
      raise errors.UserError(f"--show_plan: {e}") from None
    for n, text in texts.items():
      print(f"\n== MLPerf DCNv2 tables on {n} device(s), {budget:g} GiB each, host tier "
            f"{host:g} GiB each ==")
      print(text)
    return
  os.makedirs(FLAGS.workdir, exist_ok=True)
  if FLAGS.compare_host_prefetch:
    return compare_host_prefetch(FLAGS.compare_host_prefetch)
  B = FLAGS.batch_size
  step, state, pool, ndev = rec_bench.build_step(B, FLAGS.rows, FLAGS.mesh, FLAGS.sharding,
                                                 FLAGS.model, FLAGS.preset,
                                                 FLAGS.memory_budget_gb)
  ours, peer, peer_info = [], [], None
  for r in range(FLAGS.rounds):
    per_step, state = rec_bench.time_step(step, state, pool, FLAGS.steps, FLAGS.repeats)
    ours += [B / t for t in per_step]
    print(f"round {r}: ours     {', '.join(f'{B / t:,.0f}' for t in per_step)} ex/s", flush=True)
    if FLAGS.peer_python:
      peer_info = run_peer(FLAGS.peer_python, B, FLAGS.rows, FLAGS.steps, FLAGS.repeats, FLAGS.threads)
      peer += peer_info["examples_per_sec_all"]
      print(f"round {r}: torchrec {', '.join(f'{x:,.0f}' for x in peer_info['examples_per_sec_all'])} ex/s",
            flush=True)
  summary = {"model": FLAGS.model, "preset": FLAGS.preset, "batch_size": B, "rows": FLAGS.rows,
             "devices": ndev, "ours_examples_per_sec_median": benchmark.median(ours),
             "ours_examples_per_sec_per_device": benchmark.median(ours) / ndev}
  if peer:
    summary["torchrec_examples_per_sec_median"] = benchmark.median(peer)
    summary["ours_over_torchrec"] = summary["ours_examples_per_sec_median"] / summary["torchrec_examples_per_sec_median"]
  print(f"\n{'':10}{'median ex/s':>14}{'all repeats':>14}")
  print(f"{'ours':10}{summary['ours_examples_per_sec_median']:>14,.0f}{len(ours):>14}"
        f"   ({summary['ours_examples_per_sec_per_device']:,.0f} per device, {ndev} devices)")
  if peer:
    print(f"{'torchrec':10}{summary['torchrec_examples_per_sec_median']:>14,.0f}{len(peer):>14}")
    print(f"ours / torchrec = {summary['ours_over_torchrec']:.2f}")
  results = {"summary": summary, "ours_all": ours, "torchrec_all": peer, "peer": peer_info,
             "machine": benchmark.machine(), "config": {"steps": FLAGS.steps, "repeats": FLAGS.repeats,
                                                         "rounds": FLAGS.rounds, "mesh": FLAGS.mesh,
                                                         "sharding": FLAGS.sharding,
                                                         "memory_budget_gb": FLAGS.memory_budget_gb}}
  results_lib.write_results(FLAGS.workdir, results)
  try:
    from core import plot as plot_lib
    with plot_lib.figure(
        os.path.join(FLAGS.workdir, "bench_dlrm.png"), figsize=(5, 3.5)) as (fig, ax):
      names = ["ours (JAX)"] + (["TorchRec + FBGEMM"] if peer else [])
      vals = [ours] + ([peer] if peer else [])
      ax.boxplot(vals, tick_labels=names)
      ax.set(ylabel="train examples / s", title=f"{FLAGS.model} {FLAGS.preset}, batch {B}")
      ax.grid(alpha=0.3)
  except Exception as e:  # the numbers matter more than the picture
    print(f"plot skipped: {e}", file=sys.stderr)
  results_lib.print_summary(summary)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
