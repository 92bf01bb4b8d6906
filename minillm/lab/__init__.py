"""The measurement kit the book's labs use: the ledger, hardware probes, workloads, benchmarks and
their records, diagnosis, plots, report tables and the one notebook setup. It depends on the
engine, never the other way."""
