"""Decides when a sequence is finished (EOS, stop ids, stop strings, lengths)."""

from __future__ import annotations

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import Sequence, SequenceStatus


class StopChecker:
    """Sets ``seq.status`` to a finished state when a stop condition holds after a new token.

    Order of checks: ``min_tokens`` (nothing stops before it), EOS (unless ``ignore_eos``),
    ``stop_token_ids``, ``stop`` strings (searched in the decoded text, so a stop string need
    not fall on a token boundary), then ``max_tokens`` and ``max_model_len``.
    """

    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len

    def maybe_stop(self, seq: Sequence, params: SamplingParams, new_text: str, max_tokens: int) -> None:
        """Args:
        new_text: characters the last token added to ``seq.output_text``.
        max_tokens: the request's effective max_tokens (resolved when params had None).
        """
        out_len = seq.get_output_len()
        if out_len >= params.min_tokens:
            last = seq.get_last_token_id()
            if not params.ignore_eos and last == seq.eos_token_id:
                seq.status = SequenceStatus.FINISHED_STOPPED
                return
            if last in (params.stop_token_ids or ()):
                if not params.include_stop_str_in_output and new_text:
                    seq.output_text = seq.output_text[: -len(new_text)]
                seq.status = SequenceStatus.FINISHED_STOPPED
                seq.stop_reason = last
                return
            if params.stop and new_text:
                hit = self._find_stop_string(seq.output_text, len(new_text), params)
                if hit is not None:
                    stop_str, end = hit
                    seq.output_text = seq.output_text[:end]
                    seq.status = SequenceStatus.FINISHED_STOPPED
                    seq.stop_reason = stop_str
                    return
        if out_len >= max_tokens or seq.get_len() >= self.max_model_len:
            seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED

    @staticmethod
    def _find_stop_string(text: str, num_new_chars: int, params: SamplingParams) -> tuple | None:
        """The stop string that ends inside the new characters, as ``(stop_str, cut_index)``;
        the text is cut before the match (after it with ``include_stop_str_in_output``).

        Of several matches, the one that ends first wins (the one a left-to-right reader
        completes first), then the one that starts first: the choice depends on the text only,
        never on how the new characters were split into tokens."""
        best = None  # (end, start, stop)
        for stop in params.stop or ():
            # Only matches overlapping the new characters are new; earlier text was checked.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            idx = text.find(stop, start)
            if idx != -1 and (best is None or (idx + len(stop), idx) < best[:2]):
                best = (idx + len(stop), idx, stop)
        if best is None:
            return None
        end, idx, stop = best
        return stop, end if params.include_stop_str_in_output else idx


def max_stop_len(params: SamplingParams) -> int:
    """Characters a stream must hold back so no part of a stop string is ever sent."""
    return max((len(s) for s in params.stop or ()), default=0)
