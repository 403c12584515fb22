"""Speculative decoding: proposers and the draft model."""
