"""Every cross-process API of pdserve as protobuf (package `pdserve.v1`) and its generated stubs.

Owns the `.proto` files and the `*_pb2.py`, `*_pb2.pyi`, `*_pb2_grpc.py` modules generated from
them by `scripts/gen_proto.sh` (checked byte-for-byte by `tests/proto/test_stubs_fresh.py`).
Must not hold logic: edit a `.proto`, then regenerate; never edit generated files by hand.
"""
