"""Stub: tokamax's benchmarking imports this; training never calls it."""


def get_kernel_stats_tool(*args, **kwargs):
    raise RuntimeError("xprof is stubbed (scripts/peers/stubs): no kernel stats on this host")
