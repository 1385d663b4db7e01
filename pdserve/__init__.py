"""pdserve: LLM serving with prefill and decode in separate worker pools joined by a KV-cache store."""

__version__ = "0.1.0"
