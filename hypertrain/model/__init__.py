"""The model: parameters as a dict of tensors with a leading replica axis, and its forward pass; the
model table (`model.spec`: one entry per model kind, picked from the config by `model_spec`) says what
the rest of the code needs to know of it.
"""
