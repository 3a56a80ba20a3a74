"""The stand-ins the unit tests use for a Manager and its parts match the real interfaces.

A fake whose method drifted from the real one (a renamed argument, a new required one) would
keep its test passing while the code it stands in for no longer works that way. Each fake's
public methods must exist on the real class with the same parameters, its public attributes
must be attributes of a real instance (unless listed as the test's own bookkeeping), and a fake
must provide every member of the protocol (:mod:`unbroken.train.interface`) that the wrapper it
drives is typed with.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from tests.unit.train import test_ddp_buckets, test_optimizer, test_resume
from tests.unit.train.parts import FakeClient, FakeGroup, manager_with_fakes
from unbroken.comm.cross_replica import CrossReplicaGroup
from unbroken.control.client import CoordinatorClient
from unbroken.train.interface import BucketExchange, StepDriver
from unbroken.train.manager import Manager


def build(fake: type) -> Any:
    if fake is test_resume.FakeManager:
        return fake(test_resume.Config("/nonexistent"))
    return fake()


# fake, the class it stands in for, the test's own bookkeeping (not part of the interface)
FAKES: list[tuple[type, type, set[str]]] = [
    (test_optimizer.FakeManager, Manager, {"answer", "calls", "synced", "expected"}),
    (test_resume.FakeManager, Manager, {"weight"}),
    (test_ddp_buckets._NoExchange, Manager, set()),
    (FakeClient, CoordinatorClient, {"replica_id", "asked", "answers", "closed", "drained", "pushed_after"}),
    (FakeGroup, CrossReplicaGroup, {"fail", "closed", "aborted"}),
]


def public_methods(cls: type) -> dict[str, Any]:
    return {name: fn for name, fn in vars(cls).items() if not name.startswith("_") and inspect.isfunction(fn)}


def parameters(fn: Any) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize(("fake", "real", "own"), FAKES, ids=lambda v: getattr(v, "__qualname__", ""))
def test_a_fakes_methods_have_the_real_ones_parameters(fake: type, real: type, own: set[str]) -> None:
    for name, fn in public_methods(fake).items():
        assert hasattr(real, name), f"{fake.__qualname__}.{name} stands in for nothing on {real.__name__}"
        assert parameters(fn) == parameters(getattr(real, name)), (
            f"{fake.__qualname__}.{name}{inspect.signature(fn)} differs from "
            f"{real.__name__}.{name}{inspect.signature(getattr(real, name))}"
        )


@pytest.mark.parametrize(("fake", "real", "own"), FAKES, ids=lambda v: getattr(v, "__qualname__", ""))
def test_a_fakes_attributes_are_the_real_ones(fake: type, real: type, own: set[str]) -> None:
    if real is Manager:
        instance = manager_with_fakes()[0]
        has = lambda name: hasattr(instance, name)  # noqa: E731
    else:  # built with sockets and threads: read the attributes its __init__ and class set
        source = inspect.getsource(real)
        has = lambda name: hasattr(real, name) or f"self.{name}" in source  # noqa: E731
    attributes = {k for k in vars(build(fake)) if not k.startswith("_")} - own
    missing = sorted(a for a in attributes if not has(a))
    assert not missing, f"{fake.__qualname__} has {missing}, which {real.__name__} does not"


def test_the_optimizers_fake_provides_the_whole_protocol_the_optimizer_is_typed_with() -> None:
    fake = build(test_optimizer.FakeManager)
    missing = [name for name in protocol_members(StepDriver) if not hasattr(fake, name)]
    assert not missing, f"the optimizer's FakeManager lacks {missing} of StepDriver"


@pytest.mark.parametrize("protocol", [StepDriver, BucketExchange])
def test_the_manager_has_each_protocol_method_with_its_parameters(protocol: type) -> None:
    for name in protocol_members(protocol):
        member = inspect.getattr_static(protocol, name)
        if inspect.isfunction(member):
            assert parameters(member) == parameters(getattr(Manager, name)), f"Manager.{name}"
        else:
            assert hasattr(manager_with_fakes()[0], name), f"Manager.{name}"


def protocol_members(protocol: type) -> list[str]:
    return [n for n in vars(protocol) if not n.startswith("_")]


def test_a_drifted_fake_is_caught() -> None:
    """The check itself: a fake whose sync_gradients grew a parameter differs from the Manager's."""

    class Drifted(test_optimizer.FakeManager):
        def sync_gradients(self, grads: list[torch.Tensor], scale: float = 1.0) -> bool:
            return True

    fn = public_methods(Drifted)["sync_gradients"]
    assert parameters(fn) != parameters(Manager.sync_gradients)
