"""The controller: cluster state, pressures, the pure FluidPD policy (`policy.decide`), the safe
role flip, the controller service (`python -m pdserve.controller`), the `pdserve ctl` operator
CLI, and the local launcher that starts the embedded cluster.

Must not sit on the request path, or import torch.
"""
