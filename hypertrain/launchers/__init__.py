"""Launchers Hydra loads: the SLURM launcher's preflight."""
