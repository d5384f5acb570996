"""A sharded model outside the compiled call: eager gradients into the shards (``calls``) and whole
parameters for a block of code (``unshard``)."""
