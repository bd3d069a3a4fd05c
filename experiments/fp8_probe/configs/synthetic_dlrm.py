"""LoKA's per-layer FP8 probe and FP8 / bf16 / fp32 training from scratch on synthetic
Criteo-shaped data (linear planted signal), DLRM only: 300 steps of 512, seeds 0 and 1,
eval on 8,192 examples; FP8 emulated on CPU (quality only).

Command: python -m experiments.fp8_probe
  --config=experiments/fp8_probe/configs/synthetic_dlrm.py
Same as: python -m experiments.fp8_probe --models=dlrm --steps=300 --seeds=0,1
Hardware: the 2-core CPU of BENCHMARKS.md, shared with other jobs (load average 10-12)
Time: not yet recorded in BENCHMARKS.md (2026-11-24, jax 0.11.2: the DLRM part of a run with
  the default --models, stopped in its DCN-v2 part)
Prints: probe of the fp32 model (log loss 0.5144, AUC 0.7495): output SQNR 28.1-42.4 dB
  (tensor), every layer alone within 2.0e-3 relative log loss; trained eval AUC (mean ± std
  of 2 seeds) fp32 0.7394 ± 0.0143, bf16 0.7429 ± 0.0112, fp8_tensor 0.7403 ± 0.0131,
  fp8_row 0.7339 ± 0.0188, fp8_delayed 0.7450 ± 0.0058, fp8_safe 0.7332 ± 0.0199
  (BENCHMARKS.md "FP8 dense layers", synthetic)
"""


def get_config():
  return {
      "data": "synthetic",
      "models": ["dlrm"],
      "steps": 300,
      "seeds": ["0", "1"],
  }
