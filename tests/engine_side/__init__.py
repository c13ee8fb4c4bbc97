"""What runs inside the engine (``kvguard.engine_hooks``), without an engine: probes, the ring,
the wire format, digests, the guard's marker, Tier 1 and the SGLang / vLLM adapters' hooks on
stand-ins or on single real engine classes."""
