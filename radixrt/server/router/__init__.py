"""Data parallelism: a router speaking the client protocol in front of several workers."""
