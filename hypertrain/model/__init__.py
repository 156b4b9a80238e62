"""The model: parameters as a dict of tensors with a leading replica axis, and its forward pass."""
