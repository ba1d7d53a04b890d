"""How much a changed model (quantized, in lower precision) differs from a reference, on a fixed text.

Three measures over every position of the text, each next-token distribution of the model against
the reference's at the same position, the reference seeing the same tokens:

- **top-1 agreement**: how often the two models' most likely next token is the same (what greedy
  decoding notices first);
- **KL divergence** KL(reference || model), in nats, averaged over positions: how far the whole
  distribution moved (what sampling notices);
- **perplexity** exp(mean negative log-likelihood of the text's actual next tokens), for each model:
  how well it predicts real text.

The text ships with the package (`data/eval_text.txt`: an original essay of about 1,700 tokens with the
bundled tokenizer) and is cut into independent windows, so a long text never holds (length, vocab)
logits at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

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


@torch.inference_mode()
def compare(model: CausalLM, reference: CausalLM, token_ids: list[int], window: int = 256) -> QualityReport:
    """`model` against `reference` over `token_ids`, in independent windows of `window` tokens."""
    if len(token_ids) < 2:
        raise ValueError("the text needs at least two tokens")
    agree = positions = 0
    kl_sum = nll_sum = reference_nll_sum = 0.0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window + 1]  # the window and the token after it
        inputs = chunk[:-1]
        targets = torch.tensor(chunk[1:])
        logprobs = [m.compute_logits(m(torch.tensor([inputs], device=m.device)))[0].float().log_softmax(-1).cpu()
                    for m in (model, reference)]  # (T, vocab) each
        test, ref = logprobs
        agree += int((test.argmax(-1) == ref.argmax(-1)).sum())
        kl_sum += float((ref.exp() * (ref - test)).sum())
        nll_sum -= float(test.gather(1, targets[:, None]).sum())
        reference_nll_sum -= float(ref.gather(1, targets[:, None]).sum())
        positions += len(inputs)
    return QualityReport(positions, agree / positions, kl_sum / positions, math.exp(nll_sum / positions),
                         math.exp(reference_nll_sum / positions))
