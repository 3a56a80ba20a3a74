"""Checksum algebra and read planning for the disk tier: pure logic."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import crc32c
import pytest

from unbroken.checkpoint.storage import checksum
from unbroken.checkpoint.storage.directio import Target, plan_chunks
from unbroken.checkpoint.storage.manifest import ShardManifest, TensorSpec, layout

REFERENCE = {"crc32": zlib.crc32, "crc32c": crc32c.crc32c}


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
@pytest.mark.parametrize("len_a, len_b", [(0, 5), (5, 0), (1, 1), (100, 12345), (3 << 20, 7)])
def test_combined_pieces_equal_the_whole(algorithm: str, len_a: int, len_b: int) -> None:
    a, b = os.urandom(len_a), os.urandom(len_b)
    ref = REFERENCE[algorithm]
    assert checksum.combine(ref(a), ref(b), len_b, algorithm) == ref(a + b)


@pytest.mark.parametrize("algorithm", sorted(REFERENCE))
def test_parallel_checksums_match_one_pass(algorithm: str) -> None:
    data = memoryview(os.urandom(3 * checksum.PIECE + 123))
    ranges = [(0, 10), (10, 10), (10, 2 * checksum.PIECE + 5), (2 * checksum.PIECE + 5, len(data))]
    with ThreadPoolExecutor(3) as pool:
        got = checksum.finish(checksum.start(data, ranges, pool, algorithm), algorithm)
    assert got == [REFERENCE[algorithm](bytes(data[lo:hi])) for lo, hi in ranges]


def test_many_small_ranges_grouped_into_few_jobs_keep_their_own_checksums() -> None:
    data = memoryview(os.urandom(checksum.PIECE + 5000))
    bounds = list(range(0, 4000, 37)) + [4000, 4000, checksum.PIECE + 4000, len(data)]
    ranges = list(zip(bounds, bounds[1:], strict=False))
    with ThreadPoolExecutor(2) as pool:
        pending = checksum.start(data, ranges, pool)
        got = checksum.finish(pending)
    assert len(pending.jobs) <= 3  # ~110 small ranges do not each cost a job
    assert got == [crc32c.crc32c(bytes(data[lo:hi])) for lo, hi in ranges]


def test_unknown_algorithm_is_refused_and_old_manifests_mean_crc32() -> None:
    m = ShardManifest(1, 0, 1, 0, 1, layout([TensorSpec("x", "float32", (2,), (2,), (0,))]))
    assert m.checksum == "crc32c"
    legacy = m.to_json().replace('"checksum": "crc32c",', "")
    assert ShardManifest.from_json(legacy).checksum == "crc32"
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md4'"):
        ShardManifest.from_json(m.to_json().replace('"crc32c"', '"md4"'))


def test_read_plan_covers_every_byte_once_merging_small_and_splitting_big() -> None:
    targets = [
        Target(0, 3, None),
        Target(3, 10, None),
        Target(10, 10, None),
        Target(10, 30, None),
        Target(40, 41, None),
    ]
    chunks = plan_chunks(targets, size=8)
    assert all(c.hi - c.lo <= 8 for c in chunks)
    assert chunks[0].parts == ((0, 0, 3), (1, 3, 8))  # two small neighbours share a read
    for i, t in enumerate(targets):
        covered = sorted((b, e) for c in chunks for j, b, e in c.parts if j == i)
        assert [b for b, _ in covered] == [t.begin] + [e for _, e in covered[:-1]] if covered else t.begin == t.end
        assert not covered or covered[-1][1] == t.end
    assert not any(c.lo < 40 < c.hi for c in chunks)  # a gap starts a new read
