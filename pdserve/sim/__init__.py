"""The discrete-event simulator: virtual clock, trace replay, calibrated step-time models; drives the real
router, scheduler and controller cores (Must not copy policy code or import torch)."""
