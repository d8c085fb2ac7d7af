"""Data: tokenizer, corpus sources, packed + sharded + resumable streams, long documents."""

from data.config import DataConfig, SourceConfig, TokenizerConfig
from data.documents import long_documents
from data.loader import build_loader
from data.tokenizer import Tokenizer, get_tokenizer

__all__ = ["DataConfig", "SourceConfig", "TokenizerConfig", "Tokenizer", "get_tokenizer", "build_loader",
           "long_documents"]
