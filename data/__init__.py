"""Data: tokenizer, corpus sources, packed + sharded + resumable streams, long documents.

The public names load lazily, so `python -m data.tokenizer` does not import itself twice.
"""

import importlib

_EXPORTS = {
    "DataConfig": "data.config", "SourceConfig": "data.config", "TokenizerConfig": "data.config",
    "Tokenizer": "data.tokenizer", "get_tokenizer": "data.tokenizer",
    "build_loader": "data.loader", "long_documents": "data.documents",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
