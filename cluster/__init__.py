"""Node agents and the local multi-node launcher (issue 4). Empty until then."""
