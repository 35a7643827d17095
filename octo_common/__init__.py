"""Octo protocol core: pure (no asyncio, no I/O)."""
