"""TurboRAG's attention pattern and positions as one 4D mask, for a single forward.

This mirrors ``engine.strategies.turbo`` exactly (see ``ChunkReuse.assemble``):

- every chunk piece (and the prompt's cached leading text, ``cache_leading_text``)
  was encoded *alone*: its tokens see only earlier tokens of the same piece;
- every text piece (the ``"\\n\\n"`` separators, the question, the chat
  template's tail) is computed by ``run_tokens`` over the assembled cache: its
  tokens see every earlier token of the prompt (mask by sequence index);
- generated (answer) tokens are decoded over the whole cache: they see everything
  before them too, and continue at ``kv.next_position``;
- positions: ``"reordered"`` places each chunk where it sits (so the prompt's
  positions are simply ``0..n-1``); ``"composite"`` leaves every chunk at 0 and
  continues text after the longest chunk so far.

Encoding a chunk at 0 and rotating its keys to ``p`` equals encoding it at ``p``
(RoPE depends only on relative positions), so one masked forward over the whole
sequence gives the turbo strategy's logits up to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrag_integrations.engine.prompting.segments import TokenizedPrompt
from kvrag_integrations.engine.strategies.reuse import POSITION_MODES


@dataclass
class TurboLayout:
    """Where each token sits and what it sees.

    Attributes:
        position_ids: int64 ``[tokens]`` RoPE position of each token.
        block_ids: int64 ``[tokens]``; 0 for tokens that see every earlier token
            (text and answer), ``k >= 1`` for the k-th independently encoded piece.
    """

    position_ids: torch.Tensor
    block_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.block_ids.numel())

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Bool ``[1, 1, tokens, tokens]`` mask, True where a query may attend a key."""
        return block_mask(self.block_ids.to(device))


def turbo_layout(
    prompt: TokenizedPrompt, answer_tokens: int = 0, positions: str = "reordered"
) -> TurboLayout:
    """The layout turbo produces for ``prompt``, plus ``answer_tokens`` decoded after it.

    Args:
        prompt: the tokenized prompt as the engine builds it (chunk pieces marked).
        answer_tokens: tokens appended after the prompt (teacher-forced answer).
        positions: ``"reordered"`` (turbo's default) or ``"composite"``.

    Examples:
        >>> from kvrag_integrations.engine.prompting.segments import Piece
        >>> p = TokenizedPrompt([Piece(torch.tensor([1, 2]), "text", "a"),
        ...                      Piece(torch.tensor([3, 4, 5]), "chunk", "b")])
        >>> lay = turbo_layout(p, answer_tokens=1)
        >>> lay.position_ids.tolist(), lay.block_ids.tolist()
        ([0, 1, 2, 3, 4, 5], [0, 0, 1, 1, 1, 0])
    """
    if positions not in POSITION_MODES:
        raise ValueError(f"positions must be one of {POSITION_MODES}, got {positions!r}")
    pos: list[torch.Tensor] = []
    blocks: list[torch.Tensor] = []
    next_pos = 0
    block = 0
    for piece in prompt.pieces:
        n = piece.ids.numel()
        if piece.is_cached:  # encoded alone: a chunk, or the cached leading text
            block += 1
            at = next_pos if positions == "reordered" else 0
            pos.append(torch.arange(at, at + n))
            blocks.append(torch.full((n,), block))
            next_pos = max(next_pos, at + n)
        else:
            pos.append(torch.arange(next_pos, next_pos + n))
            blocks.append(torch.zeros(n, dtype=torch.long))
            next_pos += n
    # Decoding continues at PromptKV.next_position = max position + 1.
    pos.append(torch.arange(next_pos, next_pos + answer_tokens))
    blocks.append(torch.zeros(answer_tokens, dtype=torch.long))
    return TurboLayout(torch.cat(pos).long(), torch.cat(blocks).long())


def block_mask(block_ids: torch.Tensor) -> torch.Tensor:
    """Causal by sequence index; a token of block ``k >= 1`` sees only its own block.

    Examples:
        >>> block_mask(torch.tensor([0, 1, 1, 0]))[0, 0].int().tolist()
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]]
    """
    n = block_ids.numel()
    causal = torch.ones(n, n, dtype=torch.bool, device=block_ids.device).tril()
    q, k = block_ids.unsqueeze(1), block_ids.unsqueeze(0)
    own_block = (q == 0) | (q == k)
    return (causal & own_block)[None, None]


def causal_layout(num_tokens: int) -> TurboLayout:
    """The ordinary layout (full prefill): positions ``0..n-1``, one causal block."""
    return TurboLayout(torch.arange(num_tokens), torch.zeros(num_tokens, dtype=torch.long))
