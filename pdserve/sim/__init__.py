"""The discrete-event cluster simulator: a virtual clock, trace replay, modelled step times, and
the real routing, admission, membership, scheduling and controller cores driven unchanged.

Owns nothing itself; see `run.simulate` (the entry), `trace.load_trace` and `report.SimReport`.
Must not import torch (the scheduler is reached only through `engine_model`).
"""
