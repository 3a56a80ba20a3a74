"""The command-line options ``unbroken run`` and ``unbroken agent`` share, declared once."""

from __future__ import annotations

import click

from unbroken.config import CROSS_REPLICA_BACKENDS

cross_replica_backend_option = click.option(
    "--cross-replica-backend",
    type=click.Choice(CROSS_REPLICA_BACKENDS),
    default=None,
    help="The backend of the exchange across replicas: auto (NCCL when every member of an epoch holds a "
    "distinct GPU, else Gloo carrying the CUDA tensors), nccl or gloo "
    "[default: $UNBROKEN_CROSS_REPLICA_BACKEND, else auto].",
)
