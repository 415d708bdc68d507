"""The Redis HA topologies of the tests: the chaos bench's own (specdec/bench/chaos/redis_topology.py)."""

from specdec.bench.chaos.redis_topology import ClusterSet, Node, SentinelSet, binaries  # noqa: F401
