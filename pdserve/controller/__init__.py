"""Cluster state and actuators. So far: the local launcher that starts the embedded cluster.

Must not sit on the request path.
"""
