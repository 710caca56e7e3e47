"""Starting a job, apart from training: how processes find each other and how XLA is set up.

distributed.py  multi-host start-up: the plan (flags, XMOE_* variables, SLURM), its checks,
                `jax.distributed.initialize`; `python -m xmoe_jax.launch.distributed` prints it
slurm.py        SLURM step variables (host lists, port, device binding): pure functions
peers.py        the watch for processes that die or freeze during a run
local.py        N processes of one job on this host (explicit coordinator), and the check that
                they train like one process (`python -m xmoe_jax.launch.local run|compare`)
xla_flags.py    XLA flag defaults (ragged all-to-all presets), set before JAX starts
"""
