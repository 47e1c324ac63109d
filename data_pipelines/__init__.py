"""Data: synthetic/real video reading (decord), packing, text corpora."""
