"""LoKA's per-layer FP8 probe and FP8 / bf16 / fp32 training from scratch on the Criteo
Kaggle sample: DLRM (kaggle preset, dim 16) and DCN-v2 (small), one epoch of 56 steps of
128, seeds 0, 1, 2, eval on valid + test (800 rows); FP8 emulated on CPU (quality only).

Command: python -m experiments.fp8_probe
  --config=experiments/fp8_probe/configs/criteo_sample.py --workdir=runs/fp8_probe_criteo
Same as: python -m experiments.fp8_probe --data=criteo:../shared/data/criteo_kaggle_sample
  --epochs=1 --batch_size=128 --seeds=0,1,2 --timing_steps=0
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 10-12)
Time: 1,723 s wall, 9 min of user CPU time (2026-11-24, jax 0.11.2)
Prints: probe of the fp32 DLRM (log loss 0.4749, AUC 0.7255): every layer alone within 0.5%
  log loss; trained eval AUC (mean ± std of 3 seeds) DLRM fp32 0.7211 ± 0.0076, bf16 0.7217
  ± 0.0087, fp8_tensor 0.7193 ± 0.0130, fp8_row 0.7224 ± 0.0122, fp8_delayed 0.7187 ±
  0.0110; DCN-v2 fp32 0.7303 ± 0.0040, bf16 0.7301 ± 0.0042, fp8_tensor 0.7313 ± 0.0052,
  fp8_row 0.7308 ± 0.0043, fp8_delayed 0.7296 ± 0.0038, fp8_safe 0.7311 ± 0.0043
  (BENCHMARKS.md "FP8 dense layers")
"""


def get_config():
  return {
      "data": "criteo:../shared/data/criteo_kaggle_sample",
      "epochs": 1.0,
      "batch_size": 128,
      "seeds": ["0", "1", "2"],
      "timing_steps": 0,
  }
