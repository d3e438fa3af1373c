"""The Serve ingress and the residency controller (issue 4). Empty until then."""
