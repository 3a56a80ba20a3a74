"""Where a job's secret lives, and how each command finds it.

``unbroken run`` writes a fresh secret (mode 0600) into its run directory for every launch, so
a straggler of an earlier job in the same directory cannot join this one; ``unbroken
coordinator`` keeps the one in its state directory when there is one, so a coordinator restarted
on that directory takes back the agents and workers still running with it. Both take
``--secret-file`` instead (a multi-node job shares one file, or copies it to each node); the
workers learn it from ``UNBROKEN_SECRET_FILE``. A client of the coordinator (``unbroken status``)
finds it from ``--secret-file``, then that variable, then the run/state directory.
"""

from __future__ import annotations

from pathlib import Path

import click

from unbroken.config import ENV_SECRET_FILE, ConfigError
from unbroken.config import secret_file as secret_file_from_env
from unbroken.wire.auth import JobSecret

SECRET_NAME = "secret"


def fresh(directory: Path) -> tuple[JobSecret, Path]:
    """A new secret in ``directory/secret``, replacing an earlier job's in one atomic rename."""
    path = Path(directory) / SECRET_NAME
    secret = JobSecret.generate()
    return secret, secret.write(path, replace=True).resolve()


def kept(directory: Path) -> tuple[JobSecret, Path]:
    """The secret in ``directory/secret``, created if there is none yet."""
    path = Path(directory) / SECRET_NAME
    if path.exists():
        return JobSecret.load(path), path.resolve()
    secret = JobSecret.generate()
    return secret, secret.write(path).resolve()


def given(secret_file: Path | None) -> tuple[JobSecret, Path] | None:
    """The secret of ``--secret-file``, else of ``UNBROKEN_SECRET_FILE``; None if neither is set."""
    if secret_file is None:
        raw = secret_file_from_env()
        if not raw:
            return None
        secret_file = Path(raw)
    return JobSecret.load(secret_file), Path(secret_file).resolve()


def for_client(secret_file: Path | None, run_dir: Path) -> JobSecret:
    """The secret a client of a job's coordinator uses; a ConfigError that says where to find it."""
    found = given(secret_file)
    if found is not None:
        return found[0]
    path = Path(run_dir) / SECRET_NAME
    if not path.exists():
        raise ConfigError(
            f"no job secret: {path} does not exist and neither --secret-file nor {ENV_SECRET_FILE} is set; "
            "pass the job's run directory (--run-dir, or the coordinator's --state-dir) or --secret-file"
        )
    return JobSecret.load(path)


@click.group()
def secret() -> None:
    """Job secrets: every connection of a job proves it holds the job's secret."""


@secret.command("new")
@click.argument("path", type=click.Path(path_type=Path))
def new(path: Path) -> None:
    """Write a new secret to PATH (mode 0600; never overwrites), for --secret-file of a multi-node job."""
    try:
        JobSecret.generate().write(path)
    except FileExistsError as e:
        raise click.UsageError(f"{path} exists already: a secret is never overwritten; pick another path") from e
    except OSError as e:
        raise click.UsageError(f"cannot write {path}: {e.strerror}") from e
    click.echo(str(path))
