"""The life of a run: build, train, evaluate, tune; run directories and resume; the entry points' harness."""
