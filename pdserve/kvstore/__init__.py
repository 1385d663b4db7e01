"""The KV-cache store: a key-addressed object store for KV blocks, and its client library.

This first version is one process holding objects in memory (`store` is the pure core,
`service` the gRPC adapter, `client` the library workers use). It grows into a Mooncake-style
store: master, storage nodes with memory and SSD tiers, zero-copy transports.
Must not import `pdserve.engine`: it stores bytes and shapes, not what the tensors mean.
"""
