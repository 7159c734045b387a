"""`specdec distill` (specdec/distill/): an unrelated tiny draft learns a tiny target, a draft
equal to the target stays equal, the losses are what they say, a run resumes exactly, LoRA
merges into a plain checkpoint, and the written draft serves.

Here the e2e tests; the other tiers' are in tests/unit/test_distill.py and
tests/service/test_distill.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.distill.run import REPORT_FILE
from specdec.v1 import coordinator_pb2
from specdec_cli.main import main
from tests.cluster import Cluster
from tests.service.test_distill import pair


def test_an_unrelated_draft_learns_the_target_and_serves(pair, tmp_path, capsys):
    out = tmp_path / "distilled"
    assert main(["distill", "--target", pair["target"], "--draft", pair["draft"], "--out", str(out),
                 "--prompts", pair["train"], "--eval-prompts", pair["eval"], "--steps", "150", "--lr", "2e-2",
                 "--seq-len", "64", "--max-new-tokens", "24", "--eval-new-tokens", "24", "--no-progress"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    before, after = report["before"]["alpha"], report["after"]["alpha"]
    assert before["greedy"] < 0.15 and after["greedy"] >= 0.5, report
    assert after["sampled_t1"] > before["sampled_t1"] + 0.2, report
    assert report["steps"] == 150 and report["loss_last"] < report["loss_first"]
    assert not (out / "checkpoint").exists()
    assert "greedy" in capsys.readouterr().out
    # served: a greedy γ = 1 round accepts its one draft with the per-position α measured above
    with Cluster(str(out), pair["target"]) as cluster:
        prompts = Path(pair["eval"]).read_text().splitlines()
        accepted = proposed = 0
        for prompt in prompts:
            stats = cluster.complete(prompt=prompt, max_new_tokens=24, num_speculative_tokens=1,
                                     proposer=coordinator_pb2.Proposer.Value("PROPOSER_DRAFT")).stats
            accepted, proposed = accepted + stats.accepted_tokens, proposed + stats.draft_tokens
    assert accepted / proposed >= 0.5
