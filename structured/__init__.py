"""Structured outputs: constraints (JSON schema, regex, choice, grammar), their compiled grammars and per-sequence matchers."""
