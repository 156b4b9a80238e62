"""Engines: how one process computes the inner steps of its replicas (loop, stacked), and what they
measured."""
