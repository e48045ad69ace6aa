import os

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Tests run on the CPU; keep output quiet and everything offline.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One persistent cache for the test session: the default model (downloaded once), converted
# params and XLA's compilation cache all live under <repo>/.cache/jaxbatch unless set.
os.environ.setdefault("JAXBATCH_CACHE", os.path.join(_REPO, ".cache", "jaxbatch"))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol():
    """The built-in SmolLM2-135M-Instruct, loaded once per test session (fp32)."""
    from tests.helpers.smollm2 import load_smol

    return load_smol()


@pytest.fixture(scope="session")
def hf_smol(smol):
    """transformers' model on the same GGUF file: the reference."""
    from tests.helpers.smollm2 import load_hf_smol

    return load_hf_smol(smol)


@pytest.fixture(scope="session")
def tiny_chat_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, built once per session
    (read-only for the tests that share it)."""
    from tests.helpers.tiny_models import make_tiny_chat_model

    path = str(tmp_path_factory.mktemp("tiny_chat"))
    make_tiny_chat_model(path)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """kind -> (path, HF torch model): a tiny random-weight model of that kind
    (tests/helpers/tiny_models.py), built once per session and shared read-only."""
    from tests.helpers.tiny_models import make_tiny_model

    models = {}

    def get(kind: str):
        if kind not in models:
            path = str(tmp_path_factory.mktemp(kind))
            models[kind] = (path, make_tiny_model(kind, path))
        return models[kind]

    return get


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """After each test module, JAX's caches let go of its compiled executables. Each loaded
    XLA:CPU executable holds ~8 memory mappings (its JIT code and data) while a cache keeps it;
    over the whole suite one process passed Linux's default vm.max_map_count (65,530) and
    XLA then crashed in whatever mapped next (SIGABRT or SIGSEGV in a later module's warm-up,
    2026-12). Set up before the module's own fixtures, so torn down after them."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
