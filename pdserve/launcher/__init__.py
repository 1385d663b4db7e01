"""The local cluster: what one is (`cluster_spec`), its TLS folder (`cluster_tls`), starting and
stopping its processes (`local.LocalCluster`), and supervising them (`restart`: the pure rule
for when a dead child is started again; `supervision`: the thread that carries it out).

`pdserve serve`, the Ray backend and the benchmarks start clusters through it. Must not make
the cluster's decisions (routing, roles: the router and the controller do) nor sit on the
request path; it starts the controller as a process and never imports it.
"""
