"""The front door: client APIs, validation, tokenization, choosing workers, relaying tokens.

Must not run the model: it talks to workers only through `pdserve.v1` messages.
"""
