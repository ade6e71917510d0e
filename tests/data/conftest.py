"""Fixtures of the data tests: the tiny tokenizer, loaded once."""

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from hybridflow.models import load_tokenizer

    return load_tokenizer("tiny-llama")
