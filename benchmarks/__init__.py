"""The project's benchmark scripts, run from the repository root as ``python -m benchmarks.<name>``.

Each script holds the project's targets and prints a verdict on each; results and verdicts are
in ``BENCHMARKS.md``, how to run each script in ``benchmarks/README.md``. Not installed with
the package: the wheel holds ``gradzip`` alone.
"""
