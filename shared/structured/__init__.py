"""Structured outputs: what a request constrains its output to, and the grammars that enforce it."""
