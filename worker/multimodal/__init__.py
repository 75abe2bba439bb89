"""Images inside prompts, on the worker: the encoder cache and the step's input embeddings.

The model interface (a model family that takes images implements it; the runner only calls it):

    class SomeForConditionalGeneration(nn.Module):
        takes_images = True
        bidirectional_images = False   # True: an image's tokens attend to each other both ways

        def embed_images(self, features: list[MultiModalFeature]) -> list[torch.Tensor]:
            # one tensor [feature.length, hidden_size] in the model dtype per feature, from
            # `feature.data` (the processor's tensors for that one image): vision tower and
            # projector, unscaled (the rows replace token embeddings as they are)

        def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
            # [T] -> [T, hidden_size]: the token embeddings as the forward would compute them
            # (Gemma scales them by sqrt(hidden_size); image rows are inserted unscaled after)

        def forward(self, input_ids, positions, ctx, inputs_embeds=None) -> torch.Tensor:
            # with `inputs_embeds` [T, hidden_size] the embedding lookup is skipped

A family may add `mrope_positions(...)` (Qwen3.5's M-RoPE). Placeholder token ids at image
positions are never looked up: the runner embeds them as token 0 and overwrites their rows.

Per step (`ImageStep.prepare`, called by the model runner after the batch is built):

    1. drop the encoder outputs no request still needs (its image lies wholly before the
       request's computed tokens, or the request finished);
    2. find, per scheduled request, the images its chunk [chunk_start, chunk_end) covers: rows
       [max(offset, chunk_start) - offset, min(end, chunk_end) - offset) of the image's encoder
       output go to the chunk's rows at those positions (a prefix hit or an earlier chunk may
       already have passed part of an image);
    3. encode the step's missing images in one `embed_images` call (the cache is keyed by
       `MultiModalFeature.identifier`, a content hash, so the same image in two requests is
       encoded once);
    4. build `inputs_embeds` = `embed_input_ids(input_ids)` with the image rows overwritten;
    5. with `bidirectional_images`, give the attention metadata per query row the end of the
       keys it sees (`key_ends`): its position + 1 for text, the image's end for an image's
       tokens. The scheduler never splits such an image across chunks (checked here), so the
       image's keys are in the cache when its queries attend.

Steps without images keep the plain path (no embeddings built here, `key_ends` None).
"""

from worker.multimodal.image_step import ImageStep, takes_images

__all__ = ["ImageStep", "takes_images"]
