"""Helpers the test modules share (no test module imports another): policy builders and the brute-force
oracle, and the cluster set-up of the end-to-end modules."""
