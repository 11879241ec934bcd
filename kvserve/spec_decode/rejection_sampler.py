"""Rejection sampling of proposed tokens (speculative sampling).

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" (Algorithm 1)
and Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling"
(Algorithm 2). For each drafted position ``i`` with draft token ``d``, target distribution ``p``
and draft distribution ``q``:

- accept ``d`` with probability ``min(1, p(d) / q(d))``;
- on the first rejection, emit one token drawn from ``norm(max(p - q, 0))`` and stop;
- if every draft is accepted, emit a bonus token drawn from ``p`` at the position after the last
  draft.

Whatever ``q`` is, every emitted token is distributed as the target's ``p`` at its position (the
theorem of both papers), so speculation never changes what a request samples, only how many
forwards it takes. A proposer without probabilities (n-gram lookup) is a point mass ``q = 1[d]``:
acceptance is then ``p(d)`` and the residual is ``p`` with ``d`` removed.

Randomness: each row draws ``draws_per_row`` uniforms (the most drafts a row may ever have:
``num_speculative_tokens``; by default the call's ``k``) and one ``V``-wide exponential vector,
always the same amount whatever is accepted and whatever the other rows draft, so a seeded
request's stream advances identically from run to run and does not depend on the other rows of
the batch (with the call's ``k``, the step's largest draft count, a seeded row beside a row with
more drafts drew more than alone and its later tokens changed). Rows without a generator share one draw
from the global RNG of the probabilities' device.
"""

from __future__ import annotations

import torch

__all__ = ["rejection_sample"]


def _draw(
    shape: tuple[int, ...], kind: str, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """float64 uniforms in [0, 1) (``kind="uniform"``) or float32 ``Exponential(1)`` noise,
    drawn on the generator's device (then moved) so a stream depends only on its generator."""
    gen_device = device if generator is None else generator.device
    if kind == "uniform":
        out = torch.rand(shape, dtype=torch.float64, device=gen_device, generator=generator)
    else:
        out = torch.empty(shape, dtype=torch.float32, device=gen_device).exponential_(generator=generator)
    return out.to(device)


def _per_row_draws(
    generators: list[torch.Generator | None], shape: tuple[int, ...], kind: str, device: torch.device
) -> torch.Tensor:
    """One draw of ``shape`` per row: seeded rows from their own generator (one call each),
    the others together from the global RNG. Returns ``[B, *shape]``."""
    num_rows = len(generators)
    unseeded = [b for b, g in enumerate(generators) if g is None]
    if len(unseeded) == num_rows:
        return _draw((num_rows, *shape), kind, device, None)
    dtype = torch.float64 if kind == "uniform" else torch.float32
    out = torch.empty((num_rows, *shape), dtype=dtype, device=device)
    if unseeded:
        out[torch.tensor(unseeded, device=device)] = _draw((len(unseeded), *shape), kind, device, None)
    for b, g in enumerate(generators):
        if g is not None:
            out[b] = _draw(shape, kind, device, g)
    return out


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    generators: list[torch.Generator | None],
    num_draft_tokens: torch.Tensor | None = None,
    draws_per_row: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each row's drafts and sample the token after it.

    Row ``b`` has ``m_b`` drafts (``num_draft_tokens[b]``, or ``k`` for every row when None);
    positions past them are padding and are never read (their ids may be anything, e.g. 0).
    Draft ``j`` is accepted with probability ``min(1, p_j(x) / q_j(x))`` (``p`` = target,
    ``q`` = draft, ``x`` = the draft token), in order, until the first rejection; the token
    after the accepted prefix is drawn from ``normalize(max(0, p_j - q_j))`` at a rejection,
    or from ``p_{m_b}`` (the bonus token) when all ``m_b`` drafts were accepted.

    Args:
        target_probs: float32 ``[B, k+1, V]``, the target's sampling distribution (after
            temperature and truncation) at each verified position; row ``j`` scores draft ``j``
            (and row ``m_b`` gives the bonus).
        draft_token_ids: int64 ``[B, k]``.
        draft_probs: float32 ``[B, k, V]`` the draft distributions, or None: a point mass on
            each drafted token (n-gram lookup; acceptance is then ``p_j(x)`` and the correction
            is drawn from ``p_j`` with ``x`` removed).
        generators: ``B`` entries: the request's seeded ``torch.Generator`` (every random draw
            of that row comes from it, so a seeded request's output does not depend on the
            batch) or None (the global RNG of the tensors' device).
        num_draft_tokens: int64 ``[B]`` drafts per row (``0 <= m_b <= k``), or None (all ``k``).
        draws_per_row: uniforms each row draws (``>= k``; None: ``k``). Pass the largest ``k``
            any step can have, so a seeded row's draws do not depend on the step's other rows.
    Returns:
        ``(token_ids int64 [B, k+1], num_accepted int64 [B])``: row ``b`` emits
        ``token_ids[b, : num_accepted[b] + 1]`` (the accepted drafts then the sampled token);
        entries after it are ``-1``. ``0 <= num_accepted[b] <= m_b``.
    Raises:
        ValueError: shapes or ``len(generators)`` do not agree, ``num_draft_tokens`` outside
            ``[0, k]``, a draft id (within a row's ``m_b``) outside ``[0, V)``, or
            ``draws_per_row < k``; the message names the argument.
    """
    if target_probs.dim() != 3:
        raise ValueError(f"target_probs must be [B, k+1, V], got shape {tuple(target_probs.shape)}")
    num_rows, kp1, vocab = target_probs.shape
    k = kp1 - 1
    if k < 0:
        raise ValueError("target_probs must have k+1 >= 1 positions, got 0")
    if tuple(draft_token_ids.shape) != (num_rows, k):
        raise ValueError(
            f"draft_token_ids must be [B, k] = [{num_rows}, {k}], got {tuple(draft_token_ids.shape)}"
        )
    if draft_probs is not None and tuple(draft_probs.shape) != (num_rows, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{num_rows}, {k}, {vocab}], got {tuple(draft_probs.shape)}"
        )
    if len(generators) != num_rows:
        raise ValueError(f"generators must have B = {num_rows} entries, got {len(generators)}")
    device = target_probs.device
    p = target_probs.float()
    drafts = draft_token_ids.to(device=device, dtype=torch.long)
    positions = torch.arange(k + 1, device=device).unsqueeze(0)  # [1, k+1]
    if num_draft_tokens is None:
        num_drafts = torch.full((num_rows,), k, dtype=torch.long, device=device)
    else:
        num_drafts = num_draft_tokens.to(device=device, dtype=torch.long).reshape(-1)
        if num_drafts.shape[0] != num_rows:
            raise ValueError(
                f"num_draft_tokens must be [B] = [{num_rows}], got {tuple(num_draft_tokens.shape)}"
            )
        if num_rows and (int(num_drafts.min()) < 0 or int(num_drafts.max()) > k):
            raise ValueError(f"num_draft_tokens must be in [0, {k}], got {num_drafts.tolist()}")
    valid = positions[:, :k] < num_drafts.unsqueeze(1)  # [B, k]
    if bool(((drafts < 0) | (drafts >= vocab))[valid].any()):
        raise ValueError(f"draft_token_ids must be in [0, {vocab}) within each row's num_draft_tokens")
    safe = torch.where(valid, drafts, torch.zeros_like(drafts))  # padding is never read

    draws = k if draws_per_row is None else int(draws_per_row)
    if draws < k:
        raise ValueError(f"draws_per_row must be >= k = {k} (the most drafts of a row), got {draws_per_row}")
    uniforms = _per_row_draws(generators, (draws,), "uniform", device)[:, :k]  # [B, k]
    noise = _per_row_draws(generators, (vocab,), "exponential", device)  # [B, V]

    p_draft = p[:, :k].gather(2, safe.unsqueeze(2)).squeeze(2).double()  # p_j(x_j), [B, k]
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        q = draft_probs.to(device=device, dtype=torch.float32)
        q_draft = q.gather(2, safe.unsqueeze(2)).squeeze(2).double()
    # accept iff u < p/q, u ~ U[0, 1): probability min(1, p/q). q(x) = 0 (the draft could not
    # have drawn x): accept iff p(x) > 0. p = q gives p/q = 1 exactly: always accepted.
    ratio = torch.where(q_draft > 0, p_draft / q_draft.clamp_min(1e-300), (p_draft > 0).double() * 2.0)
    accepted = (uniforms < ratio) & valid
    # Accepted run = drafts before the first rejection (or the end of the row's drafts).
    num_accepted = accepted.to(torch.long).cumprod(dim=1).sum(dim=1)  # [B]

    # The sampled token comes from position ``num_accepted``: the residual there if a draft
    # was rejected, else (every draft accepted) the target itself (the bonus).
    rows = torch.arange(num_rows, device=device)
    p_last = p[rows, num_accepted]  # [B, V]
    if k > 0:
        rejected = num_accepted < num_drafts
        pos = num_accepted.clamp_max(k - 1)
        if draft_probs is None:
            q_last = torch.zeros_like(p_last)
            q_last[rows, safe[rows, pos]] = 1.0
        else:
            q_last = q[rows, pos]
        residual = (p_last - q_last).clamp_min(0.0)
        # Rounding can leave a rejected row's residual all zero (p and q equal but for the last
        # bits): fall back to p then, which is what the residual approximates.
        mass = residual.sum(dim=1, keepdim=True)
        residual = torch.where(mass > 0, residual, p_last)
        dist = torch.where(rejected.unsqueeze(1), residual, p_last)
    else:
        dist = p_last
    # Exponential race: argmax(w / E) picks token j with probability w_j / sum(w).
    last = (dist / noise.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=1)

    token_ids = torch.full((num_rows, k + 1), -1, dtype=torch.long, device=device)
    if k > 0:
        keep = positions[:, :k] < num_accepted.unsqueeze(1)
        token_ids[:, :k] = torch.where(keep, drafts, token_ids[:, :k])
    token_ids[rows, num_accepted] = last
    return token_ids, num_accepted
