"""Structured outputs: request constraints and the grammar matcher."""
