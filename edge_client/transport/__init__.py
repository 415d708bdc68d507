"""How the edge reaches a verifier: the backend contract, the gRPC backend and its Verify stream, errors, failover, retries, connections, probes, credentials, a simulated network, cloud decode."""
