"""`specdec bench --chaos`: every fault at once against a loopback topology (Redis HA, replicas, WAN proxy)."""
