"""Fixtures of the chaos suite: a supervised 2 prefill + 2 decode cluster (tiny Llama) that the
tests break, one process at a time."""

from __future__ import annotations
