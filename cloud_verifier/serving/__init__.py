"""The verifier on the network: the gRPC server and servicer, the Verify and Decode streams, the health probe."""
