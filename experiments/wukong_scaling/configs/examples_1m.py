"""Wukong's scaling claim (arXiv 2403.02545, Figure 1) at 1M examples per size: three Wukong
and three DLRM sizes, 250 steps of 4096 (1,024,000 examples) each, seeds 0 and 1, data drawn
on the fly by the host generator, eval on 65,536 held-out examples.

Command: python -m experiments.wukong_scaling
  --config=experiments/wukong_scaling/configs/examples_1m.py --workdir=runs/wukong_scaling_rerun
Same as: python -m experiments.wukong_scaling --models=wukong:l1_n4_k8_w64,wukong:l2_n8_k16_w128,wukong:l2_n16_k24_w256,dlrm:w128,dlrm:w256,dlrm:w512
  --seeds=0,1 --batch_size=4096 --steps=250 --data=synthetic_deep:gen=host
Hardware: the 2-core CPU of BENCHMARKS.md, shared with six other jobs (load average 14-39)
Time: 4,102 s wall (2026-11-27, jax 0.11.2)
Prints: test NE (mean ± std of 2 seeds) Wukong l1_n4_k8_w64 0.8062 ± 0.0016, l2_n8_k16_w128
  0.7901 ± 0.0012, l2_n16_k24_w256 0.8031 ± 0.0062; DLRM w128 0.7385 ± 0.0033, w256 0.7264 ±
  0.0047, w512 0.7111 ± 0.0050; NE - 0.5237 = a GFLOPs^b fitted to the seed means: Wukong b
  -0.0047 (R^2 0.04), DLRM b -0.0759 (R^2 1.00); per-seed fits with --from_results
  (BENCHMARKS.md "1M examples per size and 2 seeds")
"""


def get_config():
  return {
      "data": "synthetic_deep:gen=host",
      "models": ["wukong:l1_n4_k8_w64", "wukong:l2_n8_k16_w128", "wukong:l2_n16_k24_w256",
                 "dlrm:w128", "dlrm:w256", "dlrm:w512"],
      "seeds": ["0", "1"],
      "batch_size": 4096,
      "steps": 250,
  }
