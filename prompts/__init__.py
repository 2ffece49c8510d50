"""Prompt files shipped with clm-middleware (read them with ``clm_middleware.lifecycle.prompts``)."""
