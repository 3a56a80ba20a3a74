"""torchft's Manager, Optimizer, LocalSGD and DiLoCo on unbroken's Manager, driven through their
constructors with the stand-ins of tests/unit/train/parts.py (a one-replica job). The real
processes, a kill -9 and the comparison of replicas are in tests/integration/test_torchft.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.unit.train.parts import manager_with_fakes
from unbroken.torchft import local_sgd
from unbroken.torchft.manager import Manager
from unbroken.torchft.optim import OptimizerWrapper
from unbroken.torchft.process_group import ManagedProcessGroup, ProcessGroupBabyNCCL, ProcessGroupGloo, backend_of


def facade(**kwargs: object) -> tuple[Manager, object]:
    m, client, _ = manager_with_fakes()
    return Manager(pg=ProcessGroupGloo(), load_state_dict=None, state_dict=None, manager=m, **kwargs), client  # type: ignore[arg-type]


def test_a_step_commits_and_counts() -> None:
    ft, client = facade(min_replica_size=1)
    assert ft.num_participants() == 0 and ft.participating_rank() is None  # before any quorum
    ft.start_quorum()
    t = torch.tensor([2.0, 4.0])
    work = ft.allreduce(t)
    assert work.wait()
    assert torch.equal(work.get_future().wait(), torch.tensor([2.0, 4.0]))  # the average of one replica
    assert ft.num_participants() == 1 and ft.participating_rank() == 0 and ft.is_participating()
    assert ft.should_commit()
    assert ft.current_step() == 1 and ft.batches_committed() == 1
    assert ft.state_dict() == {"step": 1, "batches_committed": 1}


def test_report_error_vetoes_one_step_only() -> None:
    ft, client = facade(min_replica_size=1)
    ft.start_quorum()
    ft.allreduce(torch.ones(2)).wait()
    ft.report_error(RuntimeError("corrupt"))
    assert ft.errored() is not None
    assert not ft.should_commit()
    assert ft.current_step() == 0
    ft.start_quorum()
    assert ft.errored() is None  # reset at the next quorum, as torchft's
    ft.allreduce(torch.ones(2)).wait()
    assert ft.should_commit() and ft.current_step() == 1
    assert client.asked == [(0, None), (0, 1), (0, 2)][: len(client.asked)]  # type: ignore[attr-defined]


def test_fewer_participants_than_min_replica_size_do_not_commit_and_max_retries_raises() -> None:
    ft, _ = facade(min_replica_size=2, max_retries=1)
    ft.start_quorum()
    assert not ft.should_commit()
    ft.start_quorum()
    with pytest.raises(RuntimeError, match="max_retries=1"):
        ft.should_commit()


def test_average_of_an_integer_tensor_is_refused_and_max_is_a_side_collective() -> None:
    ft, _ = facade()
    ft.start_quorum()
    with pytest.raises(ValueError, match="floating point"):
        ft.allreduce(torch.ones(2, dtype=torch.int64))
    t = torch.tensor([5], dtype=torch.int64)
    ft.allreduce(t, reduce_op=dist.ReduceOp.MAX).wait()  # one replica: its own value
    assert t.item() == 5


def test_load_state_dict_restores_the_step_and_batches() -> None:
    ft, _ = facade()
    ft.load_state_dict({"step": 7, "batches_committed": 21})
    assert ft.current_step() == 7 and ft.batches_committed() == 21
    ft._manager.load_state_dict(ft._manager.state_dict())  # the counters travel in unbroken's state too
    assert ft.batches_committed() == 21


def test_the_optimizer_wrapper_steps_only_when_the_step_commits() -> None:
    ft, _ = facade()
    w = torch.nn.Parameter(torch.ones(3))
    opt = OptimizerWrapper(ft, torch.optim.SGD([w], lr=0.5))
    opt.zero_grad()
    w.sum().backward()
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), 0.5))
    opt.zero_grad()
    w.sum().backward()
    ft.report_error(RuntimeError("a rank's gradients are bad"))
    opt.step()
    assert torch.equal(w.detach(), torch.full((3,), 0.5)) and ft.current_step() == 1


def test_local_sgd_syncs_every_n_steps_and_a_failed_sync_goes_back_to_the_backup() -> None:
    ft, _ = facade(use_async_quorum=False)
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    start = [p.detach().clone() for p in model.parameters()]
    with local_sgd.LocalSGD(ft, model, inner, sync_every=2) as sgd:
        for _ in range(2):
            inner.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            inner.step()
        assert ft.current_step() == 1  # one sync: alone, the average is its own move
        moved = [p.detach().clone() for p in model.parameters()]
        assert not any(torch.equal(a, b) for a, b in zip(start, moved, strict=True))
        assert all(torch.equal(b, p) for b, p in zip(sgd._fragments[0].backup, moved, strict=True))


def test_a_sync_that_does_not_commit_puts_the_parameters_back() -> None:
    ft, _ = facade(use_async_quorum=False, min_replica_size=2)  # alone: no sync commits
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    start = [p.detach().clone() for p in model.parameters()]
    with local_sgd.LocalSGD(ft, model, inner, sync_every=1):
        inner.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        inner.step()
    assert ft.current_step() == 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), start, strict=True))


def test_diloco_outer_step_from_the_backup() -> None:
    ft, _ = facade(use_async_quorum=False)
    model = torch.nn.Linear(2, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.5)
    start = [p.detach().clone() for p in model.parameters()]
    with local_sgd.DiLoCo(ft, [model], inner, outer, sync_every=1):
        inner.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        inner.step()
        local = [s - 0.1 * g for s, g in zip(start, [torch.ones(1, 2), torch.ones(1)], strict=True)]
    # outer SGD with lr 0.5 from the backup: half of the way to where the inner steps went
    for p, s, lo in zip(model.parameters(), start, local, strict=True):
        torch.testing.assert_close(p.detach(), s + 0.5 * (lo - s))
    assert ft.current_step() == 1
    with pytest.raises(ValueError, match="fragment_sync_delay"):
        local_sgd.DiLoCo(ft, [model], inner, outer, sync_every=2, fragment_sync_delay=2)


def test_streaming_diloco_syncs_one_fragment_at_a_time_and_keeps_alpha_of_local_progress() -> None:
    ft, _ = facade(use_async_quorum=False)
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
    model = torch.nn.Sequential(a, b)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outers = [torch.optim.SGD(a.parameters(), lr=1.0), torch.optim.SGD(b.parameters(), lr=1.0)]
    start_b = [p.detach().clone() for p in b.parameters()]
    with local_sgd.DiLoCo(ft, [a, b], inner, outers, sync_every=4, fragment_sync_delay=1, fragment_update_alpha=0.5):
        at_prepare: list[torch.Tensor] = []
        for i in range(2):  # every 2 inner steps, one fragment: step 0 picks a; its exchange starts after 1
            inner.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            local = [p.detach() - 0.1 * p.grad for p in a.parameters()]
            if i == 0:
                at_prepare = local
            inner.step()
        assert ft.current_step() == 1
        # alpha 0.5: halfway between the new backup and where the inner steps went since
        for p, g, lo in zip(a.parameters(), at_prepare, local, strict=True):
            torch.testing.assert_close(p.detach(), torch.lerp(g, lo, 0.5))
        moved_a = at_prepare
        # b was not synced: it kept its local progress and its backup is where it started
        assert not any(torch.equal(p.detach(), s) for p, s in zip(b.parameters(), start_b, strict=True))
        state = ft._manager_state_dict()["user"]
        assert all(
            torch.equal(v, s)
            for v, s in zip(state["StreamingDiLoCoFragment_1"]["original_parameters"].values(), start_b, strict=True)
        )
        # outer SGD with lr 1 from the backup lands on the (one-replica) average: where a went
        for v, p in zip(state["StreamingDiLoCoFragment_0"]["original_parameters"].values(), moved_a, strict=True):
            torch.testing.assert_close(v, p)


def test_the_backends_a_script_names() -> None:
    assert backend_of(ProcessGroupGloo()) == "gloo"
    assert backend_of(ProcessGroupBabyNCCL()) == "nccl"
    assert backend_of(None) is None
    assert ProcessGroupGloo().supports_reconfigure


def test_managed_process_group_serves_dist_and_functional_collectives(tmp_path: object) -> None:
    import torch.distributed._functional_collectives as funcol

    ft, _ = facade()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        pg = ManagedProcessGroup(ft)
        pg.register("dp_replicate")
        ft.start_quorum()
        t = torch.tensor([3.0])
        dist.all_reduce(t, group=pg, op=dist.ReduceOp.AVG)
        assert t.item() == 3.0 and pg.size() == 1
        got = funcol.wait_tensor(funcol.all_reduce(torch.tensor([4.0]), reduceOp="max", group=pg))
        assert got.item() == 4.0
        n = funcol.wait_tensor(funcol.all_reduce(torch.tensor([9], dtype=torch.int64), reduceOp="sum", group=pg))
        assert n.item() == 9
        assert ft.should_commit()
    finally:
        dist.destroy_process_group()


def test_sum_and_avg_through_dist_all_reduce_are_the_steps_exchange(tmp_path: object) -> None:
    """torchtitan's FSDP hook calls ``dist.all_reduce(t, group=pg, op=AVG)``: torch hands the op in
    its options as a ``ReduceOp``, which must still go to the fault-tolerant exchange (a newcomer
    sends zeros there), never to a plain collective."""
    ft, _ = facade()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        pg = ManagedProcessGroup(ft)

        def side(*args: object) -> bool:
            raise AssertionError("a gradient all-reduce went to a plain collective")

        ft._side_allreduce = side  # type: ignore[method-assign]
        ft.start_quorum()
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            t = torch.tensor([3.0])
            dist.all_reduce(t, group=pg, op=op)
            assert t.item() == 3.0
        assert len(ft._tensors) == 2 and ft.should_commit()
    finally:
        dist.destroy_process_group()


def test_the_sampler_shards_over_replica_groups_then_ranks() -> None:
    from unbroken.torchft.data import DistributedSampler

    s = DistributedSampler(list(range(12)), replica_rank=1, num_replica_groups=2, group_rank=1, num_replicas=2)
    assert (s.global_rank, s.global_world_size) == (3, 4)
    t = DistributedSampler(
        list(range(12)), replica_group_id=1, num_replica_groups=2, group_rank=0, num_replicas=1, shuffle=False
    )
    assert list(t) == [1, 3, 5, 7, 9, 11]  # train_ddp.py's keyword


def test_leaving_at_exit_is_finished_unless_an_exception_ended_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchtitan's trainer never calls shutdown(): the facade leaves the job at interpreter exit
    ft, _ = facade()
    calls: list[bool] = []
    monkeypatch.setattr(ft._manager, "shutdown", lambda finished=True: calls.append(finished))
    monkeypatch.delattr("sys.last_value", raising=False)
    ft._leave_at_exit()
    monkeypatch.setattr("sys.last_value", RuntimeError("uncaught"), raising=False)
    ft._leave_at_exit()
    assert calls == [True, False]


def test_diloco_over_fsdp2_dtensor_parameters(tmp_path: object) -> None:
    # torchtitan's DiLoCo runs over FSDP2: parameters, backups and outer gradients are DTensors
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        ft, _ = facade(use_async_quorum=False)
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        fully_shard(model)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.5)
        start = [p.detach().full_tensor().clone() for p in model.parameters()]
        exchanged: list[type] = []
        plain = ft.allreduce
        ft.allreduce = lambda t, **kw: (exchanged.append(type(t)), plain(t, **kw))[1]  # type: ignore[method-assign]
        with local_sgd.DiLoCo(ft, [model], inner, outer, sync_every=1):
            inner.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            inner.step()
        local = [s - 0.1 * g for s, g in zip(start, [torch.ones(1, 2), torch.ones(1)], strict=True)]
        for p, s, lo in zip(model.parameters(), start, local, strict=True):
            torch.testing.assert_close(p.detach().full_tensor(), s + 0.5 * (lo - s))
        assert ft.current_step() == 1
        assert exchanged == [torch.Tensor, torch.Tensor]  # local shards: the exchange copies them into buffers
    finally:
        dist.destroy_process_group()


def test_a_caught_up_replica_steps_with_its_donors_learning_rate() -> None:
    """torchtitan's optimizer state carries the rate it cached at start: the donor's live rates
    travel on their own and are set at the step, after every loader ran."""
    from unbroken.torchft.optim import HYPERPARAMETERS, hyperparameters

    ft, _ = facade()
    w = torch.nn.Parameter(torch.ones(2))
    donor = torch.optim.SGD([w], lr=0.5)
    optim = OptimizerWrapper(ft, torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1))
    sent = hyperparameters(donor)
    assert sent == [[{"lr": 0.5, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0}]]
    ft._manager._states.load(
        {"user": {"torchft": {"batches_committed": 0}, HYPERPARAMETERS: sent}, "unbroken": {"step": 0}}
    )  # type: ignore[attr-defined]
    assert optim.param_groups[0]["lr"] == 0.1  # not yet: a later loader could still set its own
    optim.zero_grad()
    optim.optim.param_groups[0]["params"][0].grad = torch.ones(2)
    optim.step()
    assert optim.param_groups[0]["lr"] == 0.5
    assert torch.equal(optim.optim.param_groups[0]["params"][0].detach(), torch.tensor([0.5, 0.5]))
