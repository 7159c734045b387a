"""The coordinator: public API, session state and the speculation loop."""
