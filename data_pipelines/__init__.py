"""Data: synthetic/real video reading (decord or PyAV), packing, text corpora."""
