"""Constraints after the reasoning block (`structured/reasoning.py`), walked token by token over
the default model's real tokenizer (no model weights): the phases, the budget, the masks, and a
speculative draft across the block's end."""

from __future__ import annotations

import pytest

from radixrt.structured.bitmask import allocate_bitmask
from radixrt.structured.reasoning import Phase, ReasoningGuide, ThinkTags

from helpers import PADDED_VOCAB, allowed_ids

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tags(compiler):
    return ThinkTags.build(compiler.tokens, {compiler.eos_token_id})


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def guide(compiler, tags, tokenizer, prompt: str, budget: int | None = None, schema=SCHEMA):
    inner = compiler.compile(json_schema=schema).guide() if schema is not None else None
    return ReasoningGuide(tags, inner, ids(tokenizer, prompt), budget)


def mask(g) -> set[int]:
    row = allocate_bitmask(1, PADDED_VOCAB)[0]
    g.fill_mask(row)
    return set(allowed_ids(row))


def walk(g, tokens: list[int]) -> None:
    for t in tokens:
        assert t in mask(g), (t, g.walk)
        g.advance(t)


def test_an_open_block_in_the_prompt_is_free_until_it_closes(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Question?<think>\n")
    assert g.walk.phase is Phase.THINKING and not g.is_final()
    allowed = mask(g)
    assert compiler.eos_token_id not in allowed  # an answer is owed
    assert ids(tokenizer, " Paris?")[0] in allowed  # text no JSON would start with
    walk(g, ids(tokenizer, "Let me think. It is 1.</think>"))
    assert g.walk.phase is Phase.ANSWER
    fresh = compiler.compile(json_schema=SCHEMA).guide()
    assert mask(g) == mask(fresh)  # the constraint starts here, from its start
    walk(g, ids(tokenizer, '{"a":1}'))
    assert g.is_final()


def test_a_spent_budget_forces_the_end_tag(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Q<think>", budget=3)
    walk(g, ids(tokenizer, " one two three")[:3])
    assert g.walk.phase is Phase.CLOSING
    forced = []
    while g.walk.phase is Phase.CLOSING:
        (only,) = mask(g)
        forced.append(only)
        g.advance(only)
    assert tokenizer.decode(forced) == "</think>"
    assert g.walk.phase is Phase.ANSWER


def test_a_budget_of_zero_closes_at_once(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Q<think>", budget=0)
    assert g.walk.phase is Phase.CLOSING


def test_a_reply_may_open_the_block_or_answer_at_once(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Question:")
    assert g.walk.phase is Phase.OPENING
    allowed = mask(g)
    brace = ids(tokenizer, "{")[0]
    assert brace in allowed and ids(tokenizer, "<think>")[0] in allowed
    assert ids(tokenizer, " Paris")[0] not in allowed
    answered = guide(compiler, tags, tokenizer, "Question:")
    walk(answered, ids(tokenizer, '{"a":2}'))
    assert answered.walk.phase is Phase.ANSWER and answered.is_final()
    walk(g, ids(tokenizer, "<think>hm</think>"))
    assert g.walk.phase is Phase.ANSWER and not g.is_final()


def test_the_end_tag_never_carries_answer_text_past_the_constraint(compiler, tags, tokenizer):
    """A token that closes the block and goes on (`>{`) is masked while the reply thinks: its
    text after `</think>` would never pass the constraint."""
    g = guide(compiler, tags, tokenizer, "Q<think>")
    walk(g, ids(tokenizer, "ok </think"))
    assert g.walk.phase is Phase.THINKING
    allowed = mask(g)
    bad = [t for t, data in enumerate(tags.bytes_of) if data.startswith(b">") and data[1:].strip()]
    assert bad and not allowed & set(bad)
    assert ids(tokenizer, ">")[0] in allowed


def test_a_draft_is_checked_across_the_block_end(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Q<think>")
    good = ids(tokenizer, "x</think>") + ids(tokenizer, '{"a"')
    assert g.allowed_prefix(good) == len(good)
    bad = ids(tokenizer, "x</think>") + ids(tokenizer, "no")
    assert g.allowed_prefix(bad) == len(bad) - 1
    assert g.walk.phase is Phase.THINKING  # checking a draft does not advance


def test_a_budget_without_a_constraint_frees_the_answer(compiler, tags, tokenizer):
    g = guide(compiler, tags, tokenizer, "Q<think>", budget=2, schema=None)
    walk(g, ids(tokenizer, " a b"))
    while g.walk.phase is Phase.CLOSING:
        g.advance(next(iter(mask(g))))
    assert g.is_final() and compiler.eos_token_id in mask(g)  # the answer is any text
