"""The real Redis server helper, shared with the benchmarks: it lives in modeldock/devstack/redis_server.py."""

from modeldock.devstack.redis_server import RedisServer, find_server_binary, free_port

__all__ = ["RedisServer", "find_server_binary", "free_port"]
