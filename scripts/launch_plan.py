"""Prints the multi-process launch plan that xmoe_jax would resolve, without starting anything.

    python scripts/launch_plan.py                       # this process (flags, XMOE_*, SLURM env)
    python scripts/launch_plan.py --nodelist 'frontier[00001-00002]' --tasks-per-node 8 --gpus-per-task 1
    python scripts/launch_plan.py --nodelist 'gpu[01-04]' --tasks-per-node 1 --json

With --nodelist, the SLURM environment of every task of `srun -N<nodes> --ntasks-per-node=<t>
[--gpus-per-task=<g>]` is modelled (srun's GPU binding as <g> visible GPUs per task, in local-id
order; `--gpu-bind=closest` may pick other GPU ids, which does not change the plan) and each task's
plan is resolved by `xmoe_jax.launch.distributed.plan`, the same code `xmoe-train` runs. The SLURM
launchers in scripts/ call this under DRY_RUN=1.
"""

from __future__ import annotations

import argparse
import json
import sys

from xmoe_jax import cli
from xmoe_jax.errors import XmoeError
from xmoe_jax.launch import distributed, slurm


def slurm_env(
    nodelist: str, tasks_per_node: int, pid: int, gpus_per_task: int | None, gpus_per_node: int | None
):
    """The variables srun sets for task `pid` (block distribution) that the plan reads."""
    hosts = slurm.expand_hostlist(nodelist)
    node_id, local_id = divmod(pid, tasks_per_node)
    env = {
        "SLURM_JOB_ID": "1234567",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_STEP_NUM_NODES": str(len(hosts)),
        "SLURM_STEP_TASKS_PER_NODE": f"{tasks_per_node}(x{len(hosts)})",
        "SLURM_NTASKS": str(len(hosts) * tasks_per_node),
        "SLURM_PROCID": str(pid),
        "SLURM_NODEID": str(node_id),
        "SLURM_LOCALID": str(local_id),
    }
    if gpus_per_node:
        env["SLURM_GPUS_ON_NODE"] = str(gpus_per_node)
    if gpus_per_task:
        env["SLURM_GPUS_PER_TASK"] = str(gpus_per_task)
        bound = ",".join(str(local_id * gpus_per_task + i) for i in range(gpus_per_task))
        env["ROCR_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"] = bound
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="JSON output")
    sim = ap.add_argument_group("model an srun launch (dry runs outside an allocation)")
    sim.add_argument("--nodelist", help="SLURM node list, e.g. frontier[00001-00002]")
    sim.add_argument("--tasks-per-node", type=int, default=1)
    sim.add_argument("--gpus-per-task", type=int, help="as srun --gpus-per-task (binds GPUs per task)")
    sim.add_argument("--gpus-per-node", type=int, help="GPUs per node when tasks are not bound")
    sim.add_argument("--port", type=int, help="coordinator port (as XMOE_COORDINATOR_PORT)")
    cli.add_cli_flags(ap)
    args = ap.parse_args(argv)
    try:
        if args.nodelist:
            num = len(slurm.expand_hostlist(args.nodelist)) * args.tasks_per_node
            envs = [
                slurm_env(args.nodelist, args.tasks_per_node, pid, args.gpus_per_task, args.gpus_per_node)
                for pid in range(num)
            ]
            extra = {"XMOE_COORDINATOR_PORT": str(args.port)} if args.port else {}
            plans = [distributed.plan(env={**env, **extra}) for env in envs]
        else:
            flags = (args.coordinator, args.num_processes, args.process_id, args.local_device_ids)
            plans = [distributed.plan(*flags, args.init_timeout, auto=not args.no_distributed)]
    except XmoeError as err:  # a DistributedError (bad launch settings), a ConfigError
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    print(json.dumps(plans, indent=2) if args.json else distributed.format_plan(plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
