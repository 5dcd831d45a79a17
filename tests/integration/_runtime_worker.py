"""Worker for test_runtime_multiprocess: builds the runtime and exercises its sync group."""

from __future__ import annotations

import json
import sys

import torch

from pfctl.config.schema import RuntimeConfig
from pfctl.errors import PfctlError
from pfctl.runtime.accelerator import build_runtime


def main() -> int:
    group_size = int(sys.argv[1])
    out = sys.argv[2]
    try:
        rt = build_runtime(RuntimeConfig(device="cpu", collective_timeout_s=60), sync_group_size=group_size)
    except PfctlError as exc:
        print(f"rejected: {exc.message}", flush=True)
        return 2
    sync = rt.sync
    # The first rank of each group broadcasts a value unique to its group; it must reach
    # exactly that group's ranks.
    value = torch.tensor([1000.0 * (sync.index + 1) + rt.rank])
    sync.broadcast(value, src_in_group=0)
    total = sync.all_reduce(torch.tensor([float(rt.rank)]))
    agreed_index = sync.broadcast_object(sync.index)
    record = {
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "world_size": rt.world_size,
        "group_index": sync.index,
        "rank_in_group": sync.rank_in_group,
        "ranks": sync.ranks,
        "received": value.item(),
        "group_rank_sum": total.item(),
        "agreed_index": agreed_index,
        "device": str(rt.device),
    }
    with open(f"{out}/rank{rt.rank}.json", "w") as fh:
        json.dump(record, fh)
    rt.barrier()
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
