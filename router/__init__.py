"""The residency controller (controller.py, its Ray effects and Serve deployment) and, with the
ingress, the OpenAI-compatible API."""
