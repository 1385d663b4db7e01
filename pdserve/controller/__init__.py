"""The controller: cluster state, pressures, the pure FluidPD policy (`policy.decide`), the safe
role flip, the controller service (`python -m pdserve.controller`) and the `pdserve ctl`
operator CLI. The local launcher that starts the embedded cluster is `pdserve.launcher`.

Must not sit on the request path, or import torch.
"""
