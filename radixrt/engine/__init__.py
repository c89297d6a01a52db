"""Requests, the scheduler and its policies, admission budgets, the sampler, the detokenizer."""
