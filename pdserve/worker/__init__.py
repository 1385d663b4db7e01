"""The worker process: loads the engine once and hosts a role (prefill or decode), switchable at run time.

Three layers, each importing only the ones below it (the import-linter contracts say so):
- the process host: `__main__`, `server` (builds the worker), `service` (gRPC `Worker`, the role
  switch with drain), `decode_mux`, `registration`, `metrics`;
- the roles, `prefill/` and `decode/`, independent of each other;
- what both roles use: the engine loop thread (`engine_loop`, `cores`), KV to and from the store
  (`kv_blocks`, `kv_stream`, `kv_staging`, `guarded_store`, `store_health`) and `config`.
"""
