"""Whether two model services compete for the same CPU cores (specdec/cores.py), what they
report of it (ModelInfo.cpu), and what the coordinator makes of it (--tiers-share-cores)."""

from __future__ import annotations

import os

import pytest

from coordinator.sessions.model_tiers import tiers_compete
from specdec.cores import CpuPlacement, allowed_cpus, boot_id, compete, core_of, parse_cpu_list, this_placement
from specdec.rpc.convert import model_info_from_pb, model_info_to_pb
from specdec.types import CoreSharing, ModelDescription
from specdec.v1 import common_pb2

HOST_A, HOST_B = "1b2f-boot-a", "9c4e-boot-b"


def placement(boot: str, *cores: int, threads: int | None = None) -> CpuPlacement:
    """A service sized to its cores unless told otherwise."""
    return CpuPlacement(boot, frozenset(cores), threads or len(cores))


def description(cpu: CpuPlacement | None) -> ModelDescription:
    return ModelDescription(model_id="m", vocab_size=12, tokenizer_fingerprint="f", tokenizer_vocab_size=12,
                            eos_token_ids=(1,), max_context_length=64, dtype="float32",
                            device="cpu" if cpu else "cuda:0", max_speculative_tokens=8, cpu=cpu)


@pytest.mark.parametrize("a, b, expected", [
    (placement(HOST_A, 0, 1), placement(HOST_A, 0, 1), True),       # one host, the same cores
    (placement(HOST_A, 0, 1, 2), placement(HOST_A, 2, 3), True),    # one core in common
    (placement(HOST_A, 0, 1), placement(HOST_A, 2, 3), False),      # pinned apart
    (placement(HOST_A, 0, 1, threads=1), placement(HOST_A, 0, 1, threads=1), False),  # a core each
    (placement(HOST_A, 0, 1, threads=1), placement(HOST_A, 0, 1, threads=2), True),
    (placement(HOST_A, *range(64), threads=8), placement(HOST_A, *range(64), threads=8), False),
    (placement(HOST_A, 0, 1), placement(HOST_B, 0, 1), False),      # two hosts
    (None, placement(HOST_A, 0, 1), False),                         # a GPU draft
    (placement(HOST_A, 0, 1), None, False),                         # a GPU target
    (None, None, False),
], ids=["same-cores", "overlap", "disjoint", "a-thread-each",
                        "three-threads-on-two", "threads-below-cores", "two-hosts", "gpu-draft", "gpu-target", "two-gpus"])
def test_services_compete_on_one_kernel_with_overlapping_cpus(a, b, expected):
    assert compete(a, b) is expected
    assert compete(b, a) is expected


def test_this_process_reports_its_kernel_and_affinity():
    here = this_placement(threads=len(allowed_cpus()))
    assert here.boot_id == boot_id() and here.boot_id
    assert here.cores == {core_of(cpu) for cpu in allowed_cpus()} and here.cores <= allowed_cpus()
    if hasattr(os, "sched_getaffinity"):
        assert allowed_cpus() == frozenset(os.sched_getaffinity(0))
    assert compete(here, here)  # two engines sized to every CPU of this process
    assert this_placement(threads=0).threads == 1


def test_hyperthreads_of_a_core_count_once(tmp_path):
    """cpu0 and cpu2 are one core's two hyperthreads, cpu1 and cpu3 another's."""
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3"), (4, "4-5"), (5, "4-5")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert [core_of(cpu, tmp_path) for cpu in range(6)] == [0, 1, 0, 1, 4, 4]
    assert core_of(7, tmp_path) == 7  # no topology published: the CPU is its own core
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


@pytest.mark.parametrize("boot, cores, threads", [("", {0}, 1), (HOST_A, set(), 1), (HOST_A, {0}, 0)])
def test_a_placement_needs_a_host_cores_and_threads(boot, cores, threads):
    with pytest.raises(ValueError, match="boot id, cores and >= 1 thread"):
        CpuPlacement(boot, frozenset(cores), threads)


@pytest.mark.parametrize("cpu", [placement(HOST_A, 0, 3, 5), None], ids=["cpu", "accelerator"])
def test_model_info_carries_the_placement(cpu):
    desc = description(cpu)
    pb = model_info_to_pb(desc)
    assert pb.HasField("cpu") is (cpu is not None)
    assert model_info_from_pb(common_pb2.ModelInfo.FromString(pb.SerializeToString())) == desc


def test_an_empty_reported_placement_reads_as_none():
    """A placement without cores (a service of another build) is not a placement."""
    pb = model_info_to_pb(description(None))
    pb.cpu.boot_id = HOST_A
    assert model_info_from_pb(pb).cpu is None


@pytest.mark.parametrize("setting, draft, target, expected", [
    (CoreSharing.AUTO, placement(HOST_A, 0, 1), placement(HOST_A, 0, 1), True),
    (CoreSharing.AUTO, placement(HOST_A, 0, 1), placement(HOST_B, 0, 1), False),
    (CoreSharing.AUTO, None, placement(HOST_A, 0, 1), False),
    (CoreSharing.YES, placement(HOST_A, 0, 1), placement(HOST_B, 0, 1), True),   # two VMs of one host
    (CoreSharing.YES, None, None, True),
    (CoreSharing.NO, placement(HOST_A, 0, 1), placement(HOST_A, 0, 1), False),
])
def test_the_setting_overrides_the_reports(setting, draft, target, expected):
    assert tiers_compete(setting, description(draft), description(target)) is expected
    assert tiers_compete(setting, description(target), description(draft)) is expected
