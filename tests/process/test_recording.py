"""Recording what the target committed (coordinator/recording.py, specdec/records.py): off by
default, one record per finished request, never a salted request's text, bounded in bytes and
in stream entries, and readable after the coordinator was killed.

Here the process tests; the other tiers' are in tests/unit/test_recording.py and
tests/e2e/test_recording.py.
"""

from __future__ import annotations

import json

from specdec.records import ReadCount, read_records
from specdec.v1 import coordinator_pb2
from tests.procs import CoordinatorProcess
from tests.e2e.test_recording import PROMPT, recording, _records


def test_a_killed_coordinator_leaves_a_readable_record(recording, tmp_path):
    """SIGKILL in the middle of a generation: every request that finished before is there whole,
    and the reader is not upset by whatever the kill cut."""
    cluster, _, _ = recording
    process = CoordinatorProcess(f"127.0.0.1:{cluster.draft_port}", f"127.0.0.1:{cluster.target_port}",
                                 ["--record-dir", str(tmp_path)]).start()
    try:
        stub = process.stub()
        finished = [stub.Complete(coordinator_pb2.CompleteRequest(request=coordinator_pb2.GenerateRequest(
            prompt=f"{PROMPT} {i}", max_new_tokens=6)), timeout=60) for i in range(3)]
        _records(tmp_path, 3)  # written (a record is flushed as its request ends)
        stream = stub.Generate(coordinator_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=400,
                                                               ignore_eos=True), timeout=60)
        next(stream)
        process.kill()
    finally:
        process.stop()
    count = ReadCount()
    records = list(read_records(tmp_path, count))
    assert [r.session_id for r in records] == [f.session_id for f in finished]
    assert [r.tokens[r.input_tokens:] for r in records] == [list(f.token_ids) for f in finished]
    assert count.skipped == 0
    for file in tmp_path.glob("records-*.jsonl"):  # every line whole
        assert all(json.loads(line) for line in file.read_text().splitlines())
