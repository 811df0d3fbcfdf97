"""Attention kernels: decode attention over rows of different lengths (decode.py)."""
