"""The speculative maths of a round, pure functions over tensors and token lists: the warp and the
draws (`sampling`), the acceptance step (`acceptance`), the validated sparse q a draft reports
(`draft_q`), the log-probabilities of emitted tokens (`logprobs`), token trees (`tree`) and their
acceptance step (`tree_acceptance`). No gRPC, no I/O."""
