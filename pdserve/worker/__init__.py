"""The worker process: loads the engine once and hosts a role (prefill or decode), switchable at run time.

The roles live in `pdserve.prefill_worker` and `pdserve.decode_worker`; this package owns what
they share: the engine loop thread, the gRPC service, the role switch with drain.
"""
