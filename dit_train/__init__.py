"""dit_train: layout-invariant training of packed video DiTs and causal LMs."""
__version__ = "0.1.0"
