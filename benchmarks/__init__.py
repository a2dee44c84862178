"""Benchmarks of zerokit against its peers; run `python benchmarks/bench_stages.py --help`."""
