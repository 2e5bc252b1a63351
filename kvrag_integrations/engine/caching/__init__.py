"""Chunk caches: encoding chunks, their store entries, reading them for a prompt."""
