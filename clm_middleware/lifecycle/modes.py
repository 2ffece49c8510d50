"""The tagging modes, importable without the engine (the CLI offers them as choices)."""

TAGGING_MODES = ("auto", "free", "constrained", "signals", "rules")
