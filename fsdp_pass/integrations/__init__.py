"""Recipes for training frameworks: one module per framework, each using only its public extension points.

See ``docs/integrations.md``.
"""
