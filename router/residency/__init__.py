"""The residency controller, its Ray effects, its Serve deployment, the model registry and metrics."""
