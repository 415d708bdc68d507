"""One generation on the edge: the loop, the run, the speculative segment, device decode, the route and its cost model, the speculation policy."""
