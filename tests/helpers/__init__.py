"""Shared builders for tests (tiny models, tiny checkpoint folders); nothing here downloads."""
