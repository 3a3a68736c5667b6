"""A stand-in conversion *command* for slurm/convert.sbatch tests: joins the env:// rendezvous the
script sets up (real torch.distributed, gloo), all-reduces the ranks, and rank 0 writes what every
rank saw to ``argv[1]``. With ``FAIL_RANK=k`` rank k exits 3 at once instead (a failing rank)."""
import json
import os
import sys

import torch
import torch.distributed as dist


def main(out_path: str) -> int:
    rank = int(os.environ["RANK"])
    if os.environ.get("FAIL_RANK") == str(rank):
        return 3
    dist.init_process_group("gloo", init_method="env://")
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    seen = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
                                           "SLURMD_NODENAME", "GLOO_SOCKET_IFNAME")}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"sum": total.item(), "ranks": everyone, "args": sys.argv[2:]}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
