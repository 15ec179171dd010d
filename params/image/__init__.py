"""Image classification experiments."""
