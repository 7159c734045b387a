"""The speculative maths of a round, pure functions over tensors and token lists: the warp and the
draws (`sampling`), the acceptance step (`acceptance`), the validated sparse q a draft reports
(`draft_q`), the log-probabilities of emitted tokens (`logprobs`), token trees (`tree`) and their
acceptance step (`tree_acceptance`). No gRPC, no I/O.

The acceptance rule has two forms, side by side here:

* the reference, one row at a time on the host: `acceptance.py` (chains) and
  `tree_acceptance.py` (trees) — the rule as the papers state it, what the host verifier runs;
* the batched device form, every row of a verification batch at once with one host read:
  `batched_acceptance.py` (chains) and `batched_tree_acceptance.py` (trees) — what the graph
  engine's device verification runs (specdec/runtime/graph/device_verification.py).

The batched form must decide exactly what the reference decides: given the same uniforms, row
by row, the drafts accepted, the next token and the ratios (tests/test_batched_acceptance.py and
tests/test_batched_tree_acceptance.py draw random p, q, drafts, trees and seeds and check it).
"""
