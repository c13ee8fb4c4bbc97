"""kvguard benchmarks (``make bench``): see docs/performance.md."""
