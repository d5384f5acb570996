"""The compiler passes, one file each, in data order: ``detect`` → ``shard`` → ``rewrite`` → ``schedule``.
``pipeline`` runs them in that order (the backend and the scale benchmark both call it)."""
