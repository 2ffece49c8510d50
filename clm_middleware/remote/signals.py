"""Where a remote engine's self-information comes from (``--engine-signals``).

``server``: the server's prompt log-probabilities; ``scorer``: a small local scorer
model; ``none``: no self-information (rules and labels only); ``auto``: the server's
where it returns them, else the scorer. Kept apart from ``engine.py`` so the CLI can
offer the choices without importing torch.
"""

SIGNALS = ("auto", "server", "scorer", "none")
