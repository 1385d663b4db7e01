"""The prefill role: run a prompt to its first token and write its KV blocks to the store."""
