import pytest


@pytest.fixture(scope="package")
def model_dir(tiny_chat_dir):
    return tiny_chat_dir


@pytest.fixture(scope="package")
def llm(model_dir):
    """One engine on the tiny chat model for every batch test (each leaves it idle)."""
    from jaxbatch import LLM
    from tests.helpers import TINY_CONFIG

    return LLM(model_dir, config=TINY_CONFIG)
