"""Stub of pathwaysutils (Google's Pathways helpers) for MaxText on a plain GPU host: no Pathways backend."""


def initialize(*args, **kwargs):
    return None


def is_pathways_backend_used():
    return False
