"""Scaffold runtime: the thin, numerically verified library that emitted train.py scripts import."""
