"""Conformance: does a backend compute what DeepSeek's models need?

* op level (``ops_suite``): every op a backend provides against the reference implementation, on
  random inputs over the shapes of ``specs/ops.toml``, with the spec's per-dtype tolerances;
* end to end (``e2e``): per-sample perplexity and greedy tokens on fixed workloads and
  checkpoints against the platform's recorded baseline in ``specs/baselines/``.

``deepinfer conformance`` runs both from the command line; ``pytest --deepinfer-backend NAME``
(the ``pytest_plugin`` module, registered as a pytest11 entry point) runs the op checks in a
vendor's own test suite.
"""
