"""Python that deployments run beside the services: on Kubernetes, the worker pods' role label
(`k8s_labels`). The manifests themselves live in the repository's `deploy/` folder."""
