"""Shared pytest setup for tests/py. Keep it small: fixtures used by one file live there."""
