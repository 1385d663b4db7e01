"""The system's shared vocabulary, torch-free: what the router, the controller and the
simulator all use (Must not import torch or any service)."""
