"""The model: shared layers, the forward pass over stacked layers, and thin family files."""
