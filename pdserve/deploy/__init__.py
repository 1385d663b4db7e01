"""Python that deployments run beside the services: on Kubernetes, the worker pods' role label
(`k8s_labels`); on Ray, the actors that place and run every process (`ray/`). The manifests
themselves live in the repository's `deploy/` folder."""
