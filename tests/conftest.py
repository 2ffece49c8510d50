"""Shared fixtures. Unit tests run on a tiny random Llama; integration tests on SmolLM2."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

from clm_middleware.cache import PoolConfig
from clm_middleware.engine import Engine
from clm_middleware.models import tiny_llama, tiny_tokenizer

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture
def make_engine(tiny_model, tiny_tok):
    """A fresh engine (own pool) around the shared tiny model."""

    def make(block_size: int = 16, max_blocks: int | None = 256) -> Engine:
        return Engine(
            tiny_model,
            tiny_tok,
            pool_config=PoolConfig(block_size=block_size, max_blocks=max_blocks),
        )

    return make


@pytest.fixture
def engine(make_engine) -> Engine:
    return make_engine()
