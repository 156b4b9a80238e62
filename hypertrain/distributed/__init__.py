"""Processes: how ranks map to replicas (layouts), their groups and collectives, the launchers'
environment."""
