"""Scaffold's generator: spec -> validated answers -> rendered, formatted train.py."""

__version__ = "0.1.0"
