"""Where a remote engine's self-information comes from (``--engine-signals``).

``server``: the server's prompt log-probabilities (vLLM only, and only when asked for:
its V1 engine skips the prefix cache for such a request); ``scorer``: a small local
scorer model (``remote/scorer.py``); ``none``: no self-information (rules and labels
only); ``auto``: the scorer, as the server's log-probabilities would cost every turn a
full re-prefill. Kept apart from ``engine.py`` so the CLI can offer the choices without
importing torch.
"""

SIGNALS = ("auto", "server", "scorer", "none")
