"""Model layouts and request traces shared by the benchmarks and the tests (not product code)."""
