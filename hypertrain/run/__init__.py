"""A run: preparation and checks, training with its records and checkpoints, sessions, the real
processes."""
