"""Data: load + check rows, render formats, tokenize with masking, and the resumable sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.config.schema import DataConfig
from finetune.data.loading import check_columns, load_raw
from finetune.data.tokenize import Tokenized, label_names, tokenize_rows


@dataclass
class DataBundle:
    """Tokenized train and eval splits; ``labels`` are the classification label names in id order."""

    train: Tokenized | None
    eval: Tokenized | None
    labels: list[str] | None


def load_splits(cfg: DataConfig, tokenizer: Any, *, need_train: bool = True) -> DataBundle:
    """Load, check and tokenize the recipe's splits (the eval split only when ``need_train`` is False)."""
    raw_train = load_raw(cfg.train)
    check_columns(raw_train, cfg.format, cfg.train)
    labels = label_names(raw_train, cfg.labels, cfg.train) if cfg.format == "classification" else None
    common = {"fmt": cfg.format, "tokenizer": tokenizer, "max_len": cfg.max_seq_len, "overlong": cfg.overlong,
              "train_on_prompt": cfg.train_on_prompt, "labels": labels}
    train = tokenize_rows(raw_train, source=cfg.train, **common) if need_train else None
    evaluation = None
    if cfg.eval:
        raw_eval = load_raw(cfg.eval)
        check_columns(raw_eval, cfg.format, cfg.eval)
        # eval metrics measure the answers, whatever train_on_prompt says for training
        evaluation = tokenize_rows(raw_eval, source=cfg.eval, **{**common, "train_on_prompt": False})
    return DataBundle(train, evaluation, labels)


__all__ = ["DataBundle", "load_splits"]
