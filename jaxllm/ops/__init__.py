"""The backend operations the model calls."""
