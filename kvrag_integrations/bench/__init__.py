"""Benchmarks: ``python -m kvrag_integrations.bench <suite>`` (see ``__main__``)."""
