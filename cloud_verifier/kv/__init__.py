"""The target's KV memory: the paged pool, the per-step page scheduler with preemption, the prefix cache, the recurrent state of hybrid targets, one forward row."""
