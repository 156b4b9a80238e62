"""Simulation engines: many replicas on one device."""
