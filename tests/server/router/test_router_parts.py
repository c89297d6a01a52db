"""The router's parts that need no worker: fleet stats (sums, ratios of sums, tenant rows) and
the pin book (which worker a generate extending a pinned prefix goes to), the tokenizer it
routes by."""

from __future__ import annotations

import json

from radixrt.server.router.pins import PIN_SLACK_TOKENS, Pin, PinBook, extends
from radixrt.server.router.prefix_tree import Namespace, Prompt
from radixrt.server.router.router import routing_tokenizer
from radixrt.server.router.stats import count, fleet_stats

NS = Namespace("", "", "")


def test_fleet_stats_sum_numbers_and_recompute_ratios_from_the_sums():
    workers = [
        {
            "prompt_tokens_total": 100,
            "cached_prompt_tokens_total": 50,
            "cache_hit_rate": 0.5,
            "tp_size": 2,
            "tenants": {"a": {"requests": 1, "note": "x"}},
            "flag": True,
        },
        {
            "prompt_tokens_total": 300,
            "cached_prompt_tokens_total": 0,
            "cache_hit_rate": 0.0,
            "tp_size": 2,
            "tenants": {"a": {"requests": 2}, "b": {"requests": 5}},
        },
    ]
    total = fleet_stats(workers)
    assert total["prompt_tokens_total"] == 400
    assert total["cache_hit_rate"] == 50 / 400  # not 0.5 + 0.0
    assert total["tp_size"] == 2 and "flag" not in total
    assert total["tenants"] == {"a": {"requests": 3}, "b": {"requests": 5}}
    assert fleet_stats([])["cache_hit_rate"] == 0 and "tp_size" not in fleet_stats([])


def test_count_reads_only_ints():
    assert [count({"n": v}, "n") for v in (3, True, "3", None, 2.5)] == [3, 0, 0, 0, 0]
    assert count({}, "n") == 0


def test_a_pin_is_extended_only_in_its_namespace_up_to_the_slack():
    pinned = Prompt(NS, list(range(10)))
    assert extends(Prompt(NS, list(range(12))), pinned)
    retokenized = list(range(10 - PIN_SLACK_TOKENS)) + [99, 98, 97]
    assert extends(Prompt(NS, retokenized), pinned)
    assert not extends(Prompt(Namespace("t", "", ""), list(range(12))), pinned)
    assert not extends(Prompt(NS, [1] + list(range(12))), pinned)


def test_the_pin_book_forgets_by_client_and_by_worker():
    book = PinBook()
    book.add(b"a", "p1", Pin(0, Prompt(NS, [1, 2, 3, 4])))
    book.add(b"a", "p2", Pin(1, Prompt(NS, [7, 8, 9, 10])))
    book.add(b"b", "p1", Pin(1, Prompt(NS, [1, 2, 3, 4])))
    assert [p.worker for p in book.extended_by(b"a", Prompt(NS, [1, 2, 3, 4, 5]))] == [0]
    book.forget_worker(1)
    assert list(book.extended_by(b"a", Prompt(NS, [7, 8, 9, 10, 11]))) == []
    assert book.pop(b"b", "p1") is None
    assert set(book.forget_client(b"a")) == {"p1"}
    assert book.forget_client(b"a") == {}


def test_the_routing_tokenizer_ignores_a_files_padding_and_truncation(tmp_path, tiny_model_dir):
    """A tokenizer.json is input: one that pads every text to 10^7 ids or truncates to 1 is
    read without either, so the router encodes a prompt as the runtime does."""
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    spec["padding"] = {
        "strategy": {"Fixed": 10**7},
        "direction": "Right",
        "pad_to_multiple_of": None,
        "pad_id": 0,
        "pad_type_id": 0,
        "pad_token": "<pad>",
    }
    spec["truncation"] = {
        "direction": "Right",
        "max_length": 1,
        "strategy": "LongestFirst",
        "stride": 0,
    }
    hostile = tmp_path / "tokenizer.json"
    hostile.write_text(json.dumps(spec))
    plain = routing_tokenizer(str(tiny_model_dir / "tokenizer.json"))
    text = "The Danube flows through ten countries."
    assert routing_tokenizer(str(hostile)).encode(text).ids == plain.encode(text).ids
