"""Offline what-if planning: ``python -m fsdp_pass plan`` (``cli``), its cost model (``report``), tensor and
expert parallel rules by name (``parallel_rules``) and built-in model shapes (``model_configs``)."""
