"""Shared kit for the tests and benchmarks: reference models, multi-process spawning, fake process groups,
a node lab (several nodes on one machine, linked at a set rate).

Import the submodule you need (``fsdp_pass.testing.fake_pg``, ...); nothing here is part of the
training API, and importing the package pulls in nothing heavy.
"""
