"""Persistence: tables, engines per backend, migrations and the Core statements of the hot path."""
