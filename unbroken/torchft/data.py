"""torchft's ``DistributedSampler``: shards the data over the replica groups and their ranks.

The same arithmetic as torchft's: shard ``group_rank + num_replicas * replica_rank`` of
``num_replicas * num_replica_groups``. unbroken's own sample plans (:mod:`unbroken.train.data`)
go further: they re-split the data by who contributes each step, so no sample is skipped or
seen twice when a replica is down; this one, as torchft's, drops the shards of a missing group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils import data


class DistributedSampler(data.distributed.DistributedSampler):
    """torchft's sampler: ``replica_rank`` of ``num_replica_groups``, then ``group_rank`` of
    ``num_replicas`` inside the replica group (default: the replica's own default group)."""

    def __init__(
        self,
        dataset: data.Dataset,
        replica_rank: int | None = None,
        num_replica_groups: int = 1,
        group_rank: int | None = None,
        num_replicas: int | None = None,
        replica_group_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        # torchft's examples name it replica_group_id, its sampler replica_rank
        replica_rank = replica_rank if replica_rank is not None else replica_group_id
        if replica_rank is None:
            raise TypeError("DistributedSampler needs replica_rank (or replica_group_id)")
        if group_rank is None:
            group_rank = dist.get_rank() if dist.is_initialized() else 0
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_initialized() else 1
        self.global_rank: int = group_rank + num_replicas * replica_rank
        self.global_world_size: int = num_replicas * num_replica_groups
        super().__init__(dataset, rank=self.global_rank, num_replicas=self.global_world_size, **kwargs)
