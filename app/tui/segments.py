"""How each piece of an answer was produced: the view data the chat draws from the engine's events.

Nothing here touches Textual. The session turns each Iteration into segments of text tagged by how they
came to be (accepted draft, bonus, correction, plain step, rejected draft) and the candidates' utilities;
the chat colours the segments and the live panel plots the utilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# How a piece of the answer was produced. The chat colours each kind differently.
DRAFT = "draft"  # a draft token the target accepted
BONUS = "bonus"  # the target's token after every draft was accepted
CORRECTION = "correction"  # the target's token replacing the first rejected draft
TARGET = "target"  # a plain decoding step (no draft)
REJECTED = "rejected"  # a draft token the target rejected (shown struck through, or hidden)


@dataclass(frozen=True)
class Segment:
    text: str
    kind: str


@dataclass(frozen=True)
class IterationView:
    segments: tuple[Segment, ...]
    utilities: tuple[tuple[float | None, bool, float], ...]  # (utility, kept, chain prob) of the candidates


def _pieces(tokens, text: str, piece: Callable[[int], str]) -> list[str]:
    """Per-token text when it adds up to the span's text (multi-byte characters may not), else one piece."""
    if not tokens:
        return []
    pieces = [piece(t) for t in tokens]
    return pieces if "".join(pieces) == text else [text]


def segments_of(event, detokenize: Callable[[list[int]], str], piece: Callable[[int], str]) -> list[Segment]:
    """How each part of an iteration's committed text was produced, with the rejected drafts in place."""
    accepted = list(event.accepted)
    rejected = list(event.rejected)
    committed = list(event.committed)
    has_target = len(committed) == len(accepted) + 1
    accepted = accepted[: len(committed)]
    accepted_text = detokenize(accepted) if accepted else ""
    text = event.committed_text
    if not text.startswith(accepted_text):
        # Byte-level pieces that only make characters together: colour the whole step by its last token.
        accepted_text = ""
        accepted = []
    target_text = text[len(accepted_text) :] if has_target else ""
    out = [Segment(p, DRAFT) for p in _pieces(accepted, accepted_text, piece)]
    if rejected:
        out.append(Segment(detokenize(rejected), REJECTED))
    if has_target and target_text:
        if not event.drafted:
            kind = TARGET
        elif rejected:
            kind = CORRECTION
        else:
            kind = BONUS
        out.append(Segment(target_text, kind))
    elif not has_target and not accepted and text:
        out.append(Segment(text, DRAFT))
    return out


def view_of(event, decoder) -> IterationView | None:
    from ...engine.events import Iteration

    if not isinstance(event, Iteration):
        return None
    segs = segments_of(event, decoder.detokenize, decoder.piece_text)
    utils = tuple((c.utility, bool(c.kept), float(c.chain_prob)) for c in event.candidates)
    return IterationView(tuple(segs), utils)
