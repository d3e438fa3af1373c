"""The cluster side: node agents (memory reports per node), model-server placement helpers, and the
local multi-node launcher (`python -m cluster.local`). See docs/cluster.md."""
