"""Helpers shared by test directories (servers to start, fixtures to import into a conftest)."""
