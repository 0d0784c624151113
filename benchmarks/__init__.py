"""Research benchmarks, their results (results/) and the GPU check: a dev checkout's tools,
run as ``python -m loraplex.benchmarks.<name>`` from the repository. The wheel leaves this
folder out (pyproject.toml), and nothing in the package imports it; ``loraplex bench``, the
serving benchmark against a running server, is the package's (bench/)."""
