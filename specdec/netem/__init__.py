"""A WAN you can dial: a seeded fault-injecting TCP proxy (latency ± jitter, bandwidth, stalls, resets).

See :class:`WanProxy` and :class:`LinkProfile`; ``python -m specdec.netem --help`` runs one by hand.
"""

from specdec.netem.proxy import DirectionProfile, LinkProfile, LinkSchedule, WanProxy, WanStats

__all__ = ["DirectionProfile", "LinkProfile", "LinkSchedule", "WanProxy", "WanStats"]
