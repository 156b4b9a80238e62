"""The sync's exchange: how the replicas' pseudo-gradients cross the wire and become the one the
outer step uses (`communication`: the exact mean or compressed payloads; `lowrank`: PowerSGD's
factors; `wire`: one asynchronous arrival's payload), and what each costs in bytes.
"""
