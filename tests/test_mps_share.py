"""Ranks sharing a GPU under MPS each get their own share of its SMs (CPU, no GPU, no daemon).

Without a cap one MPS client's spinning blocks can hold the SMs another client's kernel needs
(a persistent GEMM grid sized to every SM the client sees, or a collective), and MPS promises no
forward progress between clients: the run deadlocks until a kernel's timeout. With the caps of
all clients of a GPU adding up to at most the GPU, each always finds its share free.
"""

from __future__ import annotations

import pytest

from pcie_allreduce import dispatch, mps, ranks
from pcie_allreduce.constants import MAX_LAUNCH_BLOCKS

H200_SMS = 132


@pytest.mark.parametrize("ranks_per_gpu", range(2, 49))  # MPS: 48 clients a GPU (Volta)
def test_the_shares_of_a_gpu_add_up_to_at_most_the_gpu_even_rounded_up(ranks_per_gpu: int) -> None:
    percentage = mps.share_percentage(ranks_per_gpu)
    for sms in (78, 108, H200_SMS, 148, 170):
        share = -(-sms * percentage // 100)  # the driver may round a cap up to a whole SM
        assert ranks_per_gpu * share <= sms, (ranks_per_gpu, sms, percentage)


def test_a_gpu_of_its_own_is_not_capped() -> None:
    assert mps.share_percentage(1) == 100


@pytest.mark.parametrize("value, expected", [("12", 12.0), (" 49.5 ", 49.5), ("100", None), ("0", None),
                                             ("", None), ("all", None)])
def test_provisioned_percentage(value: str, expected: float | None) -> None:
    assert mps.provisioned_percentage({mps.ACTIVE_THREAD_PERCENTAGE_ENV: value}) == expected
    assert mps.provisioned_percentage({}) is None


def test_the_spawner_caps_ranks_that_share_a_gpu_under_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mps.ACTIVE_THREAD_PERCENTAGE_ENV, raising=False)
    daemon_env = {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/p", "CUDA_MPS_LOG_DIRECTORY": "/tmp/l"}
    env = ranks._child_env(daemon_env, None, 8)
    assert env[mps.ACTIVE_THREAD_PERCENTAGE_ENV] == str(mps.share_percentage(8))
    # A GPU per rank, or no MPS (time-slicing): no cap.
    assert mps.ACTIVE_THREAD_PERCENTAGE_ENV not in ranks._child_env(daemon_env, None, 1)
    assert mps.ACTIVE_THREAD_PERCENTAGE_ENV not in ranks._child_env(None, None, 8)
    # The caller's setting wins, from its environment or from env=.
    assert ranks._child_env(daemon_env, {mps.ACTIVE_THREAD_PERCENTAGE_ENV: "100"}, 8)[
        mps.ACTIVE_THREAD_PERCENTAGE_ENV] == "100"
    monkeypatch.setenv(mps.ACTIVE_THREAD_PERCENTAGE_ENV, "100")
    assert mps.ACTIVE_THREAD_PERCENTAGE_ENV not in ranks._child_env(daemon_env, None, 8)


def test_block_cap_of_a_capped_rank_is_its_share_and_distinct_gpus_keep_theirs() -> None:
    share = 15  # what MPS reports a client capped to 11 % of an H200
    assert dispatch.block_cap(8, share, provisioned=True) == share
    assert dispatch.block_cap(8, H200_SMS) == H200_SMS // 8  # uncapped: today's shape
    assert dispatch.block_cap(1, H200_SMS) == dispatch.block_cap(1, H200_SMS, provisioned=True) == MAX_LAUNCH_BLOCKS
    assert dispatch.block_cap(2, 200, provisioned=True) == MAX_LAUNCH_BLOCKS


def test_a_communicator_of_capped_ranks_takes_their_share_and_one_of_oversubscribed_caps_does_not() -> None:
    from tests.test_creation_cpu import WORLD, _create, _Properties

    env = mps.ACTIVE_THREAD_PERCENTAGE_ENV
    fits = str(mps.share_percentage(WORLD))
    capped = ranks.run_ranks(_create, WORLD, "none", 1, gpu=False, timeout_s=120, env={env: fits})
    # (the fake reports every SM; a capped client under MPS is told only its share)
    assert [r["block_cap"] for r in capped] == [min(MAX_LAUNCH_BLOCKS, _Properties.multi_processor_count)] * WORLD
    over = ranks.run_ranks(_create, WORLD, "none", 1, gpu=False, timeout_s=120, env={env: "90"})
    uncapped = ranks.run_ranks(_create, WORLD, "none", 1, gpu=False, timeout_s=120, env={env: "100"})
    cap = min(MAX_LAUNCH_BLOCKS, _Properties.multi_processor_count // WORLD)
    assert [r["block_cap"] for r in over] == [r["block_cap"] for r in uncapped] == [cap] * WORLD
