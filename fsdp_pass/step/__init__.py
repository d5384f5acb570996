"""Across the optimizer step: the last reduce-scatter left in flight (``deferred_reduce``), the next step's
first gathers (``prefetch``), stepping reduced gradients first (``reduced_first``) and the gradient check
of unsharded parameters (``sync_check``)."""
