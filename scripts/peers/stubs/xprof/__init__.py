"""Stub of xprof (the profiler UI), imported by tokamax and MaxText but not used by a training run."""
