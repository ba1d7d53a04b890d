"""How much a changed model (quantized, in lower precision) differs from a reference, on a fixed text.

Three measures over every position of the text, each next-token distribution of the model against
the reference's at the same position, the reference seeing the same tokens:

- **top-1 agreement**: how often the two models' most likely next token is the same (what greedy
  decoding notices first);
- **KL divergence** KL(reference || model), in nats, averaged over positions: how far the whole
  distribution moved (what sampling notices);
- **perplexity** exp(mean negative log-likelihood of the text's actual next tokens), for each model:
  how well it predicts real text.

With `kv_cache_dtype` "int8" or "fp8" the model reads its keys and values back from a quantized paged
pool (`attention/kv_quant.py`), every position seeing its context as a decode step would: the KV
cache's own loss, measured the same way.

The text ships with the package (`data/eval_text.txt`: an original essay of about 1,700 tokens with the
bundled tokenizer) and is cut into independent windows, so a long text never holds (length, vocab)
logits at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ..attention import AttentionMetadata, PagedAttentionStep, PagedKVCache, select_backend
from ..attention.kv_quant import KVScales
from ..model import CausalLM

EVAL_TEXT = Path(__file__).with_name("data") / "eval_text.txt"


def eval_text() -> str:
    """The fixed evaluation text shipped with the package."""
    return EVAL_TEXT.read_text()


@dataclass(frozen=True)
class QualityReport:
    num_positions: int
    top1_agreement: float  # fraction of positions where both models' most likely next token is the same
    kl_divergence: float  # mean KL(reference || model) in nats
    perplexity: float  # of the model on the text
    reference_perplexity: float


def _logprobs(model: CausalLM, inputs: list[int], kv_cache_dtype: str = "auto",
              kv_scales: KVScales | None = None) -> torch.Tensor:
    """(T, vocab) next-token log-probabilities over `inputs`; through a paged pool stored as `kv_cache_dtype`
    (int8: with `kv_scales`) unless "auto" (then one plain forward)."""
    input_ids = torch.tensor([inputs], device=model.device)  # (1, T)
    if kv_cache_dtype == "auto":
        hidden = model(input_ids)
    else:
        block_size = 16
        num_blocks = -(-len(inputs) // block_size)
        cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=model.dtype, device=model.device,
                                       kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
        metadata = AttentionMetadata.build([list(range(num_blocks))], [0], [len(inputs)], block_size=block_size,
                                           device=model.device)
        step = PagedAttentionStep(cache, select_backend("auto", model.device, model.dtype), metadata)
        hidden = model(input_ids, step, torch.arange(len(inputs), device=model.device)[None])
    return model.compute_logits(hidden)[0].float().log_softmax(-1).cpu()


@torch.inference_mode()
def compare(model: CausalLM, reference: CausalLM, token_ids: list[int], window: int = 256,
            kv_cache_dtype: str = "auto", kv_scales: KVScales | None = None) -> QualityReport:
    """`model` against `reference` over `token_ids`, in independent windows of `window` tokens; `model`'s keys
    and values stored as `kv_cache_dtype` (the reference's in full precision); an int8 pool's scales are
    `kv_scales` (`attention/kv_calibration.py` measures them on its own text, not this one)."""
    if len(token_ids) < 2:
        raise ValueError("the text needs at least two tokens")
    if kv_cache_dtype == "int8" and kv_scales is None:
        raise ValueError("an int8 pool needs kv_scales: calibrate_kv_scales(model, calibration_token_ids(tokenizer, "
                         "vocab_size)) measures them as an engine does (attention/kv_calibration.py)")
    agree = positions = 0
    kl_sum = nll_sum = reference_nll_sum = 0.0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]  # the window and the token after it
        inputs = chunk[:-1]
        targets = torch.tensor(chunk[1:])
        test = _logprobs(model, inputs, kv_cache_dtype, kv_scales)  # (T, vocab)
        ref = _logprobs(reference, inputs)
        agree += int((test.argmax(-1) == ref.argmax(-1)).sum())
        kl_sum += float((ref.exp() * (ref - test)).sum())
        nll_sum -= float(test.gather(1, targets[:, None]).sum())
        reference_nll_sum -= float(ref.gather(1, targets[:, None]).sum())
        positions += len(inputs)
    return QualityReport(positions, agree / positions, kl_sum / positions, math.exp(nll_sum / positions),
                         math.exp(reference_nll_sum / positions))
