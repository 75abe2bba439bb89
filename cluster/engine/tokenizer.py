"""Loading the model's tokenizer from its local folder (nothing is downloaded)."""

from __future__ import annotations

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The model folder's tokenizer, or None when the folder has none."""
    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            path, local_files_only=True
        )
    except (OSError, ValueError, TypeError) as exc:
        logger.info("no tokenizer in %s (%s): prompts must be token IDs", path, exc)
        return None
    return tokenizer
