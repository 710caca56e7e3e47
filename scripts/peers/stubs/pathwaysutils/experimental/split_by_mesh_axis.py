"""Stub: never used without a Pathways backend; any attribute is a placeholder that fails when called."""


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("pathwaysutils is stubbed (scripts/peers/stubs): no Pathways backend on this host")


def __getattr__(name):
    return _Unavailable
