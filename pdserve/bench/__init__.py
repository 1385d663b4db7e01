"""Benchmarks behind `pdserve bench ...`: each measures pdserve against a baseline in the same run.

Every figure a benchmark reports is a ratio against a baseline measured in the same process on the
same machine (a memory copy, Hugging Face `transformers`), because the machines are shared and
noisy (DESIGN.md, "Measuring"). Benchmarks report their aims as met or not; they never assert them.
"""
