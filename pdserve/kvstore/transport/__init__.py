"""Client side of the store's data plane: moving bytes to and from a node's extents.

`base` defines the `Extent` (where an object's bytes live, as the master's placement says) and
the `Transport` protocol; `shm` (same host), `tcp` and `ucx` (across hosts) implement it;
`select` picks one per peer; `measure` times them. Must not talk to the master or know keys.
"""
