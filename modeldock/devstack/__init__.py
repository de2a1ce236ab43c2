"""Development helpers that start real processes on this machine, for the tests and the benchmarks.

`stack`: the whole stack (simulators, xDS, ext_proc, Envoy) under `modeldock up`'s `Supervisor`;
`redis_server`: a real Redis. Nothing on the request path imports this package.
"""
