"""Setup-time policy: which ranks each parameter is sharded over (``mesh_roles``), which bucket it goes
in (``buckets``), allocating the DBuffers and swapping parameters into them (``materialize``,
``swap``), initializing meta-device models (``meta_init``) and checking that ranks agree before the
first collective (``agreement``). What runs every step lives in :mod:`fsdp_pass.runtime`."""
