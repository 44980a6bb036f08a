"""Benchmarks with in-run baselines: `python -m mooncake_ep_switch.bench` (see `__main__`), the EPLB
bench (`bench.eplb_bench`) and the switch bench (`bench.switch_bench`)."""
