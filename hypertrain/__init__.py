"""hypertrain: low-communication data-parallel training experiments (DiLoCo family)."""
