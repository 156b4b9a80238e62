"""hypertrain's Hydra launcher for SLURM (Hydra loads launchers only from the hydra_plugins namespace)."""
