"""Tools that hold the simulator to reality: `pdserve sim calibrate` (a step-time profile fitted
on this machine's engine, store and cluster), `pdserve sim validate` (one trace on a real
cluster and in the simulator, and the error), and the comparison with vidur, an outside
simulator (`vidur_compare`).

They drive real engines and clusters (through the benchmarks' cluster start and client), so
they sit above `pdserve.bench`; the simulator itself (`pdserve.sim`) never imports them.
"""
