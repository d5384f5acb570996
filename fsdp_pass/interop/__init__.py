"""What adapts to other libraries' calls: ``Module._apply`` on sharded modules, whole and DCP state dicts,
list ops mixing DTensors with RaggedShard tensors, refusing wrappers that would fight the sharding."""
