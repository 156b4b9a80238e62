"""hypertrain's Hydra sweeper for Optuna studies (Hydra loads sweepers only from the hydra_plugins
namespace)."""
