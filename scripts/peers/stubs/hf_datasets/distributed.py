"""Stub (see __init__.py)."""


def split_dataset_by_node(*args, **kwargs):
    raise RuntimeError("datasets is stubbed (scripts/peers/stubs): the peer harness uses synthetic data")
