"""Reliability suite for mlxd: bad input, disconnect storm, overload, soak (python -m reliability)."""
