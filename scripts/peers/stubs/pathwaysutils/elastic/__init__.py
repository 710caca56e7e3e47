"""Stub: never used without a Pathways backend (is_pathways_backend_used() is False)."""
