"""The correctness and benchmark harness: golden token files and the gate (`goldens`), paired A/B
benchmarks (`pairbench`), traces of where time goes (`trace`)."""
