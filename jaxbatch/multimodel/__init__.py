"""Several models on one server, loaded on demand (llama-server's router mode, Ollama's model
management): the catalog of models (`catalog.py`, host only), the pool that loads and unloads
them (`pool.py`), building and letting go of one model's engine (`loader.py`), the routes
(`routes.py`) and the running server (`server.py`). docs/server.md#several-models."""

from jaxbatch.multimodel.catalog import ModelSpec, catalog, parse_keep_alive
from jaxbatch.multimodel.pool import LoadRecord, ModelPool, PoolPolicy
from jaxbatch.multimodel.server import MultiServer

__all__ = ["LoadRecord", "ModelPool", "ModelSpec", "MultiServer", "PoolPolicy", "catalog",
           "parse_keep_alive"]
