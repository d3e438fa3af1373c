"""Operator tools: `python -m router.tools parse` (docs/tool-calls.md)."""
