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
