"""The sharded tensor: the RaggedShard subclass (``ragged_tensor``), how ops run on it (``dispatch``, with
list ops once per flat buffer in ``flat_buffers``), the collectives it needs (``collectives``), gradients
still being reduced (``in_flight``), its checkpoint form (``checkpoint``) and in-place swaps (``swap``).
Imports nothing above :mod:`fsdp_pass.placement`."""
