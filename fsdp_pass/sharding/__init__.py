"""Setup-time policy: which ranks each parameter is sharded over (``mesh_roles``), what its blocks are
(``blocks``), which bucket it goes in (``buckets``), allocating the DBuffers and swapping parameters into
them (``materialize``), ``fully_shard``, initializing meta-device models (``meta_init``) and checking that
ranks agree before the first collective (``agreement``). What runs every step lives in the rooms below
(:mod:`fsdp_pass.tensor`, :mod:`fsdp_pass.buckets`, :mod:`fsdp_pass.step`)."""
