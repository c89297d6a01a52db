"""radixrt inside other serving systems: `radixrt.integrations.ray` (Ray Serve LLM)."""
