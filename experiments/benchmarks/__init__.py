"""Benchmark pieces shared by the bench_* entry points and experiments.gpu_report: each
module times one thing (flash attention, the embedding bag, a Llama train step, decoding,
a recommendation step and its loop) and returns plain dicts. Not an entry point."""
