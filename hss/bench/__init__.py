"""Benchmarks (device): ``python -m hss.bench [launch|predictor|...]``. Nothing imports this package."""
