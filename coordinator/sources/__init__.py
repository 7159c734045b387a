"""Proposal sources: one module per source behind one interface (`base.ProposalSource`)."""
