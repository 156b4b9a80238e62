"""The DiLoCo algorithm: rounds of H inner steps, the sync (pseudo-gradient, communication, outer step,
state policy), the run's state."""
