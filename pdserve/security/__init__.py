"""The cluster's security: certificates, identities, who may call what, and the checks.

`pki` makes a per-cluster CA and short-lived certificates; `tls` turns them into this
process's gRPC credentials and `ssl` contexts (or, opted into, none); `access` is the one table
of which component kind may call which method; `guard` applies it to a gRPC call, `assertion`
lets a component prove its certificate where TLS cannot ask for one; `keys` holds admin keys;
`tenants` the tenants' API keys (the router's and the controller's); `failures` counts
refusals. Torch-free. Must not import any service.
"""
