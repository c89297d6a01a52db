"""Structured generation: constraints (regex, JSON schema, choices, dtypes) over outlines-core.

Nothing is imported here: the HTTP gateway reads the plain regexes without loading torch."""
