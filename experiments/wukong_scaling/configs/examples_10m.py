"""Wukong's scaling claim (arXiv 2403.02545, Figure 1) at 10M examples per size: three Wukong
and three DLRM sizes, 2442 steps of 4096 (10,002,432 examples) each, seeds 0, 1, 2, data
drawn inside XLA (gen=device), eval on 65,536 held-out examples. A stopped run continues
with the same command and --resume.

Command: python -m experiments.wukong_scaling
  --config=experiments/wukong_scaling/configs/examples_10m.py --workdir=runs/wukong_scaling_10m
Same as: python -m experiments.wukong_scaling --models=wukong:l1_n4_k8_w64,wukong:l2_n8_k16_w128,wukong:l2_n16_k24_w256,dlrm:w128,dlrm:w256,dlrm:w512
  --seeds=0,1,2 --batch_size=4096 --steps=2442 --log_every=200
  --data=synthetic_deep:gen=device
Hardware: the 2-core AMD EPYC (Zen 4) CPU, short test and benchmark jobs beside it for about
  a third of the run
Time: 6,630 s wall for the 18 runs (2026-11-27, jax 0.11.2)
Prints: test NE (mean ± std of 3 seeds) Wukong l1_n4_k8_w64 0.6601 ± 0.0048, l2_n8_k16_w128
  0.6338 ± 0.0028, l2_n16_k24_w256 0.6256 ± 0.0025; DLRM w128 0.6194 ± 0.0008, w256 0.6078 ±
  0.0034, w512 0.6046 ± 0.0015; NE - 0.5199 = a GFLOPs^b fitted to the seed means: Wukong b
  -0.111 (R^2 0.94), DLRM b -0.088 (R^2 0.88), per seed Wukong -0.111 ± 0.021, DLRM -0.088 ±
  0.012; relative NE change per 4x compute (--from_results) Wukong -2.88% ± 0.56%, DLRM
  -1.82% ± 0.24% (BENCHMARKS.md "10M examples per size, 3 seeds")
"""


def get_config():
  return {
      "data": "synthetic_deep:gen=device",
      "models": ["wukong:l1_n4_k8_w64", "wukong:l2_n8_k16_w128", "wukong:l2_n16_k24_w256",
                 "dlrm:w128", "dlrm:w256", "dlrm:w512"],
      "seeds": ["0", "1", "2"],
      "batch_size": 4096,
      "steps": 2442,
      "log_every": 200,
  }
