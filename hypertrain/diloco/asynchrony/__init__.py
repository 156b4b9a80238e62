"""DiLoCo with asynchronous replicas (outer.schedule=async, docs/async.md): the arrival
schedule, a pure function of the config (`arrivals`), the server's step on each update (`server`) and
the loop that walks the schedule on the engine (`asynchronous`).
"""
