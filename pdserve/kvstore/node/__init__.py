"""A storage node of the distributed KV store: the bytes, not the metadata.

A node contributes DRAM (shared-memory segments that same-host clients map and copy into
directly) and optionally an SSD tier, and serves both over a small TCP data protocol
(`data_server`). It owns no object metadata: which bytes of which segment belong to which key is
the master's business. Must not import `pdserve.engine`, gRPC stubs or the master.
Submodules are imported explicitly (`pdserve.kvstore.node.segment`, ...) so clients that only need
a segment mapping do not pay for the server.
"""
