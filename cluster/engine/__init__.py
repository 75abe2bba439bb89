"""Engine-side request processing: incremental detokenization, stop strings, bad-word tokenizing."""
