"""The docs that are generated or run: docs/flags.md is current, and the README's runnable code
blocks work as written."""

from __future__ import annotations

from radixrt.flags_doc import PAGE, render


def test_flags_page_is_current():
    """docs/flags.md is what the settings generate; a new or changed flag fails this until the
    page is regenerated (`make flags-doc`)."""
    assert PAGE.read_text() == render(), "docs/flags.md is stale: run `make flags-doc`"
