"""The `specdec` command line: serve, up, generate, models.

It sits above everything else: it composes the coordinator, draft and target apps
(`coordinator`, `draft_service`, `target_service`) and the shared library (`specdec`),
none of which imports it. `specdec_cli.main` builds the parser and runs a command; each
command lives in its own module. Its helpers: `model_pair` (fetching, verifying and converting
the default model pair) and `tiny` (tiny random models for demos, tests and benchmarks).
"""
