"""The decode role: pull a prefilled request's KV from the store and decode it in the running batch."""
