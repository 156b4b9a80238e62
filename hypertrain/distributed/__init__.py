"""Processes: how ranks map to replicas (layouts), what a config decides once (`decided`: the layout,
device, backend and the sync's reduction), their groups and collectives, the launchers' environment."""
