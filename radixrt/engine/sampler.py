"""Batched sampling: penalties, temperature, top-k/top-p/min-p, greedy, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixrt.engine.request import Req


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # of the chosen tokens, under the model's raw distribution
    top_logprobs: list[list[tuple[float, int]]] | None
    # per row: why no token could be drawn (its token id is then meaningless), else None
    failures: list[str | None]


NAN_LOGITS = "the model produced non-finite logits (NaN or +inf)"
NOTHING_ALLOWED = (
    "no token is allowed here: the constraint and the banned stop tokens exclude every one"
)


def unsampleable_rows(top: torch.Tensor) -> list[str | None]:
    """Rows nothing may be drawn from, by each row's largest logit `top` [B] (NaN if any is:
    max propagates it; +inf if any is; -inf if all are): a NaN or +inf logit (a model fault:
    multinomial would raise, argmax would pick it), or every logit -inf (masks and bans left no
    token)."""
    broken = (torch.isnan(top) | torch.isposinf(top)).tolist()
    empty = torch.isneginf(top).tolist()
    return [NAN_LOGITS if b else NOTHING_ALLOWED if e else None for b, e in zip(broken, empty)]


def sample(
    logits: torch.Tensor,
    reqs: list[Req],
    banned: list[list[int]],
    constrain: Callable[[torch.Tensor], None] | None = None,
) -> SampleOutput:
    """Pick one token per row of `logits` [B, V] for `reqs`; `banned` ids get -inf (min_new_tokens);
    `constrain` masks a copy of the logits in place (constraints); a request's `logit_bias` is
    added to its row (only rows that have one pay for it). Logprobs use the raw logits.

    Speculative decoding accepts a draft exactly when the token picked here equals it. For a
    sampled row that is the rejection rule for a proposal certain of its token: the draft is
    taken with probability p(draft), and otherwise the token follows p without the draft,
    renormalized. Drawing the token as usual and comparing needs one draw per token, drafted or
    not, so a seeded request's tokens do not depend on what was drafted (a separate acceptance
    draw would shift its generator whenever the timing-priced drafter proposed something)."""
    raw = logits
    if constrain is not None or any(banned) or any(_adjusted(r) for r in reqs):
        logits = logits.clone()  # the raw logits stay for the logprobs
        if constrain is not None:
            constrain(logits)
        for i, req in enumerate(reqs):
            if req.params.penalized:
                _apply_penalties(logits[i], req)
            if req.params.logit_bias:
                _apply_logit_bias(logits[i], req.params.logit_bias)
            if banned[i]:
                logits[i, banned[i]] = float("-inf")

    best, argmax = logits.max(dim=-1)  # one pass: the failures' check and the greedy tokens
    failures = unsampleable_rows(best)
    ok = [i for i in range(len(reqs)) if failures[i] is None]
    # greedy rows take the argmax; a failed row's token is meaningless, never used
    tokens = torch.where(torch.tensor([r.params.greedy for r in reqs]), argmax, 0)
    sampled_rows = [i for i in ok if not reqs[i].params.greedy]
    if sampled_rows:
        probs = _filtered_probs(logits[sampled_rows], [reqs[i] for i in sampled_rows])
        for j, i in enumerate(sampled_rows):
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=reqs[i].generator)[0])

    token_ids = tokens.tolist()
    want_logprobs = [r.params.return_logprob for r in reqs]
    if not any(want_logprobs):
        return SampleOutput(token_ids, None, None, failures)
    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(r.params.top_logprobs_num for r in reqs)
    top = None
    if k:
        vals, ids = logprobs.topk(k, dim=-1)
        top = [
            list(
                zip(
                    vals[i, : r.params.top_logprobs_num].tolist(),
                    ids[i, : r.params.top_logprobs_num].tolist(),
                )
            )
            for i, r in enumerate(reqs)
        ]
    return SampleOutput(token_ids, chosen, top, failures)


def _adjusted(req: Req) -> bool:
    """Whether a request's row is changed before it is sampled (penalties, a logit bias)."""
    return req.params.penalized or bool(req.params.logit_bias)


def _apply_penalties(row: torch.Tensor, req: Req) -> None:
    p = req.params
    if p.frequency_penalty or p.presence_penalty:
        out = torch.tensor(req.output_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.repetition_penalty != 1.0:
        # the prompt as sent (an image's placeholders as the image token, as transformers
        # penalizes them; `all_ids` holds ids past the vocabulary there) and the output
        seen = torch.tensor(sorted(set(req.input_ids).union(req.output_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)


def _apply_logit_bias(row: torch.Tensor, bias: dict[int, float]) -> None:
    """Add each token's bias to its logit (a masked -inf stays -inf: a bias never unbans)."""
    ids = torch.tensor(list(bias), dtype=torch.long, device=row.device)
    row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype, device=row.device)


def _filtered_probs(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in reqs], dtype=logits.dtype)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    top_ks = [r.params.top_k for r in reqs]
    top_ps = [r.params.top_p for r in reqs]
    min_ps = [r.params.min_p for r in reqs]
    if all(k == -1 for k in top_ks) and all(p == 1.0 for p in top_ps) and not any(min_ps):
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1])[None, :]
    k = torch.tensor([kk if kk > 0 else probs.shape[-1] for kk in top_ks])[:, None]
    drop = ranks >= k
    # top-p keeps the smallest head whose mass reaches p (the token crossing p included)
    cum_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= cum_before > torch.tensor(top_ps, dtype=probs.dtype)[:, None]
    drop |= sorted_probs < torch.tensor(min_ps, dtype=probs.dtype)[:, None] * sorted_probs[:, :1]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
