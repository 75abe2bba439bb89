"""Images attending to themselves both ways (Gemma 3), for kernel tests: per-row key ends of a
paged test batch, and a dense float64 oracle that masks as transformers composes the rule.

transformers' Gemma 3 masks: full layers see `kv <= q or same_image(q, kv)`, sliding layers
`kv > q - window and (kv <= q or same_image(q, kv))`. The oracle builds that mask from image
ids per position; the kernels get only `key_ends` (each row's end of visible keys).
"""

from __future__ import annotations

import torch

from tests.helpers.kernel_batches import PagedBatch

Images = dict[int, list[tuple[int, int]]]
"""Request index -> its images' [start, end) positions, inside the request's query rows."""


def key_ends_of(batch: PagedBatch, images: Images) -> torch.Tensor:
    """[num_tokens] int32: a row's position + 1, or for an image's rows the image's end."""
    starts, seq_lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    ends = []
    for req_idx, seq_len in enumerate(seq_lens):
        q_len = starts[req_idx + 1] - starts[req_idx]
        row_ends = list(range(seq_len - q_len + 1, seq_len + 1))
        for start, end in images.get(req_idx, []):
            assert seq_len - q_len <= start < end <= seq_len, "an image lies in the query rows"
            for pos in range(start, end):
                row_ends[pos - (seq_len - q_len)] = end
        ends += row_ends
    return torch.tensor(ends, dtype=torch.int32, device=batch.query.device)


def dense_image_attention(
    batch: PagedBatch, scale: float, images: Images, sliding_window: int | None = None
) -> torch.Tensor:
    """Naive float64 attention over the unpaged K/V with transformers' image mask."""
    starts = batch.query_start_loc.tolist()
    outputs = []
    for req_idx, (key, value) in enumerate(zip(batch.keys, batch.values, strict=True)):
        query = batch.query[starts[req_idx] : starts[req_idx + 1]].double()
        group = query.shape[1] // key.shape[1]
        key = key.double().repeat_interleave(group, dim=1)
        value = value.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, key) * scale
        seq_len = key.shape[0]
        image_of = torch.full((seq_len,), -1)
        for image_idx, (start, end) in enumerate(images.get(req_idx, [])):
            image_of[start:end] = image_idx
        query_pos = torch.arange(seq_len - query.shape[0], seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        same_image = (image_of[query_pos] == image_of[key_pos]) & (image_of[query_pos] >= 0)
        allowed = (key_pos <= query_pos) | same_image
        if sliding_window is not None:
            allowed &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), value))
    return torch.cat(outputs)
