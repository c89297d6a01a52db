"""KV memory: the paged pools, the radix tree of cached prefixes, and the slot hand-over between
requests and the tree (`slot_manager`). Needs no model: every part is testable on token ids."""
