"""The failure type and its status table now live in deployments/wire/failure.py, where every
process can import them; this module re-exports them for the modules that still import them from
here."""

from deployments.wire.failure import STATUS, OrchardError, raise_for_error, status_of

__all__ = ["STATUS", "OrchardError", "raise_for_error", "status_of"]
