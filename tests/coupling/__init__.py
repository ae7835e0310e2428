"""Coupling tests: every private mode run on D and its neighbour D' (``harness``)."""
