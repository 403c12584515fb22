"""Rank 0's engine: scheduling, the step loop, sampling, detokenization, replicas."""
